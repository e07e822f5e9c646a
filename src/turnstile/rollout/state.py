"""What rollout routing policies read: trajectories as observed so far, engines, buckets.

The driver (simulator or live) owns these records and updates them; policies read them and never
write. Everything here is an *observation*: a trajectory's future turns are not in it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from turnstile.workload.model import ToolStatus

__all__ = [
    "SIZE_BOUNDS",
    "BucketInfo",
    "EngineInfo",
    "PoolView",
    "ToolResult",
    "TrajectoryState",
    "tool_key",
]

#: result-size classes of a tool return, in tokens: small < 256 ≤ medium < 2048 ≤ large
SIZE_BOUNDS: tuple[int, int] = (256, 2048)
_STATUS_WORD = {"ok": "success", "error": "failure", "timeout": "timeout", "unknown": "success"}


def tool_key(name: str, result_tokens: int | None, status: ToolStatus | str) -> str:
    """The causal key of one tool return: ``tool:size:status`` (e.g. ``Bash:large:failure``)."""
    if result_tokens is None:
        size = "unknown"
    elif result_tokens < SIZE_BOUNDS[0]:
        size = "small"
    elif result_tokens < SIZE_BOUNDS[1]:
        size = "medium"
    else:
        size = "large"
    return f"{name}:{size}:{_STATUS_WORD.get(status, str(status))}"


@dataclass(frozen=True, slots=True)
class ToolResult:
    """One tool return as a driver observed it."""

    name: str
    status: ToolStatus
    result_tokens: int | None
    duration_s: float

    @property
    def key(self) -> str:
        return tool_key(self.name, self.result_tokens, self.status)


class TrajectoryState:
    """One trajectory as observed so far (owned by the driver)."""

    __slots__ = (
        "arrival_s",
        "attained_output_tokens",
        "attained_prompt_tokens",
        "context_tokens",
        "done_s",
        "engine",
        "errors",
        "hint",
        "id",
        "migrations",
        "prompt_id",
        "prompt_tokens",
        "sample",
        "step",
        "timeouts",
        "tool_keys",
        "turns_done",
        "wait_s",
    )

    def __init__(
        self,
        traj_id: str,
        prompt_id: str,
        *,
        sample: int = 0,
        step: int = 0,
        arrival_s: float = 0.0,
        prompt_tokens: int = 0,
        hint: float = 0.0,
    ) -> None:
        self.id = traj_id
        self.prompt_id = prompt_id
        self.sample = sample
        self.step = step
        self.arrival_s = arrival_s
        #: first-prompt tokens (known up front) and a prompt feature (e.g. task category)
        self.prompt_tokens = prompt_tokens
        self.hint = hint
        self.turns_done = 0
        self.attained_output_tokens = 0
        #: prompt tokens of finished turns (service received, PLAS-style)
        self.attained_prompt_tokens = 0
        #: KV tokens of the conversation so far (what a move to another engine re-prefills)
        self.context_tokens = prompt_tokens
        #: causal keys of the tool returns so far, in order
        self.tool_keys: list[str] = []
        self.errors = 0
        self.timeouts = 0
        #: the engine its last turn ran on (where its KV may still be); None before turn 0
        self.engine: str | None = None
        self.migrations = 0
        #: total time its turns waited in engine queues (ready → admitted)
        self.wait_s = 0.0
        self.done_s = -1.0

    @property
    def done(self) -> bool:
        return self.done_s >= 0.0

    def __repr__(self) -> str:
        return f"<Trajectory {self.id} turns={self.turns_done} out={self.attained_output_tokens}>"


class EngineInfo:
    """One rollout engine (a model replica at some TP) as the router sees it."""

    __slots__ = (
        "accepting",
        "bucket",
        "capacity_tokens",
        "id",
        "idle_tpot_s",
        "kv_read_s_per_token",
        "level",
        "open_attained_tokens",
        "open_tokens",
        "open_trajectories",
        "prefill_s_per_token",
        "queued",
        "running",
        "tp",
        "tpot_s",
    )

    def __init__(
        self,
        engine_id: str,
        bucket: str,
        level: int,
        tp: int,
        *,
        capacity_tokens: int = 0,
        idle_tpot_s: float = 0.0,
        prefill_s_per_token: float = 0.0,
        kv_read_s_per_token: float = 0.0,
    ) -> None:
        self.id = engine_id
        self.bucket = bucket
        #: index of the bucket in the pool's level order (0 = top, highest throughput)
        self.level = level
        self.tp = tp
        self.capacity_tokens = capacity_tokens
        #: trajectories whose KV home is this engine and that are not done (tool time included)
        self.open_trajectories = 0
        #: their KV demand: context tokens of those trajectories (vs ``capacity_tokens``)
        self.open_tokens = 0
        #: and the output tokens they have generated so far
        self.open_attained_tokens = 0
        self.running = 0
        self.queued = 0
        #: seconds per output token of one sequence at the current batch (driver's estimate)
        self.tpot_s = idle_tpot_s
        #: ... and with nothing else running
        self.idle_tpot_s = idle_tpot_s
        #: seconds per prompt token of an uncached prefill (what a migration re-prefills)
        self.prefill_s_per_token = prefill_s_per_token
        #: extra seconds per iteration for each context token a joining sequence adds
        self.kv_read_s_per_token = kv_read_s_per_token
        #: False while draining (an elastic move): routers must not pick it
        self.accepting = True

    @property
    def kv_pressure(self) -> float:
        """KV demand of the open trajectories over capacity (> 1: they cannot all stay cached)."""
        return self.open_tokens / self.capacity_tokens if self.capacity_tokens else 0.0

    @property
    def mean_open_attained(self) -> float:
        """Mean output tokens generated so far by the open trajectories homed here."""
        n = self.open_trajectories
        return self.open_attained_tokens / n if n else 0.0

    def __repr__(self) -> str:
        return f"<Engine {self.id} {self.bucket} open={self.open_trajectories}>"


@dataclass(frozen=True, slots=True)
class BucketInfo:
    """Engines of one tensor-parallel size; ``level`` 0 is the top (smallest TP)."""

    name: str
    tp: int
    level: int
    engine_ids: tuple[str, ...]


class PoolView:
    """Read-only view of the rollout engines, grouped into levels (buckets by ascending TP)."""

    __slots__ = ("_engines", "buckets", "gpus_per_level", "version")

    def __init__(self, engines: Sequence[EngineInfo]) -> None:
        self._engines: dict[str, EngineInfo] = {}
        self.buckets: list[BucketInfo] = []
        #: GPUs of each level, and a counter bumped by every rebuild (for policy caches)
        self.gpus_per_level: tuple[int, ...] = ()
        self.version = 0
        self.rebuild(engines)

    def rebuild(self, engines: Sequence[EngineInfo]) -> None:
        """Replace the engine set (an elastic move); levels are renumbered by ascending TP."""
        self._engines = {e.id: e for e in engines}
        tps = sorted({e.tp for e in engines})
        self.buckets = []
        for level, tp in enumerate(tps):
            ids = tuple(e.id for e in engines if e.tp == tp)
            for i in ids:
                self._engines[i].level = level
            self.buckets.append(BucketInfo(f"tp{tp}", tp, level, ids))
        self.gpus_per_level = tuple(b.tp * len(b.engine_ids) for b in self.buckets)
        self.version += 1

    @property
    def levels(self) -> int:
        return len(self.buckets)

    def __getitem__(self, engine_id: str) -> EngineInfo:
        return self._engines[engine_id]

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self._engines

    def __iter__(self) -> Iterator[EngineInfo]:
        return iter(self._engines.values())

    def __len__(self) -> int:
        return len(self._engines)

    def accepting(self, level: int | None = None) -> list[EngineInfo]:
        """Engines open for new work, all or of one level."""
        if level is None:
            return [e for e in self._engines.values() if e.accepting]
        return [
            self._engines[i] for i in self.buckets[level].engine_ids if self._engines[i].accepting
        ]

    def level_of(self, engine_id: str | None) -> int | None:
        if engine_id is None or engine_id not in self._engines:
            return None
        return self._engines[engine_id].level

