"""``auto``: the default release policy — ``cvar``'s order, holding only where the regime
justifies it.

``cvar`` (WSPT order with tail weights, a released-work budget, a KV gate for new workflows)
wins where engines contend for KV, and loses where they do not: measured on workloads it was
never tuned on, it held ready turns for minutes while engines had room, its gate shrank on
prefix misses that no gate can prevent, and its hold limits (600 s, 3,600 s for the gate) were
fixed numbers unrelated to the workload. ``auto`` keeps cvar's order and mechanisms and changes
*when a hold is allowed* (see ``docs/policies.md``):

1. **Room means release.** A ready turn is released whenever some engine has room for it: the
   engine takes new work, has a free slot (or holds the turn's own session), and its KV demand
   — released work plus the contexts of sessions paused there — leaves room for the turn's
   prompt and expected output without evicting a paused session (:meth:`AutoRelease.has_room`).
   Holding it could neither protect KV nor save a wait. Engines of unknown KV capacity have
   room unless they report a queue. Only when no engine has room do cvar's budget and gate
   decide, and then the hold names what it protects: the paused sessions' KV.
2. **The gate shrinks only on evictions.** cvar adapts its gate (``kv_fill``) on every context
   token the prefix cache missed. Many misses are not evictions — a session moved to another
   engine, a prompt whose blocks the engine names differently than the last turn's (measured:
   19% of context tokens missed on one uncontended engine replaying mini-swe-agent sessions) —
   and a gate cannot prevent them. ``auto`` counts a miss only when the turn ran on the engine
   its session paused on *and* that engine's KV demand exceeded its capacity during the pause
   (an eviction the gate could have prevented); with no such misses the gate opens up to full
   capacity.
3. **Holds are bounded by the workload's own times.** A turn held longer than
   :meth:`AutoRelease.hold_bound_s` — ``hold_frac`` × the median flow time of recent workflows,
   at least ``4 ×`` the median turn time (release → finish), ``boot_hold_s`` before any turn
   finished — is released whatever the budget and gate say. The same bound covers new
   workflows at the gate (cvar: 3,600 s).
4. **No starvation behind one large prompt.** The gate admits new workflows oldest first but
   lets a later one that fits pass one that does not (the one that does not is bounded by 3).

Everything else (WSPT index, tail weights, output estimates, budget adaptation on engine-queue
waits, slot awareness, sessions taken as done) is cvar's.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator

from turnstile.core.state import ClusterView, TurnRecord, WorkflowRecord
from turnstile.policies.base import RELEASE
from turnstile.policies.cvar import CvarRelease
from turnstile.policies.estimators import QuantileTracker, RecentWindow


@RELEASE.register("auto")
class AutoRelease(CvarRelease):
    name = "auto"

    def __init__(
        self,
        hold_frac: float = 2.0,
        boot_hold_s: float = 5.0,
        turn_hold_factor: float = 4.0,
        gate_scan: int = 16,
        use_budget: bool = False,
        started_protect: bool = False,
        net_flow: bool = True,
        **kw: float,
    ) -> None:
        kw.setdefault("kv_fill", 0.5)
        kw.setdefault("max_kv_fill", 0.8)
        super().__init__(**kw)  # type: ignore[arg-type]
        self.hold_frac = hold_frac
        self.boot_hold_s = boot_hold_s
        self.turn_hold_factor = turn_hold_factor
        #: how many new workflows that do not fit the gate may be passed over by one that does
        self.gate_scan = gate_scan
        #: also release under cvar's released-work budget when no engine has room
        self.use_budget = use_budget
        #: hold a started workflow's turn to protect other sessions' paused KV (else only
        #: while it would queue at the engine)
        self.started_protect = started_protect
        #: the bound scales with flow times net of the workflows' own holds (no feedback)
        self.net_flow = net_flow
        self._held_s: dict[str, float] = {}  # per workflow: seconds its turns were held
        self._flow_p50 = QuantileTracker(0.5, window=256, every=4, min_samples=5)
        self._turn_s = RecentWindow(256)  # release -> finish of recent turns
        self._turn_p50 = math.inf
        #: per engine, the last time its KV demand was seen above its capacity
        self._overflow_at: dict[str, float] = {}

    # ------------------------------------------------------------ the bound
    def hold_bound_s(self, now: float) -> float:
        """The longest any ready turn is held (documented in ``docs/policies.md``):
        ``hold_frac`` × the median flow time of recent workflows, at least
        ``turn_hold_factor`` × the median turn time; ``boot_hold_s`` before any turn finished."""
        turn = self.turn_hold_factor * self._turn_p50
        flow = self._flow_p50.q
        if math.isinf(turn):
            return self.boot_hold_s
        if math.isinf(flow):
            return max(turn, self.boot_hold_s)
        return max(self.hold_frac * flow, turn, self.boot_hold_s)

    def _push_expiry(self, now: float, seq: int, turn: TurnRecord, limit_s: float) -> None:
        # keyed by the ready time: the bound is evaluated when read (it moves with the workload)
        heapq.heappush(self._expiry, (turn.ready_s, seq, turn))

    def oldest_hold_s(self, now: float) -> float:
        """Age of the oldest turn this policy holds (0 when none)."""
        expiry = self._expiry
        while expiry and not self._valid(expiry[0][1], expiry[0][2]):
            heapq.heappop(expiry)
        return max(0.0, now - expiry[0][0]) if expiry else 0.0

    # ------------------------------------------------------------ room
    def has_room(self, turn: TurnRecord, view: ClusterView, protect: bool = True) -> bool:
        """Some engine would start ``turn`` now: it takes work, has a free slot (or holds the
        turn's session), and its released work leaves room in its KV for the prompt and
        expected output — with ``protect``, beside the contexts of the sessions paused there
        too (it would evict none of them). Unknown capacity: room unless it reports a queue."""
        wf = turn.workflow
        need = turn.prompt_tokens + self.outputs.expect(turn)
        for e in view.values():
            if not (e.healthy and e.accepting):
                continue
            own = wf.paused_engine == e.id
            if not (own or e.has_free_slot):
                continue
            if e.capacity_tokens <= 0:
                if e.queue_len <= 0:
                    return True
                continue
            free = e.capacity_tokens - e.outstanding_tokens
            if protect:
                free -= e.paused_context_tokens
            elif own:
                free += wf.paused_tokens  # its own context is not counted twice below
            if need - (wf.paused_tokens if own else 0) <= free:
                return True
        return False

    def _watch_overflow(self, view: ClusterView, now: float) -> None:
        for e in view.values():
            cap = e.capacity_tokens
            if cap > 0 and e.outstanding_tokens + e.paused_context_tokens > cap:
                self._overflow_at[e.id] = now

    def _count_miss(self, turn: TurnRecord) -> None:
        """Count context misses a gate could have prevented: the turn ran where its session
        paused, and that engine's KV demand overflowed during the pause."""
        ctx = turn.turn.context_tokens
        if ctx <= 0 or turn.cached_tokens < 0 or turn.index == 0:
            return
        turns = turn.workflow.turns
        prev = turns[turn.index - 1] if turn.index - 1 < len(turns) else None
        if prev is None or prev.engine != turn.engine or turn.engine is None:
            return  # moved (a routing matter) or unknown: not an eviction the gate governs
        self._miss[1] += ctx
        if self._overflow_at.get(turn.engine, -math.inf) >= prev.finished_s:
            self._miss[0] += max(0, ctx - turn.cached_tokens)

    # ------------------------------------------------------------- protocol
    def select(self, view: ClusterView, now: float) -> Iterator[TurnRecord]:
        self._view = view
        if not self._n:
            return
        self._watch_overflow(view, now)
        self._promote(now)
        bound = self.hold_bound_s(now)
        expiry = self._expiry
        while expiry and (not self._valid(expiry[0][1], expiry[0][2])
                          or expiry[0][0] + bound <= now):
            _, seq, turn = heapq.heappop(expiry)
            if self._valid(seq, turn):
                yield self._take(seq, turn, now)  # held as long as the bound allows
        budget = self.budget(view) - view.peer_released_tokens
        while True:  # turns of started workflows, by WSPT index
            best = self._best()
            if best is None:
                break
            w, seq, turn = best
            if not (self.use_budget and self.released_work + w <= budget) and not (
                    view.any_idle() or self.has_room(turn, view, self.started_protect)):
                break
            yield self._take(seq, turn, now)
        yield from self._admit_new(view, now, budget)

    def _admit_new(self, view: ClusterView, now: float, budget: float) -> Iterator[TurnRecord]:
        """New workflows, oldest first; one that fits may pass up to ``gate_scan`` that do
        not."""
        gate = self._gate
        skipped: list[tuple[int, TurnRecord]] = []
        while gate and len(skipped) < self.gate_scan:
            seq, turn = gate.popleft()
            if not self._valid(seq, turn):
                continue
            w = self._work[seq]
            started = turn.workflow.id in self._active  # a DAG's second root
            fits = (started or self.idle_with_free_slot(view, now)
                    or (turn.prompt_tokens <= self.kv_room(view)
                        and ((self.use_budget and self.released_work + w <= budget)
                             or self.has_room(turn, view))))
            if fits:
                yield self._take(seq, turn, now)
            else:
                skipped.append((seq, turn))
        gate.extendleft(reversed(skipped))

    def on_finished(self, turn: TurnRecord, now: float) -> None:
        if turn.released_s >= 0:
            self._turn_s.add(now - turn.released_s)
            if len(self._turn_s) >= 5 and len(self._turn_s) % 4 == 0:
                self._turn_p50 = self._turn_s.quantile(0.5)
        if self._view is not None:
            self._watch_overflow(self._view, now)
        super().on_finished(turn, now)

    def _take(self, seq: int, turn: TurnRecord, now: float) -> TurnRecord:
        wid = turn.workflow.id
        self._held_s[wid] = self._held_s.get(wid, 0.0) + max(0.0, now - turn.ready_s)
        return super()._take(seq, turn, now)

    def on_workflow_done(self, workflow: WorkflowRecord, now: float) -> None:
        held = self._held_s.pop(workflow.id, 0.0) if self.net_flow else 0.0
        self._flow_p50.add(max(0.0, now - workflow.arrival_s - held))
        super().on_workflow_done(workflow, now)

    def _expiry_due(self, now: float) -> float:
        return self._expiry[0][0] + self.hold_bound_s(now)
