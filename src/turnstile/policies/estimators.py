"""Online estimators the learned policies share: one windowed-quantile type and what is built
on it (tool-latency and flow-time quantiles, the tool-return prefix tree, level bounds, a ridge
length predictor), plus the two keys a tool call is filed under.

Every estimator learns only from the past (finished turns, returned tools, finished
workflows) and holds bounded memory (windows).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np

from turnstile.core.state import TurnRecord
from turnstile.workload.model import ToolStatus

__all__ = [
    "SIZE_BOUNDS",
    "LevelBounds",
    "PrefixTree",
    "QuantileTracker",
    "RecentWindow",
    "RidgePredictor",
    "StagedUpdates",
    "ToolLatencyEstimator",
    "latency_key",
    "return_code",
]


class RecentWindow:
    """The last ``size`` observations: mean and quantiles (a sorted copy cached until the next
    observation; O(size log size) per refresh, O(1) per repeated query)."""

    __slots__ = ("_sorted", "_sum", "_vals")

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"window size must be >= 1, got {size}")
        self._vals: deque[float] = deque(maxlen=size)
        self._sum = 0.0
        self._sorted: list[float] | None = None

    def add(self, x: float) -> None:
        vals = self._vals
        if len(vals) == vals.maxlen:
            self._sum -= vals[0]
        vals.append(x)
        self._sum += x
        self._sorted = None

    def __len__(self) -> int:
        return len(self._vals)

    def _sorted_vals(self) -> list[float]:
        if self._sorted is None:
            self._sorted = sorted(self._vals)
        return self._sorted

    @property
    def mean(self) -> float:
        n = len(self._vals)
        return self._sum / n if n else 0.0

    def quantile(self, q: float) -> float:
        """Linear interpolation between order statistics (numpy's default); 0 when empty."""
        xs = self._sorted_vals()
        if not xs:
            return 0.0
        pos = q * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    def rank_quantile(self, q: float) -> float | None:
        """Nearest-rank quantile (an observed value); None when empty."""
        xs = self._sorted_vals()
        if not xs:
            return None
        return xs[min(max(math.ceil(q * len(xs)) - 1, 0), len(xs) - 1)]

    @property
    def p90(self) -> float:
        return self.quantile(0.9)

    def count_above(self, x: float) -> tuple[int, float]:
        """How many observations exceed ``x``, and their sum."""
        xs = self._sorted_vals()
        i = bisect.bisect_right(xs, x)
        return len(xs) - i, float(sum(xs[i:]))

    def values(self) -> list[float]:
        return list(self._vals)


class QuantileTracker:
    """The α-quantile of recent samples, refreshed every ``every`` samples (``inf`` until
    ``min_samples`` arrived): a cheap tail estimate for a hot path."""

    __slots__ = ("_n", "_window", "alpha", "every", "min_samples", "q")

    def __init__(self, alpha: float, window: int = 512, every: int = 16,
                 min_samples: int = 20) -> None:
        self.alpha = alpha
        self.every = every
        self.min_samples = min_samples
        self._window = RecentWindow(window)
        self._n = 0
        self.q = float("inf")  # no tail until enough samples arrived

    def values(self) -> list[float]:
        """The samples in the window."""
        return self._window.values()

    def add(self, x: float) -> None:
        self._window.add(x)
        self._n += 1
        if len(self._window) >= self.min_samples and self._n % self.every == 0:
            self.q = self._window.quantile(self.alpha)


def latency_key(turn: TurnRecord) -> str:
    """The key of the tool calls after ``turn`` for latency estimates: their names, as the LLM
    emitted them (several calls run back to back: one observation keyed by all the names); a
    turn of an open session (gateway) whose tools are not known is keyed ``""``."""
    tools = turn.turn.tools
    if not tools:
        return ""
    if len(tools) == 1:
        return tools[0].name
    return "+".join(t.name for t in tools)


#: result-size classes of a tool return, in tokens: small < 256 ≤ medium < 2048 ≤ large
SIZE_BOUNDS: tuple[int, int] = (256, 2048)
_STATUS_WORD = {"ok": "success", "error": "failure", "timeout": "timeout", "unknown": "success"}


def return_code(name: str, result_tokens: int | None, status: ToolStatus | str) -> str:
    """The causal code of one tool return, Libra's ``tool_type:size:status``
    (e.g. ``Bash:large:failure``)."""
    if result_tokens is None:
        size = "unknown"
    elif result_tokens < SIZE_BOUNDS[0]:
        size = "small"
    elif result_tokens < SIZE_BOUNDS[1]:
        size = "medium"
    else:
        size = "large"
    return f"{name}:{size}:{_STATUS_WORD.get(status, str(status))}"


class ToolLatencyEstimator:
    """Per-key tool latency: the last ``window`` observations of each key (bounded memory)."""

    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._samples: dict[str, RecentWindow] = {}

    def observe(self, key: str, duration_s: float) -> None:
        w = self._samples.get(key)
        if w is None:
            w = self._samples[key] = RecentWindow(self.window)
        w.add(max(duration_s, 0.0))

    def count(self, key: str) -> int:
        w = self._samples.get(key)
        return 0 if w is None else len(w)

    def quantile(self, key: str, q: float) -> float | None:
        """The ``q`` quantile (nearest rank) of the observations of ``key``; None if unseen."""
        w = self._samples.get(key)
        return None if w is None else w.rank_quantile(q)

    def mean(self, key: str) -> float | None:
        w = self._samples.get(key)
        return None if w is None or not len(w) else w.mean


class _TreeNode:
    __slots__ = ("children", "obs")

    def __init__(self, window: int) -> None:
        self.children: dict[str, _TreeNode] = {}
        self.obs = RecentWindow(window)

    def child(self, key: str) -> _TreeNode:
        """The child under ``key``, created empty (same window) when new."""
        nxt = self.children.get(key)
        if nxt is None:
            nxt = self.children[key] = _TreeNode(self.obs._vals.maxlen or 1)
        return nxt


class PrefixTree:
    """A trie over tool-return codes; each node keeps the remaining output tokens observed
    after that prefix of returns (a window: mean and p90)."""

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
            node = node.child(k)
            node.obs.add(remaining[i + 1])

    def lookup(self, keys: Sequence[str], min_obs: int) -> tuple[int, RecentWindow] | None:
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


class LevelBounds:
    """Maps a token count (total or remaining output tokens) to a level.

    Explicit ``bounds`` (level i holds counts ≤ ``bounds[i]``; above the last → the last level),
    or automatic: the observed totals, sorted, split where their cumulative token mass reaches
    the cumulative GPU shares of the levels, so each level gets the share of the decode work its
    share of the pool can take. Until ``min_obs`` totals are observed the ``default`` bounds
    are used.
    """

    def __init__(
        self,
        bounds: tuple[float, ...] | None = None,
        default: tuple[float, ...] = (6_000.0, 20_000.0, 60_000.0),
        min_obs: int = 32,
        window: int = 1000,
    ) -> None:
        self.bounds = bounds
        self.default = default
        self.min_obs = min_obs
        self.totals = RecentWindow(window)
        self._key: tuple[int, tuple[int, ...]] | None = None
        self._bounds: tuple[float, ...] = ()
        self._seen = 0

    def observe(self, total_tokens: float) -> None:
        self.totals.add(total_tokens)
        self._seen += 1

    def current(self, gpus_per_level: tuple[int, ...]) -> tuple[float, ...]:
        levels = len(gpus_per_level)
        if self.bounds is not None:
            return tuple(self.bounds[: max(0, levels - 1)])
        if len(self.totals) < self.min_obs:
            return self.default[: max(0, levels - 1)]
        key = (self._seen, gpus_per_level)
        if self._key == key:
            return self._bounds
        vals = np.sort(np.asarray(self.totals.values()))
        mass = np.cumsum(vals) / max(float(vals.sum()), 1.0)
        total = sum(gpus_per_level) or 1
        cum, out = 0.0, []
        for g in gpus_per_level[:-1]:
            cum += g / total
            i = min(int(np.searchsorted(mass, cum)), vals.size - 1)
            out.append(float(vals[i]))
        self._key, self._bounds = key, tuple(out)
        return self._bounds

    def level(self, tokens: float, gpus_per_level: tuple[int, ...]) -> int:
        b = self.current(gpus_per_level)
        return bisect.bisect_left(b, tokens)


class RidgePredictor:
    """Online ridge regression of log(total output tokens) on a few features per trajectory
    (``features`` builds them from the prompt size, a hint and the prompt's history)."""

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
        self._hist: dict[str, RecentWindow] = {}
        self._global = RecentWindow(1000)

    def features(self, prompt_id: str, prompt_tokens: int, hint: float) -> np.ndarray:
        h = self._hist.get(prompt_id)
        known = h is not None and len(h) > 0
        g = self._global.mean if len(self._global) else 8.0
        return np.array([
            1.0,
            math.log(max(prompt_tokens, 1)),
            hint,
            h.mean if known else g,  # type: ignore[union-attr]
            1.0 if known else 0.0,
        ])

    def predict(self, prompt_id: str, prompt_tokens: int, hint: float) -> float | None:
        """Predicted total output tokens, or None before ``min_obs`` observations."""
        if self.n < self.min_obs:
            return None
        if self._w is None:
            self._w = np.linalg.solve(self._xtx, self._xty)
        return float(math.exp(float(self.features(prompt_id, prompt_tokens, hint) @ self._w)))

    def observe(self, prompt_id: str, prompt_tokens: int, hint: float, total_tokens: int) -> None:
        y = math.log(max(total_tokens, 1))
        x = self.features(prompt_id, prompt_tokens, hint)
        self._xtx += np.outer(x, x)
        self._xty += x * y
        self._w = None
        self.n += 1
        h = self._hist.get(prompt_id)
        if h is None:
            h = self._hist[prompt_id] = RecentWindow(64)
        h.add(y)
        self._global.add(y)


class StagedUpdates:
    """Observations of finished trajectories, applied only once a later RL step starts.

    Inside a step the first trajectories to finish are the short ones; learning from them
    mid-batch biases every estimate low (censoring). With ``same_step=True`` (or an unknown
    step, ``< 0``) they apply at once.
    """

    def __init__(self, same_step: bool = False) -> None:
        self.same_step = same_step
        self._pending: dict[int, list[Callable[[], None]]] = {}

    def add(self, step: int, apply: Callable[[], None]) -> None:
        if self.same_step or step < 0:
            apply()
        else:
            self._pending.setdefault(step, []).append(apply)

    def flush(self, step: int) -> None:
        if not self._pending:
            return
        for s in sorted(k for k in self._pending if k < step):
            for apply in self._pending.pop(s):
                apply()
