"""Seeded synthetic agentic workloads, and arrival processes.

* :func:`default_spec` (also ``DEFAULT_SPEC``) is the fit to the AgentCgroup ``glm47flash_local``
  sessions (real output-token counts), stored in ``data/agentcgroup_fit.json`` so that the
  package works without the traces. What a spec holds: :mod:`turnstile.workload.synth_spec`; how
  one is fitted: :mod:`turnstile.workload.synth_fit`.
* :func:`generate` draws workflows from a spec (same seed → same workload). Context grows turn to
  turn: ``context_tokens`` = previous prompt + previous output. When a prompt would exceed
  ``max_prompt_tokens`` the session *compacts* (as Claude Code does): the context falls back to the
  first turn's prompt (system prompt + task) and the turn's new input is drawn afresh.
* :func:`poisson_arrivals` and :func:`superimpose` put real or synthetic sessions on an arrival
  stream (Poisson, or a real one such as :func:`turnstile.traces.azure.arrival_times`).

Refit the default with::

    turnstile traces fit $TURNSTILE_TRACES/agentcgroup_swerebench_claude_code \
        --subset glm47flash_local -o src/turnstile/workload/data/agentcgroup_fit.json
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from functools import lru_cache
from importlib import resources
from typing import Any, Literal

import numpy as np

from turnstile.workload.model import ToolCall, ToolStatus, Turn, Workflow
from turnstile.workload.synth_spec import SynthSpec


def poisson_arrivals(
    rate_per_s: float, n: int, seed: int | Sequence[int], start: float = 0.0
) -> np.ndarray:
    """``n`` arrival times (s) of a Poisson process of ``rate_per_s``, after ``start``; the first
    ``k`` times do not depend on ``n``."""
    if rate_per_s <= 0:
        raise ValueError("rate_per_s must be > 0")
    if n < 0:
        raise ValueError("n must be >= 0")
    rng = np.random.default_rng(seed)
    return start + np.cumsum(rng.exponential(1.0 / rate_per_s, n))


def _arrival_array(arrivals: float | Sequence[float] | np.ndarray | None, n: int,
                   seed: int) -> np.ndarray:
    if arrivals is None:
        return np.zeros(n)
    if isinstance(arrivals, int | float) and not isinstance(arrivals, bool):
        # a stream of its own: the workflows do not change with the rate
        return poisson_arrivals(float(arrivals), n, [seed, 1])
    a = np.sort(np.asarray(arrivals, dtype=np.float64))
    if a.size < n:
        raise ValueError(f"{a.size} arrival times for {n} workflows")
    return a[:n]


def _sample_tools(spec: SynthSpec, rng: np.random.Generator, n: int) -> list[ToolCall]:
    if n == 0 or not spec.tools:
        return []
    probs = np.array([t.prob for t in spec.tools], dtype=np.float64)
    which = rng.choice(len(spec.tools), size=n, p=probs / probs.sum()).tolist()
    # as Python floats (the same doubles): the loop's arithmetic is then on floats, not on
    # numpy scalars (the same IEEE operations, several times cheaper each)
    u_timeout, u_err, u_comp = (rng.random(n).tolist(), rng.random(n).tolist(),
                                rng.random(n).tolist())
    z, z_res = rng.standard_normal(n).tolist(), rng.standard_normal(n).tolist()
    tools = spec.tools
    out: list[ToolCall] = []
    for i in range(n):
        ts = tools[which[i]]
        status: ToolStatus
        if u_timeout[i] < ts.timeout_prob:
            dur, status = ts.timeout_s, "timeout"
        else:
            acc, comp = 0.0, ts.latency[-1]
            for c in ts.latency:
                acc += c[0]
                if u_comp[i] < acc:
                    comp = c
                    break
            dur = min(math.exp(comp[1] + comp[2] * z[i]), ts.max_s)
            status = "error" if u_err[i] < ts.error_prob else "ok"
        res = None
        if ts.result_tokens is not None:
            res = max(0, round(math.exp(ts.result_tokens[0] + ts.result_tokens[1] * z_res[i])))
        out.append(ToolCall(ts.name, round(dur, 6), status, res))
    return out


def generate(
    spec: SynthSpec,
    n_workflows: int,
    seed: int,
    arrivals: float | Sequence[float] | np.ndarray | None = None,
) -> list[Workflow]:
    """Draw ``n_workflows`` chain workflows from ``spec``; the same seed gives the same workload.

    ``arrivals``: ``None`` → all at 0 (a batch, like an RL rollout step); a number → a Poisson
    stream of that rate per second (seeded from ``seed``); an array → those times (sorted, the
    first ``n_workflows`` used).
    """
    if n_workflows < 0:
        raise ValueError("n_workflows must be >= 0")
    times = _arrival_array(arrivals, n_workflows, seed)
    meta = {"source": "synth", "spec": spec.name, "seed": str(seed)}
    return [
        Workflow(
            id=f"synth-{seed}-{w:06d}",
            arrival_s=float(times[w]),
            turns=_draw_turns(spec, np.random.default_rng([seed, 0, w])),
            meta=dict(meta),
        )
        for w in range(n_workflows)
    ]


def _draw_turns(spec: SynthSpec, rng: np.random.Generator) -> tuple[Turn, ...]:
    """One workflow's turns from its own generator (so workflow ``i`` of a seed never depends on
    how many workflows are drawn)."""
    n = max(1, round(float(spec.turns.sample(rng, 1)[0])))
    first_prompt = max(1, round(float(spec.first_prompt_tokens.sample(rng, 1)[0])))
    new_in = np.maximum(1, np.rint(spec.input_tokens.sample(rng, n))).astype(np.int64)
    outs = np.maximum(1, np.rint(spec.output_tokens.sample(rng, n))).astype(np.int64)
    kp = np.asarray(spec.tools_per_turn, dtype=np.float64)
    k_tools = (
        rng.choice(kp.size, size=n, p=kp / kp.sum()) if kp.size else np.zeros(n, dtype=np.int64)
    )
    k_tools[-1] = 0  # the final turn answers; it calls no tool
    tools = _sample_tools(spec, rng, int(k_tools.sum()))
    cap = spec.max_prompt_tokens
    turns: list[Turn] = []
    prev_prompt = prev_out = 0
    pos = 0
    for j in range(n):
        if j == 0:
            context, inp = 0, first_prompt
        else:
            context, inp = prev_prompt + prev_out, int(new_in[j])
            if cap is not None and context + inp > cap:  # compaction
                context = min(first_prompt, max(0, cap - inp))
        k = int(k_tools[j])
        out = int(outs[j])
        turns.append(Turn(inp, out, context, tools=tuple(tools[pos:pos + k])))
        pos += k
        prev_prompt, prev_out = context + inp, out
    return tuple(turns)


def superimpose(
    workflows: Sequence[Workflow],
    arrival_times: Sequence[float] | np.ndarray,
    seed: int = 0,
    mode: Literal["cycle", "shuffle", "sample"] = "shuffle",
) -> list[Workflow]:
    """Put sessions on an arrival stream: the ``i``-th arrival gets one session, shifted to it.

    ``mode``: ``cycle`` uses the sessions in order, again and again; ``shuffle`` uses every session
    once per pass in a fresh seeded order (each session appears equally often); ``sample`` draws
    sessions with replacement. A session used for the ``r``-th time (``r ≥ 1``) gets the fresh id
    ``<id>#<r>`` and ``meta["replica"] = r``. With fewer arrivals than sessions only as many
    sessions are used. Returns the workflows sorted by arrival.
    """
    if not workflows:
        raise ValueError("superimpose needs at least one workflow")
    times = np.sort(np.asarray(arrival_times, dtype=np.float64))
    n, m = times.size, len(workflows)
    rng = np.random.default_rng(seed)
    if mode == "cycle":
        pick = np.arange(n) % m
    elif mode == "shuffle":
        passes = max(1, -(-n // m))
        pick = np.concatenate([rng.permutation(m) for _ in range(passes)])[:n]
    elif mode == "sample":
        pick = rng.integers(0, m, size=n)
    else:
        raise ValueError(f"unknown mode {mode!r} (cycle, shuffle or sample)")
    used: Counter[int] = Counter()
    out: list[Workflow] = []
    for t, i in zip(times, pick, strict=True):
        wf = workflows[int(i)]
        r = used[int(i)]
        used[int(i)] += 1
        meta = dict(wf.meta)
        if r:
            meta["replica"] = str(r)
        out.append(
            Workflow(
                id=wf.id if r == 0 else f"{wf.id}#{r}",
                arrival_s=float(t),
                turns=wf.turns,
                tenant=wf.tenant,
                meta=meta,
            )
        )
    return out


#: the fit to AgentCgroup glm47flash_local (``data/agentcgroup_fit.json``), loaded on first use
DEFAULT_SPEC: SynthSpec


@lru_cache(maxsize=1)
def default_spec() -> SynthSpec:
    """The packaged fit to AgentCgroup ``glm47flash_local`` (see ``data/agentcgroup_fit.json``)."""
    text = resources.files("turnstile.workload").joinpath("data/agentcgroup_fit.json").read_text(
        encoding="utf-8"
    )
    return SynthSpec.from_dict(json.loads(text))


def __getattr__(name: str) -> Any:
    if name == "DEFAULT_SPEC":
        return default_spec()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
