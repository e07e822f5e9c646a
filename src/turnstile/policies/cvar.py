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
5. **KV gate for new workflows** (turnstile's extension): turns of workflows already started
   go first; the first turn of a new workflow is admitted, oldest first, only while some
   engine's KV demand — released work plus the contexts of its sessions paused in tool calls
   (the core's shadow load) — leaves room for its prompt within ``kv_fill`` × that engine's
   KV capacity. An agent's context is needed again after every tool call, so admitting more
   sessions than KV holds makes every session re-prefill its context (measured: eager
   recomputes most of its prefill at high load). ``kv_fill`` adapts to the context miss
   rate the engines report (prompt tokens of started workflows not found in the prefix
   cache): shrink when sessions lose their KV, grow while new workflows wait and they don't.
   The idle override of rule 4 admits a new workflow past this gate only onto an idle engine
   with a free slot: an engine that keeps one sequence per slot (llama.cpp, ``kv_slots``)
   and whose slots all hold sessions paused in tool calls has no room for one more, however
   few tokens they hold. A session paused longer than a high quantile of the tool pauses seen
   so far is taken as done (clients seldom say a session ended), so its slot counts as free.

Ready turns live in two heaps by work (mean-weight and tail-weight turns, since within one
weight class the index is monotone in work), a heap by workflow arrival to move turns into the
tail class as they age, a FIFO of new workflows at the KV gate, and a heap of hold-limit
expiries: every decision is O(log n) amortized, with lazy deletion.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterator
from typing import ClassVar

import numpy as np

from turnstile.core.interfaces import AdmissionPolicy
from turnstile.core.state import (
    ClusterView,
    EngineLoad,
    TurnRecord,
    TurnState,
    WorkflowRecord,
)
from turnstile.policies.base import RELEASE
from turnstile.policies.estimators import QuantileTracker, RecentWindow


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


@RELEASE.register("cvar")
class CvarRelease:
    name: ClassVar[str] = "cvar"
    #: the choices of its str options (read by :mod:`turnstile.policies.spec`)
    option_choices: ClassVar[dict[str, tuple[str, ...]]] = {
        "budget": ("adaptive", "fixed", "none"), "gate": ("adaptive", "fixed", "none"),
    }

    def __init__(
        self,
        alpha: float = 0.95,
        gamma: float = 8.0,
        kappa: float = 0.1,
        budget_per_engine: float = 65_536.0,
        min_budget_per_engine: float = 8_192.0,
        max_budget_per_engine: float = 1_048_576.0,
        budget: str = "adaptive",
        target_wait_s: float = 0.5,
        target_p95_wait_s: float = 2.0,
        adapt_every: int = 8,
        hold_limit_s: float = 600.0,
        gate_hold_limit_s: float = 3600.0,
        kv_fill: float = 0.5,
        min_kv_fill: float = 0.2,
        max_kv_fill: float = 0.8,
        target_context_miss: float = 0.05,
        gate: str = "adaptive",
        done_pause_q: float = 1.0,
        min_pause_samples: int = 20,
    ) -> None:
        if not 0.0 < alpha < 1.0:
            raise ValueError("alpha must be in (0, 1)")
        if budget not in self.option_choices["budget"]:
            raise ValueError(f"budget must be one of {self.option_choices['budget']}")
        if gate not in self.option_choices["gate"]:
            raise ValueError(f"gate must be one of {self.option_choices['gate']}")
        self.alpha = alpha
        self.tail_weight = 1.0 / (1.0 - alpha)
        self.gamma = gamma
        self.kappa = kappa
        self.budget_per_engine = budget_per_engine
        self.min_budget_per_engine = min_budget_per_engine
        self.max_budget_per_engine = max_budget_per_engine
        #: released-work budget: "adaptive" (rule 3), "fixed" (B stays ``budget_per_engine``)
        #: or "none" (no budget: only the gate and the hold limits hold turns)
        self.budget_mode = budget
        #: KV gate for new workflows: "adaptive" (``kv_fill`` adapts, rule 5), "fixed" or "none"
        self.gate_mode = gate
        self.target_wait_s = target_wait_s
        self.target_p95_wait_s = target_p95_wait_s
        self.adapt_every = adapt_every
        self.hold_limit_s = hold_limit_s
        self.gate_hold_limit_s = gate_hold_limit_s
        self.kv_fill = kv_fill
        self.min_kv_fill = min_kv_fill
        self.max_kv_fill = max_kv_fill
        self.kv_gate = gate != "none"
        self.target_context_miss = target_context_miss
        self._miss = [0.0, 0.0]  # context tokens missed / expected in the cache since adapting
        #: a session paused in a tool call longer than this quantile of the last 256 pauses
        #: (1.0: longer than any of them) is taken as done, since a client seldom says a
        #: session ended: its slot counts as free for the idle override (simulated on the real
        #: A/B's sessions: 1.0 cost 2–3 points of prefix hits and cut cvar's P95 by 12–15%;
        #: 0.9–0.98 cost 4–9 points)
        self.done_pause_q = done_pause_q
        self.min_pause_samples = min_pause_samples
        self._paused_at: dict[str, float] = {}  # workflow -> when its last turn finished
        self._pauses = RecentWindow(256)  # observed pauses: last finish -> next turn ready
        self._view: ClusterView | None = None
        #: started, unfinished workflows
        self._active: set[str] = set()
        self._gate: deque[tuple[int, TurnRecord]] = deque()
        self.outputs = OutputEstimator()
        self.flow_q = QuantileTracker(alpha)
        self.released_work = 0.0  # W: estimated work of released, unfinished turns
        self._mean: list[tuple[float, int, TurnRecord]] = []
        self._tail: list[tuple[float, int, TurnRecord]] = []
        self._by_age: list[tuple[float, int, TurnRecord]] = []
        #: (time its hold limit expires, seq, turn): H for started workflows' turns, the longer
        #: gate limit for new workflows (the KV gate is what should hold those)
        self._expiry: list[tuple[float, int, TurnRecord]] = []
        self._work: dict[int, float] = {}  # seq -> work of a held turn
        #: the sequence number of each held turn's live heap entries (lazy deletion)
        self._seq_of: dict[TurnRecord, int] = {}
        #: work charged to W for each released, unfinished turn (returned in on_finished)
        self._charged: dict[TurnRecord, float] = {}
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
        if self.budget_mode == "none":
            return math.inf
        return self.budget_per_engine * len(view)

    def kv_room(self, view: ClusterView) -> float:
        """The most KV (tokens) any healthy engine has left for a new session."""
        if not self.kv_gate:
            return float("inf")
        room = float("-inf")
        for e in view.values():
            if not e.healthy:
                continue
            if e.capacity_tokens <= 0:
                return float("inf")  # unknown capacity: no gate
            free = self.kv_fill * e.capacity_tokens - e.outstanding_tokens - self.paused_kv(e)
            room = max(room, free)
        return room

    def paused_kv(self, e: EngineLoad) -> float:
        """The KV (tokens) of the sessions paused in tool calls on ``e`` that the gate keeps."""
        return e.paused_context_tokens

    def done_pause_s(self) -> float:
        """How long a session must have been paused to be taken as done: the ``done_pause_q``
        quantile of the pauses seen (inf until ``min_pause_samples`` were)."""
        if len(self._pauses) < self.min_pause_samples:
            return math.inf
        return self._pauses.quantile(self.done_pause_q)

    def idle_with_free_slot(self, view: ClusterView, now: float) -> bool:
        """Some engine that takes new work is idle and has room for one more session without
        evicting a live one: a free slot (:attr:`EngineLoad.has_free_slot`), or a slot held
        by a session paused longer than :meth:`done_pause_s` (likely done). O(slots) per idle
        slot-limited engine."""
        limit = -1.0
        for e in view.values():  # the engines view.any_idle() looks at
            if not e.idle:
                continue
            if e.has_free_slot:
                return True
            if limit < 0.0:
                limit = self.done_pause_s()
            paused_at = self._paused_at
            live = sum(1 for s in e.cached_sessions if now - paused_at.get(s, now) < limit)
            if live < e.kv_slots:
                return True
        return False

    def expected_hold_s(self, workflow: WorkflowRecord, now: float) -> float | None:
        """How long a next turn of ``workflow`` is expected to be held (for budget-keep)."""
        return 0.0 if self.is_tail(workflow, now) else self._hold_ema

    def admission_order(self) -> AdmissionPolicy | None:
        return None

    # ------------------------------------------------------------- protocol
    def add(self, turn: TurnRecord, now: float) -> None:
        paused_at = self._paused_at.pop(turn.workflow.id, None)
        if paused_at is not None:
            self._pauses.add(now - paused_at)
        self._seq += 1
        seq = self._seq
        self._seq_of[turn] = seq
        w = self.work(turn)
        self._work[seq] = w
        self._n += 1
        if turn.workflow.id not in self._active:
            self._gate.append((seq, turn))  # a new workflow: FCFS at the KV gate
            self._push_expiry(now, seq, turn, self.gate_hold_limit_s)
            return
        if self.is_tail(turn.workflow, now):
            self._tail_seqs.add(seq)
            heapq.heappush(self._tail, (w, seq, turn))
        else:
            heapq.heappush(self._mean, (w, seq, turn))
            heapq.heappush(self._by_age, (turn.workflow.arrival_s, seq, turn))
        self._push_expiry(now, seq, turn, self.hold_limit_s)

    def _push_expiry(self, now: float, seq: int, turn: TurnRecord, limit_s: float) -> None:
        """Record when a held turn's hold limit expires (``auto`` keys it by ready time)."""
        heapq.heappush(self._expiry, (now + limit_s, seq, turn))

    def _valid(self, seq: int, turn: TurnRecord) -> bool:
        return self._seq_of.get(turn) == seq and turn.state == TurnState.READY

    def _top(self, heap: list[tuple[float, int, TurnRecord]]) -> tuple[float, int,
                                                                         TurnRecord] | None:
        while heap and not self._valid(heap[0][1], heap[0][2]):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def _take(self, seq: int, turn: TurnRecord, now: float) -> TurnRecord:
        w = self._work.pop(seq)
        self._tail_seqs.discard(seq)
        self.released_work += w
        del self._seq_of[turn]
        self._charged[turn] = w
        self._n -= 1
        self._active.add(turn.workflow.id)
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
        self._view = view  # the core's live view, read again by next_wakeup
        if not self._n:
            return
        self._promote(now)
        expiry = self._expiry
        while expiry and (not self._valid(expiry[0][1], expiry[0][2]) or expiry[0][0] <= now):
            _, seq, turn = heapq.heappop(expiry)
            if self._valid(seq, turn):
                yield self._take(seq, turn, now)  # held longer than its hold limit
        # W counts what other drivers sharing the engines released too (gateway replicas report
        # it through the core, in the core's units: prompt + expected output tokens), so the
        # budget is global; a lone driver's peer part is 0
        budget = self.budget(view) - view.peer_released_tokens
        while True:  # turns of started workflows, by WSPT index, under the budget
            best = self._best()
            if best is None:
                break
            w, seq, turn = best
            if self.released_work + w > budget and not view.any_idle():
                return
            yield self._take(seq, turn, now)
        gate = self._gate
        while gate:  # new workflows, oldest first, while their KV fits
            seq, turn = gate[0]
            if not self._valid(seq, turn):
                gate.popleft()
                continue
            w = self._work[seq]
            started = turn.workflow.id in self._active  # a DAG's second root
            # the idle override starts a new workflow only where a slot is free: on a
            # slot-limited engine (llama.cpp) whose slots all hold paused sessions, the
            # newcomer would evict one, whose next turn re-prefills its whole context and, with
            # its own slot gone, takes another paused session's (a cascade of misses)
            if not started and not self.idle_with_free_slot(view, now) and (
                self.released_work + w > budget or turn.prompt_tokens > self.kv_room(view)
            ):
                return
            gate.popleft()
            yield self._take(seq, turn, now)

    def on_finished(self, turn: TurnRecord, now: float) -> None:
        w = self._charged.pop(turn, 0.0)
        self.released_work = max(0.0, self.released_work - w)
        self.outputs.observe(turn)
        self._count_miss(turn)
        self._paused_at[turn.workflow.id] = now
        if turn.started_s >= 0:
            self._waits.append(turn.started_s - turn.released_s)
        if self.budget_mode == "adaptive" or self.gate_mode == "adaptive":
            self._finished_since_adapt += 1
            if self._finished_since_adapt >= self.adapt_every and len(self._waits) >= 8:
                self._finished_since_adapt = 0
                self._adapt()

    def _expiry_due(self, now: float) -> float:
        """When the first entry of the (valid-topped) expiry heap is due."""
        return self._expiry[0][0]

    def _count_miss(self, turn: TurnRecord) -> None:
        """Count the finished turn's context tokens and those the prefix cache missed."""
        ctx = turn.turn.context_tokens
        if ctx > 0 and turn.cached_tokens >= 0:
            self._miss[0] += max(0, ctx - turn.cached_tokens)
            self._miss[1] += ctx

    def hold_bound_s(self, now: float) -> float:
        """The longest a ready turn is held: the new-workflow gate's limit."""
        return max(self.hold_limit_s, self.gate_hold_limit_s)

    def on_workflow_done(self, workflow: WorkflowRecord, now: float) -> None:
        self.flow_q.add(now - workflow.arrival_s)
        self.outputs.forget(workflow.id)
        self._active.discard(workflow.id)
        self._paused_at.pop(workflow.id, None)

    def _adapt(self) -> None:
        waits = np.fromiter(self._waits, float)
        mean, p95 = float(waits.mean()), float(np.quantile(waits, 0.95))
        if self.budget_mode != "adaptive":
            pass
        elif mean > self.target_wait_s or p95 > self.target_p95_wait_s:
            self.budget_per_engine = max(self.min_budget_per_engine, self.budget_per_engine * 0.8)
        elif self._n:
            self.budget_per_engine = min(self.max_budget_per_engine,
                                         self.budget_per_engine * 1.1)
        missed, expected = self._miss
        if expected > 0 and self.gate_mode == "adaptive":
            self._miss = [0.0, 0.0]
            if missed > self.target_context_miss * expected:
                self.kv_fill = max(self.min_kv_fill, self.kv_fill * 0.9)
            elif self._gate:
                self.kv_fill = min(self.max_kv_fill, self.kv_fill * 1.05)

    def next_wakeup(self, now: float) -> float | None:
        if not self._n:
            return None
        while self._expiry and not self._valid(self._expiry[0][1], self._expiry[0][2]):
            heapq.heappop(self._expiry)
        times = []
        if self._expiry:
            times.append(self._expiry_due(now))
        while self._by_age and not self._valid(self._by_age[0][1], self._by_age[0][2]):
            heapq.heappop(self._by_age)
        if self._by_age and self.flow_q.q != float("inf"):
            times.append(self._by_age[0][0] + self.flow_q.q)
        if self._gate and self._view is not None:
            # a new workflow waits for a slot: wake when a paused session on an idle, full
            # engine will have been paused long enough to be taken as done
            done = self.done_pause_s()
            if done != math.inf:
                for e in self._view.values():
                    # the engines idle_with_free_slot would look at, slot-limited and full
                    if not e.idle or not e.kv_slots or e.has_free_slot:
                        continue
                    for sid in e.cached_sessions:
                        t = self._paused_at.get(sid, math.inf) + done
                        if t > now:
                            times.append(t)
        return min(times) if times else None

    def __len__(self) -> int:
        return self._n
