"""``auto``: the default release policy — ``cvar``'s KV gate and order, holding a ready turn
only where the regime justifies it (``docs/policies.md``).

``cvar`` (WSPT order with tail weights, a released-work budget, a KV gate for new workflows)
wins where engines contend for KV and loses where they do not: on workloads it was never tuned
on it held ready turns for minutes while engines had room (its budget counts decode tokens 8x,
so a few long outputs fill it), its gate shrank on prefix misses no gate can prevent, and its
hold limits (600 s; 3,600 s at the gate) were fixed numbers unrelated to the workload. ``auto``:

1. **Started workflows are not held.** A turn of a workflow that has run before goes at once
   (in WSPT order when several are ready): its context is already in an engine's KV, and
   holding it only lets that KV age out (``hold_started=True`` holds it while every engine
   would queue it; measured worse). No budget.
2. **New workflows pass the KV gate** (cvar's rule 5): admitted, oldest first, while some
   engine's KV demand — released work plus the contexts of the sessions paused in tool calls —
   leaves room for the prompt within ``kv_fill`` x its capacity, and, at full capacity, for the
   prompt and expected output without evicting a paused session (:meth:`evict_cost_s` 0); or when an
   engine is idle with a free slot. The KV a hold protects is named: the paused sessions'
   contexts plus the headroom ``(1 - kv_fill)`` x capacity their growth needs. A later new
   workflow that fits may pass one that does not (no stall behind one large prompt).
   On a paged engine, blocks paused sessions share (same ``block_hashes``) count once and a
   new prompt counts net of the blocks resident there (AIPerf's sessions share a 32k system
   prompt: summing whole contexts held new sessions at 2% contention). **The gate holds only
   on evidence** (``evidence_gate``): within a hold bound of the last time evictions cost the
   sessions more than ``evict_share`` (10%) of their context over the last ``evict_window``
   (64) counted turns (counted as in rule 3) — or while every engine would queue the turn
   anyway (it waits here instead of in an engine's queue, where a later new workflow that
   fits may pass it). On a slot-limited engine whose slots all hold sessions, a slot held by
   a session paused in a tool call can be taken (:meth:`reclaim_tokens`: that session
   re-prefills its context, the cost :meth:`evict_cost_s` weighs); taking one counts as an
   overflow, so the evictions it causes become evidence. A paused session may have ended
   unannounced (a gateway learns of an end only from the client or after ``session_idle_s``):
   on an idle engine a new workflow is held no longer than the re-prefill it saves.
   Where nothing is evicted and an engine would start the turn, nothing is
   protected and no wait saved: a hold only moves first turns into the TTFT tail (measured
   before this rule, 2026-12-07: TTFT P95 0.79–0.89x eager in 4 of 21 quick-suite cells at
   light load, with sessions' turns staying where their KV is; with it, none of the 156 full
   suite cells below 0.89x, simulated). 10%: the tune half's syn-tools-heavy keeps a 5% TTFT
   margin there, 5% left it at 0.93x; 15% gave away part of the AgentCgroup fit's gain.
3. **The gate shrinks only on evictions.** cvar adapts ``kv_fill`` on every context token the
   prefix cache missed. Many misses are not evictions — a session moved to another engine, a
   prompt whose blocks are named differently than the last turn's (measured: 19% of context
   tokens missed on one uncontended engine replaying mini-swe-agent sessions) — and no gate
   can prevent them. ``auto`` counts a miss only when the turn ran on the engine its session
   paused on and that engine's KV demand exceeded its capacity during the pause.
4. **Holds are bounded by the workload's own times**: :meth:`hold_bound_s` — ``hold_frac`` x
   the median flow time (net of holds) of recent workflows, the started unfinished ones counted
   at their age so far (a lower bound of their flow time: without them the median was that of
   the sessions short enough to have finished first) — a session paused in a tool call at its
   age when it paused, so that the bound does not grow with the wait it bounds —, at least
   ``turn_hold_factor`` x the median turn time (release -> finish), ``boot_hold_s`` before
   any turn finished. A turn held that long goes, whatever the gate says. (``hold_frac`` 8,
   chosen on the tune half: on one engine at 2x saturation 4 let new sessions in to thrash
   KV, 1.34x eager's P95 vs 2.23x.)
5. **A hold may not set the TTFT tail**: first turns held past the TTFT P95 of the turns
   released at once may be at most ``ttft_tail_share`` (2.5%, half the tail a P95 leaves out)
   of all turns; once that share is spent, the bound drops to that P95.

Unknown KV capacity (a gateway told no ``kv_tokens``): no gate; every turn goes unless the
engine reports a queue. Everything else (WSPT index, tail weights, output estimates, slot
awareness, sessions taken as done) is cvar's.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterator
from typing import ClassVar

import numpy as np

from turnstile.core.state import ClusterView, EngineLoad, TurnRecord, WorkflowRecord
from turnstile.policies.base import RELEASE
from turnstile.policies.cvar import CvarRelease
from turnstile.policies.estimators import QuantileTracker, RecentWindow

#: the least cost of taking a paused session's slot (when the engine's prefill time is not
#: known): not 0, which would pass the KV gate as "room without evicting anyone"
_RECLAIM_EPS_S = 1e-6


@RELEASE.register("auto")
class AutoRelease(CvarRelease):
    name = "auto"
    #: cvar's options that ``auto`` honours (the budget's are cvar's alone: auto has none)
    inherited_options: ClassVar[tuple[str, ...]] = (
        "alpha", "gamma", "kappa", "adapt_every", "kv_fill", "min_kv_fill", "max_kv_fill",
        "target_context_miss", "gate", "done_pause_q", "min_pause_samples",
    )

    def __init__(
        self,
        hold_frac: float = 8.0,
        boot_hold_s: float = 5.0,
        turn_hold_factor: float = 10.0,
        gate_scan: int = 16,
        hold_started: bool = False,
        evidence_gate: bool = True,
        evict_share: float = 0.1,
        evict_window: int = 64,
        net_flow: bool = True,
        dedup_shared: bool = True,
        ttft_tail_share: float = 0.025,
        censored_flow: bool = True,
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
        #: also hold a started workflow's turn while every engine would queue it, in WSPT
        #: order (off by default: measured, it let held sessions' KV age out of the cache —
        #: 87% of context tokens missed on a long-context family at 3x load)
        self.hold_started = hold_started
        #: the bound scales with flow times net of the workflows' own holds (no feedback)
        self.net_flow = net_flow
        self._held_s: dict[str, float] = {}  # per workflow: seconds its turns were held
        self._flow_p50 = QuantileTracker(0.5, window=256, every=4, min_samples=5)
        #: count started, unfinished workflows' ages (net of holds) as flow times too: they
        #: are lower bounds of theirs (censored), and without them the median is that of the
        #: workflows short enough to have finished (measured: on one engine at 2x saturation
        #: the bound came from the first few short sessions and let new ones in to thrash KV)
        self.censored_flow = censored_flow
        self._since: dict[str, float] = {}  # started workflow -> its arrival
        self._flow_cache = (-math.inf, math.inf)  # (when computed, median)
        self._turn_s = RecentWindow(256)  # release -> finish of recent turns
        self._turn_p50 = math.inf
        #: per engine, the last time its KV demand was seen above its capacity
        self._overflow_at: dict[str, float] = {}
        #: when a turn last lost more than ``target_context_miss`` of its context to an
        #: eviction (the gate holds only within a hold bound of that: evidence, not a guess)
        self._evicted_at = -math.inf
        self.evidence_gate = evidence_gate
        self.evict_share = evict_share
        #: (context tokens lost to evictions, context tokens) of the last counted turns
        self._evict_window: deque[tuple[int, int]] = deque(maxlen=evict_window)
        self._evict_sums = [0, 0]
        #: count KV blocks that paused sessions share (by ``block_hashes``) once per engine
        self.dedup_shared = dedup_shared
        #: at most this share of turns may be held past :meth:`ttft_hold_cap_s` (into the
        #: time-to-first-token tail of the turns nobody held): half of the 5% a P95 leaves out,
        #: so holds do not set the TTFT P95; once spent, holds end at the cap. Negative: off.
        self.ttft_tail_share = ttft_tail_share
        self._ttft_free = RecentWindow(512)  # ready -> first token of turns released at once
        self._ttft_cap = math.inf
        #: per recent first turn: held past the cap? (first turns are the ones the gate holds)
        self._ttft_tail: deque[bool] = deque(maxlen=128)
        self._tail_n = 0
        self._wf_turns = RecentWindow(256)  # turns per finished workflow
        #: per workflow: the hash blocks of its last finished turn's prompt, and tokens each
        self._blocks: dict[str, tuple[tuple[int, ...], float]] = {}
        #: per engine: (paused tokens, paused sessions) -> KV paused sessions share, in tokens
        self._shared: dict[str, tuple[int, int, float, dict[int, int]]] = {}
        #: when the first new workflow held at the gate has waited its eviction cost (it then
        #: goes if an engine is idle)
        self._gate_wake = math.inf

    # ------------------------------------------------------------ the bound
    def hold_bound_s(self, now: float) -> float:
        """The longest any ready turn is held (documented in ``docs/policies.md``):
        ``hold_frac`` × the median flow time of recent workflows, at least
        ``turn_hold_factor`` × the median turn time; ``boot_hold_s`` before any turn finished."""
        turn = self.turn_hold_factor * self._turn_p50
        flow = self.flow_p50_s(now)
        if math.isinf(turn):
            return self.boot_hold_s
        if math.isinf(flow):
            bound = max(turn, self.boot_hold_s)
        else:
            bound = max(self.hold_frac * flow, turn, self.boot_hold_s)
        if self._tail_spent():  # holds already fill their share of the TTFT tail
            bound = min(bound, self._ttft_cap)
        return bound

    def flow_p50_s(self, now: float) -> float:
        """The median flow time (net of holds) of recent workflows, counting those started and
        not finished at their age so far (``censored_flow``): ``inf`` before 5 were seen.
        Recomputed at most once a second."""
        q = self._flow_p50.q
        if not self.censored_flow or len(self._since) + len(self._flow_p50.values()) < 5:
            return q
        at, med = self._flow_cache
        if now - at < 1.0 and now >= at:
            return med
        held, paused_at = self._held_s, self._paused_at
        # a session paused in a tool call counts at its age when it paused: it may have
        # ended unannounced, and a hold must not lengthen the bound it is held under
        ages = [paused_at.get(w, now) - t - held.get(w, 0.0) for w, t in self._since.items()]
        med = float(np.median(np.concatenate((np.fromiter(ages, float),
                                              np.asarray(self._flow_p50.values(), float)))))
        self._flow_cache = (now, med)
        return med

    def ttft_hold_cap_s(self) -> float:
        """How long a hold may last before it puts the turn in the TTFT tail: the P95 time to
        first token (ready -> first token) of recent turns released at once (``inf`` until 64
        were seen)."""
        return self._ttft_cap

    def _tail_spent(self) -> bool:
        """Recent first turns held past the cap are ``ttft_tail_share`` of all turns: with
        ``n`` turns per workflow, a share ``ttft_tail_share`` x ``n`` of the first turns."""
        tail = self._ttft_tail
        if self.ttft_tail_share < 0 or len(tail) < 16 or len(self._wf_turns) < 5:
            return False
        return self._tail_n >= self.ttft_tail_share * self._wf_turns.mean * len(tail)

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
    def _shared_on(self, e: EngineLoad) -> tuple[float, dict[int, int]]:
        """KV tokens the sessions paused on ``e`` hold twice over in ``paused_context_tokens``
        (prefix blocks named by the same ``block_hashes``, which a paged engine stores once),
        and how many of them hold each hash block. Slot engines keep a copy per slot: 0."""
        if not self.dedup_shared or e.kv_slots or not self._blocks:
            return 0.0, {}
        key = (e.paused_context_tokens, len(e.cached_sessions))
        hit = self._shared.get(e.id)
        if hit is not None and hit[:2] == key:
            return hit[2], hit[3]
        seen: dict[int, int] = {}
        dup = 0.0
        for wid in e.cached_sessions:
            blocks = self._blocks.get(wid)
            if blocks is None:
                continue
            hashes, per = blocks
            n = 0
            for h in hashes:
                c = seen.get(h, 0)
                if c:
                    n += 1
                seen[h] = c + 1
            dup += n * per
        self._shared[e.id] = (*key, dup, seen)
        return dup, seen

    def paused_kv(self, e: EngineLoad) -> float:
        """The KV (tokens) the sessions paused on ``e`` occupy: their contexts, blocks they
        share counted once."""
        return e.paused_context_tokens - self._shared_on(e)[0]

    def _need_on(self, turn: TurnRecord, e: EngineLoad, need: float) -> float:
        """``need`` less the prompt's hash blocks already resident on ``e`` (paused sessions')."""
        hashes = turn.turn.block_hashes
        if not hashes or not self.dedup_shared or e.kv_slots:
            return need
        seen = self._shared_on(e)[1]
        if not seen:
            return need
        hit = sum(1 for h in hashes if h in seen)
        return need - hit * turn.prompt_tokens / len(hashes)

    def _fits_gate(self, turn: TurnRecord, view: ClusterView) -> bool:
        """Some engine's KV demand leaves room for ``turn``'s prompt (net of the hash blocks
        it shares with the sessions paused there) within ``kv_fill`` x its capacity."""
        if not self.kv_gate:
            return True
        for e in view.values():
            if not e.healthy:
                continue
            if e.capacity_tokens <= 0:
                return True  # unknown capacity: no gate
            room = self.kv_fill * e.capacity_tokens - e.outstanding_tokens - self.paused_kv(e)
            if self._need_on(turn, e, turn.prompt_tokens) <= room:
                return True
        return False

    def evict_cost_s(self, turn: TurnRecord, view: ClusterView) -> float:
        """What releasing ``turn`` now costs the sessions paused in tool calls, in seconds of
        re-prefill: over the engines that take work, have a free slot (or hold its session)
        and KV for it beside their released work, the least of (paused context it would push
        out of KV) × (the engine's prefill time per token). 0: some engine has room without
        evicting anyone; ``inf``: every engine would queue it. Unknown capacity: 0 unless the
        engine reports a queue."""
        wf = turn.workflow
        need = turn.prompt_tokens + self.outputs.expect(turn)
        best = math.inf
        for e in view.values():
            if not (e.healthy and e.accepting):
                continue
            own = wf.paused_engine == e.id
            reclaim = 0.0
            if not (own or e.has_free_slot):
                reclaim = self.reclaim_tokens(e)
                if reclaim < 0:
                    continue  # every slot runs a turn: it would queue here
            if e.capacity_tokens <= 0:
                if e.queue_len <= 0:
                    return reclaim * e.prefill_s_per_token + _RECLAIM_EPS_S if reclaim else 0.0
                continue
            free = e.capacity_tokens - e.outstanding_tokens  # what running work leaves
            if need > free:
                continue  # it would queue here
            if reclaim > 0:  # it takes a paused session's slot: that session re-prefills
                best = min(best, max(reclaim, need + self.paused_kv(e) - free)
                           * e.prefill_s_per_token + _RECLAIM_EPS_S)
                continue
            # paused KV beyond what the engine holds (shared blocks once; a new session's prompt
            # net of the blocks it shares with the paused ones)
            if own:
                evicted = need + self.paused_kv(e) - wf.paused_tokens - free
            else:
                evicted = self._need_on(turn, e, need) + self.paused_kv(e) - free
            if evicted <= 0:
                return 0.0
            best = min(best, evicted * e.prefill_s_per_token)
        return best

    @staticmethod
    def reclaim_tokens(e: EngineLoad) -> float:
        """On a slot-limited engine whose slots all hold sessions, the context (tokens) a new
        session evicts by taking the slot of a paused one (their mean); -1 when no slot can be
        taken (each runs a turn) or the engine is not slot-limited."""
        n = len(e.cached_sessions)
        if not e.kv_slots or not n or e.outstanding_turns >= e.kv_slots:
            return -1.0
        return e.paused_context_tokens / n

    def _watch_overflow(self, view: ClusterView, now: float) -> None:
        for e in view.values():
            cap = e.capacity_tokens
            if (cap > 0 and e.outstanding_tokens + self.paused_kv(e) > cap) or (
                    e.kv_slots and e.open_sessions > e.kv_slots):  # a paused session's slot taken
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
        missed = 0
        if self._overflow_at.get(turn.engine, -math.inf) >= prev.finished_s:
            missed = max(0, ctx - turn.cached_tokens)
            self._miss[0] += missed
        window, sums = self._evict_window, self._evict_sums
        if len(window) == window.maxlen:
            old_missed, old_ctx = window[0]
            sums[0] -= old_missed
            sums[1] -= old_ctx
        window.append((missed, ctx))
        sums[0] += missed
        sums[1] += ctx
        if sums[0] > self.evict_share * sums[1]:
            self._evicted_at = max(self._evicted_at, turn.finished_s)

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
        while True:  # turns of started workflows, by WSPT index
            best = self._best()
            if best is None:
                break
            _, seq, turn = best
            if self.hold_started and not view.any_idle() and math.isinf(
                    self.evict_cost_s(turn, view)):
                break  # every engine would queue it: it waits here, in WSPT order
            yield self._take(seq, turn, now)
        yield from self._admit_new(view, now)

    def _admit_new(self, view: ClusterView, now: float) -> Iterator[TurnRecord]:
        """New workflows, oldest first; one that fits may pass up to ``gate_scan`` that do
        not."""
        gate = self._gate
        skipped: list[tuple[int, TurnRecord]] = []
        wake = math.inf
        while gate and len(skipped) < self.gate_scan:
            seq, turn = gate.popleft()
            if not self._valid(seq, turn):
                continue
            started = turn.workflow.id in self._active  # a DAG's second root
            fits = started or self.idle_with_free_slot(view, now)
            if not fits:
                cost = self.evict_cost_s(turn, view)  # 0: room; inf: every engine queues it
                fits = ((self.evidence_gate and now - self._evicted_at > self.hold_bound_s(now)
                         and not math.isinf(cost))
                        or (cost == 0.0 and self._fits_gate(turn, view))
                        # on an idle engine a wait longer than the re-prefill it saves is lost
                        or (now - turn.ready_s >= cost and view.any_idle()))
            if fits:
                yield self._take(seq, turn, now)
            else:
                skipped.append((seq, turn))
                if not math.isinf(cost):
                    wake = min(wake, turn.ready_s + cost)
        self._gate_wake = wake
        gate.extendleft(reversed(skipped))

    def next_wakeup(self, now: float) -> float | None:
        t = super().next_wakeup(now)
        if self._gate and self._gate_wake > now and self._view is not None and (
                self._view.any_idle()):
            return self._gate_wake if t is None else min(t, self._gate_wake)
        return t

    def on_finished(self, turn: TurnRecord, now: float) -> None:
        hashes = turn.turn.block_hashes
        if hashes and self.dedup_shared:  # (a turn without them keeps its session's last:
            # the context grows by appending, the named prefix blocks stay in it)
            self._blocks[turn.workflow.id] = (hashes, turn.prompt_tokens / len(hashes))
        if turn.first_token_s >= 0 and turn.released_s >= 0 and self.ttft_tail_share >= 0:
            held = turn.released_s - turn.ready_s
            if held <= 0.0:
                free = self._ttft_free
                free.add(turn.first_token_s - turn.ready_s)
                if len(free) >= 64 and len(free) % 16 == 0:
                    self._ttft_cap = free.quantile(0.95)
            if turn.index == 0:
                tail = self._ttft_tail
                if len(tail) == tail.maxlen and tail[0]:
                    self._tail_n -= 1
                over = held > self._ttft_cap
                tail.append(over)
                self._tail_n += over
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
        self._since.setdefault(wid, turn.workflow.arrival_s)
        return super()._take(seq, turn, now)

    def on_workflow_done(self, workflow: WorkflowRecord, now: float) -> None:
        self._blocks.pop(workflow.id, None)
        self._since.pop(workflow.id, None)
        self._wf_turns.add(float(len(workflow.turns)))
        held = self._held_s.pop(workflow.id, 0.0) if self.net_flow else 0.0
        self._flow_p50.add(max(0.0, now - workflow.arrival_s - held))
        super().on_workflow_done(workflow, now)

    def _expiry_due(self, now: float) -> float:
        return self._expiry[0][0] + self.hold_bound_s(now)
