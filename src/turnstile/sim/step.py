"""The engine model's step executor: one iteration (:meth:`StepExecutor.step`), the exact
fast-forward over event-free decode iterations (:meth:`StepExecutor.leap`; both in one call,
:meth:`StepExecutor.step_and_leap`), and the continuation of a leap that an unrelated event cut
short (:meth:`StepExecutor.resume`).

A step is schedule → time → apply: the batch scheduler picks the decodes and
prefill chunks, the :class:`~turnstile.sim.perf.PerfModel` prices them from O(1) running sums,
and the effects (first tokens, finishes) land at the end of the step.
"""

from __future__ import annotations

import heapq

from turnstile.sim.batch_scheduler import BatchScheduler
from turnstile.sim.block_pool import BlockPool
from turnstile.sim.leap_loop import EPS, NO_PLAN, LeapLoops, LeapPlan, LeapResult
from turnstile.sim.leap_sums import LeapSums, first_at_or_after
from turnstile.sim.perf import PerfModel
from turnstile.sim.request import SimRequest, StepOutcome
from turnstile.sim.slot_pool import SlotPool

_NEVER = float("inf")
#: the started and first-token lists of a decode run, which starts nothing and emits no first
#: token (an empty tuple: read only, like every outcome's lists outside the engine)
_NONE: tuple = ()


class StepExecutor(LeapLoops):
    """Runs iterations of one engine over its batch scheduler and block pool."""

    engine_id: str
    perf: PerfModel
    pool: BlockPool | SlotPool
    sched: BatchScheduler
    #: seconds to copy one block back from the CPU tier
    reload_s_per_block: float

    def _init_executor(self) -> None:
        """Counters and the resumable leap (called by the engine's constructor)."""
        #: the outcome whose leap stopped only at ``until``, while nothing has reached the
        #: engine since (see :meth:`resume`)
        self._cut_out: StepOutcome | None = None
        self._cut_plan: LeapPlan = NO_PLAN
        #: lazily committed leaps (set by the cluster driver): a leap is planned to its own
        #: natural end, and recorded only when that end is reached (:meth:`fire`) or when
        #: something reaches the engine earlier (:meth:`materialise`). Other engines' events
        #: then do not cut it (each cut costs the driver an event). Not with an offload tier:
        #: there the leap's loop evicts as it goes, so it cannot run ahead without recording.
        self.lazy = False
        #: the outcome whose planned leap is not recorded yet, its plan, result and end
        self.lazy_out: StepOutcome | None = None
        self._lazy_plan: LeapPlan = NO_PLAN
        self._lazy_c: LeapResult = (0, 0, 0, 0, 0.0, 0.0, 0.0, 0)
        #: the planned leap's step and end times when numpy summed them (materialise then
        #: finds the cut in them instead of running the loop again), and the last run's
        self._lazy_sums: LeapSums | None = None
        self._sums: LeapSums | None = None
        self.lazy_end = 0.0
        self._lazy_until = _NEVER
        #: what a step costs more with the engine's caches cold (``FittedPerf.cold_step_s``; 0
        #: for models without the term), the rule that says which steps are cold (the perf
        #: model's ``warm``, from the engine's profile: a pause longer than ``_warm_gap_s``, or
        #: fewer than ``_warm_after`` small iterations in a row, small being under
        #: ``_warm_max_prefill`` prompt tokens), and what decides it: the engine's last outcome
        #: (its ``end_s`` and ``iterations`` as leaps extended them), whether its first
        #: iteration computed a large prompt chunk, and the small iterations in a row before it
        self._cold_s = float(getattr(self.perf, "cold_step_s", 0.0))
        warm = getattr(self.perf, "warm", None)
        if self._cold_s and warm is None:
            raise ValueError(f"engine {self.engine_id}: a cold-step cost without a warm rule")
        self._warm_gap_s = warm.gap_s if warm is not None else 0.0
        self._warm_after = warm.steps if warm is not None else 0
        self._warm_max_prefill = warm.max_prefill if warm is not None else 0
        self._prev_out: StepOutcome | None = None
        self._prev_big = False
        self._warm_steps = 0
        self.decode_tokens = 0
        self.iterations = 0
        self.busy_s = 0.0
        self.idle_wait_s = 0.0
        #: the factor on the next iteration's time: other engines on the same host computing
        #: meanwhile (set by the cluster driver, which knows them; 1.0 alone)
        self.slowdown = 1.0

    def step(self, now: float) -> StepOutcome | None:
        """Run one iteration starting at ``now``; ``None`` when there is nothing to do."""
        pool = self.pool
        s = self.sched
        self._cut_out = None
        if pool.pin_heap and pool.pin_heap[0][0] <= now + EPS:
            pool.expire_pins(now + EPS)
        if not s.running and not s.waiting:
            return None
        it = s.it
        n_dec = s.n_dec
        # 1. decodes: one token each; some cross into a new block
        if n_dec:
            need = s.phase[it % s.bs]
            if need:
                if need > pool.free:
                    if need > pool.free + pool.n_evict:
                        need = s.preempt_for_decode(it)
                        n_dec = s.n_dec
                    pool.take(need)
                else:
                    pool.free -= need
                pool.private += need
        # 2. prefills (continued, then admitted), retrying after a preemption if all stalled
        started: list[SimRequest] = []
        done_prefill: list[SimRequest] = []
        if s.prefilling or s.waiting:
            while True:
                pre = s.schedule_prefills(n_dec, started, done_prefill, now)
                if n_dec or pre[0] or not s.running:
                    break
                # every running request is a prefill stalled on memory: free the least important
                s.preempt(s.victim(), it)
            prefill_tokens, attn2, ctx_read, reload_blocks = pre
        else:  # pure decode (running and not prefilling, so n_dec > 0): nothing to schedule
            prefill_tokens, attn2, ctx_read, reload_blocks = 0, 0.0, 0, 0
        if not n_dec and not prefill_tokens:
            return self._idle(now)
        # 3. duration
        lanes = s.lanes
        if lanes is None:
            dur = self.perf.step_time(prefill_tokens, n_dec, s.kv_sum + n_dec + ctx_read, attn2)
        else:
            dur = self.perf.step_time(prefill_tokens, n_dec, s.kv_sum + n_dec + ctx_read, attn2,
                                      lanes.step_passes(), lanes.step_prompts())
        if reload_blocks:
            dur += reload_blocks * self.reload_s_per_block
        if self._cold_s:  # after an idle spell or a large chunk the caches are cold
            self._warm_steps = self._warm_run(now)
            self._prev_big = prefill_tokens >= self._warm_max_prefill
            if self._warm_steps < self._warm_after:
                dur += self._cold_s
        if self.slowdown != 1.0:
            dur *= self.slowdown
        end = now + dur
        # 4. effects at the end of the step
        finished: list[SimRequest] = []
        if n_dec:
            s.kv_sum += n_dec
            self.decode_tokens += n_dec
            bucket = s.fin.pop(it, None)
            if bucket:
                heap = s.fin_heap
                while heap and heap[0] <= it:
                    heapq.heappop(heap)
                s.finish_decoders(bucket, it + 1, end, finished)
        first_token: list[SimRequest] = []
        if done_prefill:
            s.start_decoding(done_prefill, it, end, first_token, finished)
        s.it = it + 1
        self.iterations += 1
        self.busy_s += dur
        out = StepOutcome(dur, started, first_token, finished, end_s=end)
        self._prev_out = out
        return out

    def decodes_only(self, now: float) -> bool:
        """Whether the iteration at ``now`` is a pure decode iteration with nothing to admit
        (decoders running, no prefill or only stalled ones, an empty queue, no pin expiring):
        what :meth:`step_and_leap` runs inside the leap."""
        s = self.sched
        pin_heap = self.pool.pin_heap
        return bool(s.n_dec and not s.waiting
                    and (not s.prefilling or self._prefills_stalled())
                    and not (pin_heap and pin_heap[0][0] <= now + EPS))

    def step_and_leap(self, now: float, until: float, decodes_only: bool,
                      horizon: float = _NEVER) -> StepOutcome | None:
        """:meth:`step` at ``now`` followed by :meth:`leap` to ``until``, with the same results
        (engine state, iterations, ``end_s``). ``decodes_only`` is :meth:`decodes_only` at
        ``now`` (the caller asked already); then the first iteration is the leap's first,
        without the step's bookkeeping, and ``duration_s`` is summed from the first iteration on
        instead of first + the rest (the driver reads ``end_s``, summed as stepping would)."""
        if decodes_only and now < until and not self._cooling(now):
            out = StepOutcome(0.0, _NONE, _NONE, [], end_s=now, iterations=0)
            self._cut_out = None
            if self._cold_s:
                self._warm_steps, self._prev_big = self._warm_run(now), False
            self._prev_out = out
            plan = self._plan(self.sched.n_dec, False)
            if self._run_or_defer(out, plan, until, horizon):
                return out
            # the first iteration needs a preemption: left to step()
        stepped = self.step(now)
        if stepped is not None:
            self.leap(stepped, until, horizon)
        return stepped

    def leap(self, out: StepOutcome, until: float, horizon: float = _NEVER) -> None:
        """Extend ``out`` (what :meth:`step` just returned) with the following iterations that
        would start strictly before ``until`` and that nothing observable happens in: pure
        decode, no admission possible, no pin expiring, no preemption. It stops after the
        iteration in which a request finishes (``out.finished``), before an iteration that is
        not such a decode iteration, and once the next one would start at or after ``until``.

        The result is exactly what stepping would give: the same iterations in the same order
        with the same state changes and the same float sums (each end is the previous end plus
        that iteration's ``step_time``), so ``out.end_s`` is the time the driver's next ``step``
        would have been due after the last of them. The driver must pass as ``until`` the time
        of the next event that could reach this engine (a submit, a retention, or any event of
        its loop), so that no such event falls inside the leap."""
        s = self.sched
        n_dec = s.n_dec
        self._cut_out = None
        if out.finished or out.first_token or not out.busy or self._cooling(out.end_s):
            return
        pool = self.pool
        if s.prefilling and not (n_dec and self._prefills_stalled()):
            # a chunked prefill that takes every iteration's whole budget: only with the block
            # pool and no offload tier (a tier evicts as it goes; a slot pool counts per slot)
            if type(pool) is BlockPool and not pool.cpu_cap:
                prefill = self._prefill_plan()
                if prefill is not None:
                    self._run_or_defer(out, prefill, until, horizon)
            return
        if not n_dec:
            return
        waiting = s.waiting
        blocked = False
        if waiting:
            # admission is impossible for the whole leap: the batch is full, the budget is
            # spent, or the head request's memo says it does not fit (memory only shrinks here)
            if len(s.running) >= s.max_seqs or s.max_tokens - n_dec <= 0:
                pass
            elif (
                s.head() is s.blk_req
                and s.max_tokens - n_dec >= s.blk_budget
                and pool.ver == s.blk_ver
            ):
                blocked = True
            else:
                return
        self._run_or_defer(out, self._plan(n_dec, blocked), until, horizon)

    def _prefills_stalled(self) -> bool:
        """Whether every prefilling request is stalled on memory, and stays so over a decode
        leap: nothing is free or evictable and each has filled its last block (a chunk would
        need a new block). Their iterations are then pure decode iterations (no prefill
        tokens, no prefix read), which memory can only keep so."""
        pool = self.pool
        if pool.free or pool.n_evict:
            return False
        bs = self.sched.bs
        return all(req.num_computed % bs == 0 for req in self.sched.prefilling)

    def _run_or_defer(self, out: StepOutcome, plan: LeapPlan, until: float,
                      horizon: float) -> bool:
        """Run the leap to ``until`` (recorded now) or, lazily, plan it to its natural end or
        ``horizon`` (recorded later; a leap cut by ``horizon`` resumes as one cut by
        ``until``); whether it has any iteration. The driver's horizon is its next arrival,
        which reaches some engine anyway: planning past it is mostly work thrown away."""
        # a prefill leap is never planned ahead: its chunks move the session's mark, which the
        # engines share (a DAG's parallel turns of one session on two engines read it), so it
        # is recorded at once, up to ``until``, before any other engine can look
        if self.lazy and not self.pool.cpu_cap and plan[6] is None:
            c = self._run(out, plan, horizon)
            if c is None:
                return False
            self.lazy_out = out
            self._lazy_plan = plan
            self._lazy_c = c
            self._lazy_sums = self._sums
            self._lazy_until = horizon
            self.lazy_end = c[4]
            return True
        c = self._run(out, plan, until)
        if c is None:
            return False
        self._commit(out, c, self._sums, plan[6])
        return True

    def fire(self, out: StepOutcome) -> int:
        """Record ``out``'s planned leap in full (its end is due and nothing reached the
        engine before); returns its iterations."""
        self.lazy_out = None
        self._commit(out, self._lazy_c, self._lazy_sums, self._lazy_plan[6])
        return self._lazy_c[0]

    def materialise(self, t: float) -> int:
        """Something reaches the engine at ``t``, inside its planned leap: record only the
        iterations starting before ``t`` (the same loop from the same start, so the same float
        sums), as a leap cut at ``t`` would have. The leap then ends at ``out.end_s`` and the
        engine steps from there (nothing resumes it). Returns the iterations recorded."""
        out = self.lazy_out
        if out is None:
            return 0
        self.lazy_out = None
        # every planned iteration starts before the horizon: if t is past it, all of them
        # start before t (and none after them does: the planned end is not before t)
        if t >= self._lazy_until:
            c: LeapResult | None = self._lazy_c
        elif self._lazy_sums is not None:
            # the loop run again to t would stop at the first planned iteration starting at or
            # after t (there is one, or the plan ended naturally: the planned end is >= t)
            sums = self._lazy_sums
            plan = self._lazy_plan
            s = self.sched
            k = first_at_or_after(sums[0], self._lazy_c[0], t)
            c = self._sums_result(sums, k, plan[0], s.kv_sum + plan[0], plan[4])
        else:
            c = self._run(out, self._lazy_plan, t)  # a short leap: the loop is cheaper
        self._cut_out = None
        if c is None:
            return 0
        self._commit(out, c, self._lazy_sums, self._lazy_plan[6])
        return c[0]

    def _commit(self, out: StepOutcome, c: LeapResult, sums: LeapSums | None,
                prefill: SimRequest | None) -> None:
        """Record ``k`` leaped iterations: ``taken`` new blocks, ``kv`` the KV tokens the
        next iteration's decodes read, ``end`` and ``busy_s`` the sums after the last one, and
        the finish of the decoders whose last iteration was ``stop - 1`` if it was reached
        (``taken`` -1: a leap summed by numpy, whose blocks and sums come from ``sums``), and
        ``k`` budgets of ``prefill``'s prompt computed (accounted as one chunk: the same
        counts and session mark as chunk by chunk)."""
        k, taken, n_dec, kv, end, busy_s, total, stop = c
        if taken < 0:
            taken, busy_s, total = self.commit_sums(sums, k)
        s = self.sched
        if prefill is not None:
            s.computed(prefill, prefill.num_computed, (s.max_tokens - n_dec) * k)
        if taken:
            pool = self.pool
            pool.take(taken)
            pool.private += taken
        it = s.it + k
        s.it = it
        s.kv_sum = kv - n_dec
        self.busy_s = busy_s
        self.iterations += k
        self.decode_tokens += n_dec * k
        out.iterations += k
        out.duration_s += total
        out.end_s = end
        if it == stop:
            bucket = s.fin.pop(stop - 1)
            s.finish_decoders(bucket, it, end, out.finished)

    def resume(self, out: StepOutcome, now: float, until: float,
               horizon: float = _NEVER) -> bool:
        """The driver's next step, due at ``now = out.end_s``, when ``out``'s leap stopped only
        because of ``until`` and nothing reached the engine since (no submit, no retention, no
        step): continue the same decode run in ``out`` (reset to start at ``now``) as
        :meth:`leap` would after a :meth:`step` at ``now``, with the same results, but without
        the step's bookkeeping. Returns False, with no change to the engine, when that does not
        hold or the iteration at ``now`` is not such a decode iteration; the driver then calls
        ``step``."""
        if self._cut_out is not out or out.end_s != now:
            return False
        self._cut_out = None
        out.duration_s = 0.0
        out.iterations = 0
        if out.started:
            out.started = []
        return self._run_or_defer(out, self._cut_plan, until, horizon)

    def _cooling(self, now: float) -> bool:
        """Whether an iteration at ``now`` runs cold: then it is stepped, not leapt over (a
        leap prices every iteration alike)."""
        return bool(self._cold_s) and self._warm_run(now) < self._warm_after

    def _warm_run(self, now: float) -> int:
        """Small iterations (under the warm rule's ``max_prefill`` prompt tokens) the engine ran
        in a row right before ``now``, none after a pause of more than its ``gap_s``: the last
        outcome's first iteration, unless it was large, and its leap's decodes, after the run
        before."""
        prev = self._prev_out
        if prev is None or now - prev.end_s > self._warm_gap_s:
            return 0
        return (0 if self._prev_big else self._warm_steps + 1) + prev.iterations - 1

    def _idle(self, now: float) -> StepOutcome:
        """Requests wait, nothing can run: KV is held by pinned sessions. Wait for a pin."""
        t = self.pool.next_pin_expiry
        if t is None:
            raise RuntimeError(
                f"engine {self.engine_id}: {len(self.sched.waiting)} requests wait, none can be "
                f"admitted and nothing holds memory (free={self.pool.free}): a bug"
            )
        dur = max(t - now, 0.0)
        self.idle_wait_s += dur
        return StepOutcome(dur, busy=False, end_s=now + dur)
