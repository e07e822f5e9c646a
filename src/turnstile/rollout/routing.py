"""Routing policies for rollout trajectories across buckets of engines (registry by CLI name).

* ``load-balance``: least open trajectories per GPU; sticky per trajectory (cache affinity) unless
  ``sticky=False``.
* ``length-predict``: a length predictor learned online (ridge regression on prompt features and
  the prompt's history) routes each trajectory once, at its first turn, to the level whose share
  of the pool matches its predicted length; sticky afterwards. The usual baseline.
* ``cmlfq``: a causality-driven multi-level feedback queue. Levels are buckets by ascending TP
  (level 0: many small engines, high throughput; the last level: few large engines, low latency).
  Every trajectory starts at level 0 (or lower when its prompt's history says so) and is demoted
  by online signals — attained output tokens, turn count, and the keys ``tool:size:status`` of its
  tool returns, looked up in prefix trees of remaining-length observations (mean and p90, window
  200) per prompt and global; the tree moves a trajectory only when mean and p90 agree. Moves are
  monotone (no promotion unless asked), need a minimum dwell between them (hysteresis), and must
  pay for themselves: a move re-prefills the whole context on the new engine. Aging: a trajectory
  whose turns have waited in queues for ``aging_wait_s`` since its last move goes to the adjacent
  level with the faster engine, whatever the signals, so nothing starves.

Policies are synchronous and pure: they read :class:`TrajectoryState` and :class:`PoolView` and
return an engine id; their only state is what they learned.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np

from turnstile.core.registry import Registry
from turnstile.rollout.state import EngineInfo, PoolView, ToolResult, TrajectoryState

__all__ = [
    "ROLLOUT_ROUTING",
    "CMLFQRouter",
    "LengthPredictRouter",
    "LevelBounds",
    "LoadBalanceRouter",
    "NoEngineError",
    "PrefixTree",
    "RolloutRouter",
    "create_router",
]


class NoEngineError(RuntimeError):
    """No engine accepts work."""


@runtime_checkable
class RolloutRouter(Protocol):
    """Decides the engine of each turn of a trajectory. The driver calls, in this order per turn:
    ``place`` (the turn is ready) → ``on_turn_finished`` → ``on_tool_result`` per call →
    ``place`` (next turn) ... → ``on_trajectory_done``. Records are updated before each call."""

    name: ClassVar[str]

    def place(self, traj: TrajectoryState, pool: PoolView, now: float) -> str: ...

    def on_turn_finished(self, traj: TrajectoryState, output_tokens: int, now: float) -> None: ...

    def on_tool_result(self, traj: TrajectoryState, result: ToolResult, now: float) -> None: ...

    def on_trajectory_done(self, traj: TrajectoryState, now: float) -> None: ...


ROLLOUT_ROUTING: Registry[RolloutRouter] = Registry("rollout routing")


def create_router(name: str, **kwargs: object) -> RolloutRouter:
    """A fresh router by CLI name (``load-balance``, ``length-predict``, ``cmlfq``, ...)."""
    return ROLLOUT_ROUTING.create(name, **kwargs)


def _load(e: EngineInfo, weighted: bool) -> tuple[float, int, int]:
    per = e.open_trajectories / e.tp if weighted else float(e.open_trajectories)
    return (per, e.queued, -e.tp)


def least_open(engines: Sequence[EngineInfo], weighted: bool = True) -> EngineInfo:
    """The engine with the fewest open trajectories (per GPU when ``weighted``); ties go to the
    shorter queue, then the larger engine, then the first listed."""
    if not engines:
        raise NoEngineError("no engine accepts work")
    return min(engines, key=lambda e: _load(e, weighted))


def _sticky(traj: TrajectoryState, pool: PoolView) -> EngineInfo | None:
    if traj.engine is not None and traj.engine in pool:
        e = pool[traj.engine]
        if e.accepting:
            return e
    return None


class _Base:
    """No-op learning hooks."""

    name: ClassVar[str] = ""

    def on_turn_finished(self, traj: TrajectoryState, output_tokens: int, now: float) -> None:
        return None

    def on_tool_result(self, traj: TrajectoryState, result: ToolResult, now: float) -> None:
        return None

    def on_trajectory_done(self, traj: TrajectoryState, now: float) -> None:
        return None


@ROLLOUT_ROUTING.register("load-balance")
class LoadBalanceRouter(_Base):
    """Least open trajectories (per GPU), counting trajectories in tool calls (Libra's load).

    ``sticky``: a trajectory stays on its engine while it accepts work (its KV is there);
    ``weighted``: compare open trajectories per GPU (``False``: per engine, as Libra does).
    """

    name: ClassVar[str] = "load-balance"

    def __init__(self, *, sticky: bool = True, weighted: bool = True) -> None:
        self.sticky = sticky
        self.weighted = weighted

    def place(self, traj: TrajectoryState, pool: PoolView, now: float) -> str:
        if self.sticky:
            e = _sticky(traj, pool)
            if e is not None:
                return e.id
        # the trajectory's own open count leaves its current engine when it moves
        engines = pool.accepting()
        return least_open(engines, self.weighted).id


@ROLLOUT_ROUTING.register("round-robin")
class RoundRobinRouter(_Base):
    """Engines in turn, per trajectory at its first turn, sticky afterwards (a floor baseline)."""

    name: ClassVar[str] = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def place(self, traj: TrajectoryState, pool: PoolView, now: float) -> str:
        e = _sticky(traj, pool)
        if e is not None:
            return e.id
        engines = pool.accepting()
        if not engines:
            raise NoEngineError("no engine accepts work")
        pick = engines[self._next % len(engines)]
        self._next += 1
        return pick.id


# ------------------------------------------------------------------------------ level bounds


class Window:
    """The last ``size`` observations with cached mean and p90."""

    __slots__ = ("_mean", "_p90", "_vals")

    def __init__(self, size: int) -> None:
        self._vals: deque[float] = deque(maxlen=size)
        self._mean: float | None = None
        self._p90: float | None = None

    def add(self, x: float) -> None:
        self._vals.append(x)
        self._mean = self._p90 = None

    def __len__(self) -> int:
        return len(self._vals)

    @property
    def mean(self) -> float:
        if self._mean is None:
            self._mean = sum(self._vals) / len(self._vals) if self._vals else 0.0
        return self._mean

    @property
    def p90(self) -> float:
        if self._p90 is None:
            self._p90 = float(np.percentile(self._vals, 90)) if self._vals else 0.0
        return self._p90

    def quantile(self, q: float) -> float:
        return float(np.quantile(self._vals, q)) if self._vals else 0.0

    def values(self) -> list[float]:
        return list(self._vals)


@dataclass
class LevelBounds:
    """Maps a token count (total or remaining output tokens) to a level.

    Explicit ``bounds`` (level i holds counts ≤ ``bounds[i]``; above the last bound → last level),
    or automatic: the observed totals, sorted, split where their cumulative token mass reaches
    the cumulative GPU shares of the levels, so each level gets the share of the decode work its
    share of the pool can take (level 0 the shortest trajectories). Until
    ``min_obs`` totals are observed the ``default`` bounds are used.
    """

    bounds: tuple[float, ...] | None = None
    default: tuple[float, ...] = (6_000.0, 20_000.0, 60_000.0)
    min_obs: int = 32
    window: int = 1000
    #: the last level's share of the work relative to its share of the GPUs (< 1 keeps the
    #: low-latency tier lightly loaded, so the stragglers there run near single-stream speed)
    tail_share: float = 1.0

    def __post_init__(self) -> None:
        self.totals = Window(self.window)
        self._key: tuple[int, tuple[int, ...]] | None = None
        self._bounds: tuple[float, ...] = ()

    def observe(self, total_tokens: float) -> None:
        self.totals.add(total_tokens)
        self._key = None

    def current(self, pool: PoolView) -> tuple[float, ...]:
        levels = pool.levels
        if self.bounds is not None:
            return tuple(self.bounds[: max(0, levels - 1)])
        if len(self.totals) < self.min_obs:
            return self.default[: max(0, levels - 1)]
        gpus = pool.gpus_per_level
        key = (len(self.totals), gpus)
        if self._key == key:
            return self._bounds
        # split the observed token mass (sorted by trajectory length) at the GPU shares
        vals = np.sort(np.asarray(self.totals.values()))
        mass = np.cumsum(vals) / max(float(vals.sum()), 1.0)
        weights = [float(g) for g in gpus]
        weights[-1] *= self.tail_share
        total = sum(weights) or 1.0
        cum, out = 0.0, []
        for g in weights[:-1]:
            cum += g / total
            i = min(int(np.searchsorted(mass, cum)), vals.size - 1)
            out.append(float(vals[i]))
        self._key, self._bounds = key, tuple(out)
        return self._bounds

    def level(self, tokens: float, pool: PoolView) -> int:
        b = self.current(pool)
        for i, x in enumerate(b):
            if tokens <= x:
                return i
        return len(b)


# ------------------------------------------------------------------------------ length-predict


class RidgePredictor:
    """Online ridge regression of log(total output tokens) on prompt features and history."""

    FEATURES: ClassVar[tuple[str, ...]] = (
        "bias", "log_prompt_tokens", "hint", "prompt_history", "has_history",
    )

    def __init__(self, l2: float = 1.0, min_obs: int = 16) -> None:
        n = len(self.FEATURES)
        self._xtx = np.eye(n) * l2
        self._xty = np.zeros(n)
        self._w: np.ndarray | None = None
        self.n = 0
        self.min_obs = min_obs
        self._hist: dict[str, Window] = {}
        self._global = Window(1000)

    def features(self, traj: TrajectoryState) -> np.ndarray:
        h = self._hist.get(traj.prompt_id)
        g = self._global.mean if len(self._global) else 8.0
        return np.array([
            1.0,
            math.log(max(traj.prompt_tokens, 1)),
            traj.hint,
            h.mean if h is not None and len(h) else g,
            1.0 if h is not None and len(h) else 0.0,
        ])

    def predict(self, traj: TrajectoryState) -> float | None:
        """Predicted total output tokens, or None before ``min_obs`` observations."""
        if self.n < self.min_obs:
            return None
        if self._w is None:
            self._w = np.linalg.solve(self._xtx, self._xty)
        return float(math.exp(float(self.features(traj) @ self._w)))

    def observe(self, traj: TrajectoryState, total_tokens: int) -> None:
        y = math.log(max(total_tokens, 1))
        x = self.features(traj)
        self._xtx += np.outer(x, x)
        self._xty += x * y
        self._w = None
        self.n += 1
        self._hist.setdefault(traj.prompt_id, Window(64)).add(y)
        self._global.add(y)


class _Staged:
    """Observations of finished trajectories, visible only to trajectories of later steps.

    Inside a step the first trajectories to finish are the short ones; learning from them
    mid-batch biases every estimate low (censoring). Folding a step's observations in once a
    later step starts removes the bias. With ``same_step=True`` they are used at once.
    """

    def __init__(self, same_step: bool = False) -> None:
        self.same_step = same_step
        self._pending: dict[int, list[Callable[[], None]]] = {}

    def add(self, step: int, apply: Callable[[], None]) -> None:
        if self.same_step:
            apply()
        else:
            self._pending.setdefault(step, []).append(apply)

    def flush(self, step: int) -> None:
        if not self._pending:
            return
        for s in sorted(k for k in self._pending if k < step):
            for apply in self._pending.pop(s):
                apply()


@ROLLOUT_ROUTING.register("length-predict")
class LengthPredictRouter(_Base):
    """Route once by predicted total length (learned online), then stay.

    Before the predictor has data it falls back to ``load-balance``. With a prediction, the
    trajectory goes to the level whose share of the decode work matches it: the bounds split
    the recent *predictions* at the levels' GPU shares of predicted token mass (predictions are
    shrunk towards the mean, so bounds learned from true lengths would send almost everything to
    level 0); least open trajectories inside the level. When that level holds more than
    ``max_imbalance`` times the pool's open trajectories per GPU it balances instead.
    """

    name: ClassVar[str] = "length-predict"

    def __init__(
        self,
        *,
        bounds: LevelBounds | None = None,
        weighted: bool = True,
        max_imbalance: float = 1.1,
        same_step: bool = False,
    ) -> None:
        self.max_imbalance = max_imbalance
        self.predictor = RidgePredictor()
        self.bounds = bounds or LevelBounds(min_obs=16)
        self.weighted = weighted
        self.predicted: dict[str, float] = {}
        self._staged = _Staged(same_step)

    def place(self, traj: TrajectoryState, pool: PoolView, now: float) -> str:
        e = _sticky(traj, pool)
        if e is not None:
            return e.id
        self._staged.flush(traj.step)
        pred = self.predictor.predict(traj)
        if pred is None:
            return least_open(pool.accepting(), self.weighted).id
        self.predicted[traj.id] = pred
        self.bounds.observe(pred)
        e = _pick_in_level(pool, self.bounds.level(pred, pool), self.weighted)
        engines = pool.accepting()
        avg = sum(x.open_trajectories for x in engines) / max(1, sum(x.tp for x in engines))
        if e.open_trajectories / e.tp > self.max_imbalance * avg + 1:
            e = least_open(engines, self.weighted)  # the predicted level is full: balance
        return e.id

    def on_trajectory_done(self, traj: TrajectoryState, now: float) -> None:
        total = traj.attained_output_tokens
        self.predicted.pop(traj.id, None)
        self._staged.add(traj.step, lambda: self.predictor.observe(traj, total))


def _pick_in_level(
    pool: PoolView, level: int, weighted: bool = True, kv_aware: bool = False
) -> EngineInfo:
    """Least-loaded engine of ``level``; when it has none accepting, the nearest level that does.

    Load: open trajectories (per GPU when ``weighted``), or with ``kv_aware`` their KV demand
    over the engine's capacity first."""
    for d in range(pool.levels):
        for lv in (level + d, level - d) if d else (level,):
            if 0 <= lv < pool.levels:
                engines = pool.accepting(lv)
                if engines:
                    if kv_aware:
                        return min(engines, key=lambda e: (e.kv_pressure, _load(e, weighted)))
                    return least_open(engines, weighted)
    raise NoEngineError("no engine accepts work")


def _pressure_with(e: EngineInfo, traj: TrajectoryState) -> float:
    """KV pressure of ``e`` if ``traj`` moved there."""
    extra = 0 if traj.engine == e.id else traj.context_tokens
    return (e.open_tokens + extra) / e.capacity_tokens if e.capacity_tokens else 0.0


# ------------------------------------------------------------------------------ C-MLFQ


class _TreeNode:
    __slots__ = ("children", "obs")

    def __init__(self, window: int) -> None:
        self.children: dict[str, _TreeNode] = {}
        self.obs = Window(window)


class PrefixTree:
    """A trie over tool-return keys; each node keeps remaining-output observations (window)."""

    def __init__(self, window: int = 200, max_depth: int = 32) -> None:
        self.window = window
        self.max_depth = max_depth
        self.root = _TreeNode(window)

    def observe(self, keys: Sequence[str], remaining: Sequence[float]) -> None:
        """``remaining[i]`` = output tokens still to come after the first ``i`` keys
        (``remaining[0]`` is the total); ``len(remaining) == len(keys) + 1``."""
        node = self.root
        node.obs.add(remaining[0])
        for i, k in enumerate(keys[: self.max_depth]):
            nxt = node.children.get(k)
            if nxt is None:
                nxt = node.children[k] = _TreeNode(self.window)
            nxt.obs.add(remaining[i + 1])
            node = nxt

    def lookup(self, keys: Sequence[str], min_obs: int) -> tuple[int, Window] | None:
        """The deepest node on ``keys`` with at least ``min_obs`` observations, and its depth."""
        if len(keys) > self.max_depth:
            return None  # positions past the tree's depth have no comparable observations
        node = self.root
        best = (0, node.obs) if len(node.obs) >= min_obs else None
        for i, k in enumerate(keys):
            nxt = node.children.get(k)
            if nxt is None:
                break
            node = nxt
            if len(node.obs) >= min_obs:
                best = (i + 1, node.obs)
        return best


class _TrajMemo:
    __slots__ = ("attained_at", "level", "moved_turn", "moves", "wait_at_move")

    def __init__(self, level: int) -> None:
        self.level = level
        self.moved_turn = 0
        self.wait_at_move = 0.0
        self.moves = 0
        #: attained output tokens at each tool return (remaining = total − this, learned at end)
        self.attained_at: list[int] = []


@ROLLOUT_ROUTING.register("cmlfq")
class CMLFQRouter(_Base):
    """Causality-driven MLFQ over buckets (see the module docstring for the rules).

    Parameters (all optional):

    * ``bounds``: token bounds of the levels (:class:`LevelBounds`; automatic by default);
    * ``turn_bounds``: turn counts past which a trajectory is demoted below level i (None: off);
    * ``window``, ``min_obs``, ``max_depth``: prefix trees (window of remaining-length
      observations, observations needed to trust a node, deepest key path);
    * ``min_dwell_turns``: turns a trajectory stays on a level after a move (hysteresis);
    * ``move_margin``: a move must cut the estimated remaining time by this fraction, the
      re-prefill of the context on the new engine included (``cost_aware``);
    * ``aging_wait_s``: queue wait since the last move that moves a trajectory one level down
      to a less loaded engine whatever the signals;
    * ``overflow_at``: KV demand over capacity past which a level is over-committed: a first
      turn overflows to a lower level, and later turns of its longer-than-average trajectories
      move down to an engine with room (``pressure``);
    * ``allow_promote``: let the trees move a trajectory back up (off: levels only go down);
    * ``use_history``: place a trajectory's first turn by its prompt's history;
    * ``overflow_at``, ``overflow_headroom``: a first turn goes below its level only when that
      level's KV demand would pass ``overflow_at`` and a lower one stays under the headroom;
    * ``max_dst_pressure``: a demotion waits while the destination's KV demand would pass this;
    * ``same_step``: learn from trajectories of the running step too (biased low; off);
    * ``fill_idle``, ``idle_load``: when an engine of a faster level holds fewer than
      ``idle_load`` × the pool's open trajectories per GPU (the batch's tail), a trajectory
      longer than its engine's average moves there if the move pays (``idle``).
    """

    name: ClassVar[str] = "cmlfq"

    def __init__(
        self,
        *,
        bounds: LevelBounds | None = None,
        turn_bounds: tuple[int, ...] | None = None,
        window: int = 200,
        min_obs: int = 8,
        max_depth: int = 32,
        min_dwell_turns: int = 2,
        move_margin: float = 0.1,
        aging_wait_s: float = 120.0,
        allow_promote: bool = False,
        use_history: bool = True,
        use_attained: bool = True,
        use_tree: bool = True,
        cost_aware: bool = True,
        overflow_at: float = 1.0,
        overflow_headroom: float = 0.3,
        max_dst_pressure: float = 0.9,
        same_step: bool = False,
        fill_idle: bool = True,
        idle_load: float = 0.5,
    ) -> None:
        self.fill_idle = fill_idle
        self.idle_load = idle_load
        self.bounds = bounds or LevelBounds()
        self.turn_bounds = turn_bounds
        self.window = window
        self.min_obs = min_obs
        self.max_depth = max_depth
        self.min_dwell_turns = min_dwell_turns
        self.move_margin = move_margin
        self.aging_wait_s = aging_wait_s
        self.allow_promote = allow_promote
        self.use_history = use_history
        self.use_attained = use_attained
        self.use_tree = use_tree
        self.cost_aware = cost_aware
        self.overflow_at = overflow_at
        self.overflow_headroom = overflow_headroom
        self.max_dst_pressure = max_dst_pressure
        self.global_tree = PrefixTree(window, max_depth)
        self.prompt_trees: dict[str, PrefixTree] = {}
        self._memo: dict[str, _TrajMemo] = {}
        self._staged = _Staged(same_step)
        #: counters for reports
        self.moves = 0
        self.moves_by_reason: dict[str, int] = {}
        self.blocked_by_cost = 0
        self.blocked_by_room = 0

    # ---------------------------------------------------------------- signals
    def _tree_level(self, traj: TrajectoryState, pool: PoolView) -> tuple[int, float] | None:
        """(level, mean remaining) when the deepest trusted node's mean and p90 agree."""
        found: tuple[int, Window] | None = None
        tree = self.prompt_trees.get(traj.prompt_id)
        if tree is not None:
            found = tree.lookup(traj.tool_keys, self.min_obs)
        g = self.global_tree.lookup(traj.tool_keys, self.min_obs)
        if g is not None and (found is None or g[0] > found[0]):
            found = g
        if found is None or found[0] == 0:
            return None  # the root says nothing about this trajectory's tool returns
        obs = found[1]
        lm = self.bounds.level(obs.mean, pool)
        lp = self.bounds.level(obs.p90, pool)
        if lm != lp:
            return None
        return lm, obs.mean

    def _remaining_estimate(self, traj: TrajectoryState, tree_mean: float | None) -> float:
        if tree_mean is not None:
            return tree_mean
        a = traj.attained_output_tokens
        longer = [t - a for t in self.bounds.totals.values() if t > a]
        if len(longer) >= 4:
            return sum(longer) / len(longer)
        return float(max(a, 1))  # nothing known: as much again as so far

    def _initial_level(self, traj: TrajectoryState, pool: PoolView) -> int:
        if not self.use_history:
            return 0
        tree = self.prompt_trees.get(traj.prompt_id)
        if tree is None or len(tree.root.obs) < max(2, self.min_obs // 2):
            return 0
        obs = tree.root.obs
        lm = self.bounds.level(obs.mean, pool)
        lp = self.bounds.level(obs.p90, pool)
        return lm if lm == lp else 0

    def target_level(
        self, traj: TrajectoryState, pool: PoolView, here: EngineInfo | None = None
    ) -> tuple[int, str, float | None]:
        """The level the signals ask for, why, and the tree's mean remaining (if any).
        ``here``: the engine holding the trajectory's KV (if it still accepts work)."""
        memo = self._memo[traj.id]
        cur = memo.level
        target, reason = cur, "stay"
        tree_mean: float | None = None
        if self.use_attained:
            la = self.bounds.level(traj.attained_output_tokens, pool)
            if la > target:
                target, reason = la, "attained"
        if self.turn_bounds is not None:
            lt = min(sum(1 for b in self.turn_bounds if traj.turns_done >= b), pool.levels - 1)
            if lt > target:
                target, reason = lt, "turns"
        if self.use_tree and traj.tool_keys:
            tl = self._tree_level(traj, pool)
            if tl is not None:
                tree_mean = tl[1]
                if tl[0] > target:
                    target, reason = tl[0], "tool"
                elif self.allow_promote and tl[0] < cur and target == cur:
                    target, reason = tl[0], "promote"
        if target == cur and cur + 1 < pool.levels:
            if (
                here is not None
                and here.kv_pressure > self.overflow_at
                and traj.attained_output_tokens >= here.mean_open_attained
            ):
                # the level is over-committed: its longer-than-average trajectories move down
                target, reason = cur + 1, "pressure"
            elif traj.wait_s - memo.wait_at_move >= self.aging_wait_s:
                target, reason = cur + 1, "aging"
            elif (
                self.fill_idle
                and here is not None
                and traj.attained_output_tokens > here.mean_open_attained
                and self._underloaded(pool, cur + 1)
            ):
                # a faster level has room (e.g. the batch's tail): the longest trajectories of
                # this engine take it, if the move pays (work conservation)
                target, reason = pool.levels - 1, "idle"
        return min(target, pool.levels - 1), reason, tree_mean

    def _idle_below(self, pool: PoolView) -> float:
        """Open trajectories per GPU under which an engine counts as underloaded."""
        open_n = gpus = 0
        for x in pool:
            if x.accepting:
                open_n += x.open_trajectories
                gpus += x.tp
        return self.idle_load * open_n / max(1, gpus)

    def _underloaded(self, pool: PoolView, from_level: int) -> bool:
        limit = self._idle_below(pool)
        return any(e.open_trajectories / e.tp < limit
                   for lv in range(from_level, pool.levels) for e in pool.accepting(lv))

    # ---------------------------------------------------------------- policy
    def place(self, traj: TrajectoryState, pool: PoolView, now: float) -> str:
        self._staged.flush(traj.step)
        memo = self._memo.get(traj.id)
        if memo is None:
            e = self._first_engine(traj, pool)
            self._memo[traj.id] = _TrajMemo(e.level)
            return e.id
        here = _sticky(traj, pool)
        if here is not None:
            memo.level = here.level  # levels are renumbered when the pool changes
        memo.level = min(memo.level, pool.levels - 1)
        dwell_ok = memo.moves == 0 or traj.turns_done - memo.moved_turn >= self.min_dwell_turns
        if dwell_ok:
            target, reason, tree_mean = self.target_level(traj, pool, here)
            if target != memo.level:
                dst = self._destination(traj, pool, here, memo.level, target, tree_mean, reason)
                if dst is not None:
                    memo.level = dst.level
                    memo.moved_turn = traj.turns_done
                    memo.wait_at_move = traj.wait_s
                    memo.moves += 1
                    self.moves += 1
                    self.moves_by_reason[reason] = self.moves_by_reason.get(reason, 0) + 1
                    return dst.id
        if here is not None:
            return here.id
        return _pick_in_level(pool, memo.level, kv_aware=True).id

    def _first_engine(self, traj: TrajectoryState, pool: PoolView) -> EngineInfo:
        """Level 0 (or the prompt history's level), KV-aware inside the level; when that level
        is full (KV demand over ``overflow_at``), the lower level with the most headroom below
        ``overflow_headroom`` takes it instead (work conservation without crowding the tail)."""
        level = self._initial_level(traj, pool)
        e = _pick_in_level(pool, level, kv_aware=True)
        if _pressure_with(e, traj) <= self.overflow_at:
            return e
        best: EngineInfo | None = None
        for lv in range(e.level + 1, pool.levels):
            engines = pool.accepting(lv)
            if not engines:
                continue
            cand = min(engines, key=lambda x: (x.kv_pressure, _load(x, True)))
            if _pressure_with(cand, traj) <= self.overflow_headroom and (
                best is None or cand.kv_pressure < best.kv_pressure
            ):
                best = cand
        return best if best is not None else e

    @staticmethod
    def _time_on(e: EngineInfo, traj: TrajectoryState, remaining: float, home: bool) -> float:
        """Estimated seconds to generate ``remaining`` tokens on ``e`` (plus the re-prefill of
        the whole context when ``e`` is not where its KV is)."""
        tpot = max(e.tpot_s, e.idle_tpot_s) + traj.context_tokens * e.kv_read_s_per_token
        return remaining * tpot + (0.0 if home else traj.context_tokens * e.prefill_s_per_token)

    def _destination(
        self,
        traj: TrajectoryState,
        pool: PoolView,
        here: EngineInfo | None,
        cur: int,
        target: int,
        tree_mean: float | None,
        reason: str,
    ) -> EngineInfo | None:
        """The engine to move to (levels between ``cur`` and ``target``), or None to stay.

        A destination needs KV room (``max_dst_pressure``); with ``cost_aware`` the move must
        cut the estimated remaining time by ``move_margin``, re-prefill included. Aging moves
        one level, to an engine less loaded than the current one."""
        if reason == "aging":
            levels = [cur + 1]
        elif reason in ("pressure", "idle"):
            levels = list(range(cur + 1, pool.levels))
        elif target > cur:
            levels = list(range(cur + 1, target + 1))
        else:
            levels = list(range(target, cur))
        remaining = self._remaining_estimate(traj, tree_mean)
        best: tuple[float, EngineInfo] | None = None
        room_blocked = False
        idle_limit = self._idle_below(pool) if reason == "idle" else 0.0
        for lv in levels:
            for e in pool.accepting(lv):
                if _pressure_with(e, traj) > self.max_dst_pressure:
                    room_blocked = True
                    continue
                if (
                    reason in ("aging", "pressure")
                    and here is not None
                    and _pressure_with(e, traj) >= here.kv_pressure - 0.1
                ):
                    continue
                if reason == "idle" and e.open_trajectories / e.tp >= idle_limit:
                    continue
                t = self._time_on(e, traj, remaining, home=False)
                if best is None or t < best[0]:
                    best = (t, e)
        if best is None:
            if room_blocked:
                self.blocked_by_room += 1
            return None
        if reason in ("aging", "pressure") or not self.cost_aware or here is None:
            return best[1]
        stay = self._time_on(here, traj, remaining, home=True)
        if best[0] < stay * (1.0 - self.move_margin):
            return best[1]
        self.blocked_by_cost += 1
        return None

    def on_tool_result(self, traj: TrajectoryState, result: ToolResult, now: float) -> None:
        memo = self._memo.get(traj.id)
        if memo is not None:
            memo.attained_at.append(traj.attained_output_tokens)

    def on_trajectory_done(self, traj: TrajectoryState, now: float) -> None:
        memo = self._memo.pop(traj.id, None)
        total = traj.attained_output_tokens
        attained_at = memo.attained_at if memo is not None else []
        n = min(len(attained_at), len(traj.tool_keys))
        remaining = [float(total)] + [float(total - a) for a in attained_at[:n]]
        keys = list(traj.tool_keys[:n])
        prompt_id = traj.prompt_id

        def apply() -> None:
            self.bounds.observe(total)
            self.global_tree.observe(keys, remaining)
            tree = self.prompt_trees.get(prompt_id)
            if tree is None:
                tree = self.prompt_trees[prompt_id] = PrefixTree(self.window, self.max_depth)
            tree.observe(keys, remaining)

        self._staged.add(traj.step, apply)

    def level_of(self, traj_id: str) -> int | None:
        memo = self._memo.get(traj_id)
        return None if memo is None else memo.level

    def moves_of(self, traj_id: str) -> int:
        memo = self._memo.get(traj_id)
        return 0 if memo is None else memo.moves

    def stats(self) -> dict[str, object]:
        return {
            "moves": self.moves,
            "moves_by_reason": dict(self.moves_by_reason),
            "blocked_by_cost": self.blocked_by_cost,
            "blocked_by_room": self.blocked_by_room,
            "prompt_trees": len(self.prompt_trees),
            "global_tree_obs": len(self.global_tree.root.obs),
        }
