"""Scheduler state: turn and workflow records, and the read-only cluster view policies see.

Records are mutable and owned by :class:`turnstile.core.scheduler.Scheduler`; policies receive
them to *read* (attained service, ages, engines) and never write them. Plain ``__slots__``
classes keep the hot path allocation-light.
"""

from __future__ import annotations

from collections.abc import Callable, ItemsView, Iterator, KeysView, Mapping, ValuesView
from enum import IntEnum
from typing import TypeVar

from turnstile.workload.model import Turn, Workflow

_T = TypeVar("_T")

try:  # installed with mypy, where ``make compiled`` builds (docs/results/*-sim-speed.md)
    from mypy_extensions import mypyc_attr
except ImportError:  # the plain-Python install: the decorator only informs mypyc
    def mypyc_attr(
        *attrs: str, **kwattrs: object
    ) -> Callable[[_T], _T]:
        return lambda cls: cls


class TurnState(IntEnum):
    PENDING = 0  # waiting for its parents (and their tool calls)
    READY = 1  # could run now; held by the release policy
    RELEASED = 2  # sent to an engine, queued there
    RUNNING = 3  # the engine started prefilling it
    TOOL = 4  # finished; its tool calls are running
    DONE = 5  # finished, tools returned


class TurnRecord:
    """One turn's life in the scheduler. Times are in the driver's clock (seconds)."""

    __slots__ = (
        "cached_tokens",
        "charged_tokens",
        "engine",
        "engine_hint",
        "finished_s",
        "first_token_s",
        "index",
        "output_tokens",
        "priority",
        "ready_s",
        "released_s",
        "started_s",
        "state",
        "turn",
        "workflow",
    )

    def __init__(self, workflow: WorkflowRecord, index: int, turn: Turn) -> None:
        self.workflow = workflow
        self.index = index
        self.turn = turn
        self.state = TurnState.PENDING
        self.ready_s = -1.0
        self.released_s = -1.0
        self.started_s = -1.0
        self.first_token_s = -1.0
        self.finished_s = -1.0
        self.engine: str | None = None
        #: an engine the driver's client asked for (gateway ``x-turnstile-engine``); only a
        #: routing policy that reads it (``hinted``) acts on it
        self.engine_hint: str | None = None
        self.priority = 0.0
        #: actual output tokens (from the engine); the trace's value until it finishes
        self.output_tokens = turn.output_tokens
        #: prompt tokens the engine found in its prefix cache (reported at finish; -1 = unknown)
        self.cached_tokens = -1
        #: work charged to the engine and the released-work counter at release (tokens)
        self.charged_tokens = 0

    @property
    def workflow_id(self) -> str:
        return self.workflow.id

    @property
    def prompt_tokens(self) -> int:
        return self.turn.prompt_tokens

    def __repr__(self) -> str:
        return f"<Turn {self.workflow.id}#{self.index} {self.state.name}>"


class WorkflowRecord:
    """One workflow (session) in the scheduler."""

    __slots__ = (
        "arrival_s",
        "attained_tokens",
        "children",
        "closed",
        "finished_s",
        "id",
        "last_engine",
        "paused_engine",
        "paused_tokens",
        "pending_parents",
        "remaining",
        "source",
        "tenant",
        "turns",
    )

    def __init__(self, wf_id: str, arrival_s: float, tenant: str, source: Workflow | None) -> None:
        self.id = wf_id
        self.arrival_s = arrival_s
        self.tenant = tenant
        #: the full workflow when known in advance (simulator); None for open sessions (gateway)
        self.source = source
        self.turns: list[TurnRecord] = []
        #: per turn, how many parents are not DONE yet (DAG workflows only)
        self.pending_parents: list[int] = []
        self.children: list[list[int]] | None = None
        #: turns not DONE yet (for known workflows); open sessions end when closed
        self.remaining = 0
        self.closed = source is not None
        self.finished_s = -1.0
        #: tokens of service received so far (prompt + output of finished turns): PLAS's measure
        self.attained_tokens = 0
        #: the engine the previous turn ran on (where its KV may still be)
        self.last_engine: str | None = None
        #: while a tool call runs: the engine holding this session's KV, and its size (tokens)
        self.paused_engine: str | None = None
        self.paused_tokens = 0

    @property
    def done(self) -> bool:
        return self.finished_s >= 0.0

    @property
    def turns_done(self) -> int:
        return sum(1 for t in self.turns if t.state == TurnState.DONE)

    def __repr__(self) -> str:
        return f"<Workflow {self.id} {len(self.turns)} turns>"


_set = object.__setattr__  # the core's write path past the read-only __setattr__ below


def _read_only(obj: object, name: str, value: object) -> None:
    raise AttributeError(
        f"{type(obj).__name__}.{name} is read-only: policies read the view, only the core "
        "changes it (turnstile.core.state's charge/discharge/pause_session/... functions)"
    )


# compiled, still a plain Python class: the core writes past the read-only __setattr__ with
# object.__setattr__, which a mypyc native class does not allow
@mypyc_attr(native_class=False)
class EngineLoad:
    """What the scheduler knows about one engine: its own accounting plus reported stats.

    Read-only for everyone but the core: attributes are plain slots (reads cost nothing on the
    hot path) but assignment raises; the core writes through the functions at the end of this
    module. ``cached_sessions`` is a live read-only view of the sessions paused here.
    """

    __slots__ = (
        "_sessions",
        "accepting",
        "bucket",
        "cached_sessions",
        "capacity_tokens",
        "healthy",
        "id",
        "kv_slots",
        "kv_used_frac",
        "outstanding_tokens",
        "outstanding_turns",
        "paused_context_tokens",
        "peer_paused_sessions",
        "prefill_s_per_token",
        "queue_len",
        "running",
        "tp",
        "tpot_s",
        "weight",
    )

    # the slots' types (set through ``_set`` in __init__ and the write path below)
    id: str
    capacity_tokens: int
    weight: float
    tp: int
    bucket: str
    tpot_s: float
    prefill_s_per_token: float
    kv_slots: int
    accepting: bool
    outstanding_turns: int
    outstanding_tokens: int
    paused_context_tokens: int
    peer_paused_sessions: int
    _sessions: dict[str, None]
    cached_sessions: KeysView[str]
    queue_len: int
    running: int
    kv_used_frac: float
    healthy: bool

    def __setattr__(self, name: str, value: object) -> None:
        _read_only(self, name, value)

    def __init__(
        self,
        engine_id: str,
        capacity_tokens: int = 0,
        weight: float = 1.0,
        *,
        tp: int = 1,
        bucket: str = "",
        tpot_s: float = 0.0,
        prefill_s_per_token: float = 0.0,
        kv_slots: int = 0,
    ) -> None:
        _set(self, "id", engine_id)
        #: KV capacity in tokens when known (0 = unknown)
        _set(self, "capacity_tokens", capacity_tokens)
        #: relative speed (heterogeneous clusters): loads are compared as load / weight
        _set(self, "weight", weight)
        #: tensor-parallel degree (GPUs of the replica) and its bucket (default ``tp{tp}``):
        #: driver metadata (the simulator's performance model, the gateway's engine config);
        #: bucket routers (``cmlfq``) group engines by ``tp``
        _set(self, "tp", tp)
        _set(self, "bucket", bucket or f"tp{tp}")
        #: seconds per output token of one sequence at small batch, and per uncached prompt
        #: token (what a move to this engine re-prefills); 0 = unknown
        _set(self, "tpot_s", tpot_s)
        _set(self, "prefill_s_per_token", prefill_s_per_token)
        #: sessions whose KV the engine keeps at once whatever their length (a slot-limited
        #: engine's slots, one sequence each); 0 = bounded only by ``capacity_tokens``
        _set(self, "kv_slots", kv_slots)
        #: False while the engine drains (an elastic move): no new work is routed to it
        _set(self, "accepting", True)
        _set(self, "outstanding_turns", 0)  # released to this engine and not finished
        _set(self, "outstanding_tokens", 0)  # their prompt + expected output tokens
        #: "shadow load": context tokens of sessions paused in a tool call whose KV lives here
        _set(self, "paused_context_tokens", 0)
        #: sessions other drivers sharing this engine (gateway replicas) hold paused on it
        _set(self, "peer_paused_sessions", 0)
        sessions: dict[str, None] = {}
        _set(self, "_sessions", sessions)
        #: ids of the sessions paused here (a read-only, live view)
        _set(self, "cached_sessions", sessions.keys())
        # reported by the engine (EngineStats); -1 = never reported
        _set(self, "queue_len", -1)
        _set(self, "running", -1)
        _set(self, "kv_used_frac", -1.0)
        _set(self, "healthy", True)

    @property
    def open_sessions(self) -> int:
        """Turns released here plus sessions paused in a tool call with their KV here (Libra's
        load: open trajectories, tool time included), other gateway replicas' included."""
        return self.outstanding_turns + len(self.cached_sessions) + self.peer_paused_sessions

    @property
    def idle(self) -> bool:
        """Takes new work (healthy, not draining) and has nothing released to it."""
        return self.outstanding_turns == 0 and self.healthy and self.accepting

    @property
    def has_free_slot(self) -> bool:
        """One more session's KV fits beside the open sessions' without taking a slot: always
        on an engine that is not slot-limited (``kv_slots`` 0)."""
        return not self.kv_slots or self.open_sessions < self.kv_slots

    @property
    def kv_pressure(self) -> float:
        """KV demand (outstanding plus paused context tokens) over capacity; 0 when unknown."""
        if not self.capacity_tokens:
            return 0.0
        return (self.outstanding_tokens + self.paused_context_tokens) / self.capacity_tokens

    def __repr__(self) -> str:
        return f"<Engine {self.id} turns={self.outstanding_turns} tokens={self.outstanding_tokens}>"


@mypyc_attr(native_class=False)  # as EngineLoad
class ClusterView:
    """Read-only view of the engines and the global released-work counters (assignment
    raises; the core writes through the functions below).

    A read-only ``Mapping`` of engine id → :class:`EngineLoad` (registered as one; written out
    rather than inherited: ``make compiled`` builds this module with mypyc, whose classes
    cannot derive from ``Mapping``'s metaclass)."""

    __slots__ = (
        "_engines",
        "_order",
        "peer_released_tokens",
        "ready_turns",
        "released_tokens",
        "released_turns",
    )

    _engines: dict[str, EngineLoad]
    _order: tuple[str, ...]
    peer_released_tokens: int
    ready_turns: int
    released_tokens: int
    released_turns: int

    def __setattr__(self, name: str, value: object) -> None:
        _read_only(self, name, value)

    def __init__(self, engines: list[EngineLoad]) -> None:
        _set(self, "_engines", {e.id: e for e in engines})
        _set(self, "_order", tuple(e.id for e in engines))
        _set(self, "released_turns", 0)
        _set(self, "released_tokens", 0)
        _set(self, "ready_turns", 0)
        #: of ``released_tokens``, the part other drivers sharing these engines released (other
        #: gateway replicas, see ``Scheduler.peer_load``); 0 for a lone driver
        _set(self, "peer_released_tokens", 0)

    def __getitem__(self, key: str) -> EngineLoad:
        return self._engines[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._engines

    def get(self, key: str, default: EngineLoad | None = None) -> EngineLoad | None:
        return self._engines.get(key, default)

    def keys(self) -> KeysView[str]:
        return self._engines.keys()

    def values(self) -> ValuesView[EngineLoad]:
        return self._engines.values()

    def items(self) -> ItemsView[str, EngineLoad]:
        return self._engines.items()

    @property
    def ids(self) -> tuple[str, ...]:
        return self._order

    def healthy(self) -> list[EngineLoad]:
        """Engines that take new work: healthy and not draining."""
        return [e for i in self._order if (e := self._engines[i]).healthy and e.accepting]

    def any_accepting(self) -> bool:
        """Some engine takes new work."""
        return any(e.healthy and e.accepting for e in self._engines.values())

    def any_idle(self) -> bool:
        """Some engine that takes new work has nothing released to it."""
        return any(e.idle for e in self._engines.values())


Mapping.register(ClusterView)


# ------------------------------------------------------------------ the core's write path
# Called by the Scheduler (and by tests that set up a view); never by a policy.


def add_engine(view: ClusterView, engine: EngineLoad) -> None:
    """Register another engine with the view (elastic pools)."""
    if engine.id in view._engines:
        raise ValueError(f"engine {engine.id!r} already registered")
    view._engines[engine.id] = engine
    _set(view, "_order", (*view._order, engine.id))


def set_kv_slots(engine: EngineLoad, kv_slots: int) -> None:
    """The engine keeps ``kv_slots`` sessions' KV at once (0: not slot-limited), as found when
    the driver met it (e.g. from the server's own slot listing)."""
    _set(engine, "kv_slots", max(0, int(kv_slots)))


def set_accepting(engine: EngineLoad, accepting: bool) -> None:
    """The engine starts (True) or stops (False: it drains) taking new work."""
    _set(engine, "accepting", accepting)


def charge(engine: EngineLoad, work_tokens: int) -> None:
    """A turn was released to ``engine`` with ``work_tokens`` of expected work."""
    _set(engine, "outstanding_turns", engine.outstanding_turns + 1)
    _set(engine, "outstanding_tokens", engine.outstanding_tokens + work_tokens)


def discharge(engine: EngineLoad, work_tokens: int) -> None:
    """A turn charged ``work_tokens`` to ``engine`` finished."""
    _set(engine, "outstanding_turns", engine.outstanding_turns - 1)
    _set(engine, "outstanding_tokens", engine.outstanding_tokens - work_tokens)


def pause_session(engine: EngineLoad, session_id: str, context_tokens: int) -> None:
    """A session whose KV lives on ``engine`` entered a tool call."""
    _set(engine, "paused_context_tokens", engine.paused_context_tokens + context_tokens)
    engine._sessions[session_id] = None


def resume_session(engine: EngineLoad, session_id: str, context_tokens: int) -> None:
    """A session paused on ``engine`` was resumed (released again) or finished."""
    _set(engine, "paused_context_tokens", engine.paused_context_tokens - context_tokens)
    engine._sessions.pop(session_id, None)


def report_stats(
    engine: EngineLoad,
    *,
    queue_len: int | None = None,
    running: int | None = None,
    kv_used_frac: float | None = None,
    healthy: bool | None = None,
) -> None:
    """Stats the engine reported (None: not reported this time)."""
    if queue_len is not None:
        _set(engine, "queue_len", queue_len)
    if running is not None:
        _set(engine, "running", running)
    if kv_used_frac is not None:
        _set(engine, "kv_used_frac", kv_used_frac)
    if healthy is not None:
        _set(engine, "healthy", healthy)


def add_peer_load(engine: EngineLoad, turns: int, work_tokens: int, paused_tokens: int,
                  paused_sessions: int = 0) -> None:
    """Work another driver sharing ``engine`` (another gateway replica) released to it or holds
    paused on it changed by these deltas (see ``Scheduler.peer_load``)."""
    _set(engine, "outstanding_turns", engine.outstanding_turns + turns)
    _set(engine, "outstanding_tokens", engine.outstanding_tokens + work_tokens)
    _set(engine, "paused_context_tokens", engine.paused_context_tokens + paused_tokens)
    _set(engine, "peer_paused_sessions", engine.peer_paused_sessions + paused_sessions)


def count_peer_released(view: ClusterView, turns: int, work_tokens: int) -> None:
    """Other drivers' released work changed by these deltas: counted in the view's totals and
    in ``peer_released_tokens``."""
    count_released(view, turns, work_tokens)
    _set(view, "peer_released_tokens", view.peer_released_tokens + work_tokens)


def count_ready(view: ClusterView, turns: int) -> None:
    """``turns`` turns became READY (negative: left READY)."""
    _set(view, "ready_turns", view.ready_turns + turns)


def count_released(view: ClusterView, turns: int, work_tokens: int) -> None:
    """``turns`` turns with ``work_tokens`` of work were released (negative: finished)."""
    _set(view, "released_turns", view.released_turns + turns)
    _set(view, "released_tokens", view.released_tokens + work_tokens)
