"""``turnstile rollout sim`` as a function: every policy through the same simulated RL run.

Each policy gets a fresh router and its own planner (or the same static plan), on the same
seeded batches. The result dict is what ``results.json`` holds; everything in it is simulated.
"""

from __future__ import annotations

import dataclasses
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnstile.policies import ROUTING, RoutingPolicy
from turnstile.rollout.libra_workloads import LibraWorkload, make_workload
from turnstile.rollout.planner import Plan, PlannerConfig, RLLoop, StepRecord
from turnstile.rollout.sim import SimConfig, parse_mix
from turnstile.rollout.workload import RolloutSpec, RolloutTrajectory, RolloutWorkload

__all__ = ["MAX_GPUS", "RolloutSimRequest", "SharedBatches", "make_router", "run_rollout_sim"]

#: the largest GPU pool ``rollout sim`` takes (the planner simulates layouts of the whole pool)
MAX_GPUS = 1024
#: trajectories in one step (``--prompts`` × ``--samples``): each is simulated with its turns
#: in memory, and a step of 100k takes minutes already
MAX_TRAJECTORIES = 100_000


#: ``name:option`` ablations the CLI accepts, as constructor arguments
_OPTIONS: dict[tuple[str, str], dict[str, object]] = {
    ("least-open", "nosticky"): {"sticky": False},
    ("least-open", "pergpu"): {"weighted": True},
    # Libra's rules: starts in the first bucket, moves both ways whatever the load
    ("cmlfq", "libra"): {"balance": False, "start": "level0", "move_back": True},
    ("cmlfq-adaptive", "notree"): {"use_tree": False},
    ("cmlfq-adaptive", "nohistory"): {"use_history": False},
    ("cmlfq-adaptive", "nocost"): {"cost_aware": False},
}


def make_router(spec: str) -> RoutingPolicy:
    """A core routing policy from a CLI spec: a registry name (``least-open``, ``cmlfq``,
    ``cmlfq-adaptive``, ``length-predict`` ...), optionally with an ablation
    (``least-open:nosticky``, ``cmlfq-adaptive:notree`` ...)."""
    name, _, opt = spec.partition(":")
    if name not in ROUTING:
        ROUTING.create(name)  # raises with the valid names
    if not opt:
        return ROUTING.create(name)
    kw = _OPTIONS.get((name, opt))
    if kw is None:
        valid = ", ".join(f"{n}:{o}" for n, o in _OPTIONS)
        raise ValueError(f"unknown option {opt!r} for policy {name!r}; valid: {valid}")
    return ROUTING.create(name, **kw)


@dataclass
class RolloutSimRequest:
    steps: int = 5
    gpus: int = 16
    policies: Sequence[str] = ("least-open", "cmlfq")
    #: prompts per step and samples per prompt (None: the workload's own)
    prompts: int | None = None
    samples: int | None = None
    #: ``tool-heavy`` (agent sessions fitted to the traces) or a Libra-like one
    workload: str = "tool-heavy"
    seed: int = 0
    tool_time_scale: float = 1.0
    gpu: str = "H100"
    model: str = "qwen3-8b"
    #: a fixed rollout mix (``tp1x8,tp2x2,tp4x1``); None: the planner chooses every step
    mix: str | None = None
    #: training GPUs with a fixed mix (default: the rest of the pool)
    train_gpus: int | None = None
    tiered: bool = True
    mode: str = "off-policy"
    partial_frac: float = 1.0
    replan_every: int = 10
    spec_overrides: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Check every knob before any work, naming the CLI flag (``ValueError``; an unknown
        policy, GPU or model raises the registry's error listing the valid names)."""
        from turnstile.bench.runner import check_tp
        from turnstile.sim.roofline_perf import load_gpu, load_model

        if self.steps < 1:
            raise ValueError("--steps must be >= 1")
        if not 2 <= self.gpus <= MAX_GPUS:
            raise ValueError(f"--gpus {self.gpus}: the pool holds 2 to {MAX_GPUS:,} GPUs")
        if not self.policies:
            raise ValueError("--policies needs at least one name")
        for p in self.policies:
            make_router(p)
        load_gpu(self.gpu)
        load_model(self.model)
        if self.tool_time_scale < 0:
            raise ValueError(f"--tool-time-scale must be >= 0, got {self.tool_time_scale:g}")
        if not 0.0 < self.partial_frac <= 1.0:
            raise ValueError(f"--partial must be in (0, 1], got {self.partial_frac:g}")
        if self.mode not in ("off-policy", "sync"):
            raise ValueError(f"--mode must be off-policy or sync, got {self.mode!r}")
        if self.train_gpus is not None and self.mix is None:
            raise ValueError("--train-gpus needs --mix (without it the planner splits the GPUs)")
        if self.train_gpus is not None and self.train_gpus < 0:
            raise ValueError(f"--train-gpus must be >= 0, got {self.train_gpus}")
        if self.mix is not None:
            try:
                mix = parse_mix(self.mix)
            except ValueError as e:
                raise ValueError(f"--mix {self.mix}: {e}") from None
            for b in mix:
                check_tp(self.model, b.tp, flag=f"--mix {self.mix}: TP")
            self.planner_config()  # the mix and the training GPUs fit --gpus
        elif self.mode == "off-policy":
            from turnstile.rollout.planner import Planner
            from turnstile.rollout.training import TrainModel

            train = TrainModel.for_names(self.gpu, self.model)
            if not Planner(self.planner_config(), self.sim_config(), train).splits():
                raise ValueError(f"--gpus {self.gpus}: too few to hold a rollout engine and "
                                 f"training ({self.model} trains on {train.min_gpus()} GPUs); "
                                 "raise --gpus or use --mode sync")
        n = self.make_workload().spec.batch_size  # an unknown --workload lists the valid ones
        if n > MAX_TRAJECTORIES:
            raise ValueError(f"--prompts × --samples: {n:,} trajectories per step; at most "
                             f"{MAX_TRAJECTORIES:,}")

    def rollout_spec(self) -> RolloutSpec:
        return RolloutSpec(n_prompts=self.prompts or 32, group_size=self.samples or 8,
                           seed=self.seed, tool_time_scale=self.tool_time_scale,
                           **self.spec_overrides)

    def make_workload(self) -> Any:
        """A fresh workload (the same seeded batches for every policy)."""
        if self.workload == "tool-heavy":
            return RolloutWorkload(self.rollout_spec())
        kw: dict[str, Any] = {"seed": self.seed, **self.spec_overrides}
        if self.prompts is not None:
            kw["n_prompts"] = self.prompts
        if self.samples is not None:
            kw["group_size"] = self.samples
        return make_workload(self.workload, **kw)

    def sim_config(self) -> SimConfig:
        return SimConfig(gpu=self.gpu, model=self.model)

    def planner_config(self) -> PlannerConfig:
        static = None
        if self.mix is not None:
            mix = parse_mix(self.mix)
            rollout = sum(b.gpus for b in mix)
            train = self.gpus - rollout if self.train_gpus is None else self.train_gpus
            if rollout > self.gpus:
                raise ValueError(f"--mix {self.mix} needs {rollout} GPUs, more than --gpus "
                                 f"{self.gpus}")
            if train < 0 or rollout + train > self.gpus:
                raise ValueError(f"--mix {self.mix} ({rollout} GPUs) and --train-gpus {train} "
                                 f"need {rollout + train} GPUs, more than --gpus {self.gpus}")
            static = Plan(mix, train)
        return PlannerConfig(total_gpus=self.gpus, mode=self.mode,  # type: ignore[arg-type]
                             tiered=self.tiered, static=static, replan_every=self.replan_every)


class SharedBatches:
    """A workload whose batches and forecasts are drawn once and handed to every policy:
    both are pure functions of the spec and the step (the trajectories are frozen, and the
    simulator copies each workflow it runs), so a second draw would only repeat the first."""

    def __init__(self, workload: RolloutWorkload | LibraWorkload) -> None:
        self.workload = workload
        self.spec = workload.spec
        self._batches: dict[int, list[RolloutTrajectory]] = {}
        self._forecasts: dict[int, list[RolloutTrajectory]] = {}

    def batch(self, step: int) -> list[RolloutTrajectory]:
        got = self._batches.get(step)
        if got is None:
            got = self._batches[step] = self.workload.batch(step)
        return got

    def forecast(self, step: int) -> list[RolloutTrajectory]:
        got = self._forecasts.get(step)
        if got is None:
            got = self._forecasts[step] = self.workload.forecast(step)
        return got


def run_rollout_sim(
    req: RolloutSimRequest,
    on_step: Callable[[str, StepRecord], None] | None = None,
) -> dict[str, Any]:
    """Run every policy; returns the ``results.json`` document."""
    req.validate()  # every knob before any work
    # every policy runs the same seeded batches: drawn once, by the first policy that asks
    workload = SharedBatches(req.make_workload())
    spec = workload.spec
    planner_cfg = req.planner_config()
    sim_cfg = req.sim_config()
    from turnstile.bench.report import results_header

    out: dict[str, Any] = {
        **results_header("rollout-sim", simulated=True),
        "generator": "turnstile rollout sim",
        "config": {
            **{k: v for k, v in dataclasses.asdict(req).items() if k != "policies"},
            "policies": list(req.policies),
            "workload": {"name": req.workload, **dataclasses.asdict(spec)},
            "sim": sim_cfg.describe(),
            "planner": {
                "mode": planner_cfg.mode,
                "replan_every": planner_cfg.replan_every,
                "pressure_ratio": planner_cfg.pressure_ratio,
                "min_gain": planner_cfg.min_gain,
                "tiered": planner_cfg.tiered,
                "static": str(planner_cfg.static) if planner_cfg.static else None,
            },
            "timing_assumption": (
                "one-step off-policy: training of step k-1 overlaps rollout of step k on "
                "disjoint GPU pools; period = max(rollout, train)"
                if planner_cfg.mode == "off-policy"
                else "synchronous on-policy, colocated: period = rollout + train + switch"
            ),
            "python": platform.python_version(),
        },
        "policies": {},
    }
    for policy in req.policies:
        t0 = time.perf_counter()
        loop = RLLoop(
            workload,
            lambda policy=policy: make_router(policy),
            sim_config=sim_cfg,
            planner=planner_cfg,
            partial_frac=req.partial_frac,
        )
        res = loop.run(req.steps, on_step=(lambda r, p=policy: on_step(p, r)) if on_step else None)
        wall = time.perf_counter() - t0
        makespans = [r.rollout_s for r in res.steps]
        stats = getattr(loop.router, "stats", None)
        out["policies"][policy] = {
            "steps": [r.to_dict() for r in res.steps],
            "makespan_s": [round(m, 3) for m in makespans],
            "mean_makespan_s": round(sum(makespans) / len(makespans), 3),
            "total_s": round(res.total_s, 3),
            "throughput_trajectories_per_h": round(res.throughput * 3600, 2),
            "planner_evaluations": res.planner_evals,
            "router": stats() if callable(stats) else {},
            "sim": {k: v for k, v in res.sim_stats.items() if k != "busy_s"},
            "wall_s": round(wall, 3),
        }
    pols = out["policies"]
    base = req.policies[0]
    out["summary"] = {
        "mean_makespan_s": {p: pols[p]["mean_makespan_s"] for p in pols},
        "total_s": {p: pols[p]["total_s"] for p in pols},
        f"makespan_speedup_vs_{base}": {
            p: round(pols[base]["mean_makespan_s"] / pols[p]["mean_makespan_s"], 4)
            for p in pols
        },
    }
    return out
