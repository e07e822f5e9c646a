"""The rollout/training planner and the elastic GPU pool, driving a simulated RL loop.

**Timing assumption.** By default (``mode="off-policy"``) training of step ``k−1`` overlaps
rollout of step ``k`` on disjoint GPU pools — one-step off-policy, as in Libra and other
asynchronous RL systems — so a step's period is ``max(rollout_k, train_{k−1})``. With
``mode="sync"`` (strictly on-policy, colocated) every GPU rolls out and then every GPU trains:
the period is ``rollout_k + train_k + switch_s`` and the planner only picks the bucket mix.

**Planner.** At step 0, every ``replan_every`` steps, and early when the last step was
imbalanced (the longer of rollout and training ≥ ``pressure_ratio`` × the shorter; Libra also
watches queue/active pressure, which is subsumed here because only the step times matter to the
objective), it forecasts the next step with the *last observed batch* (before any, a batch drawn
from the workload model) and scores candidate plans: how many GPUs roll out, in which bucket
mix, and how the rest train (the training model picks dp/tp/pp). Candidates are ranked by a
cheap analytic bound and the best few are simulated with a copy of the live router. A new plan
is accepted only if ``gain × horizon − reconfiguration cost > 0`` and the gain is at least
``min_gain`` (5%) of the current period.

**Elastic pool.** A plan change takes effect at the next step boundary. Engines leaving the
rollout pool drain: no new placements, running turns finish there and the trajectories paused on
them move at their next turn (re-prefilling their context) — never dropped; the GPUs are
released when the engine's last turn ends. New engines start only on free GPUs and load weights
first (``engine_start_s``). GPUs joining training contribute from the next step (a joining
worker adds zero gradients for one step); a training pool that changes size pays ``reshard_s`` once.

**Partial rollout** (``partial_frac < 1``, off by default, RollPacker-style tail batching): a
step's rollout ends when that fraction of its batch is done; the rest keep running into the
next step and train with the step in which they finish.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from turnstile.policies import ROUTING, RoutingPolicy
from turnstile.rollout.sim import (
    Bucket,
    GpuPool,
    RolloutCluster,
    SimConfig,
    format_mix,
    simulate_batch,
)
from turnstile.rollout.training import TrainModel
from turnstile.rollout.workload import RolloutTrajectory, RolloutWorkload, training_tokens

__all__ = [
    "Plan",
    "Planner",
    "PlannerConfig",
    "RLLoop",
    "RLResult",
    "StepRecord",
    "accept_plan",
    "best_static",
    "candidate_mixes",
]

Mode = Literal["off-policy", "sync"]


@dataclass(frozen=True)
class Plan:
    """A GPU split: the rollout bucket mix and the GPUs that train."""

    mix: tuple[Bucket, ...]
    train_gpus: int

    @property
    def rollout_gpus(self) -> int:
        return sum(b.gpus for b in self.mix)

    @property
    def mix_text(self) -> str:
        return format_mix(self.mix)

    def __str__(self) -> str:
        return f"rollout {self.rollout_gpus} [{self.mix_text}] / train {self.train_gpus}"


@dataclass(frozen=True)
class PlannerConfig:
    total_gpus: int = 16
    mode: Mode = "off-policy"
    replan_every: int = 10
    pressure_ratio: float = 1.25
    #: at least this many steps between two early (pressure) replans
    cooldown_steps: int = 3
    min_gain: float = 0.05
    #: GPUs move in units of this many (a data-parallel replica / the largest engine)
    gpu_step: int = 2
    #: engine TPs the planner may use
    tps: tuple[int, ...] = (1, 2, 4, 8)
    #: only bucketed mixes (at least two TPs: a throughput tier and a latency tier), as in Libra
    tiered: bool = False
    #: one-off cost of resharding a training pool that changes size
    reshard_s: float = 15.0
    #: colocated (sync) mode: switching all GPUs between rollout and training, per step
    switch_s: float = 10.0
    #: fix the GPU split (no planner): a static plan for baselines
    static: Plan | None = None
    #: rollout batches in flight at once (asynchronous RL with staleness s: s + 1); the probe
    #: then holds that many batches and the rollout time per step is its makespan / overlap
    overlap: int = 1


def accept_plan(
    current_period_s: float,
    new_period_s: float,
    horizon_steps: int,
    reconfig_s: float,
    min_gain: float = 0.05,
) -> bool:
    """Libra's acceptance rule: the saving over the horizon must exceed the reconfiguration
    cost, and the per-step gain must be at least ``min_gain`` of the current period."""
    gain = current_period_s - new_period_s
    return gain * horizon_steps - reconfig_s > 0 and gain >= min_gain * current_period_s


def candidate_mixes(
    gpus: int, tps: Sequence[int] = (1, 2, 4, 8), tiered: bool = False
) -> list[tuple[Bucket, ...]]:
    """Bucket mixes on ``gpus`` GPUs: one TP throughout (unless ``tiered``), or a base TP plus
    one or two tail engines of a larger TP, or the three-level mix (TP1, two TP2, one TP4)."""
    out: set[tuple[Bucket, ...]] = set()
    for tp in tps:
        if not tiered and gpus % tp == 0 and gpus >= tp:
            out.add((Bucket(tp, gpus // tp),))
    for base in tps:
        for tail in tps:
            if tail <= base:
                continue
            for n_tail in (1, 2):
                rest = gpus - tail * n_tail
                if rest >= base and rest % base == 0:
                    out.add((Bucket(base, rest // base), Bucket(tail, n_tail)))
    if 1 in tps and 2 in tps and 4 in tps and gpus >= 10:
        out.add((Bucket(1, gpus - 8), Bucket(2, 2), Bucket(4, 1)))
    if not out:  # too few GPUs for two tiers
        return candidate_mixes(gpus, tps, tiered=False)
    return sorted(out, key=lambda m: (len(m), [(b.tp, b.count) for b in m]))


@dataclass
class StepRecord:
    step: int
    plan: Plan
    train_config: str
    start_s: float
    rollout_s: float
    train_s: float
    period_s: float
    trajectories_done: int
    train_tokens: int
    replanned: bool = False
    reason: str = ""
    predicted_gain: float | None = None
    moves: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "rollout_gpus": self.plan.rollout_gpus,
            "mix": self.plan.mix_text,
            "train_gpus": self.plan.train_gpus,
            "train_config": self.train_config,
            "start_s": round(self.start_s, 3),
            "rollout_makespan_s": round(self.rollout_s, 3),
            "train_s": round(self.train_s, 3),
            "period_s": round(self.period_s, 3),
            "trajectories_done": self.trajectories_done,
            "train_tokens": self.train_tokens,
            "replanned": self.replanned,
            "reason": self.reason,
            "predicted_gain": None if self.predicted_gain is None
            else round(self.predicted_gain, 4),
            "moves": self.moves,
        }


@dataclass
class RLResult:
    steps: list[StepRecord]
    total_s: float
    trajectories: int
    sim_stats: dict[str, Any]
    planner_evals: int

    @property
    def throughput(self) -> float:
        """Trajectories per simulated second over the whole run (final training included)."""
        return self.trajectories / self.total_s if self.total_s > 0 else 0.0



class Planner:
    """Chooses plans (see the module docstring)."""

    def __init__(self, cfg: PlannerConfig, sim_cfg: SimConfig, train: TrainModel) -> None:
        self.cfg = cfg
        self.sim_cfg = sim_cfg
        self.train = train
        self.evals = 0
        self._fast: dict[int, float] = {}

    def period(self, rollout_s: float, train_s: float) -> float:
        """Libra's objective: max(T_train, T_rollout) per step (sync: their sum plus the
        switch); rollout time per step is the probe's makespan over the batches in flight."""
        rollout_s /= max(1, self.cfg.overlap)
        if self.cfg.mode == "sync":
            return rollout_s + train_s + self.cfg.switch_s
        return max(rollout_s, train_s)

    def splits(self) -> list[int]:
        """Rollout GPU counts the planner may choose (off-policy mode)."""
        c = self.cfg
        if c.mode == "sync":
            return [c.total_gpus]
        min_train = self.train.min_gpus()
        return [g for g in range(c.gpu_step, c.total_gpus - min_train + 1, c.gpu_step)]

    @staticmethod
    def reference_mix(gpus: int, tps: Sequence[int]) -> tuple[Bucket, ...]:
        """The mix used to size the split: small engines plus one tail engine of TP4 when the
        pool is big enough (the shape C-MLFQ wants), else the smallest TP that divides."""
        if 1 in tps and 4 in tps and gpus >= 8:
            return (Bucket(1, gpus - 4), Bucket(4, 1))
        for tp in sorted(tps):
            if gpus % tp == 0:
                return (Bucket(tp, gpus // tp),)
        return (Bucket(1, gpus),)

    def _rollout_s(
        self,
        mix: tuple[Bucket, ...],
        probe: Sequence[RolloutTrajectory],
        router: RoutingPolicy,
        cache: dict[tuple[Bucket, ...], float],
    ) -> float:
        if mix not in cache:
            res, _, _ = simulate_batch(probe, mix, copy.deepcopy(router), self.sim_cfg)
            self.evals += 1
            cache[mix] = res.makespan_s
        return cache[mix]

    def search(
        self,
        probe: Sequence[RolloutTrajectory],
        router: RoutingPolicy,
        extra: Sequence[Plan] = (),
    ) -> list[tuple[float, float, float, Plan]]:
        """``(period, rollout_s, train_s, plan)`` of the plans tried, best first.

        1. Split: with the reference mix, rollout time falls and training time rises with the
           rollout GPUs, so the period ``max`` is unimodal: a binary search for the crossing
           point, then its neighbours (about log2 of the splits simulated).
        2. Mix: every candidate mix at the best split (and the plans in ``extra``, e.g. the
           current one) is simulated on the same probe.
        """
        c = self.cfg
        tokens = training_tokens(probe) // max(1, c.overlap)
        cache: dict[tuple[Bucket, ...], float] = {}
        splits = self.splits()
        if not splits:
            raise ValueError(f"{c.total_gpus} GPUs cannot hold both a rollout engine and training"
                             f" (training needs {self.train.min_gpus()})")

        def t_train(g: int) -> float:
            if c.mode == "sync":
                return self.train.step_time(c.total_gpus, tokens)[0]
            return self.train.step_time(c.total_gpus - g, tokens)[0]

        def period_at(i: int) -> float:
            g = splits[i]
            return self.period(self._rollout_s(self.reference_mix(g, c.tps), probe, router,
                                               cache), t_train(g))

        lo, hi = 0, len(splits) - 1
        while lo < hi:  # first split whose rollout is no longer than its training
            mid = (lo + hi) // 2
            g = splits[mid]
            r = self._rollout_s(self.reference_mix(g, c.tps), probe, router, cache)
            if r / max(1, c.overlap) <= t_train(g):
                hi = mid
            else:
                lo = mid + 1
        near = sorted({max(0, lo - 1), lo})
        best_i = min(near, key=period_at)
        g = splits[best_i]
        tried: list[tuple[float, float, float, Plan]] = []
        plans = [Plan(m, c.total_gpus - g if c.mode != "sync" else c.total_gpus)
                 for m in candidate_mixes(g, c.tps, c.tiered)]
        for p in [*plans, *extra]:
            r = self._rollout_s(p.mix, probe, router, cache)
            tt = t_train(p.rollout_gpus)
            tried.append((self.period(r, tt), r, tt, p))
        tried.sort(key=lambda x: (x[0], -x[3].rollout_gpus))
        return tried


    def choose(
        self,
        current: Plan | None,
        probe: Sequence[RolloutTrajectory],
        router: RoutingPolicy,
        reconfig_s: float,
    ) -> tuple[Plan, float | None, float]:
        """The plan to run next, its predicted per-step gain over ``current`` (a fraction;
        None for the first plan) and its predicted period: the best plan :meth:`search` finds,
        taken only when :func:`accept_plan` holds (gain over ``replan_every`` steps beats
        ``reconfig_s``, and at least ``min_gain``)."""
        ranked = self.search(probe, router, extra=[current] if current else [])
        best_period, _, _, best = ranked[0]
        if current is None:
            return best, None, best_period
        cur = next(r[0] for r in ranked if r[3] == current)
        if best == current or cur <= 0:
            return current, 0.0, cur
        gain = (cur - best_period) / cur
        if accept_plan(cur, best_period, self.cfg.replan_every, reconfig_s, self.cfg.min_gain):
            return best, gain, best_period
        return current, gain, cur


class RLLoop:
    """Simulated RL: rollout batches through one continuous rollout simulator and the training
    model, with a planner (or a static plan) and an elastic pool."""

    def __init__(
        self,
        workload: RolloutWorkload,
        policy: str | Callable[[], RoutingPolicy] = "cmlfq",
        *,
        sim_config: SimConfig | None = None,
        planner: PlannerConfig | None = None,
        train: TrainModel | None = None,
        partial_frac: float = 1.0,
        reconfig_s: float | None = None,
    ) -> None:
        self.workload = workload
        self.sim_cfg = sim_config or SimConfig()
        self.cfg = planner or PlannerConfig()
        self.train = train or TrainModel.for_names(self.sim_cfg.gpu, self.sim_cfg.model)
        self._make_router = (lambda: ROUTING.create(policy)) if isinstance(policy, str) else policy
        self.router = self._make_router()
        self.planner = Planner(self.cfg, self.sim_cfg, self.train)
        self.partial_frac = partial_frac
        #: the cost the planner charges a plan change (weights load or reshard, whichever longer)
        self.reconfig_s = (
            max(self.sim_cfg.engine_start_s, self.cfg.reshard_s) if reconfig_s is None
            else reconfig_s
        )
        self.sim: RolloutCluster | None = None
        self.pool: GpuPool | None = None

    # -- planning ----------------------------------------------------------------------------
    def _choose(
        self, current: Plan | None, probe: Sequence[RolloutTrajectory]
    ) -> tuple[Plan, float | None]:
        if self.cfg.static is not None:
            return self.cfg.static, None
        plan, gain, _ = self.planner.choose(current, probe, self.router, self.reconfig_s)
        return plan, gain

    def _can_rebalance(self, plan: Plan, rollout_s: float, train_s: float) -> bool:
        """Pressure is worth a replan only if GPUs can move towards the slower side."""
        splits = self.planner.splits()
        if rollout_s > train_s:
            return plan.rollout_gpus < max(splits)
        return plan.rollout_gpus > min(splits)

    # -- the loop ------------------------------------------------------------------------------
    def run(self, steps: int, on_step: Callable[[StepRecord], None] | None = None) -> RLResult:
        c = self.cfg
        if c.mode == "sync" and self.partial_frac < 1.0:
            raise ValueError("partial rollout needs the off-policy mode")
        # before any step, the planner sees a batch drawn from the model (a static plan needs
        # none: drawing it cost a step's worth of workload draws)
        probe = self.workload.forecast(0) if c.static is None else []
        plan, _ = self._choose(None, probe)
        sim = RolloutCluster(plan.mix, self.router, self.sim_cfg)
        self.sim = sim
        self.pool = pool = GpuPool(sim, c.total_gpus,
                                   plan.train_gpus if c.mode != "sync" else 0)
        records: list[StepRecord] = []
        now = 0.0
        prev_train_s = 0.0
        last_replan = 0
        last_early = -10**9
        train_gpus_prev = plan.train_gpus
        done_before = 0
        tokens_before: list[RolloutTrajectory] = []
        total_trajs = 0
        for k in range(steps):
            batch_trajs = self.workload.batch(k)
            total_trajs += len(batch_trajs)
            batch = sim.add_batch(batch_trajs, now)
            sim.run_batch(batch, self.partial_frac)
            rollout_s = sim.now - now
            done_ids = self._finished_since(sim, done_before)
            done_before += len(done_ids)
            by_id = {t.id: t for t in batch_trajs}
            finished = [by_id[i] for i in done_ids if i in by_id] + [
                t for t in tokens_before if t.id in done_ids
            ]
            tokens_before = [t for t in tokens_before if t.id not in done_ids] + [
                t for t in batch_trajs if t.id not in done_ids
            ]
            tokens = training_tokens(finished)
            if c.mode == "sync":
                train_s, tcfg = self.train.step_time(c.total_gpus, tokens)
                period = rollout_s + train_s + c.switch_s
            else:
                # this step's rollout overlaps the previous step's training
                period = max(rollout_s, prev_train_s)
                gpus = min(plan.train_gpus, train_gpus_prev)  # joiners add zero gradients once
                if plan.train_gpus == 0:  # a rollout-only run: training is not modelled
                    train_s, tcfg = 0.0, None
                else:
                    train_s, tcfg = self.train.step_time(gpus, tokens)
                if plan.train_gpus != train_gpus_prev:
                    train_s += c.reshard_s
                train_gpus_prev = plan.train_gpus
            rec = StepRecord(k, plan, str(tcfg) if tcfg else "-", now, rollout_s, train_s,
                             period, len(done_ids), tokens)
            now += period
            sim.run_until(now)  # carried-over trajectories (partial rollout) keep running
            # plan for the next step
            if k + 1 < steps and c.static is None:
                reason = ""
                if k + 1 - last_replan >= c.replan_every:
                    reason = "periodic"
                elif c.mode != "sync" and k + 1 - last_early >= c.cooldown_steps:
                    hi, lo = max(rollout_s, train_s), min(rollout_s, train_s)
                    if (
                        lo > 0
                        and hi / lo >= c.pressure_ratio
                        and self._can_rebalance(plan, rollout_s, train_s)
                    ):
                        reason = "pressure"
                if reason:
                    new, gain = self._choose(plan, batch_trajs)
                    rec.predicted_gain = gain
                    rec.reason = reason
                    if reason == "periodic":
                        last_replan = k + 1
                    else:
                        last_early = k + 1
                    if new != plan:
                        rec.replanned = True
                        rec.moves = pool.apply(new.mix, new.train_gpus if c.mode != "sync"
                                               else 0, now)
                        plan = new
            records.append(rec)
            prev_train_s = train_s
            if on_step is not None:
                on_step(rec)
        # the last step's training (off-policy) and any carried-over rollouts
        if c.mode != "sync":
            sim.run_until()
            now = max(now + prev_train_s, sim.now)
        return RLResult(records, now, total_trajs, sim.stats(), self.planner.evals)

    @staticmethod
    def _finished_since(sim: RolloutCluster, n_before: int) -> set[str]:
        done = sim.done_order[n_before:]
        return set(done)


def best_static(
    workload: RolloutWorkload,
    steps: int,
    policy: str,
    plans: Sequence[Plan],
    *,
    sim_config: SimConfig | None = None,
    planner: PlannerConfig | None = None,
) -> tuple[Plan, RLResult, list[tuple[Plan, float]]]:
    """Run every static plan for ``steps`` steps; the best by total time, its run, and all."""
    base = planner or PlannerConfig()
    results: list[tuple[Plan, RLResult]] = []
    for p in plans:
        cfg = dataclasses.replace(base, static=p)
        res = RLLoop(workload, policy, sim_config=sim_config, planner=cfg).run(steps)
        results.append((p, res))
    results.sort(key=lambda pr: pr[1].total_s)
    return results[0][0], results[0][1], [(p, r.total_s) for p, r in results]
