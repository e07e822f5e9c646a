"""Simulator fidelity: replay a trace slice on real engines and in the simulator, compare.

The pieces, each usable on its own:

* :class:`TraceScale` / :func:`scale_workflow` shrink real agent sessions to what a small engine
  serves (token counts divided, context capped, tool times divided), keeping each session a
  proper chain (turn ``n+1``'s context is turn ``n``'s prompt plus its output);
* :func:`select_sessions` picks sessions from a trace, :func:`on_poisson` puts them on arrivals;
* :func:`simulate` runs the same workflows, with the same static engine assignment as the real
  replay, on a :class:`turnstile.sim.cluster.ClusterSim` (eager release, pinned routing, one
  simulated engine per real one, configured like it: KV tokens, max sequences, per-step token
  budget; slower while the others compute when the perf model measured its host's contention);
* :func:`~turnstile.calibrate.fidelity_report.compare` pairs turns and workflows and returns
  relative errors; :mod:`turnstile.calibrate.fidelity_report` reports them.

:func:`run_fidelity` ties them together for a list of arrival rates.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from turnstile.calibrate.fidelity_report import Observed, compare, observe
from turnstile.calibrate.replay import ReplayRun, assign_round_robin, replay_workflows
from turnstile.policies import PolicySet
from turnstile.policies.routing import PinnedRouting
from turnstile.sim.cluster import ClusterSim, EngineGroup
from turnstile.sim.perf import PerfModel
from turnstile.sim.roofline_perf import ModelSpec, load_model
from turnstile.workload import synth
from turnstile.workload.model import ToolCall, Turn, Workflow

__all__ = [
    "REAL_RERUN",
    "SimEngineSpec",
    "TraceScale",
    "engine_spec_for",
    "model_spec",
    "on_poisson",
    "run_fidelity",
    "scale_workflow",
    "select_sessions",
    "simulate",
]


#: the row comparing a second real run with the first (run-to-run noise)
REAL_RERUN = "real rerun (noise floor)"


@dataclass(frozen=True)
class TraceScale:
    """How real sessions are shrunk to fit a small engine."""

    #: prompt (first turn) and new-input token counts are divided by this
    token_div: float = 32.0
    #: output token counts are divided by this (less than tokens: keeps decode visible)
    output_div: float = 8.0
    max_output: int = 48
    #: tool and think seconds are divided by this, and a turn's tools capped at ``max_tool_s``
    tool_div: float = 10.0
    max_tool_s: float = 3.0
    #: a session ends before a turn whose prompt + output would exceed this
    max_context: int = 1536
    max_turns: int = 12


def scale_workflow(wf: Workflow, s: TraceScale) -> Workflow | None:
    """``wf`` shrunk by ``s`` as a chain whose turns extend each other; ``None`` if not even
    the first turn fits."""
    turns: list[Turn] = []
    prev_prompt = prev_out = 0
    for i, t in enumerate(wf.turns[: s.max_turns]):
        out = min(s.max_output, max(1, round(t.output_tokens / s.output_div)))
        if i == 0:
            ctx = 0
            inp = max(1, round(t.prompt_tokens / s.token_div))
        else:
            ctx = prev_prompt + prev_out
            inp = max(1, round(t.input_tokens / s.token_div))
        if ctx + inp + out > s.max_context:
            break
        tool_s = t.tool_duration_s / s.tool_div
        shrink = min(1.0, s.max_tool_s / tool_s) if tool_s > 0 else 1.0
        tools = tuple(
            ToolCall(c.name, c.duration_s / s.tool_div * shrink, c.status, c.result_tokens)
            for c in t.tools
        )
        think = min(t.think_s / s.tool_div, s.max_tool_s)
        turns.append(Turn(inp, out, ctx, None, tools, None, think if i else 0.0))
        prev_prompt, prev_out = ctx + inp, out
    if not turns:
        return None
    how = f"tokens/{s.token_div:g} out/{s.output_div:g} tools/{s.tool_div:g}"
    meta = {**wf.meta, "scaled": how}
    return Workflow(wf.id, wf.arrival_s, tuple(turns), wf.tenant, meta)


def select_sessions(
    workflows: Sequence[Workflow],
    n: int,
    scale: TraceScale,
    *,
    seed: int = 0,
    min_turns: int = 4,
) -> list[Workflow]:
    """``n`` chain sessions (seeded choice) that keep at least ``min_turns`` turns once scaled."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(workflows))
    out: list[Workflow] = []
    for i in order:
        wf = workflows[int(i)]
        if not wf.is_chain:
            continue
        s = scale_workflow(wf, scale)
        if s is not None and len(s.turns) >= min_turns:
            out.append(s)
            if len(out) == n:
                break
    if len(out) < n:
        raise ValueError(f"only {len(out)} sessions keep {min_turns}+ turns at this scale")
    return out


def on_poisson(sessions: Sequence[Workflow], rate: float, seed: int = 0) -> list[Workflow]:
    """Each session once, on a Poisson stream of ``rate`` sessions/s (seeded order)."""
    times = synth.poisson_arrivals(rate, len(sessions), seed)
    return synth.superimpose(sessions, times, seed=seed)


@dataclass
class SimEngineSpec:
    """The simulated engine, configured like the real one."""

    kv_tokens: int
    max_num_seqs: int
    max_batched_tokens: int
    #: an offload tier for the engine's host prompt cache (llama.cpp ``--cache-ram``)
    cpu_offload_tokens: int = 0
    #: prefix-cache granularity: llama.cpp reuses any common prefix (1 token), vLLM full blocks
    block_size: int = 16
    #: client-side time a request spends outside the engine's steps (HTTP, scheduling hop),
    #: added to every simulated turn; ``None``: the perf model's measured
    #: ``meta["request_overhead_s"]`` when it has one (llama.cpp: TTFT − ``prompt_ms``), else 0
    request_overhead_s: float | None = None

    def group(self, perf: PerfModel) -> EngineGroup:
        return EngineGroup(
            count=1,
            kv_tokens=self.kv_tokens,
            max_num_seqs=self.max_num_seqs,
            max_batched_tokens=max(self.max_batched_tokens, self.max_num_seqs),
            cpu_offload_tokens=self.cpu_offload_tokens,
            perf=perf,
        )


def engine_spec_for(kind: str, *, kv_tokens: int, max_num_seqs: int,
                    block_size: int | None = None, ctx: int = 0) -> SimEngineSpec:
    """The simulated engine configured like a real engine of ``kind`` (its
    :class:`~turnstile.sim.engine_profile.EngineProfile`): the per-step token budget, the prefix
    cache's granularity (``block_size`` as the engine reports it wins over the profile's), and,
    for a slot engine (llama.cpp), its host prompt cache (``--cache-ram``, 8 GiB by default) as
    an offload tier far larger than the sessions (``64 * ctx``)."""
    from turnstile.sim.engine_profile import profile_for

    prof = profile_for(kind)
    slots = prof.slot_limited
    return SimEngineSpec(
        kv_tokens=kv_tokens,
        max_num_seqs=max_num_seqs,
        max_batched_tokens=prof.max_batched_tokens,
        cpu_offload_tokens=64 * (ctx or kv_tokens) if slots else 0,
        block_size=1 if slots else int(block_size or prof.block_size),
    )


def rates_for_loads(loads: Sequence[float], sessions: Sequence[Workflow], engine: SimEngineSpec,
                    perf: PerfModel, engines: int = 1) -> list[float]:
    """Arrival rates (sessions/s) that offer ``loads`` (fractions of the capacity
    :func:`turnstile.bench.runner.capacity_rate` estimates for ``engines`` such engines with
    ``perf``). An absolute rate loads a slow host's engines more than a fast one's (0.5
    sessions/s is past saturation on an engine 1.7x slower): the same loads keep a protocol's
    rates at the same point of the engines' curve on any host."""
    from turnstile.bench.runner import capacity_rate

    if not loads or any(x <= 0 for x in loads):
        raise ValueError(f"loads must be positive fractions of capacity, got {list(loads)}")
    capacity = capacity_rate(sessions, [replace(engine.group(perf), count=max(engines, 1))])
    # three significant digits: a rate names its profile file (profile_rate<r>.json)
    return [float(f"{x * capacity:.3g}") for x in loads]


def simulate(
    workflows: Sequence[Workflow],
    assignment: Mapping[str, int],
    engine: SimEngineSpec,
    perf: PerfModel,
    policy: str = "eager",
) -> Observed:
    """Simulate ``workflows`` on one simulated engine per real one, each workflow on the engine
    ``assignment`` gives it (the real replay's static choice).

    The engines run side by side in one cluster: with a perf model measured on a shared host
    (``FittedPerf.host_contention``) a step is slower while the others compute, as on the real
    host; without it they are independent. The request overhead (see :class:`SimEngineSpec`)
    is added to every turn's TTFT and E2E and, once per turn, to its workflow's flow time."""
    count = max(assignment.values(), default=0) + 1
    policies = PolicySet.from_spec(policy)
    # the cluster names its engines e0, e1, ... in order
    policies.routing = PinnedRouting({w.id: f"e{assignment[w.id]}" for w in workflows})
    group = replace(engine.group(perf), count=count)
    res = ClusterSim(workflows, policies, [group], block_size=engine.block_size).run()
    obs = observe(res.workflows)
    oh = engine.request_overhead_s
    if oh is None:
        meta = getattr(perf, "meta", None)
        oh = float(meta.get("request_overhead_s", 0.0)) if isinstance(meta, dict) else 0.0
    if oh:
        turns = {wf.id: len(wf.turns) for wf in workflows}
        obs.ttft = {k: v + oh for k, v in obs.ttft.items()}
        obs.e2e = {k: v + oh for k, v in obs.e2e.items()}
        obs.flow = {k: v + oh * turns[k] for k, v in obs.flow.items()}
    return obs


def _prompt_ms(timings: Mapping[str, Any] | None) -> float | None:
    if not timings or timings.get("prompt_ms") is None:
        return None
    return round(float(timings["prompt_ms"]), 3)


def model_spec(name_or_path: str | os.PathLike[str]) -> ModelSpec:
    """A model by ``models.json`` name, or from a Hugging Face ``config.json`` (a file or a
    model directory holding one): what the roofline comparison needs for any local model."""
    p = Path(name_or_path)
    cfg_path = p / "config.json" if p.is_dir() else p
    if not cfg_path.is_file():
        return load_model(str(name_or_path))
    import json

    c = json.loads(cfg_path.read_text())
    c = c.get("text_config", c)
    hidden = int(c["hidden_size"])
    heads = int(c["num_attention_heads"])
    spec = ModelSpec(
        name=str(c.get("_name_or_path") or p.name or "hf-model"),
        params=0.0,
        active_params=0.0,
        num_layers=int(c["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads", heads)),
        head_dim=int(c.get("head_dim") or hidden // heads),
        dtype_bytes=1 if "8" in str(c.get("torch_dtype", "")) else 2,
        intermediate_size=int(c.get("intermediate_size", 4 * hidden)),
        vocab_size=int(c.get("vocab_size", 0)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        num_experts=int(c.get("num_experts", c.get("num_local_experts", 0)) or 0),
        experts_per_token=int(c.get("num_experts_per_tok", 0) or 0),
        source=str(cfg_path),
    )
    if spec.num_experts and c.get("moe_intermediate_size"):
        spec = replace(spec, intermediate_size=int(c["moe_intermediate_size"]))
    total, active = spec.shape_params()
    return replace(spec, params=total, active_params=active)


def run_fidelity(
    sessions: Sequence[Workflow],
    targets: Sequence[str],
    rates: Sequence[float],
    engine: SimEngineSpec,
    perfs: Mapping[str, PerfModel | Callable[[float], PerfModel]],
    *,
    apis: Sequence[str] | None = None,
    models: Sequence[str | None] | None = None,
    seed: int = 0,
    repeat_real: bool = False,
    token_range: tuple[int, int] = (33, 127),
    on_rate: Callable[[float, ReplayRun], None] | None = None,
    on_turn: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """For each rate: replay ``sessions`` on Poisson arrivals against ``targets`` (for real),
    simulate the same workflows with each perf model, compare. Returns a JSON-able report with
    ``rows`` for :mod:`turnstile.calibrate.fidelity_report`.

    A perf model given as a callable is called with the rate just before that rate's replay
    (e.g. to profile the engine again right then: on a machine whose load drifts, a profile
    taken minutes earlier describes a different engine).

    With ``repeat_real`` each rate is replayed a second time and compared with the first as if
    it were a prediction (row ``REAL_RERUN``): the run-to-run noise of the real system, a floor
    under any simulator's error."""
    from turnstile.bench.metrics import compute_metrics, public_metrics

    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    names = [*perfs, *([REAL_RERUN] if repeat_real else [])]
    replays = 0
    pooled: dict[str, tuple[Observed, Observed]] = {n: (Observed(), Observed()) for n in names}
    for rate in rates:
        models_now: dict[str, PerfModel] = {
            name: p if isinstance(p, PerfModel) else p(rate) for name, p in perfs.items()
        }
        wfs = on_poisson(sessions, rate, seed)
        assignment = assign_round_robin(wfs, len(targets))
        # fresh prompt tokens for every replay: an engine's prefix cache (llama.cpp keeps idle
        # prompts in host RAM) must not serve one run's prompts to the next
        replays += 1
        run = replay_workflows(wfs, targets, apis=apis, models=models, assignment=assignment,
                               seed=seed * 7919 + replays, token_range=token_range,
                               on_turn=on_turn)
        if on_rate is not None:
            on_rate(rate, run)
        real = observe(run.records)
        metrics = public_metrics(compute_metrics(run.records, makespan_s=run.makespan_s))
        hits = [t.cached_tokens for t in run.turns if t.cached_tokens is not None]
        prompts = sum(t.prompt_tokens for t in run.turns if t.cached_tokens is not None)
        preds: dict[str, Observed] = {
            name: simulate(wfs, assignment, engine, perf) for name, perf in models_now.items()
        }
        if repeat_real:
            replays += 1
            again = replay_workflows(wfs, targets, apis=apis, models=models,
                                     assignment=assignment, seed=seed * 7919 + replays,
                                     token_range=token_range, on_turn=on_turn)
            if on_rate is not None:
                on_rate(rate, again)
            preds[REAL_RERUN] = observe(again.records)
        runs.append({
            "rate": rate,
            "workflows": len(wfs),
            "turns": len(run.turns),
            "errors": run.errors[:20],
            "wall_s": run.wall_s,
            "real_metrics": metrics,
            "engine_prefix_hit_rate": (sum(hits) / prompts) if prompts else None,
            "coefficients": {
                name: list(getattr(p, "coefficients", ())) for name, p in models_now.items()
            },
            # the engine's own prompt time (llama.cpp ``timings.prompt_ms``, else None) splits
            # a turn's TTFT into the engine's part and the way in and out
            "turn_log_fields": ["workflow", "index", "engine", "ready_s", "first_token_s",
                                "finished_s", "prompt_tokens", "cached_tokens",
                                "output_tokens", "prompt_ms"],
            "turn_log": [
                [t.workflow, t.index, t.engine, round(t.ready_s, 4), round(t.first_token_s, 4),
                 round(t.finished_s, 4), t.prompt_tokens, t.cached_tokens, t.output_tokens,
                 _prompt_ms(t.timings)]
                for t in run.turns
            ],
        })
        for name, pred in preds.items():
            rows.append({"model": name, "rate": rate, "errors": compare(real, pred)})
            tag = f"{rate}:"
            for src, dst in ((real, pooled[name][0]), (pred, pooled[name][1])):
                dst.ttft.update({(tag + k[0], k[1]): v for k, v in src.ttft.items()})
                dst.e2e.update({(tag + k[0], k[1]): v for k, v in src.e2e.items()})
                dst.flow.update({tag + k: v for k, v in src.flow.items()})
    for name, (real, pred) in pooled.items():
        rows.append({"model": name, "rate": "all", "errors": compare(real, pred)})
    rows.sort(key=lambda r: (names.index(r["model"]), r["rate"] == "all"))
    return {
        "rows": rows,
        "runs": runs,
        "engine": asdict(engine),
        "sessions": len(sessions),
        "rates": list(rates),
    }
