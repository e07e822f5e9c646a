"""``cvar``: separate readiness from release, tail-aware (the "Decoupling Readiness from
Release" method, 2026).

Rule, per call to :meth:`CvarRelease.select`:

1. **Order** ready turns by WSPT index = holding-cost rate / estimated turn work. Every
   unfinished workflow carries the mean weight 1; once its age (now − arrival) passes an online
   estimate q̂ of the α-quantile of workflow flow time it also carries the tail weight
   1/(1−α) — the derivative of CVaR_α with respect to a flow time beyond VaR_α.
2. **Work** of a turn in token-equivalents: new prompt tokens + κ·reused context (mostly a
   cache hit) + γ·expected decode tokens. Expected decode is learned online: the workflow's own
   mean output so far, else the mean output after the preceding tool, else the global mean.
   Nothing is read from the trace's future.
3. **Budget**: release the next turn only while released-but-unfinished work W + w ≤ B(t).
   B(t) adapts to queue pressure at the engines (the wait from release to start of recently
   started turns, mean and P95, against targets): multiplicative decrease when over, increase
   while turns are held and the engines keep up.
4. **Overrides**: a turn is released when some engine is idle even if it exceeds the budget
   (an oversized turn must not wait forever), and any turn held longer than H is released.

Ready turns live in two heaps by work (mean-weight and tail-weight turns, since within one
weight class the index is monotone in work), a heap by workflow arrival to move turns into the
tail class as they age, and a heap by ready time for the hold limit: every decision is
O(log n), with lazy deletion.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

import numpy as np

from turnstile.core.state import ClusterView, TurnRecord, TurnState, WorkflowRecord
from turnstile.policies.base import RELEASE


class OutputEstimator:
    """Online expected decode length: per workflow, per preceding tool, and global means."""

    __slots__ = ("_global", "_tool", "_wf")

    def __init__(self, prior: float = 256.0) -> None:
        self._global = [prior, 1.0]
        self._tool: dict[str, list[float]] = {}
        self._wf: dict[str, list[float]] = {}

    @staticmethod
    def _prev_tool(turn: TurnRecord) -> str | None:
        if turn.index == 0:
            return None
        prev = turn.workflow.turns[turn.index - 1].turn.tools
        return prev[-1].name if prev else None

    def expect(self, turn: TurnRecord) -> float:
        s = self._wf.get(turn.workflow.id)
        if s is not None and s[1] >= 2:
            return s[0] / s[1]
        tool = self._prev_tool(turn)
        if tool is not None and (t := self._tool.get(tool)) is not None and t[1] >= 3:
            return t[0] / t[1]
        return self._global[0] / self._global[1]

    def observe(self, turn: TurnRecord) -> None:
        out = float(turn.output_tokens)
        self._global[0] += out
        self._global[1] += 1
        s = self._wf.setdefault(turn.workflow.id, [0.0, 0.0])
        s[0] += out
        s[1] += 1
        tool = self._prev_tool(turn)
        if tool is not None:
            t = self._tool.setdefault(tool, [0.0, 0.0])
            t[0] += out
            t[1] += 1

    def forget(self, workflow_id: str) -> None:
        self._wf.pop(workflow_id, None)


class QuantileTracker:
    """α-quantile of recent samples (a bounded window, re-sorted every ``every`` samples)."""

    __slots__ = ("_n", "_window", "alpha", "every", "min_samples", "q")

    def __init__(self, alpha: float, window: int = 512, every: int = 16,
                 min_samples: int = 20) -> None:
        self.alpha = alpha
        self.every = every
        self.min_samples = min_samples
        self._window: deque[float] = deque(maxlen=window)
        self._n = 0
        self.q = float("inf")  # no tail until enough workflows finished

    def add(self, x: float) -> None:
        self._window.append(x)
        self._n += 1
        if len(self._window) >= self.min_samples and self._n % self.every == 0:
            self.q = float(np.quantile(np.fromiter(self._window, float), self.alpha))


@RELEASE.register("cvar")
class CvarRelease:
    name = "cvar"

    def __init__(
        self,
        alpha: float = 0.95,
        gamma: float = 8.0,
        kappa: float = 0.1,
        budget_per_engine: float = 65_536.0,
        min_budget_per_engine: float = 8_192.0,
        max_budget_per_engine: float = 1_048_576.0,
        adapt: bool = True,
        target_wait_s: float = 0.5,
        target_p95_wait_s: float = 2.0,
        adapt_every: int = 8,
        hold_limit_s: float = 120.0,
    ) -> None:
        if not 0.0 < alpha < 1.0:
            raise ValueError("alpha must be in (0, 1)")
        self.alpha = alpha
        self.tail_weight = 1.0 / (1.0 - alpha)
        self.gamma = gamma
        self.kappa = kappa
        self.budget_per_engine = budget_per_engine
        self.min_budget_per_engine = min_budget_per_engine
        self.max_budget_per_engine = max_budget_per_engine
        self.adapt = adapt
        self.target_wait_s = target_wait_s
        self.target_p95_wait_s = target_p95_wait_s
        self.adapt_every = adapt_every
        self.hold_limit_s = hold_limit_s
        self.outputs = OutputEstimator()
        self.flow_q = QuantileTracker(alpha)
        self.released_work = 0.0  # W: estimated work of released, unfinished turns
        self._mean: list[tuple[float, int, TurnRecord]] = []
        self._tail: list[tuple[float, int, TurnRecord]] = []
        self._by_age: list[tuple[float, int, TurnRecord]] = []
        self._by_ready: list[tuple[float, int, TurnRecord]] = []
        self._work: dict[int, float] = {}  # seq -> work of a held turn
        self._tail_seqs: set[int] = set()
        self._seq = 0
        self._n = 0
        self._waits: deque[float] = deque(maxlen=64)
        self._finished_since_adapt = 0
        self._hold_ema = 0.0

    # ------------------------------------------------------------ estimates
    def work(self, turn: TurnRecord) -> float:
        t = turn.turn
        return t.input_tokens + self.kappa * t.context_tokens + self.gamma * self.outputs.expect(
            turn)

    def is_tail(self, wf: WorkflowRecord, now: float) -> bool:
        return now - wf.arrival_s > self.flow_q.q

    def budget(self, view: ClusterView) -> float:
        return self.budget_per_engine * len(view)

    def expected_hold_s(self, workflow: WorkflowRecord, now: float) -> float:
        """How long a next turn of ``workflow`` is expected to be held (for budget-keep)."""
        return 0.0 if self.is_tail(workflow, now) else self._hold_ema

    # ------------------------------------------------------------- protocol
    def add(self, turn: TurnRecord, now: float) -> None:
        self._seq += 1
        seq = self._seq
        turn.key = seq
        w = self.work(turn)
        self._work[seq] = w
        if self.is_tail(turn.workflow, now):
            self._tail_seqs.add(seq)
            heapq.heappush(self._tail, (w, seq, turn))
        else:
            heapq.heappush(self._mean, (w, seq, turn))
            heapq.heappush(self._by_age, (turn.workflow.arrival_s, seq, turn))
        heapq.heappush(self._by_ready, (now, seq, turn))
        self._n += 1

    @staticmethod
    def _valid(seq: int, turn: TurnRecord) -> bool:
        return turn.key == seq and turn.state == TurnState.READY

    def _top(self, heap: list[tuple[float, int, TurnRecord]]) -> tuple[float, int,
                                                                         TurnRecord] | None:
        while heap and not self._valid(heap[0][1], heap[0][2]):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def _take(self, seq: int, turn: TurnRecord, now: float) -> TurnRecord:
        w = self._work.pop(seq)
        self._tail_seqs.discard(seq)
        self.released_work += w
        turn.key = w  # after release, key holds the charged work (see on_finished)
        self._n -= 1
        self._hold_ema += 0.05 * ((now - turn.ready_s) - self._hold_ema)
        return turn

    def _promote(self, now: float) -> None:
        limit = now - self.flow_q.q
        by_age = self._by_age
        while by_age and by_age[0][0] < limit:
            _, seq, turn = heapq.heappop(by_age)
            if self._valid(seq, turn) and seq not in self._tail_seqs:
                self._tail_seqs.add(seq)
                heapq.heappush(self._tail, (self._work[seq], seq, turn))
                # the mean-heap entry stays behind; _best skips it via _tail_seqs

    def _best(self) -> tuple[float, int, TurnRecord] | None:
        """The held turn with the highest WSPT index."""
        mean = self._mean
        while mean and (not self._valid(mean[0][1], mean[0][2]) or mean[0][1] in self._tail_seqs):
            heapq.heappop(mean)
        m = mean[0] if mean else None
        t = self._top(self._tail)
        if t is None:
            return m
        if m is None:
            return t
        # index = weight / work: tail turns weigh 1 + 1/(1-α), mean turns 1
        return t if (1.0 + self.tail_weight) * m[0] >= t[0] else m

    def select(self, view: ClusterView, now: float) -> Iterator[TurnRecord]:
        if not self._n:
            return
        self._promote(now)
        by_ready = self._by_ready
        limit = now - self.hold_limit_s
        while by_ready and (not self._valid(by_ready[0][1], by_ready[0][2])
                            or by_ready[0][0] <= limit):
            _, seq, turn = heapq.heappop(by_ready)
            if self._valid(seq, turn):
                yield self._take(seq, turn, now)  # held longer than H
        budget = self.budget(view)
        while self._n:
            best = self._best()
            if best is None:
                return
            w, seq, turn = best
            if self.released_work + w > budget and not view.any_idle():
                return
            yield self._take(seq, turn, now)

    def on_finished(self, turn: TurnRecord, now: float) -> None:
        w = turn.key if isinstance(turn.key, float) else 0.0
        self.released_work = max(0.0, self.released_work - w)
        turn.key = None
        self.outputs.observe(turn)
        wf = turn.workflow
        if wf.source is not None and turn.index == len(wf.turns) - 1:
            self.flow_q.add(now - wf.arrival_s)
            self.outputs.forget(wf.id)
        if turn.started_s >= 0:
            self._waits.append(turn.started_s - turn.released_s)
        if self.adapt:
            self._finished_since_adapt += 1
            if self._finished_since_adapt >= self.adapt_every and len(self._waits) >= 8:
                self._finished_since_adapt = 0
                self._adapt()

    def _adapt(self) -> None:
        waits = np.fromiter(self._waits, float)
        mean, p95 = float(waits.mean()), float(np.quantile(waits, 0.95))
        if mean > self.target_wait_s or p95 > self.target_p95_wait_s:
            self.budget_per_engine = max(self.min_budget_per_engine, self.budget_per_engine * 0.8)
        elif self._n:
            self.budget_per_engine = min(self.max_budget_per_engine,
                                         self.budget_per_engine * 1.1)

    def next_wakeup(self, now: float) -> float | None:
        if not self._n:
            return None
        while self._by_ready and not self._valid(self._by_ready[0][1], self._by_ready[0][2]):
            heapq.heappop(self._by_ready)
        times = []
        if self._by_ready:
            times.append(self._by_ready[0][0] + self.hold_limit_s)
        while self._by_age and not self._valid(self._by_age[0][1], self._by_age[0][2]):
            heapq.heappop(self._by_age)
        if self._by_age and self.flow_q.q != float("inf"):
            times.append(self._by_age[0][0] + self.flow_q.q)
        return min(times) if times else None

    def __len__(self) -> int:
        return self._n


@RELEASE.register("cvar-fixed")
class CvarFixedBudgetRelease(CvarRelease):
    """``cvar`` with the budget B held fixed (the ablation the paper compares against)."""

    name = "cvar-fixed"

    def __init__(self, **kw: float) -> None:
        kw.setdefault("adapt", False)
        super().__init__(**kw)  # type: ignore[arg-type]
