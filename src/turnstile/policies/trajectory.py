"""What rollout routers read: a trajectory as observed from its finished turns, and the
engines grouped into tensor-parallel buckets (levels).

A rollout trajectory is a workflow of the core; its router sees only the past — turns that
finished (their real output lengths, queue waits) and tool calls that returned (their
``tool:size:status`` codes). :class:`TrajectoryTracker` folds those in incrementally, once per
turn, so a route costs O(new turns) and never reads a turn that has not run.
"""

from __future__ import annotations

from collections.abc import Iterator

from turnstile.core.state import ClusterView, EngineLoad, TurnRecord, TurnState, WorkflowRecord
from turnstile.policies.estimators import RecentWindow, return_code
from turnstile.policies.routing import NoHealthyEngineError

__all__ = [
    "STARTS",
    "Levels",
    "PeakContexts",
    "Trajectory",
    "TrajectoryTracker",
    "check_start",
    "home_engine",
    "kv_fits",
    "least_open",
    "start_engine",
    "within_share",
]


class Trajectory:
    """One trajectory as observed so far (built by :class:`TrajectoryTracker`)."""

    __slots__ = ("attained_at", "attained_output_tokens", "codes", "context_tokens", "hint",
                 "id", "prompt_id", "prompt_tokens", "step", "turns_done", "wait_s")

    def __init__(self, wf: WorkflowRecord) -> None:
        self.id = wf.id
        meta = wf.source.meta if wf.source is not None else {}
        #: the prompt the trajectory samples (rollout workloads name it; else the tenant)
        self.prompt_id = meta.get("prompt", wf.tenant)
        #: the RL step (-1: unknown, e.g. a gateway session)
        self.step = int(meta.get("step", -1))
        self.hint = float(meta.get("hint", 0.0))
        self.prompt_tokens = wf.turns[0].prompt_tokens if wf.turns else 0
        self.turns_done = 0
        self.attained_output_tokens = 0
        #: KV tokens of the conversation so far (what a move to another engine re-prefills)
        self.context_tokens = self.prompt_tokens
        #: codes of the tool returns so far, and the attained output at each return
        self.codes: list[str] = []
        self.attained_at: list[int] = []
        #: seconds its turns waited in engine queues (released → started)
        self.wait_s = 0.0

    def fold(self, rec: TurnRecord) -> None:
        """Take in one finished turn (and its returned tool calls)."""
        self.turns_done += 1
        self.attained_output_tokens += rec.output_tokens
        self.context_tokens = rec.prompt_tokens + rec.output_tokens
        if rec.started_s >= 0.0 and rec.released_s >= 0.0:
            self.wait_s += max(0.0, rec.started_s - rec.released_s)
        if rec.state == TurnState.DONE:
            for c in rec.turn.tools:
                self.codes.append(return_code(c.name, c.result_tokens, c.status))
                self.attained_at.append(self.attained_output_tokens)


class TrajectoryTracker:
    """Trajectories by workflow id, folded up to the turn being routed."""

    def __init__(self) -> None:
        self._by_id: dict[str, Trajectory] = {}

    def observe(self, turn: TurnRecord) -> Trajectory:
        """The trajectory of ``turn`` with every finished turn before it folded in."""
        wf = turn.workflow
        tr = self._by_id.get(wf.id)
        if tr is None:
            tr = self._by_id[wf.id] = Trajectory(wf)
        turns = wf.turns
        i = tr.turns_done
        while i < turn.index and turns[i].state == TurnState.DONE:
            tr.fold(turns[i])
            i += 1
        return tr

    def finish(self, wf: WorkflowRecord) -> Trajectory:
        """The whole trajectory of a finished workflow; forgets it."""
        tr = self._by_id.pop(wf.id, None) or Trajectory(wf)
        for rec in wf.turns[tr.turns_done:]:
            if rec.finished_s >= 0.0:
                tr.fold(rec)
        return tr

    def __len__(self) -> int:
        return len(self._by_id)


def home_engine(turn: TurnRecord, view: ClusterView) -> EngineLoad | None:
    """The engine holding the session's KV (paused there, or where its last turn ran) when
    it still takes new work."""
    wf = turn.workflow
    eid = wf.paused_engine or wf.last_engine
    if eid is None or eid not in view:
        return None
    e = view[eid]
    return e if e.healthy and e.accepting else None


def _load(e: EngineLoad, weighted: bool) -> tuple[float, int]:
    n = e.open_sessions
    return (n / e.tp if weighted else float(n), e.outstanding_turns)


def least_open(engines: list[EngineLoad], weighted: bool = False,
               cap: int | None = None) -> EngineLoad:
    """Least connections: the engine with the fewest open sessions (per GPU when
    ``weighted``); ties to the fewer running turns, then the engine listed first. With ``cap``,
    engines holding ``cap`` or more are skipped while another has room."""
    if not engines:
        raise NoHealthyEngineError("no engine takes new work")
    pool = engines
    if cap is not None:
        room = [e for e in engines if e.open_sessions < cap]
        pool = room or engines
    return min(pool, key=lambda e: _load(e, weighted))


class Levels:
    """The engines that take new work, grouped into levels by ascending TP (level 0: the
    smallest engines, highest throughput; the last: the largest, lowest per-token latency)."""

    __slots__ = ("engines", "gpus", "level_of")

    def __init__(self, view: ClusterView) -> None:
        by_tp: dict[int, list[EngineLoad]] = {}
        for e in view.healthy():
            by_tp.setdefault(e.tp, []).append(e)
        tps = sorted(by_tp)
        self.engines: list[list[EngineLoad]] = [by_tp[tp] for tp in tps]
        self.gpus: tuple[int, ...] = tuple(tp * len(by_tp[tp]) for tp in tps)
        self.level_of: dict[str, int] = {e.id: i for i, es in enumerate(self.engines) for e in es}
        if not self.engines:
            raise NoHealthyEngineError("no engine takes new work")

    def __len__(self) -> int:
        return len(self.engines)

    def __iter__(self) -> Iterator[list[EngineLoad]]:
        return iter(self.engines)

    def nearest(self, level: int) -> list[EngineLoad]:
        """The engines of ``level`` (clamped to the levels there are)."""
        return self.engines[min(max(level, 0), len(self.engines) - 1)]


STARTS = ("balanced", "least-open", "pool", "level0")


def check_start(start: str) -> str:
    if start not in STARTS:
        raise ValueError(f"start must be one of {', '.join(STARTS)}; got {start!r}")
    return start


class PeakContexts:
    """The peak contexts (KV tokens) of the last ``size`` finished trajectories: what a
    trajectory is expected to grow to (:meth:`expected`, the ``peak_tokens`` that
    :func:`start_engine` and :func:`kv_fits` take)."""

    __slots__ = ("_window",)

    def __init__(self, size: int) -> None:
        self._window = RecentWindow(size)

    def finished(self, tr: Trajectory) -> None:
        self._window.add(float(tr.context_tokens))

    def expected(self, tr: Trajectory) -> float:
        """Its context so far, or the recent mean peak if larger."""
        return max(float(tr.context_tokens), self._window.mean)


def kv_fits(e: EngineLoad, peak_tokens: float) -> bool:
    """``e`` holds its open trajectories and one more at ``peak_tokens`` of KV each (engines of
    unknown capacity always do)."""
    return not e.capacity_tokens or (e.open_sessions + 1) * peak_tokens <= e.capacity_tokens


def start_engine(view: ClusterView, start: str, peak_tokens: float) -> EngineLoad:
    """Where a trajectory nothing is known of starts.

    ``balanced`` (the default): least-open's engine (fewest open trajectories: Libra's
    control), among the engines whose KV holds one more trajectory at ``peak_tokens`` (the
    workload's recent mean peak context, or this trajectory's prompt before any finished);
    when none does, the one with the fewest open trajectories per KV token. Measured
    (simulated): per-GPU balancing everywhere lost up to 10% to least-open on dapo-math, where
    nothing is KV-bound and the batch's end is one long generation on whichever engine drew it;
    per-engine balancing everywhere put 85 agent sessions on a TP2 engine that holds 23 (2.0x
    slower on tool-heavy ``tp2x2,tp8x1``). ``least-open``: least-open's engine always;
    ``pool``: the fewest open trajectories per GPU."""
    engines = view.healthy()
    if start == "pool":
        return least_open(engines, weighted=True)
    e = least_open(engines)
    if start == "least-open" or kv_fits(e, peak_tokens):
        return e
    room = [x for x in engines if kv_fits(x, peak_tokens)]
    if room:
        return least_open(room)
    return min(engines, key=lambda x: ((x.open_sessions + 1) / (x.capacity_tokens or 1),
                                       x.outstanding_turns))


def within_share(dest: EngineLoad, levels: Levels) -> bool:
    """``dest`` has at most one open trajectory per GPU more than the pool's average: a
    bucket's lower per-token latency pays for a move only while it is not queued deeper than
    the rest of the pool."""
    engines = [e for es in levels for e in es]
    gpus = sum(e.tp for e in engines)
    mean = sum(e.open_sessions for e in engines) / max(1, gpus)
    return dest.open_sessions / dest.tp <= mean + 1.0
