"""Real-engine A/B: the workload, the simulator's prediction of each cell, and the report.

An A/B *cell* is one (policy, offered load, seed): the same scaled agent sessions, on the same
seeded Poisson arrivals, replayed for real through the gateway (:mod:`.ab_real`) and simulated by
``turnstile bench``'s runner with a profile fitted to the same engines. This module holds what
does not touch a real engine:

* :func:`build_sessions`: AgentCgroup sessions plus synthetic ones (the packaged fit), scaled with
  :class:`~turnstile.calibrate.fidelity.TraceScale` so that they fit a small CPU engine;
* :func:`cell_workload` / :func:`sim_workflows`: a cell's arrivals, and the same workflows as the
  simulator sees them (the chat template's tokens per message added to each turn's input);
* :func:`predict`: :func:`turnstile.bench.runner.run_bench` on engines configured like the real
  ones (slots, KV tokens, per-step budget, fitted step times);
* :func:`cell_row`, :func:`aggregate`, :func:`check_goals`, :func:`render_table`,
  :func:`plot_ab`: per-cell figures, their mean and spread over seeds, the issue's goals, the
  README table and plot.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from turnstile.bench.runner import capacity_rate, run_bench
from turnstile.calibrate.fidelity import TraceScale, on_poisson, scale_workflow, select_sessions
from turnstile.gateway.sessions import sweep_period_s
from turnstile.sim.cluster import EngineGroup
from turnstile.sim.perf import PerfModel
from turnstile.workload import synth
from turnstile.workload.model import ToolCall, Workflow

__all__ = [
    "AbEngines",
    "ServingTerms",
    "aggregate",
    "build_sessions",
    "cell_row",
    "cell_workload",
    "check_goals",
    "offered_load",
    "plot_ab",
    "policy_spec",
    "predict",
    "render_table",
    "repredict",
    "sim_workflows",
    "slot_kv_tokens",
    "with_profile_slots",
]

#: tokens the ChatML template adds around one message (``<|im_start|>role\n … <|im_end|>\n``)
CHAT_TOKENS_PER_MESSAGE = 6


@dataclass(frozen=True)
class AbEngines:
    """The real engines, as the simulator must model them (one llama.cpp server each)."""

    count: int
    #: llama.cpp ``-np``: concurrent sequences, each with its own slot
    n_parallel: int
    #: llama.cpp ``-c``: KV tokens of one server (all slots)
    ctx: int
    #: llama.cpp ``-b``: the most tokens one step computes
    chunk: int = 2048
    #: the KV an engine keeps *for sessions* (tokens), given to the simulator and to the
    #: gateway's KV gate; ``None``: ``ctx``. llama.cpp holds one sequence per slot, so across
    #: tool calls it keeps ``n_parallel`` sessions whatever their length, not ``ctx`` tokens of
    #: them: :func:`slot_kv_tokens` gives the tokens that many sessions hold
    kv_tokens: int | None = None
    #: how the simulator models the engines' KV: ``"slots"`` as llama.cpp keeps it (``n_parallel``
    #: slots of ``ctx / n_parallel`` tokens, one sequence each, :mod:`turnstile.sim.slot_pool`),
    #: or ``"paged"``: a paged prefix cache of ``session_kv_tokens`` (the model before slots)
    kv_model: str = "slots"
    #: KV tokens of one slot as the server reports it (llama.cpp may round ``-c``, e.g. 3184
    #: with ``-np 4`` to 1,024 per slot); ``None``: ``ctx // n_parallel``
    slot_tokens: int | None = None
    #: prompt tokens a turn after the first adds beyond its text and the previous reply (the
    #: chat template around both messages), as measured on the engine
    #: (:func:`turnstile.calibrate.ab_engines.turn_template_tokens`)
    turn_template_tokens: int = CHAT_TOKENS_PER_MESSAGE
    #: the paged engines' KV block, their prefix cache's granularity (vLLM on a CPU: 128)
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.kv_model not in ("slots", "paged"):
            raise ValueError(f"kv_model must be 'slots' or 'paged', not {self.kv_model!r}")

    @property
    def session_kv_tokens(self) -> int:
        return self.kv_tokens if self.kv_tokens is not None else self.ctx

    def group(self, perf: PerfModel) -> EngineGroup:
        """The engines as a simulator engine group. Either way the scheduler's KV gate is told
        ``session_kv_tokens``, as the gateway's is."""
        slots = self.kv_model == "slots"
        return EngineGroup(count=self.count, kv_tokens=self.session_kv_tokens,
                           kv_slots=self.n_parallel if slots else 0,
                           slot_tokens=(self.slot_tokens or self.ctx // self.n_parallel)
                           if slots else 0,
                           max_num_seqs=self.n_parallel,
                           max_batched_tokens=max(self.chunk, self.n_parallel), perf=perf)


def with_profile_slots(engines: AbEngines, perf: PerfModel) -> AbEngines:
    """``engines`` with the slot size a fitted profile measured (``ctx_per_seq``), if any."""
    per_slot = int(getattr(perf, "meta", {}).get("ctx_per_seq") or 0)
    return replace(engines, slot_tokens=per_slot) if per_slot else engines


def slot_kv_tokens(sessions: Sequence[Workflow], n_parallel: int) -> int:
    """KV tokens that ``n_parallel`` slots hold of these sessions: ``n_parallel`` × the mean
    context of a live session (turn prompts and outputs averaged over the sessions' turns, as
    the engine sees them through the chat API)."""
    ctx = [t.prompt_tokens + t.output_tokens for w in sim_workflows(sessions) for t in w.turns]
    return round(n_parallel * float(np.mean(ctx)))


def _no_think(wf: Workflow) -> Workflow:
    """The replay sends the next turn when the tools return: no client think time."""
    return replace(wf, turns=tuple(replace(t, think_s=0.0) for t in wf.turns))


def build_sessions(
    trace_workflows: Sequence[Workflow],
    n_trace: int,
    n_synth: int,
    scale: TraceScale,
    *,
    seed: int = 0,
    min_turns: int = 4,
) -> list[Workflow]:
    """``n_trace`` real sessions (seeded choice of chains) and ``n_synth`` synthetic ones from
    the packaged AgentCgroup fit, all scaled by ``scale``; arrival times are set per cell."""
    out: list[Workflow] = []
    if n_trace:
        out += select_sessions(trace_workflows, n_trace, scale, seed=seed, min_turns=min_turns)
    if n_synth:
        drawn = synth.generate(synth.DEFAULT_SPEC, 20 * n_synth, seed + 7919)
        got = 0
        for wf in drawn:
            s = scale_workflow(wf, scale)
            if s is not None and len(s.turns) >= min_turns:
                out.append(replace(s, id=f"synth-{wf.id}"))
                got += 1
                if got == n_synth:
                    break
        if got < n_synth:
            raise ValueError(f"only {got} synthetic sessions keep {min_turns}+ turns")
    return [_no_think(w) for w in out]


def cell_workload(sessions: Sequence[Workflow], rate: float, seed: int) -> list[Workflow]:
    """The sessions on seeded Poisson arrivals at ``rate`` sessions/s, first arrival at 0."""
    wfs = sorted(on_poisson(sessions, rate, seed), key=lambda w: w.arrival_s)
    t0 = wfs[0].arrival_s
    return [w.shifted(w.arrival_s - t0) for w in wfs]


def sim_workflows(workflows: Sequence[Workflow],
                  per_message: int = CHAT_TOKENS_PER_MESSAGE,
                  session_idle_s: float | None = None,
                  turn_template_tokens: int | None = None,
                  turn_overhead_s: float = 0.0) -> list[Workflow]:
    """The workflows as the engine sees them through the chat API: the first turn also carries
    its message's template tokens and the first line naming the session that the replay adds
    (about ``per_message`` tokens each), every later turn the template tokens around its message
    and the previous reply (``turn_template_tokens``, default ``per_message``).

    ``session_idle_s`` (the gateway's setting): the workflows also as *the gateway* sees them,
    so that the simulated policies know what the gateway's do. The replay sends no tool
    messages, so every pause between turns is one unnamed tool call (its latency estimates are
    pooled, as the gateway's are); and no client says a session is over, so after its last
    turn a session stays paused, its KV counted and retained, until the gateway closes it
    (``session_idle_s`` plus half the gateway's sweep period).

    ``turn_overhead_s`` (:class:`ServingTerms`, with ``session_idle_s`` only) lengthens every
    pause but the last by a turn's round trip outside the engine, so that a session holds its
    slot and KV as long as it does when served."""
    if turn_overhead_s and session_idle_s is None:
        raise ValueError("turn_overhead_s needs session_idle_s (the sessions as served)")
    close_s = None if session_idle_s is None else session_idle_s + sweep_period_s(
        session_idle_s) / 2
    later = per_message if turn_template_tokens is None else turn_template_tokens
    out = []
    for wf in workflows:
        turns = []
        ctx = 0
        last = len(wf.turns) - 1
        for i, t in enumerate(wf.turns):
            inp = t.input_tokens + (later if i else 2 * per_message)
            turn = replace(t, input_tokens=inp, context_tokens=ctx)
            if close_s is not None:
                pause = close_s if i == last else t.tool_duration_s + turn_overhead_s
                turn = replace(turn, tools=(ToolCall("", pause),))
            turns.append(turn)
            ctx += inp + t.output_tokens
        out.append(replace(wf, turns=tuple(turns)))
    return out


def offered_load(rate: float, sessions: Sequence[Workflow], engines: AbEngines,
                 perf: PerfModel) -> float:
    """``rate`` as a fraction of the estimated capacity of the engines (compute and KV bound,
    :func:`turnstile.bench.runner.capacity_rate`)."""
    return rate / capacity_rate(sessions, [engines.group(perf)])


#: a cell label's suffix for a second run of the same policy (``eager@rerun``): the measurement's
#: own noise, run after the group's other policies
RERUN = "@rerun"


def policy_spec(label: str) -> str:
    """The policy a cell label runs (``eager@rerun`` runs ``eager``)."""
    return label.removesuffix(RERUN)


@dataclass(frozen=True)
class ServingTerms:
    """What serving through the gateway adds to the profiled engines, on a host where the
    engines share their CPU with the serving stack (the A/B's 2-core host; on a GPU engine
    both are about 0 and 1): ``turn_overhead_s``, each turn's round trip outside the engine's
    compute (client and gateway hops, the gateway's ``/tokenize``, the server's HTTP thread and
    chat template), and ``engine_slowdown``, how much slower the engines compute than the
    profile measured them while the gateway, the clients and the servers' HTTP threads run
    beside them. Both are measured from served turns (llama.cpp's per-request ``timings``
    against the client's clock and the fitted model), never fitted to the A/B's flow times."""

    turn_overhead_s: float = 0.0
    engine_slowdown: float = 1.0

    def __post_init__(self) -> None:
        if self.turn_overhead_s < 0 or self.engine_slowdown <= 0:
            raise ValueError(f"bad serving terms: {self}")

    def perf(self, perf: PerfModel) -> PerfModel:
        if self.engine_slowdown == 1.0:
            return perf
        scaled = getattr(perf, "scaled", None)
        if scaled is None:
            raise TypeError(f"{type(perf).__name__} cannot be slowed (no .scaled)")
        return scaled(self.engine_slowdown)  # type: ignore[no-any-return]

    def metrics(self, m: dict[str, Any]) -> dict[str, Any]:
        """``m`` with every session's last round trip added to its flow time (the others are
        inside the simulation, :func:`sim_workflows`)."""
        oh = self.turn_overhead_s
        flow = m.get("flow_time_s")
        if not oh or not isinstance(flow, dict):
            return m
        return {**m, "flow_time_s": {k: v if k == "count" or v is None else v + oh
                                     for k, v in flow.items()}}


def predict(workflows: Sequence[Workflow], policies: Sequence[str], engines: AbEngines,
            perf: PerfModel, session_idle_s: float | None = None,
            serving: ServingTerms | Mapping[str, ServingTerms] | None = None,
            ) -> dict[str, dict[str, Any]]:
    """Simulated metrics of each policy on ``workflows`` (``turnstile bench``'s runner); with
    ``session_idle_s``, as the gateway sees the sessions (:func:`sim_workflows`); with
    ``serving``, as served on a host shared with the serving stack (:class:`ServingTerms`;
    a mapping: each policy's own terms, by policy spec, none for a policy it lacks)."""
    if isinstance(serving, Mapping):
        by_terms: dict[ServingTerms, list[str]] = {}
        for p in policies:
            by_terms.setdefault(serving.get(policy_spec(p), ServingTerms()), []).append(p)
        out: dict[str, dict[str, Any]] = {}
        for terms, group in by_terms.items():
            out.update(predict(workflows, group, engines, perf, session_idle_s, terms))
        return {p: out[p] for p in policies}
    serving = serving or ServingTerms()
    wfs = sim_workflows(workflows, session_idle_s=session_idle_s,
                        turn_template_tokens=engines.turn_template_tokens,
                        turn_overhead_s=serving.turn_overhead_s)
    specs = list(dict.fromkeys(policy_spec(p) for p in policies))
    got = {r["policy"]: r["metrics"]
           for r in run_bench(wfs, specs, [engines.group(serving.perf(perf))],
                              block_size=engines.block_size)}
    return {p: serving.metrics(got[policy_spec(p)]) for p in policies}


def repredict(cells: Sequence[Mapping[str, Any]], sessions: Sequence[Workflow],
              rates: Mapping[float, float], engines: AbEngines, perf: PerfModel,
              session_idle_s: float | None = None,
              serving: ServingTerms | Mapping[str, ServingTerms] | None = None,
              ) -> list[dict[str, Any]]:
    """The cells of a finished A/B with their predictions made again (``engines``' KV model,
    ``perf``, ``session_idle_s`` as in :func:`predict`), each on its own workload (``sessions``
    at ``rates[load]``, the cell's seed); the measured figures are kept, the previous
    prediction goes to ``pred_before``."""
    policies = list(dict.fromkeys(c["policy"] for c in cells))
    preds: dict[tuple[float, int], dict[str, dict[str, Any]]] = {}
    out = []
    for c in cells:
        key = (c["load"], c["seed"])
        if key not in preds:
            wfs = cell_workload(sessions, rates[c["load"]], c["seed"])
            preds[key] = predict(wfs, policies, engines, perf, session_idle_s, serving)
        out.append({**c, "pred": cell_row(preds[key][c["policy"]]),
                    "pred_before": c.get("pred_before", c["pred"])})
    return out


def cell_row(metrics: Mapping[str, Any]) -> dict[str, float | None]:
    """The figures the A/B reports of one run (real or simulated)."""
    flow = metrics.get("flow_time_s") or {}
    totals = metrics.get("engine_totals") or {}
    return {
        "flow_p50_s": flow.get("p50"),
        "flow_p95_s": flow.get("p95"),
        "flow_mean_s": flow.get("mean"),
        "prefix_hit_rate": metrics.get("prefix_hit_rate"),
        "recomputed_prompt_tokens": totals.get("recomputed_prefill_tokens"),
        "prompt_tokens": totals.get("prompt_tokens"),
        "hold_mean_s": (metrics.get("hold_s") or {}).get("mean"),
        "workflows": metrics.get("workflows"),
        "unfinished": metrics.get("workflows_unfinished"),
    }


def _mean(xs: Sequence[float | None]) -> float | None:
    v = [x for x in xs if x is not None and math.isfinite(x)]
    return float(np.mean(v)) if v else None


def aggregate(cells: Sequence[Mapping[str, Any]], baseline: str = "eager") -> list[dict[str, Any]]:
    """One row per (load, policy): real and predicted figures averaged over seeds, and the
    P95 ratio ``baseline / policy`` per seed (mean, min, max), real and predicted.

    ``cells`` items: ``{"policy", "load", "rate", "seed", "real": cell_row, "pred": cell_row,
    ...}`` (``pred_before``, a previous prediction, is aggregated as ``pred``; extra keys
    such as the engine counters are averaged when numeric)."""
    by: dict[tuple[float, str], list[Mapping[str, Any]]] = {}
    for c in cells:
        by.setdefault((c["load"], c["policy"]), []).append(c)
    base: dict[tuple[float, int], Mapping[str, Any]] = {
        (c["load"], c["seed"]): c for c in cells if c["policy"] == baseline
    }
    first = {p: i for i, p in reversed(list(enumerate(c["policy"] for c in cells)))}
    rows = []
    # by load, then policies in the order they first ran (cells may rotate it per load and seed)
    for (load, policy), group in sorted(by.items(), key=lambda kv: (kv[0][0], first[kv[0][1]])):
        row: dict[str, Any] = {"load": load, "policy": policy, "seeds": len(group),
                               "rate": _mean([c["rate"] for c in group])}
        sides = [s for s in ("real", "pred", "pred_before") if s in group[0]]
        for side in sides:
            keys = group[0][side].keys()
            row[side] = {k: _mean([c[side][k] for c in group]) for k in keys}
        for side in sides:
            ratios = []
            for c in group:
                b = base.get((load, c["seed"]))
                p95, b95 = c[side]["flow_p95_s"], b[side]["flow_p95_s"] if b else None
                if p95 and b95:
                    ratios.append(b95 / p95)
            row[f"{side}_ratio"] = ({"mean": float(np.mean(ratios)), "min": min(ratios),
                                     "max": max(ratios), "n": len(ratios)} if ratios else None)
        extra = [k for k in group[0] if k.startswith("engine_")]
        for k in extra:
            row[k] = _mean([c.get(k) for c in group])
        rows.append(row)
    return rows


def check_goals(rows: Sequence[Mapping[str, Any]], *, best: str = "cvar",
                baseline: str = "eager", gain: float = 2.0, light_slack: float = 0.03,
                ratio_tol: float = 0.20, tie: float = 0.05) -> dict[str, Any]:
    """The issue's goals, measured: ``best`` beats ``baseline`` on real P95 by ``gain``× at the
    most contended load and is at most ``light_slack`` worse at the lightest; the simulator
    ranks the policies as the real runs do at every load (every pair whose real P95 differ by
    more than ``tie`` is ordered the same way); each predicted P95 ratio is within
    ``ratio_tol`` of the real one."""
    loads = sorted({r["load"] for r in rows})
    at = {(r["load"], r["policy"]): r for r in rows}
    out: dict[str, Any] = {"loads": loads}
    hi, lo = at.get((loads[-1], best)), at.get((loads[0], best))
    if hi and hi["real_ratio"]:
        out["gain_at_most_contended"] = hi["real_ratio"]["mean"]
        out["gain_met"] = hi["real_ratio"]["mean"] >= gain
    if lo and lo["real_ratio"]:
        out["light_ratio"] = lo["real_ratio"]["mean"]
        out["light_met"] = lo["real_ratio"]["mean"] >= 1.0 - light_slack
    noise = [abs(1.0 - r["real_ratio"]["mean"]) for r in rows
             if r["policy"] == baseline + RERUN and r["real_ratio"]]
    if noise:  # the baseline against its own rerun: how far apart two runs of one policy are
        out["noise_floor_max"] = max(noise)
    rows = [r for r in rows if not r["policy"].endswith(RERUN)]
    ranks = {}
    for load in loads:
        pols = [r for r in rows if r["load"] == load]
        real = [r["policy"] for r in sorted(pols, key=lambda r: r["real"]["flow_p95_s"] or 1e18)]
        pred = [r["policy"] for r in sorted(pols, key=lambda r: r["pred"]["flow_p95_s"] or 1e18)]
        # pairs the real runs tell apart (P95 more than ``tie`` apart) must be ordered alike
        wrong = []
        for i, a in enumerate(pols):
            for b in pols[i + 1:]:
                ra, rb = a["real"]["flow_p95_s"], b["real"]["flow_p95_s"]
                pa, pb = a["pred"]["flow_p95_s"], b["pred"]["flow_p95_s"]
                if not (ra and rb and pa and pb) or abs(ra / rb - 1.0) <= tie:
                    continue
                if (ra < rb) != (pa < pb):
                    wrong.append([a["policy"], b["policy"]])
        ranks[str(load)] = {"real": real, "pred": pred, "same": not wrong,
                            "misordered_pairs": wrong}
    out["ranking"] = ranks
    out["ranking_met"] = all(v["same"] for v in ranks.values())
    errs = []
    for r in rows:
        if r["policy"] == baseline or not r["real_ratio"] or not r["pred_ratio"]:
            continue
        real, pred = r["real_ratio"]["mean"], r["pred_ratio"]["mean"]
        errs.append({"load": r["load"], "policy": r["policy"], "real": real, "pred": pred,
                     "rel_err": abs(pred - real) / real})
    out["ratio_errors"] = errs
    out["ratio_max_err"] = max((e["rel_err"] for e in errs), default=None)
    out["ratio_met"] = bool(errs) and all(e["rel_err"] <= ratio_tol for e in errs)
    return out


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} s" if v >= 10 else f"{v:.2f} s"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _tok(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e3:.1f}k" if v >= 1e3 else f"{v:.0f}"


def _ratio(r: Mapping[str, float] | None) -> str:
    if not r:
        return "-"
    if r.get("n", 1) > 1:
        return f"{r['mean']:.2f}× ({r['min']:.2f}–{r['max']:.2f})"
    return f"{r['mean']:.2f}×"


def render_table(rows: Sequence[Mapping[str, Any]], baseline: str = "eager") -> str:
    """Markdown: per load and policy, real (measured) beside predicted (simulated)."""
    head = (
        "| load (rate) | policy | flow P95 real / pred | P50 real / pred | mean real / pred "
        f"| prefix hit real / pred | recomputed prompt tokens real / pred | {baseline}/policy "
        "P95 real (min–max over seeds) | pred |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        real, pred = r["real"], r["pred"]
        lines.append(
            f"| {r['load']:g} ({r['rate']:.2f}/s) | {r['policy']} "
            f"| {_s(real['flow_p95_s'])} / {_s(pred['flow_p95_s'])} "
            f"| {_s(real['flow_p50_s'])} / {_s(pred['flow_p50_s'])} "
            f"| {_s(real['flow_mean_s'])} / {_s(pred['flow_mean_s'])} "
            f"| {_pct(real['prefix_hit_rate'])} / {_pct(pred['prefix_hit_rate'])} "
            f"| {_tok(real['recomputed_prompt_tokens'])} "
            f"/ {_tok(pred['recomputed_prompt_tokens'])} "
            f"| {_ratio(r['real_ratio'])} | {_ratio(r['pred_ratio'])} |"
        )
    return head + "\n".join(lines) + "\n"


def plot_ab(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str) -> Path:
    """P95 flow time vs offered load per policy: measured (solid, seed range shaded) and
    predicted (dashed); right: the prefix hit rate the engines reported."""
    from turnstile.bench.plots import pyplot

    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    policies = list(dict.fromkeys(r["policy"] for r in rows if not r["policy"].endswith(RERUN)))
    for i, pol in enumerate(policies):
        pts = sorted((r for r in rows if r["policy"] == pol), key=lambda r: r["load"])
        x = [r["load"] for r in pts]
        color = f"C{i}"
        ax.plot(x, [r["real"]["flow_p95_s"] for r in pts], "-o", color=color,
                label=f"{pol} (measured)")
        ax.plot(x, [r["pred"]["flow_p95_s"] for r in pts], "--x", color=color, alpha=0.8,
                label=f"{pol} (simulated)")
        ax2.plot(x, [r["real"]["prefix_hit_rate"] for r in pts], "-o", color=color, label=pol)
        ax2.plot(x, [r["pred"]["prefix_hit_rate"] for r in pts], "--x", color=color, alpha=0.8)
    ax.set_xlabel("offered load (fraction of estimated capacity)")
    ax.set_ylabel("workflow flow time P95 (s)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax2.set_xlabel("offered load")
    ax2.set_ylabel("prefix hit rate")
    ax2.set_title("solid: engines' own counters, dashed: simulated", fontsize=8)
    ax2.set_ylim(0, 1)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
