"""Rollout batches on the one simulator: :class:`~turnstile.sim.cluster.ClusterSim` driving the
scheduler core and :class:`~turnstile.sim.engine.EngineModel` engines, grouped into
tensor-parallel buckets.

A trajectory is a core workflow (its turns and tool calls); the routing policy is a core
:class:`~turnstile.policies.base.RoutingPolicy` (``cmlfq``, ``least-open``, ``length-predict``
...), released eagerly, admitted FCFS, KV kept by LRU. Engines model continuous batching,
chunked prefill, paged KV with a prefix cache (a trajectory that stays on its engine reuses its
context; a move re-prefills it) and preemption; their step times come from the calibrated
performance model (roofline by default, the per-TP model or a fitted one through
``SimConfig.perf``).

The pool is elastic: engines join (after a weight-loading delay) and drain (no new placements;
running turns finish there, trajectories paused on it move at their next turn; the engine
retires and frees its GPUs when its last turn ends). Everything it reports is simulated.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnstile.core.state import WorkflowRecord
from turnstile.policies import ROUTING, PolicySet, RoutingPolicy
from turnstile.rollout.workload import RolloutTrajectory
from turnstile.sim.cluster import ClusterSim, EngineGroup
from turnstile.sim.perf import PerfModel
from turnstile.sim.tp_perf import tp_perf_model

__all__ = [
    "BatchResult",
    "Bucket",
    "GpuPool",
    "RolloutCluster",
    "SimConfig",
    "format_mix",
    "parse_mix",
    "simulate_batch",
]


@dataclass(frozen=True, slots=True)
class Bucket:
    """``count`` engines of tensor parallelism ``tp``."""

    tp: int
    count: int

    @property
    def gpus(self) -> int:
        return self.tp * self.count

    @property
    def name(self) -> str:
        return f"tp{self.tp}x{self.count}"


def parse_mix(text: str) -> tuple[Bucket, ...]:
    """``"tp1x8,tp2x2,tp4x1"`` → buckets (counts of 0 are dropped)."""
    out: list[Bucket] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        p = part.lower()
        if not p.startswith("tp") or "x" not in p:
            raise ValueError(f"bad bucket {part!r}: expected tpNxM, e.g. tp2x4")
        tp_s, n_s = p[2:].split("x", 1)
        if not (tp_s.isdigit() and n_s.isdigit()):
            raise ValueError(f"bad bucket {part!r}: expected tpNxM, e.g. tp2x4")
        tp, n = int(tp_s), int(n_s)
        if tp < 1 or n < 0:
            raise ValueError(f"bad bucket {part!r}")
        if n:
            out.append(Bucket(tp, n))
    if not out:
        raise ValueError(f"no engines in mix {text!r}")
    return tuple(sorted(out, key=lambda b: b.tp))


def format_mix(buckets: Iterable[Bucket]) -> str:
    return ",".join(b.name for b in sorted(buckets, key=lambda b: b.tp) if b.count)


@dataclass(frozen=True)
class SimConfig:
    """Engine and pool knobs of the rollout simulator."""

    gpu: str = "H100"
    model: str = "qwen3-8b"
    gpu_mem_util: float = 0.9
    #: KV capacity per engine in tokens (None: from the GPU memory, the model and the TP)
    kv_tokens: int | None = None
    max_num_seqs: int = 128
    max_batched_tokens: int = 8192
    #: KV block size in tokens (the prefix cache's granularity)
    block_size: int = 64
    #: an engine joining the pool loads weights for this long before it takes work
    engine_start_s: float = 20.0
    #: tp → performance model (a fitted one, tests' simple ones); None: the per-TP roofline
    #: of gpu/model (:mod:`turnstile.sim.tp_perf`: all-reduce costs by message size), or the
    #: plain roofline with ``tp_model=False``
    perf: Callable[[int], PerfModel] | None = None
    tp_model: bool = True

    def perf_for(self, tp: int) -> PerfModel | None:
        if self.perf is not None:
            return self.perf(tp)
        return _tp_perf(self.gpu, self.model, tp) if self.tp_model else None

    def group(self, tp: int, count: int) -> EngineGroup:
        return EngineGroup(
            gpu=self.gpu, model=self.model, tp=tp, count=count, gpu_mem_util=self.gpu_mem_util,
            kv_tokens=self.kv_tokens, max_num_seqs=self.max_num_seqs,
            max_batched_tokens=self.max_batched_tokens, perf=self.perf_for(tp),
        )

    def describe(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "model": self.model,
            "gpu_mem_util": self.gpu_mem_util,
            "kv_tokens": self.kv_tokens,
            "max_num_seqs": self.max_num_seqs,
            "max_batched_tokens": self.max_batched_tokens,
            "block_size": self.block_size,
            "engine_start_s": self.engine_start_s,
            "perf": "custom" if self.perf is not None else (
                "tp-roofline (sim.tp_perf)" if self.tp_model else "roofline"),
            "engine": "sim.engine.EngineModel via sim.cluster.ClusterSim",
        }


@dataclass
class BatchResult:
    """One batch (rollout step) in the simulator."""

    batch: int
    start_s: float
    n: int
    done: int = 0
    end_s: float = -1.0
    #: completion time of each trajectory, relative to the batch start
    finish_s: dict[str, float] = field(default_factory=dict)
    output_tokens: int = 0

    @property
    def makespan_s(self) -> float:
        return self.end_s - self.start_s if self.end_s >= 0 else math.nan


@functools.cache
def _tp_perf(gpu: str, model: str, tp: int) -> PerfModel:
    return tp_perf_model(gpu, model, tp)


def _policies(routing: RoutingPolicy | str) -> PolicySet:
    router = ROUTING.create(routing) if isinstance(routing, str) else routing
    return PolicySet.from_spec(f"eager+{router.name}", router=router)


class RolloutCluster:
    """Rollout batches → the scheduler core → bucket engines (see the module docstring)."""

    def __init__(
        self,
        buckets: Sequence[Bucket],
        routing: RoutingPolicy | str,
        config: SimConfig | None = None,
    ) -> None:
        self.config = cfg = config or SimConfig()
        self.policies = _policies(routing)
        self.router = self.policies.routing
        self.sim = ClusterSim([], self.policies, [cfg.group(b.tp, b.count) for b in buckets],
                              block_size=cfg.block_size)
        self.batches: list[BatchResult] = []
        self._batch_of: dict[str, int] = {}
        self._seen = 0
        #: trajectory ids in completion order
        self.done_order: list[str] = []
        self.migrations = 0

    @property
    def now(self) -> float:
        return self.sim.now

    # -- pool -----------------------------------------------------------------------------------
    def add_engines(self, tp: int, count: int, at_s: float | None = None) -> list[str]:
        """Engines of ``tp`` join at ``at_s`` (default now) plus the weight-loading delay."""
        at = self.now if at_s is None else at_s
        return self.sim.add_engines(self.config.group(tp, count), at + self.config.engine_start_s)

    def drain(self, engine_ids: Iterable[str]) -> None:
        self.sim.drain(list(engine_ids))

    def gpus_in_use(self) -> int:
        return self.sim.gpus_in_use()

    def engines(self) -> list[tuple[str, int, bool]]:
        """(id, TP, takes new work) of every engine not retired, joined or joining."""
        view = self.sim.scheduler.view
        tps, retired = self.sim.tps, self.sim.retired_s
        out = []
        for i, e in enumerate(self.sim.engines):
            if retired[i] >= 0:
                continue
            eid = e.engine_id
            out.append((eid, tps[i], eid not in view or view[eid].accepting))
        return out

    def open_on(self, engine_id: str) -> int:
        view = self.sim.scheduler.view
        return view[engine_id].open_sessions if engine_id in view else 0

    @property
    def on_retire(self) -> Callable[[str, int, float], Any] | None:
        return self.sim.on_retire

    @on_retire.setter
    def on_retire(self, fn: Callable[[str, int, float], Any] | None) -> None:
        self.sim.on_retire = fn

    # -- workload -------------------------------------------------------------------------------
    def add_batch(self, trajectories: Sequence[RolloutTrajectory], at_s: float | None = None
                  ) -> BatchResult:
        at = self.now if at_s is None else at_s
        res = BatchResult(len(self.batches), at, len(trajectories))
        self.batches.append(res)
        wfs = []
        for tr in trajectories:
            if tr.id in self._batch_of:
                raise ValueError(f"trajectory {tr.id!r} added twice")
            self._batch_of[tr.id] = res.batch
            meta = {**tr.workflow.meta, "prompt": tr.prompt_id, "step": str(tr.step),
                    "hint": repr(tr.hint)}
            wfs.append(dataclasses.replace(tr.workflow, arrival_s=at, meta=meta))
        self.sim.submit(wfs)
        return res

    def _collect(self) -> None:
        fin = self.sim.finished
        while self._seen < len(fin):
            wf = fin[self._seen]
            self._seen += 1
            self._record(wf)

    def _record(self, wf: WorkflowRecord) -> None:
        b = self.batches[self._batch_of[wf.id]]
        b.done += 1
        b.finish_s[wf.id] = wf.finished_s - b.start_s
        prev = None
        for t in wf.turns:
            b.output_tokens += t.output_tokens
            if prev is not None and t.engine != prev:
                self.migrations += 1
            prev = t.engine
        if b.done == b.n:
            b.end_s = wf.finished_s
        self.done_order.append(wf.id)

    # -- run ------------------------------------------------------------------------------------
    def run_until(self, t_s: float = math.inf, stop: Callable[[], bool] | None = None) -> float:
        """Run to ``t_s`` or until ``stop()`` (which sees every batch's progress so far)."""
        fin = self.sim.finished

        def check() -> bool:
            if self._seen < len(fin):
                self._collect()
            return stop() if stop is not None else False

        now = self.sim.run_until(t_s, check if stop is not None else None)
        self._collect()
        return now

    def run_batch(self, batch: BatchResult, frac: float = 1.0) -> float:
        """Run until ``frac`` of ``batch``'s trajectories are done; returns the time."""
        need = min(batch.n, max(1, math.ceil(frac * batch.n))) if batch.n else 0
        fin = self.sim.finished

        def stop() -> bool:
            if self._seen < len(fin):
                self._collect()
            return batch.done >= need

        if batch.done < need:
            self.sim.run_until(stop=stop)
        self._collect()
        if batch.done < need:
            raise RuntimeError(f"simulation ended with batch {batch.batch} at {batch.done}/{need}")
        return self.now

    def stats(self) -> dict[str, Any]:
        es = [e.stats() for e in self.sim.engines]
        keys = ("prefilled_tokens", "recomputed_tokens", "hit_tokens", "decode_tokens",
                "preemptions", "iterations")
        out: dict[str, Any] = {k: sum(s[k] for s in es) for k in keys}
        out["events"] = self.sim.events
        out["migrations"] = self.migrations
        return out


class GpuPool:
    """The GPU budget of a rollout cluster and training: moves the cluster to a plan's bucket
    mix (drains surplus replicas, starts missing ones once their GPUs are free) and lends
    whole replicas to training and back."""

    def __init__(self, cluster: RolloutCluster, total_gpus: int, train_gpus: int) -> None:
        self.cluster = cluster
        self.total_gpus = total_gpus
        self.train_gpus = train_gpus
        #: TPs of replicas waiting for free GPUs
        self.pending: list[int] = []
        #: TPs of replicas lent to training
        self.lent: list[int] = []
        cluster.on_retire = lambda eid, tp, t: self.start_pending(t)

    def free_gpus(self) -> int:
        return self.total_gpus - self.train_gpus - self.cluster.gpus_in_use()

    def start_pending(self, now: float) -> list[str]:
        started: list[str] = []
        keep: list[int] = []
        for tp in sorted(self.pending, reverse=True):
            if self.free_gpus() >= tp:
                started += self.cluster.add_engines(tp, 1, now)
            else:
                keep.append(tp)
        self.pending = keep
        return started

    def rollout_engines(self) -> list[tuple[str, int]]:
        """(id, TP) of the replicas taking rollout work (joining ones included)."""
        return [(eid, tp) for eid, tp, accepting in self.cluster.engines() if accepting]

    def mix(self) -> tuple[Bucket, ...]:
        counts: dict[int, int] = {}
        for _, tp in self.rollout_engines():
            counts[tp] = counts.get(tp, 0) + 1
        return tuple(Bucket(tp, n) for tp, n in sorted(counts.items()))

    def apply(self, mix: Sequence[Bucket], train_gpus: int, now: float) -> dict[str, Any]:
        """Move to ``mix`` with ``train_gpus`` training: drain the emptiest surplus replicas
        (idle ones retire at once), start the missing ones on free GPUs (the rest when drained
        replicas free theirs)."""
        have: dict[int, list[str]] = {}
        for eid, tp in self.rollout_engines():
            have.setdefault(tp, []).append(eid)
        want = {b.tp: b.count for b in mix}
        drained: list[str] = []
        for tp, ids in have.items():
            extra = len(ids) - want.get(tp, 0)
            if extra > 0:
                drained += sorted(ids, key=self.cluster.open_on)[:extra]
        self.pending = []
        self.train_gpus = train_gpus
        self.lent = []
        if drained:
            self.cluster.drain(drained)  # idle ones retire now, freeing their GPUs
        for tp, n in want.items():
            self.pending += [tp] * max(0, n - len(have.get(tp, [])))
        started = self.start_pending(now)
        return {"drained": drained, "started": started, "waiting_for_gpus": list(self.pending)}

    def lend(self, min_rollout_gpus: int) -> str | None:
        """Lend the emptiest rollout replica to training (not below ``min_rollout_gpus``)."""
        engines = self.rollout_engines()
        if not engines:
            return None
        eid, tp = min(engines, key=lambda e: (self.cluster.open_on(e[0]), -e[1]))
        if sum(t for _, t in engines) - tp < min_rollout_gpus:
            return None
        self.cluster.drain([eid])
        self.train_gpus += tp
        self.lent.append(tp)
        return f"lent {eid} (tp{tp}) to training"

    def give_back(self, now: float) -> str | None:
        """Return the last lent replica's GPUs to rollout (a new replica loads weights)."""
        if not self.lent:
            return None
        tp = self.lent.pop()
        self.train_gpus -= tp
        self.pending.append(tp)
        self.start_pending(now)
        return f"returned a tp{tp} replica to rollout"


def simulate_batch(
    trajectories: Sequence[RolloutTrajectory],
    buckets: Sequence[Bucket],
    routing: RoutingPolicy | str,
    config: SimConfig | None = None,
) -> tuple[BatchResult, RolloutCluster, float]:
    """Run one batch to completion; returns the batch result, the cluster and the wall time."""
    t0 = time.perf_counter()
    cluster = RolloutCluster(buckets, routing, config)
    res = cluster.add_batch(trajectories, 0.0)
    cluster.run_batch(res)
    return res, cluster, time.perf_counter() - t0
