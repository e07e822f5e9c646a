"""Seeded synthetic agentic workloads fitted to real traces, and arrival processes.

* :class:`SynthSpec` describes a workload: turns per workflow, first-prompt size, new input tokens
  per later turn, output tokens (each a :class:`Dist`: empirical inverse-CDF quantiles that keep the
  heavy tail, or a clipped lognormal), how many tool calls follow a non-final turn, and per tool
  name its probability, latency (a lognormal mixture plus a timeout point mass), error probability
  and result size.
* :func:`fit_spec` fits a spec to loaded workflows; :data:`DEFAULT_SPEC` is the fit to the
  AgentCgroup ``glm47flash_local`` sessions (real output-token counts), stored in
  ``data/agentcgroup_fit.json`` so that the package works without the traces.
* :func:`generate` draws workflows from a spec (same seed → same workload). Context grows turn to
  turn: ``context_tokens`` = previous prompt + previous output. When a prompt would exceed
  ``max_prompt_tokens`` the session *compacts* (as Claude Code does): the context falls back to the
  first turn's prompt (system prompt + task) and the turn's new input is drawn afresh.
* :func:`poisson_arrivals` and :func:`superimpose` put real or synthetic sessions on an arrival
  stream (Poisson, or a real one such as :func:`turnstile.traces.azure.arrival_times`).

Refit the default with::

    turnstile traces fit ../shared/traces/agentcgroup_swerebench_claude_code \
        --subset glm47flash_local -o src/turnstile/workload/data/agentcgroup_fit.json
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import numpy as np

from turnstile.workload.model import ToolCall, ToolStatus, Turn, Workflow

#: probabilities of the stored quantiles: dense in the tail, where heavy-tailed data lives
QUANTILE_PROBS: tuple[float, ...] = tuple(
    [round(i / 100, 4) for i in range(0, 90)]
    + [round(0.90 + i / 200, 4) for i in range(0, 18)]
    + [round(0.99 + i / 1000, 4) for i in range(0, 11)]
)
#: latencies below this are treated as this (log of zero)
MIN_LATENCY_S = 1e-3
#: smallest component width of a latency mixture (natural-log units)
MIN_SIGMA = 0.05
#: a tool with fewer calls than this is pooled into ``OTHER_TOOL``
MIN_TOOL_CALLS = 5
OTHER_TOOL = "other"
#: Bash calls at least this long are timeouts (Claude Code's 120 s default)
TIMEOUT_S = 119.5

DistKind = Literal["empirical", "lognormal"]


@dataclass(frozen=True)
class Dist:
    """A positive distribution.

    ``empirical``: inverse CDF through ``(probs[i], quantiles[i])``, linearly interpolated (keeps
    the observed tail up to the observed maximum). ``lognormal``: ``exp(N(mu, sigma))`` clipped to
    ``[lo, hi]``.
    """

    kind: DistKind
    quantiles: tuple[float, ...] = ()
    probs: tuple[float, ...] = ()
    mu: float = 0.0
    sigma: float = 0.0
    lo: float = 0.0
    hi: float = math.inf

    @staticmethod
    def empirical(values: Any, probs: Sequence[float] = QUANTILE_PROBS) -> Dist:
        a = np.asarray(values, dtype=np.float64)
        if a.size == 0:
            raise ValueError("cannot fit a distribution to no values")
        q = np.quantile(a, probs)
        qs = tuple(round(float(x), 4) for x in q)
        return Dist("empirical", qs, tuple(float(p) for p in probs))

    @staticmethod
    def lognormal(mu: float, sigma: float, lo: float = 0.0, hi: float = math.inf) -> Dist:
        return Dist("lognormal", mu=float(mu), sigma=float(sigma), lo=float(lo), hi=float(hi))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "empirical":
            return np.interp(rng.random(n), self.probs, self.quantiles)
        x = rng.lognormal(self.mu, self.sigma, n)
        return np.clip(x, self.lo, self.hi)

    def quantile(self, p: float) -> float:
        if self.kind == "empirical":
            return float(np.interp(p, self.probs, self.quantiles))
        from statistics import NormalDist

        z = NormalDist().inv_cdf(min(max(p, 1e-12), 1 - 1e-12))
        return float(min(max(math.exp(self.mu + self.sigma * z), self.lo), self.hi))

    def to_dict(self) -> dict[str, Any]:
        if self.kind == "empirical":
            return {
                "kind": "empirical",
                "probs": list(self.probs),
                "quantiles": list(self.quantiles),
            }
        d: dict[str, Any] = {"kind": "lognormal", "mu": self.mu, "sigma": self.sigma, "lo": self.lo}
        if math.isfinite(self.hi):
            d["hi"] = self.hi
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Dist:
        if d["kind"] == "empirical":
            probs, qs = tuple(map(float, d["probs"])), tuple(map(float, d["quantiles"]))
            if len(probs) != len(qs) or len(probs) < 2:
                raise ValueError("empirical Dist needs matching probs and quantiles (>= 2)")
            return Dist("empirical", qs, probs)
        if d["kind"] == "lognormal":
            return Dist.lognormal(d["mu"], d["sigma"], d.get("lo", 0.0), d.get("hi", math.inf))
        raise ValueError(f"unknown Dist kind {d['kind']!r}")


@dataclass(frozen=True)
class ToolSpec:
    """One tool name: how often it is called and how it behaves.

    Latency: with probability ``timeout_prob`` exactly ``timeout_s`` (status ``timeout``), else a
    draw from the lognormal mixture ``latency`` (``(weight, mu, sigma)`` of ``ln seconds``)
    clipped to ``max_s``; then ``error`` with probability ``error_prob``.
    """

    name: str
    prob: float
    latency: tuple[tuple[float, float, float], ...]
    error_prob: float = 0.0
    timeout_prob: float = 0.0
    timeout_s: float = 120.0
    max_s: float = math.inf
    #: lognormal (mu, sigma) of the result size in tokens, or None when unknown
    result_tokens: tuple[float, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "prob": round(self.prob, 6),
            "latency": [[round(w, 6), round(m, 6), round(s, 6)] for w, m, s in self.latency],
            "error_prob": round(self.error_prob, 6),
            "timeout_prob": round(self.timeout_prob, 6),
            "timeout_s": self.timeout_s,
        }
        if math.isfinite(self.max_s):
            d["max_s"] = round(self.max_s, 6)
        if self.result_tokens is not None:
            d["result_tokens"] = [round(x, 6) for x in self.result_tokens]
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ToolSpec:
        rt = d.get("result_tokens")
        return ToolSpec(
            name=str(d["name"]),
            prob=float(d["prob"]),
            latency=tuple((float(w), float(m), float(s)) for w, m, s in d["latency"]),
            error_prob=float(d.get("error_prob", 0.0)),
            timeout_prob=float(d.get("timeout_prob", 0.0)),
            timeout_s=float(d.get("timeout_s", 120.0)),
            max_s=float(d.get("max_s", math.inf)),
            result_tokens=(float(rt[0]), float(rt[1])) if rt is not None else None,
        )


@dataclass(frozen=True)
class SynthSpec:
    """Everything :func:`generate` needs; JSON round-trips through ``to_dict``/``from_dict``."""

    name: str
    turns: Dist
    first_prompt_tokens: Dist
    #: new tokens appended by each later turn (tool results, user text)
    input_tokens: Dist
    output_tokens: Dist
    #: P(k tool calls) after a non-final turn, k = 0, 1, 2, ...; the final turn calls none
    tools_per_turn: tuple[float, ...]
    tools: tuple[ToolSpec, ...]
    max_prompt_tokens: int | None = None
    #: provenance and fitted summary numbers (free-form)
    info: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def error_prob(self) -> float:
        """Overall probability that a tool call fails (weighted over tools)."""
        total = sum(t.prob for t in self.tools) or 1.0
        return sum(t.prob * t.error_prob for t in self.tools) / total

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "turns": self.turns.to_dict(),
            "first_prompt_tokens": self.first_prompt_tokens.to_dict(),
            "input_tokens": self.input_tokens.to_dict(),
            "output_tokens": self.output_tokens.to_dict(),
            "tools_per_turn": [round(p, 6) for p in self.tools_per_turn],
            "tools": [t.to_dict() for t in self.tools],
            "max_prompt_tokens": self.max_prompt_tokens,
            "info": self.info,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> SynthSpec:
        mp = d.get("max_prompt_tokens")
        return SynthSpec(
            name=str(d["name"]),
            turns=Dist.from_dict(d["turns"]),
            first_prompt_tokens=Dist.from_dict(d["first_prompt_tokens"]),
            input_tokens=Dist.from_dict(d["input_tokens"]),
            output_tokens=Dist.from_dict(d["output_tokens"]),
            tools_per_turn=tuple(float(p) for p in d["tools_per_turn"]),
            tools=tuple(ToolSpec.from_dict(t) for t in d["tools"]),
            max_prompt_tokens=int(mp) if mp is not None else None,
            info=dict(d.get("info") or {}),
        )


def save_spec(spec: SynthSpec, path: str | Path, note: str = "") -> None:
    d = spec.to_dict()
    if note:
        d = {"_note": note, **d}
    # one top-level key per line, values compact: small diffs when refitted
    body = ",\n".join(
        f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}"
        for k, v in d.items()
    )
    Path(path).write_text("{\n" + body + "\n}\n", encoding="utf-8")


def load_spec(path: str | Path) -> SynthSpec:
    return SynthSpec.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


def _load_default() -> SynthSpec:
    text = resources.files("turnstile.workload").joinpath("data/agentcgroup_fit.json").read_text(
        encoding="utf-8"
    )
    return SynthSpec.from_dict(json.loads(text))


# ------------------------------------------------------------------------------------ fitting


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
        raise ValueError("fit_spec needs at least one workflow with turns")
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


# ------------------------------------------------------------------------------------ generation


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
    which = rng.choice(len(spec.tools), size=n, p=probs / probs.sum())
    u_timeout, u_err, u_comp = rng.random(n), rng.random(n), rng.random(n)
    z, z_res = rng.standard_normal(n), rng.standard_normal(n)
    out: list[ToolCall] = []
    for i in range(n):
        ts = spec.tools[int(which[i])]
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
            dur = min(math.exp(comp[1] + comp[2] * float(z[i])), ts.max_s)
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
    return _load_default()


def __getattr__(name: str) -> Any:
    if name == "DEFAULT_SPEC":
        return default_spec()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
