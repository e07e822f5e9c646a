"""C-MLFQ: causality-driven multi-level feedback queues over tensor-parallel buckets.

Levels are the buckets by ascending TP (level 0: many small engines, high throughput; the last:
few large engines, lowest per-token latency). Remaining output tokens map to a level through
:class:`~turnstile.policies.estimators.LevelBounds` (learned: each level takes the share of the
decode work its share of the GPUs can take).

* ``cmlfq`` — Libra's C-MLFQ (NetX-lab/Libra, read, not copied), made never slower than
  least-open: a trajectory nothing is known of starts where least-open would put it (unless
  that engine's KV cannot hold it; Libra starts every trajectory in the shortest bucket:
  ``start="level0"``); a move is decided only when a tool returns; the returns so far, as
  ``tool_type:size_class:status`` codes, walk a prefix tree (per prompt, and a global one) whose
  nodes hold the mean and p90 of the remaining output tokens of recent trajectories (window 200);
  the trajectory moves only when mean and p90 map to the same bucket; the trees are rebuilt every
  ``rebuild_every`` RL steps from the recent finished trajectories; least connections with a
  per-instance cap inside a bucket (``cap``; off by default). It moves only towards larger
  engines (``move_back=True``: both ways, as Libra), and off an engine whose KV is
  over-committed (``relieve``). ``cmlfq:libra`` in ``rollout sim`` is Libra's rules.
* ``cmlfq-adaptive`` — turnstile's variant: also demotes by attained tokens, keeps a prompt's
  history for the first placement, holds a move for ``min_dwell_turns`` (no bouncing), moves only
  when the move pays for its re-prefill, moves over-committed or aged trajectories, and fills
  an underloaded fast level with the longest trajectories of a busy one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import ClassVar

from turnstile.core.state import ClusterView, EngineLoad, TurnRecord, WorkflowRecord
from turnstile.policies.base import ROUTING
from turnstile.policies.estimators import LevelBounds, PrefixTree, RecentWindow, StagedUpdates
from turnstile.policies.trajectory import (
    STARTS,
    Levels,
    PeakContexts,
    Trajectory,
    TrajectoryTracker,
    check_start,
    home_engine,
    kv_fits,
    least_open,
    start_engine,
    within_share,
)

__all__ = ["AdaptiveCmlfqRouting", "CmlfqRouting", "TreeSet"]


class TreeSet:
    """A global prefix tree and one per prompt, of remaining output tokens after each prefix of
    tool-return codes."""

    def __init__(self, window: int = 200, max_depth: int = 32, min_obs: int = 8) -> None:
        self.window = window
        self.max_depth = max_depth
        self.min_obs = min_obs
        self.global_tree = PrefixTree(window, max_depth)
        self.prompt_trees: dict[str, PrefixTree] = {}

    def observe(self, tr: Trajectory) -> None:
        total = tr.attained_output_tokens
        remaining = [float(total)] + [float(total - a) for a in tr.attained_at]
        self.global_tree.observe(tr.codes, remaining)
        tree = self.prompt_trees.get(tr.prompt_id)
        if tree is None:
            tree = self.prompt_trees[tr.prompt_id] = PrefixTree(self.window, self.max_depth)
        tree.observe(tr.codes, remaining)

    def lookup(self, prompt_id: str, codes: list[str]) -> RecentWindow | None:
        """The observations of the deepest trusted node on ``codes`` (the prompt's tree or the
        global one, whichever matches deeper); None when only a root matches."""
        found: tuple[int, RecentWindow] | None = None
        tree = self.prompt_trees.get(prompt_id)
        if tree is not None:
            found = tree.lookup(codes, self.min_obs)
        g = self.global_tree.lookup(codes, self.min_obs)
        if g is not None and (found is None or g[0] > found[0]):
            found = g
        if found is None or found[0] == 0:
            return None
        return found[1]

    def prompt_root(self, prompt_id: str) -> RecentWindow | None:
        tree = self.prompt_trees.get(prompt_id)
        return None if tree is None else tree.root.obs


def _bounds(bounds: LevelBounds | Sequence[float] | None) -> LevelBounds:
    """Level bounds from an object, explicit token bounds (a config file's list), or learned."""
    if bounds is None:
        return LevelBounds()
    if isinstance(bounds, LevelBounds):
        return bounds
    return LevelBounds(bounds=tuple(float(b) for b in bounds))


def _agreeing_level(obs: RecentWindow, bounds: LevelBounds, gpus: tuple[int, ...]) -> int | None:
    """The level of the mean and of the p90 of ``obs`` when they agree, else None."""
    lm = bounds.level(obs.mean, gpus)
    return lm if lm == bounds.level(obs.p90, gpus) else None


@ROUTING.register("cmlfq")
class CmlfqRouting:
    """Libra's C-MLFQ (see the module docstring).

    ``bounds``: level bounds on remaining output tokens — Libra configures them (short bucket
    ≤ 5,000 remaining tokens, then ≤ 20,000, then the rest; ``None``: learned from the GPU
    shares, :class:`LevelBounds`); ``window``,
    ``min_obs``, ``max_depth``: the prefix trees; ``rebuild_every``: RL steps between tree
    rebuilds (sessions of unknown step: every ``rebuild_every_done`` finished trajectories);
    ``history``: recent trajectories the trees are rebuilt from; ``cap``: open trajectories per
    engine past which least connections looks elsewhere in the bucket; ``balance``: a start or
    a move into a bucket whose least-loaded engine holds more than one open trajectory per
    GPU above the pool's average is not made (the trajectory stays on the engine holding its
    KV, or takes the least-loaded engine per GPU) — Libra moves regardless, which piles long
    trajectories onto a small bucket (``balance=False`` restores it); ``start``: where a
    trajectory nothing is known of starts (``balanced``, ``least-open``, ``pool``, or Libra's
    ``level0``: :func:`~turnstile.policies.trajectory.start_engine`); ``move_back``: a tree
    prediction may also move a trajectory to a smaller-TP bucket (off: the move re-prefills
    its context and makes nothing finish sooner; measured 0.96-0.98x least-open on search-r1
    with least-open's starts);
    ``relieve``: at a tool return, a trajectory whose engine's KV demand exceeds its capacity
    takes least-open's engine among those with room (it never fires where nothing is KV-bound).

    Everything relative is the workload's own: the KV room test uses the recent mean peak
    context of finished trajectories (before any finished, the trajectory's prompt).
    """

    name: ClassVar[str] = "cmlfq"
    option_choices: ClassVar[dict[str, tuple[str, ...]]] = {"start": STARTS}

    def __init__(
        self,
        *,
        bounds: LevelBounds | Sequence[float] | None = (5_000.0, 20_000.0),
        window: int = 200,
        min_obs: int = 8,
        max_depth: int = 32,
        rebuild_every: int = 2,
        rebuild_every_done: int = 32,
        history: int = 2000,
        cap: int | None = None,
        balance: bool = True,
        start: str = "balanced",
        move_back: bool = False,
        relieve: bool = True,
    ) -> None:
        self.bounds = _bounds(bounds)
        self.balance = balance
        self.move_back = move_back
        self.relieve = relieve
        self.relieved = 0
        self.start = check_start(start)
        #: peak contexts (KV tokens) of recently finished trajectories
        self.peaks = PeakContexts(window)
        self.window, self.min_obs, self.max_depth = window, min_obs, max_depth
        self.rebuild_every = rebuild_every
        self.rebuild_every_done = rebuild_every_done
        self.cap = cap
        self.trees = TreeSet(window, max_depth, min_obs)
        self._recent: deque[Trajectory] = deque(maxlen=history)
        self._built_step = 0
        self._done_since_build = 0
        self._tracker = TrajectoryTracker()
        #: per open trajectory: [level, tool returns seen at the last decision]
        self._state: dict[str, list[int]] = {}
        self.moves = 0
        self.rebuilds = 0

    def _maybe_rebuild(self, step: int) -> None:
        if step >= 0:
            if step < self._built_step + self.rebuild_every:
                return
            self._built_step = step
            recent = [t for t in self._recent if t.step < step]
        else:
            if self._done_since_build < self.rebuild_every_done:
                return
            recent = list(self._recent)
        self._done_since_build = 0
        self.trees = TreeSet(self.window, self.max_depth, self.min_obs)
        for t in recent:
            self.trees.observe(t)
            self.bounds.observe(t.attained_output_tokens)
        self.rebuilds += 1

    def route(self, turn: TurnRecord, view: ClusterView, now: float) -> str:
        tr = self._tracker.observe(turn)
        self._maybe_rebuild(tr.step)
        levels = Levels(view)
        home = home_engine(turn, view)
        st = self._state.get(tr.id)
        if st is None:
            st = self._state[tr.id] = [0, len(tr.codes)]
            if self.start != "level0" and home is None:
                # nothing is known of it yet: the pool's least-loaded engine (Libra starts
                # every trajectory in the first bucket, which left the others idle: 0.91x
                # least-open on dapo-math, where no tool ever returns to move it)
                e = start_engine(view, self.start, self.peaks.expected(tr))
                st[0] = levels.level_of[e.id]
                return e.id
        elif home is not None:
            st[0] = levels.level_of[home.id]
        if len(tr.codes) > st[1]:  # a tool returned since the last decision: re-decide
            st[1] = len(tr.codes)
            obs = self.trees.lookup(tr.prompt_id, tr.codes)
            if obs is not None:
                target = _agreeing_level(obs, self.bounds, levels.gpus)
                if target is not None and (
                        target > st[0] or (target < st[0] and self.move_back)):
                    st[0] = target
                    self.moves += 1
        level = min(st[0], len(levels) - 1)
        if home is not None and levels.level_of[home.id] == level:
            if self.relieve and home.kv_pressure > 1.0 and len(tr.codes) > 0:
                # its engine's KV is over-committed (its sessions' contexts do not fit: they
                # are evicted and re-prefilled, or preempted): take an engine with room
                peak = self.peaks.expected(tr)
                room = [e for e in view.healthy() if e is not home and kv_fits(e, peak)
                        and e.kv_pressure < 1.0]
                if room:
                    self.relieved += 1
                    return least_open(room).id
            return home.id
        dest = least_open(levels.nearest(level), cap=self.cap)
        if self.balance and not within_share(dest, levels):
            # the bucket is oversubscribed: placing the trajectory there would queue it behind
            # more open trajectories per GPU than the pool has on average (measured: with the
            # planner's TP1×10 + TP2×1 mix every long trajectory piled onto the one TP2 engine,
            # 0.26× least-open; and every start in the smallest bucket left the larger ones
            # idle, so the planner chose a mix of TP1 engines slower than least-open's); stay
            # where the KV is, or take the least-loaded engine
            if home is not None:
                return home.id
            dest = least_open([e for es in levels for e in es], weighted=True)
        return dest.id

    def on_workflow_done(self, workflow: WorkflowRecord, now: float) -> None:
        tr = self._tracker.finish(workflow)
        self._state.pop(tr.id, None)
        self.peaks.finished(tr)
        self._recent.append(tr)
        self._done_since_build += 1

    def stats(self) -> dict[str, object]:
        return {"moves": self.moves, "relieved": self.relieved, "rebuilds": self.rebuilds,
                "prompt_trees": len(self.trees.prompt_trees),
                "global_tree_obs": len(self.trees.global_tree.root.obs)}


class _Memo:
    __slots__ = ("charged", "engine", "level", "moved_turn", "moves", "wait_at_move")

    def __init__(self, level: int) -> None:
        self.level = level
        #: the engine it is homed on, and the attained tokens counted there
        self.engine: str | None = None
        self.charged = 0

    def set_level(self, level: int) -> None:
        self.level = level

    def moved(self, turns_done: int, wait_s: float) -> None:
        self.moved_turn = turns_done
        self.wait_at_move = wait_s
        self.moves += 1

    def home(self, engine_id: str, charged: int, level: int) -> None:
        self.engine = engine_id
        self.charged = charged
        self.level = level
        self.moved_turn = 0
        self.wait_at_move = 0.0
        self.moves = 0


@ROUTING.register("cmlfq-adaptive")
class AdaptiveCmlfqRouting:
    """turnstile's C-MLFQ variant (see the module docstring).

    ``min_dwell_turns``: turns a trajectory stays on a level after a move; ``move_margin``: a
    move must cut the estimated remaining time by this fraction, its re-prefill included;
    ``aging_wait_s``: queue wait since the last move that moves a trajectory one level towards
    the faster engines; ``overflow_at``: KV pressure past which a level is over-committed (its
    longer-than-average trajectories move); ``max_dst_pressure``: a move waits while the
    destination's KV pressure would pass this; ``idle_load``: an engine below this × the pool's
    open trajectories per GPU takes the longest trajectories of busier levels.
    """

    name: ClassVar[str] = "cmlfq-adaptive"
    option_choices: ClassVar[dict[str, tuple[str, ...]]] = {"start": STARTS}

    def __init__(
        self,
        *,
        bounds: LevelBounds | Sequence[float] | None = None,
        window: int = 200,
        min_obs: int = 8,
        max_depth: int = 32,
        min_dwell_turns: int = 2,
        move_margin: float = 0.1,
        aging_wait_s: float = 120.0,
        use_history: bool = True,
        use_tree: bool = True,
        cost_aware: bool = True,
        overflow_at: float = 1.0,
        max_dst_pressure: float = 0.9,
        idle_load: float = 0.5,
        same_step: bool = False,
        start: str = "balanced",
    ) -> None:
        self.bounds = _bounds(bounds)
        self.start = check_start(start)
        self.peaks = PeakContexts(window)
        self.trees = TreeSet(window, max_depth, min_obs)
        self.min_obs = min_obs
        self.min_dwell_turns = min_dwell_turns
        self.move_margin = move_margin
        self.aging_wait_s = aging_wait_s
        self.use_history = use_history
        self.use_tree = use_tree
        self.cost_aware = cost_aware
        self.overflow_at = overflow_at
        self.max_dst_pressure = max_dst_pressure
        self.idle_load = idle_load
        self._staged = StagedUpdates(same_step)
        self._tracker = TrajectoryTracker()
        self._memo: dict[str, _Memo] = {}
        #: per engine: open trajectories' attained output tokens (sum, count)
        self._attained: dict[str, list[int]] = {}
        self.moves = 0
        self.moves_by_reason: dict[str, int] = {}
        self.blocked_by_cost = 0

    # ------------------------------------------------------------------ signals
    def _mean_attained(self, e: EngineLoad) -> float:
        s = self._attained.get(e.id)
        return s[0] / s[1] if s and s[1] else 0.0

    def _remaining(self, tr: Trajectory, tree_mean: float | None) -> float:
        if tree_mean is not None:
            return tree_mean
        a = tr.attained_output_tokens
        n, total = self.bounds.totals.count_above(a)
        if n >= 4:
            return total / n - a
        return float(max(a, 1))  # nothing known: as much again as so far

    def _first_level(self, tr: Trajectory, levels: Levels) -> int | None:
        """The level its prompt's history names; None when nothing is known."""
        if not self.use_history:
            return None
        obs = self.trees.prompt_root(tr.prompt_id)
        if obs is None or len(obs) < max(2, self.min_obs // 2):
            return None
        return _agreeing_level(obs, self.bounds, levels.gpus)

    def _idle_below(self, levels: Levels) -> float:
        open_n = sum(e.open_sessions for es in levels for e in es)
        return self.idle_load * open_n / max(1, sum(levels.gpus))

    def _target(self, tr: Trajectory, memo: _Memo, levels: Levels, here: EngineLoad | None
                ) -> tuple[int, str, float | None]:
        cur, gpus = memo.level, levels.gpus
        target, reason, tree_mean = cur, "stay", None
        la = self.bounds.level(tr.attained_output_tokens, gpus)
        if la > target:
            target, reason = la, "attained"
        if self.use_tree and tr.codes:
            obs = self.trees.lookup(tr.prompt_id, tr.codes)
            tl = None if obs is None else _agreeing_level(obs, self.bounds, gpus)
            if tl is not None:
                tree_mean = obs.mean  # type: ignore[union-attr]
                if tl > target:
                    target, reason = tl, "tool"
        if target == cur and cur + 1 < len(levels):
            longer = here is not None and tr.attained_output_tokens >= self._mean_attained(here)
            if longer and here is not None and here.kv_pressure > self.overflow_at:
                target, reason = cur + 1, "pressure"
            elif tr.wait_s - memo.wait_at_move >= self.aging_wait_s:
                target, reason = cur + 1, "aging"
            elif longer and here is not None and tr.attained_output_tokens > 0:
                limit = self._idle_below(levels)
                if any(e.open_sessions / e.tp < limit
                       for es in levels.engines[cur + 1:] for e in es):
                    target, reason = len(levels) - 1, "idle"
        return min(target, len(levels) - 1), reason, tree_mean

    @staticmethod
    def _time_on(e: EngineLoad, tr: Trajectory, remaining: float, home: bool) -> float:
        """Estimated seconds to generate ``remaining`` tokens on ``e`` (per-token time grown by
        its batch), plus the re-prefill of the whole context when its KV is elsewhere."""
        tpot = e.tpot_s * (1.0 + e.outstanding_turns / (16.0 * e.tp))
        return remaining * tpot + (0.0 if home else tr.context_tokens * e.prefill_s_per_token)

    def _destination(self, tr: Trajectory, levels: Levels, here: EngineLoad | None, cur: int,
                     target: int, tree_mean: float | None, reason: str) -> EngineLoad | None:
        if reason == "aging":
            lvls = [cur + 1]
        elif reason in ("pressure", "idle"):
            lvls = list(range(cur + 1, len(levels)))
        else:
            lvls = list(range(min(cur + 1, target), max(cur, target) + 1))
        remaining = self._remaining(tr, tree_mean)
        idle_limit = self._idle_below(levels) if reason == "idle" else 0.0
        best: tuple[float, EngineLoad] | None = None
        for lv in lvls:
            for e in levels.engines[lv]:
                room = e.capacity_tokens or 1
                pressure = e.kv_pressure + tr.context_tokens / room
                if e.capacity_tokens and pressure > self.max_dst_pressure:
                    continue
                if reason in ("aging", "pressure") and here is not None and (
                        pressure >= here.kv_pressure - 0.1 and e.capacity_tokens):
                    continue
                if reason == "idle" and e.open_sessions / e.tp >= idle_limit:
                    continue
                t = self._time_on(e, tr, remaining, home=False)
                if best is None or t < best[0]:
                    best = (t, e)
        if best is None:
            return None
        if reason in ("aging", "pressure") or not self.cost_aware or here is None:
            return best[1]
        if best[0] < self._time_on(here, tr, remaining, home=True) * (1.0 - self.move_margin):
            return best[1]
        self.blocked_by_cost += 1
        return None

    # ------------------------------------------------------------------ policy
    def route(self, turn: TurnRecord, view: ClusterView, now: float) -> str:
        tr = self._tracker.observe(turn)
        self._staged.flush(tr.step)
        levels = Levels(view)
        here = home_engine(turn, view)
        memo = self._memo.get(tr.id)
        if memo is None:
            first = self._first_level(tr, levels)
            if first is None and self.start != "level0":
                # nothing known: least loaded
                e = start_engine(view, self.start, self.peaks.expected(tr))
            else:
                e = least_open(levels.nearest(first or 0), weighted=True)
            memo = self._memo[tr.id] = _Memo(levels.level_of[e.id])
            return self._place(tr, memo, e, levels)
        if here is not None:
            memo.set_level(levels.level_of[here.id])  # levels renumber when the pool changes
        memo.set_level(min(memo.level, len(levels) - 1))
        if memo.moves == 0 or tr.turns_done - memo.moved_turn >= self.min_dwell_turns:
            target, reason, tree_mean = self._target(tr, memo, levels, here)
            if target != memo.level:
                dst = self._destination(tr, levels, here, memo.level, target, tree_mean, reason)
                if dst is not None:
                    memo.moved(tr.turns_done, tr.wait_s)
                    self.moves += 1
                    self.moves_by_reason[reason] = self.moves_by_reason.get(reason, 0) + 1
                    return self._place(tr, memo, dst, levels)
        if here is not None:
            return self._place(tr, memo, here, levels)
        return self._place(tr, memo, least_open(levels.nearest(memo.level), weighted=True),
                           levels)

    def _place(self, tr: Trajectory, memo: _Memo, e: EngineLoad, levels: Levels) -> str:
        if memo.engine is not None:
            old = self._attained[memo.engine]
            old[0] -= memo.charged
            old[1] -= 1
        s = self._attained.setdefault(e.id, [0, 0])
        s[0] += tr.attained_output_tokens
        s[1] += 1
        memo.home(e.id, tr.attained_output_tokens, levels.level_of[e.id])
        return e.id

    def on_workflow_done(self, workflow: WorkflowRecord, now: float) -> None:
        tr = self._tracker.finish(workflow)
        memo = self._memo.pop(tr.id, None)
        if memo is not None and memo.engine is not None:
            s = self._attained[memo.engine]
            s[0] -= memo.charged
            s[1] -= 1
        self.peaks.finished(tr)
        self._staged.add(tr.step, lambda: self._learn(tr))

    def _learn(self, tr: Trajectory) -> None:
        self.bounds.observe(tr.attained_output_tokens)
        self.trees.observe(tr)

    def stats(self) -> dict[str, object]:
        return {"moves": self.moves, "moves_by_reason": dict(self.moves_by_reason),
                "blocked_by_cost": self.blocked_by_cost,
                "prompt_trees": len(self.trees.prompt_trees)}
