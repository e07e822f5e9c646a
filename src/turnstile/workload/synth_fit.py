"""Fit a :class:`~turnstile.workload.synth_spec.SynthSpec` to loaded workflows.

Token sizes become empirical quantiles (the heavy tail kept); tool latencies a lognormal mixture
per tool name (deterministic EM) plus a timeout point mass; tools seen fewer than
``MIN_TOOL_CALLS`` times are pooled as ``OTHER_TOOL``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from turnstile.workload.model import ToolCall, Workflow
from turnstile.workload.synth_spec import Dist, SynthSpec, ToolSpec

#: latencies below this are treated as this (log of zero)
MIN_LATENCY_S = 1e-3
#: smallest component width of a latency mixture (natural-log units)
MIN_SIGMA = 0.05
#: a tool with fewer calls than this is pooled into ``OTHER_TOOL``
MIN_TOOL_CALLS = 5
OTHER_TOOL = "other"
#: Bash calls at least this long are timeouts (Claude Code's 120 s default)


def fit_lognormal_mixture(
    values: Any, k: int = 3, iters: int = 300, min_per_component: int = 30
) -> tuple[tuple[float, float, float], ...]:
    """EM fit of a ``k``-component Gaussian mixture to ``ln(values)``; deterministic.

    Uses fewer components when there are fewer than ``min_per_component`` values per component.
    Returns ``(weight, mu, sigma)`` sorted by ``mu``.
    """
    y = np.log(np.maximum(np.asarray(values, dtype=np.float64), MIN_LATENCY_S))
    n = y.size
    if n == 0:
        raise ValueError("no values")
    k = max(1, min(k, n // min_per_component))
    if k == 1:
        return ((1.0, float(y.mean()), float(max(y.std(), MIN_SIGMA))),)
    mu = np.quantile(y, (np.arange(k) + 0.5) / k)
    sig = np.full(k, max(float(y.std()) / k, MIN_SIGMA))
    w = np.full(k, 1.0 / k)
    prev = -np.inf
    for _ in range(iters):
        logp = -0.5 * ((y[:, None] - mu) / sig) ** 2 - np.log(sig) + np.log(w)
        m = logp.max(axis=1, keepdims=True)
        p = np.exp(logp - m)
        tot = p.sum(axis=1, keepdims=True)
        ll = float((np.log(tot) + m).sum())
        r = p / tot
        nk = r.sum(axis=0) + 1e-12
        w = nk / n
        mu = (r * y[:, None]).sum(axis=0) / nk
        sig = np.maximum(np.sqrt((r * (y[:, None] - mu) ** 2).sum(axis=0) / nk), MIN_SIGMA)
        if ll - prev < 1e-7 * abs(ll):
            break
        prev = ll
    keep = w > 1e-4
    w = w[keep] / w[keep].sum()
    comps = sorted(zip(w, mu[keep], sig[keep], strict=True), key=lambda c: c[1])
    return tuple((float(a), float(b), float(c)) for a, b, c in comps)


def fit_spec(workflows: Sequence[Workflow], name: str = "fit", k_latency: int = 3) -> SynthSpec:
    """Fit a :class:`SynthSpec` to workflows (token sizes: empirical quantiles; tool latency:
    lognormal mixtures per tool name plus a timeout point mass; rare tools pooled as 'other')."""
    wfs = [w for w in workflows if w.turns]
    if not wfs:
        raise ValueError("no workflow with turns to fit the generator to")
    n_turns = [len(w.turns) for w in wfs]
    first = [w.turns[0].prompt_tokens for w in wfs]
    later = [t.input_tokens for w in wfs for t in w.turns[1:]] or [1]
    outs = [t.output_tokens for w in wfs for t in w.turns]
    prompts = [t.prompt_tokens for w in wfs for t in w.turns]
    k_counts: Counter[int] = Counter(len(t.tools) for w in wfs for t in w.turns[:-1])
    kmax = max(k_counts, default=0)
    n_nonfinal = sum(k_counts.values())
    tools_per_turn = (
        tuple(k_counts.get(k, 0) / n_nonfinal for k in range(kmax + 1)) if n_nonfinal else (1.0,)
    )
    by_name: dict[str, list[ToolCall]] = defaultdict(list)
    for w in wfs:
        for t in w.turns:
            for c in t.tools:
                by_name[c.name].append(c)
    pooled: dict[str, list[ToolCall]] = defaultdict(list)
    for tname, calls in by_name.items():
        pooled[tname if len(calls) >= MIN_TOOL_CALLS else OTHER_TOOL].extend(calls)
    total_calls = sum(len(c) for c in pooled.values())
    tools: list[ToolSpec] = []
    for tname, calls in sorted(pooled.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lat = np.array([c.duration_s for c in calls])
        timeouts = np.array([c.status == "timeout" for c in calls])
        rest = lat[~timeouts] if (~timeouts).any() else lat
        res = [c.result_tokens for c in calls if c.result_tokens is not None]
        rt = None
        if res:
            lr = np.log(np.maximum(np.array(res, dtype=np.float64), 1.0))
            rt = (float(lr.mean()), float(max(lr.std(), MIN_SIGMA)))
        n_err = sum(c.status == "error" for c in calls)
        tools.append(
            ToolSpec(
                name=tname,
                prob=len(calls) / total_calls,
                latency=fit_lognormal_mixture(rest, k_latency),
                error_prob=n_err / len(calls),
                timeout_prob=float(timeouts.mean()),
                timeout_s=float(np.median(lat[timeouts])) if timeouts.any() else 120.0,
                max_s=float(rest.max()),
                result_tokens=rt,
            )
        )
    nt = np.array(n_turns, dtype=np.float64)
    all_lat = np.array([c.duration_s for cs in pooled.values() for c in cs])
    info = {
        "fitted_workflows": len(wfs),
        "fitted_turns": int(nt.sum()),
        "fitted_tool_calls": int(total_calls),
        "turns_p50": float(np.percentile(nt, 50)),
        "turns_p99": float(np.percentile(nt, 99)),
        "turns_max": int(nt.max()),
        "prompt_p50": float(np.percentile(prompts, 50)),
        "prompt_p99": float(np.percentile(prompts, 99)),
        "output_p50": float(np.percentile(outs, 50)),
        "tool_latency_p50": float(np.percentile(all_lat, 50)) if all_lat.size else 0.0,
        "tool_latency_p99": float(np.percentile(all_lat, 99)) if all_lat.size else 0.0,
    }
    return SynthSpec(
        name=name,
        turns=Dist.empirical(n_turns),
        first_prompt_tokens=Dist.empirical(first),
        input_tokens=Dist.empirical(later),
        output_tokens=Dist.empirical(outs),
        tools_per_turn=tools_per_turn,
        tools=tuple(tools),
        max_prompt_tokens=int(max(prompts)),
        info=info,
    )
