"""The engines' configuration against the chosen policies, checked once at start.

A policy may rely on something an engine ignores without a word: vLLM accepts a request's
``priority`` and drops it unless started with ``--scheduling-policy priority``; without
``--enable-prompt-tokens-details`` its usage has no cached tokens (hit rates read 0); no vLLM
can pin a session's KV (retention decisions). Each adapter says what its engine does
(:meth:`EngineAdapter.check_config`: True, False or unknown); this module says what the policies
need, logs one warning per engine and feature that is missing (or, for priority, cannot be
confirmed), and keeps the verdicts for ``/metrics``
(``turnstile_engine_config_warning{engine,feature}``).

An engine declared with the wrong kind (``--engine URL,vllm`` in front of a llama.cpp server)
is told by the endpoints only one kind answers (:attr:`EngineAdapter.signature`: llama.cpp's
``/props`` and ``/slots``, vLLM's ``/version``, SGLang's ``/get_model_info``): one warning
names the kind it answers as and the flag that declares it (:func:`check_kinds`).

Retention on an engine that cannot pin (vLLM) is not an error: its decisions become no-ops there
(the driver sends them only to adapters that act on them), and the log says so once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from turnstile.gateway.adapters import EngineAdapter
from turnstile.gateway.adapters.kinds import ADAPTERS, answers_as
from turnstile.policies import PolicySet

__all__ = ["check_engines", "check_kinds", "context_limits", "kind_warning", "max_model_lens",
           "policy_needs"]

log = logging.getLogger("turnstile.gateway")

#: routing policies that place a session where its KV is (they rely on prefix caching)
KV_ROUTING = frozenset({"kv-affinity", "composite", "composite-noshadow", "cmlfq",
                        "cmlfq-adaptive"})


def _name(policy: object) -> str:
    return str(getattr(policy, "name", type(policy).__name__))


def policy_needs(policies: PolicySet) -> dict[str, str]:
    """Feature → why the chosen policies need it (see :data:`adapters.base.FEATURES`)."""
    needs = {"cached_tokens": "prefix-hit telemetry (/metrics, replay hit rates) and the "
                              "scheduler's cached-token records read it"}
    admission = _name(policies.admission)
    if admission != "fcfs":
        needs["priority"] = f"admission policy {admission!r} orders the engine's queue by priority"
    routing = _name(policies.routing)
    if routing in KV_ROUTING:
        needs["prefix_caching"] = f"routing policy {routing!r} sends a session to its cached KV"
    retention = _name(policies.retention)
    if retention != "lru":
        needs["slot_pinning"] = f"retention policy {retention!r} pins or offloads KV across " \
                                "tool calls"
    return needs


def check_engines(policies: PolicySet, adapters: Mapping[str, EngineAdapter]
                  ) -> dict[str, dict[str, str | None]]:
    """Engine → needed feature → the warning logged (None: the engine does it). Logs each
    warning once."""
    needs = policy_needs(policies)
    out: dict[str, dict[str, str | None]] = {}
    for eid, a in adapters.items():
        verdicts: dict[str, str | None] = {}
        for feature, why in needs.items():
            state = a.features.get(feature)
            # unknown is worth a warning only where an engine may drop it silently
            if state or (state is None and feature != "priority"):
                verdicts[feature] = None
                continue
            note = a.config_notes.get(feature)
            hint = a.config_hint(feature)
            if feature == "slot_pinning" and state is False:
                msg = (f"engine {eid} ({a.kind}) cannot pin or offload KV ({note}): "
                       f"{why}, and its decisions are no-ops there. {hint}")
            elif state is False:
                msg = (f"engine {eid} ({a.kind}) ignores {feature} ({note}), but {why}. "
                       f"{hint}")
            else:
                msg = (f"engine {eid} ({a.kind}): cannot confirm {feature}, and {why}. "
                       f"{hint}")
            verdicts[feature] = msg.strip()
            log.warning("%s", verdicts[feature])
        out[eid] = verdicts
        if a.max_model_len is not None:
            log.info("engine %s accepts contexts up to %d tokens", eid, a.max_model_len)
    for eid, limit_msg in context_limits(policies, adapters).items():
        out[eid]["max_model_len"] = limit_msg
        if limit_msg is not None:
            log.warning("%s", limit_msg)
    return out


def max_model_lens(adapters: Mapping[str, EngineAdapter]) -> dict[str, int]:
    """Engine → the longest context it accepts, for the engines whose limit is known (vLLM's
    ``--max-model-len``, a llama.cpp slot's context)."""
    return {eid: a.max_model_len for eid, a in adapters.items() if a.max_model_len}


def context_limits(policies: PolicySet, adapters: Mapping[str, EngineAdapter]
                   ) -> dict[str, str | None]:
    """Engine → the warning for its context limit (None: no engine behind the gateway accepts
    longer contexts), for the engines whose limit is known (``max_model_len``: vLLM's
    ``--max-model-len``, a llama.cpp slot's context).

    No routing policy reads an engine's context limit: a session placed on an engine whose
    limit is below another's is refused (HTTP 400) there once its context outgrows it, while
    the other engine would take it. Where every engine has the same limit a client that keeps
    its contexts under it (less the chat template's few dozen tokens) is never refused."""
    limits = max_model_lens(adapters)
    if not limits:
        return {}
    top = max(limits.values())
    larger = [e for e, n in limits.items() if n == top]
    routing = _name(policies.routing)
    return {eid: None if n == top else
            (f"engine {eid} ({adapters[eid].kind}) accepts contexts up to {n} tokens, "
             f"{', '.join(larger)} up to {top}: routing policy {routing!r} does not read "
             f"context limits, so a session placed here is refused (HTTP 400) once its "
             f"context passes {n} tokens. Give the engines one limit (vLLM: --max-model-len; "
             "llama.cpp: -c / -np per slot).")
            for eid, n in limits.items()}


def kind_warning(eid: str, adapter: EngineAdapter, found: str | None) -> str | None:
    """The warning for an engine declared as ``adapter.kind`` that answers as ``found`` (None:
    no warning — the kinds agree, or nothing told; the generic ``openai`` kind is never
    wrong)."""
    if found is None or adapter.kind in (found, "openai"):
        return None
    cls = ADAPTERS[found]
    paths = " and ".join(f"GET {p}" for p, _ in cls.signature)
    return (f"engine {eid} is declared as {adapter.kind} but answers as {found} ({paths}): "
            f"its {adapter.kind} requests and checks do not fit it; declare it as "
            f"--engine {adapter.base_url},{found} (kind = \"{found}\" in the config)")


async def check_kinds(adapters: Mapping[str, EngineAdapter]) -> dict[str, str | None]:
    """Engine → the warning logged when it answers as another kind than declared (None: no
    warning). Logs each warning once, as one line."""
    eids = list(adapters)
    found = await asyncio.gather(*(answers_as(adapters[e]) for e in eids))
    out = {}
    for eid, kind in zip(eids, found, strict=True):
        msg = out[eid] = kind_warning(eid, adapters[eid], kind)
        if msg is not None:
            log.warning("%s", msg)
    return out
