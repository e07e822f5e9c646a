"""Side-by-side simulated benchmarks: every policy on the *same* workload, one evidence record.

Workload preparation is explicit about what is real and what is synthetic: real sessions from a
trace are *superimposed* on an arrival process (Poisson at a rate, or a real arrival stream),
because no shared trace has real multi-tenant session arrivals.
"""

from __future__ import annotations

import hashlib
import math
import platform
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from turnstile.policies import resolved_spec
from turnstile.sim.cluster import EngineGroup, run_sim
from turnstile.sim.roofline_perf import RooflinePerf, load_gpu, load_model
from turnstile.workload import synth
from turnstile.workload.model import Workflow, check_turn_sizes

LOAD_LEVELS = {"light": 0.3, "medium": 0.7, "high": 1.2, "overload": 2.0}


@dataclass
class WorkloadSpec:
    """How the benchmark workload is built from a trace (or the synthetic generator)."""

    trace: str | None
    workflows: int = 200
    #: arrival rate in workflows/s; None = derived from ``load`` and the cluster's capacity
    rate: float | None = None
    load: float = 0.7
    arrivals: str = "poisson"  # poisson | trace (keep the trace's own arrival times)
    seed: int = 0
    subset: str | None = None


def parse_load(load: str) -> float:
    """``light``/``medium``/``high``/``overload`` or a number: offered load as a fraction of the
    cluster's estimated token capacity."""
    if load in LOAD_LEVELS:
        return LOAD_LEVELS[load]
    try:
        v = float(load)
    except ValueError:
        raise ValueError(
            f"--load must be a number or one of {', '.join(LOAD_LEVELS)}; got {load!r}"
        ) from None
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"--load {load}: expected a finite number > 0")
    return v


def workflow_service_s(wf: Workflow, perf: RooflinePerf, batch: int = 32) -> float:
    """Rough busy time one engine spends on ``wf``: new prompt tokens prefilled in 2k chunks
    (context read from cache) plus decode steps shared by ``batch`` sequences."""
    total = 0.0
    for t in wf.turns:
        total += perf.step_time(t.input_tokens, 0, t.prompt_tokens)
        step = perf.step_time(0, batch, batch * (t.prompt_tokens + t.output_tokens // 2))
        total += t.output_tokens * step / batch
    return total


def capacity_rate(workflows: Sequence[Workflow], groups: Sequence[EngineGroup]) -> float:
    """Estimated workflows/s the cluster sustains (offered load 1.0): the lower of a compute
    bound (busy time per workflow) and a KV bound (Little's law: sessions resident at once ×
    their context must fit in KV memory, tool time included, since an agent's context is
    needed again after every tool call). An estimate for choosing arrival rates, not a
    measurement: the simulator measures."""
    sample = list(workflows)[:200]
    mean_ctx = float(np.mean([t.prompt_tokens + t.output_tokens for w in sample for t in w.turns]))
    rate = 0.0
    for g in groups:
        perf = g.build_perf()
        service = np.array([workflow_service_s(w, perf) for w in sample])  # type: ignore[arg-type]
        tools = np.array([sum(t.tool_duration_s for t in w.turns) for w in sample])
        compute_rate = g.count / float(service.mean())
        kv_tokens = g.scheduler_kv_tokens(g.build_config())
        kv_rate = g.count * kv_tokens / (mean_ctx * float((service + tools).mean()))
        rate += min(compute_rate, kv_rate)
    return rate


def load_base_workflows(spec: WorkloadSpec) -> tuple[list[Workflow], dict[str, Any]]:
    """The sessions to replay and a description of where they came from."""
    if spec.trace is None:
        wfs = synth.generate(synth.DEFAULT_SPEC, max(spec.workflows, 1), spec.seed)
        return wfs, {"path": None, "name": "synthetic (fitted to agentcgroup)", "sha256": None}
    from turnstile.bench.report import file_sha256, tree_sha256
    from turnstile.traces import load_trace

    path = Path(spec.trace)
    kw: dict[str, Any] = {}
    if spec.subset:
        kw["subset"] = spec.subset
    try:
        loaded = load_trace(path, **kw)
    except TypeError:  # the format's loader takes no subset
        if not spec.subset:
            raise
        raise ValueError(f"--subset {spec.subset}: {path} is not an AgentCgroup trace (the "
                         "only format with subsets)") from None
    if not loaded.workflows:  # a recording gains a session only when that session finishes
        raise ValueError(f"{path}: no workflows to simulate (serve --record writes a session "
                         "when it ends: idle for session_idle_s, 300 s by default, or when the "
                         "gateway stops)")
    digest = tree_sha256(path) if path.is_dir() else file_sha256(path)
    # hash ids name blocks of a trace-defined size (Mooncake: 512 tokens); the engine must
    # know the unit
    hash_tokens = loaded.hash_block_tokens
    return loaded.workflows, {"path": str(path), "name": loaded.name, "sha256": digest,
                              "notes": loaded.notes, "hash_block_tokens": hash_tokens,
                              "warnings": list(loaded.warnings)}


def build_workload(
    spec: WorkloadSpec, groups: Sequence[EngineGroup]
) -> tuple[list[Workflow], dict[str, Any]]:
    base, info = load_base_workflows(spec)
    check_turn_sizes(base, spec.trace)
    if spec.arrivals == "trace":
        wfs = sorted(base, key=lambda w: w.arrival_s)[: spec.workflows]
        if spec.trace is None:  # the generator's own times: one batch at t = 0
            info.update(arrivals="synthetic sessions, all arriving at t = 0 (one batch)",
                        rate=None)
            return wfs, info
        info.update(arrivals="trace-driven: the trace's sessions at the trace's own arrival "
                    "times", rate=None, used=workflows_used(len(wfs), len(base), True))
        return wfs, info
    if spec.arrivals != "poisson":
        raise ValueError(f"unknown arrival process {spec.arrivals!r}; use poisson or trace")
    rate = spec.rate if spec.rate is not None else spec.load * capacity_rate(base, groups)
    times = synth.poisson_arrivals(rate, spec.workflows, spec.seed)
    what = ("synthetic sessions on" if spec.trace is None
            else "trace-driven: the trace's sessions superimposed on")
    info.update(arrivals=f"{what} seeded Poisson arrivals (seed {spec.seed})", rate=rate,
                offered_load=spec.load if spec.rate is None else None)
    if spec.trace is not None:
        info["used"] = workflows_used(spec.workflows, len(base), False)
    return synth.superimpose(base, times, seed=spec.seed), info


def workflows_used(n: int, available: int, trace_arrivals: bool) -> str:
    """One sentence: how many of the trace's workflows ``--workflows n`` used."""
    if trace_arrivals:
        return (f"--workflows {n:,}: the first {n:,} of the trace's {available:,} workflows "
                "by arrival")
    if n < available:
        return (f"--workflows {n:,}: {n:,} of the trace's {available:,} workflows "
                "(a seeded shuffle)")
    if n == available:
        return f"--workflows {n:,}: all {available:,} of the trace's workflows, once each"
    return (f"--workflows {n:,}: the trace's {available:,} workflows, each replayed about "
            f"{n / available:.1f} times (repeats get new ids)")


def workload_digest(wfs: Sequence[Workflow]) -> str:
    h = hashlib.sha256()
    for w in wfs:
        h.update(f"{w.id}|{w.arrival_s:.6f}|{len(w.turns)}|{w.total_prompt_tokens}\n".encode())
    return h.hexdigest()


def run_bench(
    workflows: Sequence[Workflow],
    specs: Sequence[str],
    groups: Sequence[EngineGroup],
    *,
    slo_ttft_s: float = 2.0,
    slo_tpot_s: float = 0.1,
    hash_block_tokens: int = 0,
    block_size: int = 16,
    on_policy_start: Callable[[str], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
    detailed: bool = False,
    session_idle_s: float | None = None,
) -> list[dict[str, Any]]:
    """Run each policy spec on the same workflows; one result dict per policy.

    ``block_size``: the engines' KV block (their prefix cache reuses whole blocks).
    ``session_idle_s``: workflow ends are not announced to the policies; sessions close by the
    gateway's idle rule after this long (:class:`~turnstile.sim.cluster.ClusterSim`).
    ``detailed``: add every workflow's and turn's samples (``--save-detailed``,
    :mod:`turnstile.bench.detailed`)."""
    from turnstile.bench.detailed import DETAILED_KEY, TTFT_KEY, detailed_samples, ttft_samples
    from turnstile.bench.metrics import compute_metrics

    gpu = load_gpu(groups[0].gpu)
    results = []
    for spec in specs:
        if on_policy_start is not None:
            on_policy_start(spec)
        res = run_sim(workflows, spec, groups, on_progress=on_progress,
                      hash_block_tokens=hash_block_tokens, block_size=block_size,
                      session_idle_s=session_idle_s)
        metrics = compute_metrics(
            res.workflows,
            engine_stats=res.engine_stats,
            makespan_s=res.makespan_s,
            gpu_price_per_h=gpu.price_per_hour,
            gpu_power_w=gpu.power_w,
            num_gpus=res.num_gpus,
            slo_ttft_s=slo_ttft_s,
            slo_tpot_s=slo_tpot_s,
        )
        results.append({
            "policy": spec,
            "simulated": True,
            "metrics": metrics,
            "sim": {"wall_s": res.wall_s, "iterations": res.iterations, "events": res.events,
                    "makespan_s": res.makespan_s,
                    "iterations_per_s": res.iterations / max(res.wall_s, 1e-9)},
            "engines": res.engine_stats,
        })
        # the report's TTFT CDF (a private key: results.json keeps it only with ``detailed``)
        results[-1][TTFT_KEY] = ttft_samples(res.workflows)
        if detailed:
            results[-1][DETAILED_KEY] = detailed_samples(res.workflows)
    return results


def bench_config(spec: WorkloadSpec, groups: Sequence[EngineGroup], policies: Sequence[str],
                 **extra: Any) -> dict[str, Any]:
    from turnstile import __version__

    return {
        "turnstile": __version__,
        "python": platform.python_version(),
        "policies": list(policies),
        # every option of every policy, defaults included (the spec as it ran)
        "resolved_policies": {p: resolved_spec(p) for p in policies},
        "workload": asdict(spec),
        "engines": [{k: v for k, v in asdict(g).items() if k != "perf"} for g in groups],
        **extra,
    }


#: GPUs one tensor-parallel engine may span (one node, as the roofline's all-reduce assumes)
MAX_TP = 8


def check_tp(model: str, tp: int, flag: str = "--tp") -> None:
    """``tp`` must divide the model's attention heads and fit one node of ``MAX_TP`` GPUs."""
    spec = load_model(model)
    if tp < 1 or tp > MAX_TP:
        raise ValueError(f"{flag} {tp}: one engine spans 1 to {MAX_TP} GPUs")
    if spec.num_heads % tp:
        raise ValueError(f"{flag} {tp} does not divide {spec.name}'s {spec.num_heads} attention "
                         "heads")


def model_check(gpu: str, model: str, tp: int = 1) -> None:
    """Fail early with the valid names, and on a tensor parallelism the model cannot use."""
    g, m = load_gpu(gpu), load_model(model)
    check_tp(model, tp)
    from turnstile.sim.roofline_perf import kv_capacity_tokens

    try:
        kv_capacity_tokens(g, m, tp)
    except ValueError:  # the weights do not fit: said with the flags that change it
        raise ValueError(f"--model {model} ({m.weight_bytes / 1e9:.1f} GB of weights) does "
                         f"not fit on --tp {tp} {g.name} GPU{'s' if tp > 1 else ''} per "
                         "engine: raise --tp or pick a larger --gpu") from None


def check_kv_fits(workflows: Sequence[Workflow], groups: Sequence[EngineGroup]) -> None:
    """Every turn's prompt and output must fit one engine's KV (a slot's, on slot engines):
    said now, naming ``--kv-tokens``, rather than by the simulator half-way through a run."""
    longest = max((t.prompt_tokens + t.output_tokens - 1 for wf in workflows for t in wf.turns),
                  default=0)
    for g in groups:
        cfg = g.build_config()
        holds = cfg.slot_tokens if cfg.kv_slots else cfg.num_gpu_blocks * cfg.block_size
        if longest > holds:
            what = (f"--kv-tokens {g.kv_tokens}" if g.kv_tokens is not None
                    else f"the KV of {g.gpu} {g.model} TP{g.tp} (--kv-tokens to set it)")
            where = "a slot of an engine" if cfg.kv_slots else "an engine"
            raise ValueError(f"{what}: {where} holds {holds:,} KV tokens but the workload's "
                             f"longest turn needs {longest:,} (prompt + output)")
