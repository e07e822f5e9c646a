"""The engine kinds: llama.cpp (slots for KV affinity and retention), vLLM, SGLang, and any
other OpenAI-compatible server; :func:`make_adapter` picks one by name."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import httpx

from turnstile.core.actions import RetentionDecision
from turnstile.core.slots import choose_slot
from turnstile.gateway.adapters.base import (
    EngineAdapter,
    ForwardHints,
)
from turnstile.transport import PROBE_HEADER

__all__ = ["ADAPTERS", "LlamaCppAdapter", "OpenAIAdapter", "SglangAdapter", "VllmAdapter",
           "answers_as", "make_adapter"]


# --------------------------------------------------------------------------- llama.cpp
@dataclass(slots=True)
class _Slot:
    id: int
    owner: str | None = None  # session whose KV the slot holds
    bound: int = 0  # turns forwarded with this id_slot and not over
    pinned_until_s: float = 0.0
    gw_last_used: float = 0.0


class LlamaCppAdapter(EngineAdapter):
    """llama.cpp's C++ ``llama-server``.

    * KV affinity inside the engine: each session is pinned to a slot (``id_slot``) with
      ``cache_prompt=true``, so its next turn reuses the slot's KV prefix. A slot is chosen as:
      the session's own slot if idle; else an idle slot nobody pinned (empty first, then least
      recently used); else none (the server picks and queues).
    * Retention: ``pin`` keeps other sessions off the slot for the TTL; ``offload`` saves the
      slot to ``--slot-save-path`` (``POST /slots/{id}?action=save``) so it can be restored into
      any slot later (``action=restore``); ``discard`` erases it. Offload needs the server
      started with ``--slot-save-path``; without it offload degrades to LRU.
    * ``/metrics`` (``--metrics``): ``requests_processing``/``requests_deferred`` and prompt
      token counters; ``/tokenize`` for exact prompt lengths.
    """

    kind = "llama.cpp"
    signature = (("/props", "total_slots"), ("/slots", "[]"))
    running_metrics = ("llamacpp:requests_processing",)
    waiting_metrics = ("llamacpp:requests_deferred",)
    counter_metrics: ClassVar[Mapping[str, str]] = {
        "llamacpp:prompt_tokens_total": "prompt_tokens_computed",
        "llamacpp:prompt_tokens_cached_total": "prefix_hit_tokens",
        "llamacpp:tokens_predicted_total": "output_tokens",
    }

    def __init__(self, base_url: str, **kw: Any) -> None:
        super().__init__(base_url, **kw)
        self.slots: list[_Slot] = []
        self.offload_enabled = bool(self.options.get("offload", True))
        #: session → (file name, expiry) of KV saved through the slots API
        self.offloaded: dict[str, tuple[str, float]] = {}
        self.slot_errors = 0

    async def start(self) -> None:
        n = self.options.get("slots")
        if n is None:
            try:
                resp = await self._get("/slots")
                if resp.status_code == 200 and isinstance(resp.json(), list):
                    n = len(resp.json())
                    ctx = [s.get("n_ctx") for s in resp.json() if isinstance(s, dict)]
                    known = [c for c in ctx if isinstance(c, int) and c > 0]
                    if known and len(known) == len(ctx):
                        self.max_model_len = min(known)  # a slot's context (-c / -np)
            except (httpx.HTTPError, ValueError):
                n = None
        if n is None:
            try:
                resp = await self._get("/props")
                n = int(resp.json().get("total_slots", 0)) if resp.status_code == 200 else 0
            except (httpx.HTTPError, ValueError, AttributeError, TypeError):
                n = 0
        self.slots = [_Slot(i) for i in range(int(n or 0))]

    async def check_config(self) -> None:
        # llama-server has no request priority; it reports cached tokens and keeps a slot's
        # prompt with cache_prompt; pinning needs the slots it reported (``--slots``)
        self.features.update(priority=False, cached_tokens=True, prefix_caching=True,
                             slot_pinning=bool(self.slots))
        self.config_notes["priority"] = "llama-server has no request priority"
        if not self.slots:
            self.config_notes["slot_pinning"] = "GET /slots reported no slots"

    def prepare(self, body: dict[str, Any], hints: ForwardHints) -> dict[str, Any]:
        out = dict(body)
        out.setdefault("cache_prompt", True)
        if hints.slot is not None:
            out["id_slot"] = hints.slot
        return out

    async def begin(self, hints: ForwardHints) -> None:
        if not self.slots:
            return
        now_s = hints.now_s
        # a session owns at most one slot (an owner is set only here, on the chosen slot)
        own, slot = choose_slot(self.slots, hints.session_id, now_s)
        if own is not None and own is not slot:
            own.owner = None  # the turn moves, or the server picks: ownership is unknown now
        if slot is None:
            return
        k = slot.id
        restore = self.offloaded.pop(hints.session_id, None)
        if slot.owner != hints.session_id and restore is not None and restore[1] >= now_s:
            try:
                await self._post_json(f"/slots/{k}?action=restore", {"filename": restore[0]})
            except httpx.HTTPError:
                self.slot_errors += 1
        slot.owner = hints.session_id
        slot.bound += 1
        slot.pinned_until_s = 0.0
        slot.gw_last_used = now_s
        hints.slot = k

    def end(self, hints: ForwardHints) -> None:
        if hints.slot is not None and hints.slot < len(self.slots):
            slot = self.slots[hints.slot]
            slot.bound = max(0, slot.bound - 1)
            slot.gw_last_used = hints.now_s

    def _owned(self, session_id: str) -> _Slot | None:
        for s in self.slots:
            if s.owner == session_id:
                return s
        return None

    async def retain(self, session_id: str, decision: RetentionDecision, now_s: float) -> None:
        slot = self._owned(session_id)
        if slot is None:
            return
        if decision.action == "pin":
            slot.pinned_until_s = now_s + decision.ttl_s
        elif decision.action == "offload" and self.offload_enabled and slot.bound == 0:
            name = "ts-" + re.sub(r"[^A-Za-z0-9_.-]", "_", session_id)[:80] + ".bin"
            try:
                resp = await self._post_json(f"/slots/{slot.id}?action=save", {"filename": name})
            except httpx.HTTPError:
                self.slot_errors += 1
                return
            if resp.status_code == 200:
                self.offloaded[session_id] = (name, now_s + max(decision.ttl_s, 1.0))
            else:  # no --slot-save-path: offload is unavailable on this server
                self.offload_enabled = False
        elif decision.action == "discard" and slot.bound == 0:
            try:
                await self._post_json(f"/slots/{slot.id}?action=erase", {})
            except httpx.HTTPError:
                self.slot_errors += 1
                return
            slot.owner = None

    async def tokenize(self, text: str) -> int | None:
        try:
            resp = await self._post_json("/tokenize", {"content": text})
            if resp.status_code != 200:
                return None
            return len(resp.json()["tokens"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None


# --------------------------------------------------------------------------- vLLM
class VllmAdapter(EngineAdapter):
    """vLLM's OpenAI server.

    Sends the admission priority as vLLM's ``priority`` request field (an integer, lower runs
    first; the server must run with ``--scheduling-policy priority``, else set the engine
    option ``priority = false``). Prefix caching is vLLM's own (automatic); retention
    decisions have no per-session API in vLLM and are no-ops. Stats from ``/metrics``.
    """

    kind = "vllm"
    signature = (("/version", "version"),)
    running_metrics = ("vllm:num_requests_running",)
    waiting_metrics = ("vllm:num_requests_waiting",)
    kv_metrics = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    counter_metrics: ClassVar[Mapping[str, str]] = {
        "vllm:prompt_tokens_total": "prompt_tokens",
        "vllm:prefix_cache_hits_total": "prefix_hit_tokens",
        "vllm:prefix_cache_queries_total": "prefix_query_tokens",
        "vllm:num_preemptions_total": "preemptions",
        "vllm:generation_tokens_total": "output_tokens",
    }
    #: the admission priority (seconds or tokens, a float) is scaled to vLLM's integer
    priority_scale: ClassVar[float] = 1000.0

    def prepare(self, body: dict[str, Any], hints: ForwardHints) -> dict[str, Any]:
        if not self.options.get("priority", True):
            return body
        out = dict(body)
        out["priority"] = _int_priority(hints.priority, self.priority_scale)
        return out

    async def check_config(self) -> None:
        """``/v1/models`` (max_model_len), ``/metrics`` (cache_config_info: prefix caching),
        ``/server_info`` where the server runs with ``VLLM_SERVER_DEV_MODE=1`` (the scheduling
        policy), and a one-token probe request (whether its usage has cached-token details).
        vLLM 0.32 accepts ``priority`` under any scheduling policy and ignores it unless the
        server runs ``--scheduling-policy priority``: without /server_info that stays unknown,
        unless the engine option ``priority`` says so."""
        f, notes = self.features, self.config_notes
        f["slot_pinning"] = False
        notes["slot_pinning"] = "vLLM has no per-session KV pinning or offload API"
        model = None
        with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError, TypeError):
            resp = await self._get("/v1/models")
            for m in resp.json().get("data") or ():
                model = model or m.get("id")
                if isinstance(m.get("max_model_len"), int):
                    self.max_model_len = m["max_model_len"]
        with contextlib.suppress(httpx.HTTPError):
            resp = await self._get("/metrics")
            if resp.status_code == 200:
                found = _PREFIX_CACHING.search(resp.text)
                if found:
                    f["prefix_caching"] = found.group(1) == "True"
                    notes["prefix_caching"] = f"/metrics: enable_prefix_caching={found.group(1)}"
        with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError, TypeError):
            # its first answer takes seconds (vLLM collects its environment: 4.7 s measured)
            resp = await self.transport.get("/server_info?config_format=json", timeout=20.0)
            if resp.status_code == 200:
                cfg = resp.json()["vllm_config"]
                policy = cfg["scheduler_config"]["policy"]
                f["priority"] = policy == "priority"
                notes["priority"] = f"/server_info: scheduling policy {policy!r}"
        if f["priority"] is None and "priority" in self.options:
            f["priority"] = bool(self.options["priority"])
            notes["priority"] = f"engine option priority = {f['priority']}"
        if model is not None:
            with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError, TypeError):
                resp = await self.transport.post_json("/v1/completions", {
                    "model": model, "prompt": "turnstile probe", "max_tokens": 1},
                    headers={PROBE_HEADER: "1"})
                if resp.status_code == 200:
                    usage = resp.json().get("usage") or {}
                    f["cached_tokens"] = isinstance(usage.get("prompt_tokens_details"), dict)
                    notes["cached_tokens"] = ("probe: usage has prompt_tokens_details"
                                              if f["cached_tokens"] else
                                              "probe: usage has no prompt_tokens_details")

    def config_hint(self, feature: str) -> str:
        return {
            "priority": "start vLLM with --scheduling-policy priority (then set the engine "
                        "option priority = true, or run it with VLLM_SERVER_DEV_MODE=1 so "
                        "turnstile can read /server_info)",
            "cached_tokens": "start vLLM with --enable-prompt-tokens-details",
            "prefix_caching": "start vLLM with --enable-prefix-caching",
            "slot_pinning": "retention decisions are no-ops on vLLM; its prefix cache keeps a "
                            "paused session's blocks until evicted (LRU)",
        }.get(feature, "")

    # vLLM finishes the requests it drops (shutdown, engine error) with these reasons, as a 200
    def aborted_reply(self, reply: Any) -> bool:
        choices = reply.get("choices") if isinstance(reply, dict) else None
        return any(isinstance(c, dict) and c.get("finish_reason") in _VLLM_ABORTED
                   for c in choices or ())

    def aborted_event(self, event: bytes) -> bool:
        return b'"finish_reason":"abort"' in event or b'"finish_reason":"error"' in event

    async def tokenize(self, text: str) -> int | None:
        try:
            resp = await self._post_json("/tokenize", {"prompt": text})
            if resp.status_code != 200:
                return None
            data = resp.json()
            return int(data.get("count", len(data.get("tokens", ()))))
        except (httpx.HTTPError, ValueError, TypeError, AttributeError):
            return None


_VLLM_ABORTED = ("abort", "error")
_PREFIX_CACHING = re.compile(r'vllm:cache_config_info\{[^}]*enable_prefix_caching="(\w+)"')


def _int_priority(priority: float, scale: float) -> int:
    if not math.isfinite(priority):
        return 2**62 if priority > 0 else -(2**62)
    return max(-(2**62), min(2**62, math.floor(priority * scale)))


# --------------------------------------------------------------------------- SGLang
class SglangAdapter(EngineAdapter):
    """SGLang's OpenAI-compatible server (``--enable-metrics`` for ``/metrics``).

    SGLang's RadixAttention caches prefixes on its own. With the engine option
    ``priority = true`` (server started with ``--enable-priority-scheduling``) the admission
    priority is sent as ``priority``; SGLang runs *higher* values first unless started with
    ``--schedule-low-priority-values-first`` (option ``low_priority_first = true``), so the
    sign is flipped by default.
    """

    kind = "sglang"
    signature = (("/get_model_info", "model_path"),)
    running_metrics = ("sglang:num_running_reqs",)
    waiting_metrics = ("sglang:num_queue_reqs",)
    kv_metrics = ("sglang:token_usage",)
    counter_metrics: ClassVar[Mapping[str, str]] = {
        "sglang:prompt_tokens_total": "prompt_tokens",
        "sglang:cached_tokens_total": "prefix_hit_tokens",
        "sglang:generation_tokens_total": "output_tokens",
    }

    async def check_config(self) -> None:
        self.features.update(priority=bool(self.options.get("priority", False)),
                             slot_pinning=False)
        self.config_notes["priority"] = "sent only with the engine option priority = true"
        self.config_notes["slot_pinning"] = "no per-session KV pinning API"

    def prepare(self, body: dict[str, Any], hints: ForwardHints) -> dict[str, Any]:
        if not self.options.get("priority", False):
            return body
        out = dict(body)
        p = _int_priority(hints.priority, 1000.0)
        out["priority"] = p if self.options.get("low_priority_first", False) else -p
        return out


# --------------------------------------------------------------------------- generic
class OpenAIAdapter(EngineAdapter):
    """Any OpenAI-compatible endpoint: forwarding only; health is ``GET /v1/models``."""

    kind = "openai"
    health_path = "/v1/models"
    metrics_path = None

    async def check_config(self) -> None:
        self.features.update(priority=False, slot_pinning=False)
        self.config_notes["priority"] = "the generic adapter sends no priority"
        self.config_notes["slot_pinning"] = "no KV API"


ADAPTERS: dict[str, type[EngineAdapter]] = {
    "llama.cpp": LlamaCppAdapter,
    "llamacpp": LlamaCppAdapter,
    "llama-cpp": LlamaCppAdapter,
    "vllm": VllmAdapter,
    "sglang": SglangAdapter,
    "openai": OpenAIAdapter,
}


async def answers_as(adapter: EngineAdapter) -> str | None:
    """The kind of engine ``adapter``'s server answers as — the first kind (SGLang, llama.cpp,
    vLLM) one of whose :attr:`~EngineAdapter.signature` endpoints it answers — or None (no
    kind's: a generic OpenAI server, or nothing answered)."""
    for cls in (SglangAdapter, LlamaCppAdapter, VllmAdapter):
        for path, key in cls.signature:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                resp = await adapter.transport.get(path, timeout=5.0)
                if resp.status_code != 200:
                    continue
                doc = resp.json()
                if (isinstance(doc, list) if key == "[]" else
                        isinstance(doc, dict) and key in doc):
                    return cls.kind
    return None


def make_adapter(url: str, kind: str = "llama.cpp", **kw: Any) -> EngineAdapter:
    """Build the adapter for ``kind`` (``llama.cpp``, ``vllm``, ``sglang``, ``openai``)."""
    try:
        cls = ADAPTERS[kind.lower()]
    except KeyError:
        valid = ", ".join(sorted({c.kind for c in ADAPTERS.values()}))
        raise ValueError(f"unknown engine kind {kind!r}; valid kinds: {valid}") from None
    return cls(url, **kw)
