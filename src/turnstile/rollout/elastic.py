"""Asynchronous RL with bounded staleness and an elastic rollout/training pool (simulated).

Libra's loop (GRPO, asynchronous): rollout batches and training steps overlap on disjoint GPU
pools. Batch ``k`` is sampled with the newest weights when it starts and may start once the
trainer has produced version ``k − staleness`` (``staleness`` 2–4 versions: no trajectory trains
a model more than that many versions newer than the one that generated it); training step ``k``
starts when batch ``k`` is complete and step ``k − 1`` is done. A batch's long tail therefore no
longer idles the GPUs: the next batches' trajectories fill them.

**Planner.** At the first step, every ``replan_every`` steps and early when the trainer and
rollout are out of balance (their time ratio past ``pressure_ratio``), the planner of
:mod:`turnstile.rollout.planner` minimises ``max(T_train, T_rollout)`` over rollout TP layouts and
the GPU split (each candidate simulated on the last batch), and a plan is applied only when its
gain over ``replan_every`` steps beats the reconfiguration cost.

**Elastic pool.** Between plans, whole rollout replicas are *lent* to training when training is
the bottleneck — a finished batch waits for the trainer, or the recent train/rollout time ratio
is at least ``lend_ratio`` — and given back when rollout is (ratio at most ``1 / lend_ratio``):
a lent replica drains (its running turns finish, its paused trajectories move at their next
turn), its GPUs join training from the next training step (a joining worker adds zero
gradients for one step: it counts from the step after), and the training pool pays
``reshard_s`` once per change. Everything here is simulated.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from turnstile.policies import ROUTING, RoutingPolicy
from turnstile.rollout.planner import Plan, Planner, PlannerConfig
from turnstile.rollout.sim import BatchResult, GpuPool, RolloutCluster, SimConfig, format_mix
from turnstile.rollout.training import TrainModel
from turnstile.rollout.workload import RolloutTrajectory, training_tokens

__all__ = ["AsyncRLLoop", "AsyncResult", "AsyncStep", "ElasticConfig", "Workload"]


class Workload(Protocol):
    """What the loops read of a workload (``RolloutWorkload``, ``LibraWorkload``)."""

    def batch(self, step: int) -> list[RolloutTrajectory]: ...

    def forecast(self, step: int) -> list[RolloutTrajectory]: ...


@dataclass(frozen=True)
class ElasticConfig:
    #: versions a batch may lag the trainer (0: strictly on-policy, one batch at a time)
    staleness: int = 2
    #: lend / return replicas (False: the plan's split only)
    lend: bool = True
    #: train/rollout time ratio that lends a replica to training (its inverse returns one)
    lend_ratio: float = 1.25
    #: rollout replicas never lent below this many GPUs of rollout
    min_rollout_gpus: int = 2


@dataclass
class AsyncStep:
    """One training step: the batch it consumed and when things happened (simulated)."""

    step: int
    batch_start_s: float
    batch_end_s: float
    train_start_s: float
    train_end_s: float
    train_gpus: int
    rollout_gpus: int
    mix: str
    #: versions between the weights that sampled the batch and the weights it trains
    staleness: int
    train_tokens: int
    events: list[str] = field(default_factory=list)

    @property
    def rollout_s(self) -> float:
        return self.batch_end_s - self.batch_start_s

    @property
    def train_s(self) -> float:
        return self.train_end_s - self.train_start_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "rollout_makespan_s": round(self.rollout_s, 3),
            "train_s": round(self.train_s, 3),
            "batch_start_s": round(self.batch_start_s, 3),
            "train_end_s": round(self.train_end_s, 3),
            "train_gpus": self.train_gpus,
            "rollout_gpus": self.rollout_gpus,
            "mix": self.mix,
            "staleness": self.staleness,
            "train_tokens": self.train_tokens,
            "events": self.events,
        }


@dataclass
class AsyncResult:
    steps: list[AsyncStep]
    total_s: float
    sim_stats: dict[str, Any]
    planner_evals: int
    lends: int
    returns: int

    @property
    def steps_per_hour(self) -> float:
        return len(self.steps) / self.total_s * 3600 if self.total_s > 0 else 0.0


class AsyncRLLoop:
    """Asynchronous RL with bounded staleness, a planner and an elastic pool (see the module
    docstring)."""

    def __init__(
        self,
        workload: Workload,
        policy: str | Callable[[], RoutingPolicy] = "cmlfq",
        *,
        sim_config: SimConfig | None = None,
        planner: PlannerConfig | None = None,
        elastic: ElasticConfig | None = None,
        train: TrainModel | None = None,
        reconfig_s: float | None = None,
    ) -> None:
        self.workload = workload
        self.sim_cfg = sim_config or SimConfig()
        self.el = elastic or ElasticConfig()
        base = planner or PlannerConfig()
        #: the planner sizes the pool for the batches in flight at once
        self.cfg = dataclasses.replace(base, overlap=self.el.staleness + 1)
        self.train = train or TrainModel.for_names(self.sim_cfg.gpu, self.sim_cfg.model)
        make = (lambda: ROUTING.create(policy)) if isinstance(policy, str) else policy
        self.router = make()
        self.planner = Planner(self.cfg, self.sim_cfg, self.train)
        self.reconfig_s = (max(self.sim_cfg.engine_start_s, self.cfg.reshard_s)
                           if reconfig_s is None else reconfig_s)
        self.sim: RolloutCluster | None = None
        self.pool: GpuPool | None = None
        self.lends = 0
        self.returns = 0

    # -- planning -----------------------------------------------------------------------------
    def _choose(self, current: Plan | None, probe: Sequence[RolloutTrajectory]
                ) -> tuple[Plan, str]:
        if self.cfg.static is not None:
            return self.cfg.static, ""
        plan, gain, period = self.planner.choose(current, probe, self.router, self.reconfig_s)
        if current is None:
            return plan, f"initial plan {plan}"
        if plan != current:
            return plan, f"replan: {gain:.0%} gain, {period:,.0f} s per step"
        return current, ""

    # -- the loop -----------------------------------------------------------------------------
    def run(self, steps: int, on_step: Callable[[AsyncStep], None] | None = None
            ) -> AsyncResult:
        c, el = self.cfg, self.el
        plan, _ = self._choose(None, self._probe(0))
        sim = RolloutCluster(plan.mix, self.router, self.sim_cfg)
        self.sim = sim
        self.pool = pool = GpuPool(sim, c.total_gpus, plan.train_gpus)
        batches: list[tuple[BatchResult, list[RolloutTrajectory], int, str]] = []
        waiting: deque[int] = deque()  # complete batches waiting for the trainer
        records: list[AsyncStep] = []
        version = 0
        train_end = math.inf  # the running training step's end (inf: idle)
        training: tuple[int, float, int] | None = None  # (batch, start, GPUs)
        train_gpus_prev = pool.train_gpus
        last_replan = 0
        events: list[str] = []
        recent: deque[tuple[float, float]] = deque(maxlen=3)  # (rollout_s, train_s)

        def start_batches(now: float) -> None:
            while len(batches) < steps and len(batches) <= version + el.staleness:
                k = len(batches)
                trajs = self.workload.batch(k)
                res = sim.add_batch(trajs, now)
                mix = format_mix(pool.mix())
                batches.append((res, trajs, version, mix))

        def start_training(now: float) -> None:
            nonlocal training, train_end, train_gpus_prev
            if training is not None or not waiting:
                return
            k = waiting.popleft()
            tokens = training_tokens(batches[k][1])
            # a joining worker contributes zero gradients for one step
            gpus = min(pool.train_gpus, train_gpus_prev) or pool.train_gpus
            t, _ = self.train.step_time(gpus, tokens)
            if pool.train_gpus != train_gpus_prev:
                t += c.reshard_s
            train_gpus_prev = pool.train_gpus
            training = (k, now, gpus)
            train_end = now + t

        start_batches(0.0)
        queued = 0
        while len(records) < steps:
            open_batches = [b for b, *_ in batches if b.done < b.n]

            def stop(bs: list[BatchResult] = open_batches) -> bool:
                return any(b.done >= b.n for b in bs)

            if open_batches:
                sim.run_until(train_end, stop=stop)
            else:
                sim.run_until(train_end)
            now = sim.now
            # batches train in order: queue each complete batch once those before it are
            while queued < len(batches) and batches[queued][0].done >= batches[queued][0].n:
                waiting.append(queued)
                queued += 1
            if training is not None and now >= train_end - 1e-9:
                k, t0, gpus = training
                b, trajs, v0, mix = batches[k]
                rec = AsyncStep(k, b.start_s, b.end_s, t0, train_end, gpus,
                                c.total_gpus - pool.train_gpus, mix, version - v0,
                                training_tokens(trajs), events)
                events = []
                records.append(rec)
                recent.append((rec.rollout_s, rec.train_s))
                version += 1
                training, train_end = None, math.inf
                if on_step is not None:
                    on_step(rec)
                if len(records) < steps:
                    events += self._adjust(recent, now, version, last_replan,
                                           self._probe(len(records)))
                    if events and events[0].startswith("plan "):
                        last_replan = version
            start_training(now)
            start_batches(now)
            if training is None and not waiting and len(records) < steps and all(
                    b.done >= b.n for b, *_ in batches):
                raise RuntimeError(f"async loop stalled at step {len(records)}")
        return AsyncResult(records, records[-1].train_end_s if records else 0.0, sim.stats(),
                           self.planner.evals, self.lends, self.returns)

    def _probe(self, step: int) -> list[RolloutTrajectory]:
        """What the planner simulates: the batches in flight at once (``overlap``), drawn from
        the workload model (a forecast, not the batches that will run)."""
        out: list[RolloutTrajectory] = []
        for j in range(max(1, self.cfg.overlap)):
            out += self.workload.forecast(step + j)
        return out

    def _adjust(self, recent: deque[tuple[float, float]], now: float, version: int,
                last_replan: int, probe: Sequence[RolloutTrajectory]) -> list[str]:
        """After a training step: replan (periodically or on pressure), else lend or return a
        replica when the trainer or the rollout is the bottleneck."""
        c, el, pool = self.cfg, self.el, self.pool
        assert pool is not None
        out: list[str] = []
        rollout_s = sum(r for r, _ in recent) / len(recent)
        train_s = sum(t for _, t in recent) / len(recent)
        # with staleness s, up to s + 1 batches overlap: rollout's time per step is divided
        per_step_rollout = rollout_s / (el.staleness + 1)
        ratio = train_s / per_step_rollout if per_step_rollout > 0 else math.inf
        pressure = ratio >= c.pressure_ratio or ratio <= 1.0 / c.pressure_ratio
        if c.static is None and (version - last_replan >= c.replan_every or
                                 (pressure and version - last_replan >= c.cooldown_steps)):
            current = Plan(pool.mix(), pool.train_gpus)
            new, why = self._choose(current, probe)
            if why and new != current:
                moves = pool.apply(new.mix, new.train_gpus, now)
                out.append(f"plan {new}: drained {len(moves['drained'])}, started "
                           f"{len(moves['started'])} ({why})")
                return out
        if el.lend:
            msg = None
            if ratio >= el.lend_ratio:
                msg = pool.lend(el.min_rollout_gpus)
                self.lends += msg is not None
            elif ratio <= 1.0 / el.lend_ratio:
                msg = pool.give_back(now)
                self.returns += msg is not None
            if msg:
                out.append(msg)
        return out
