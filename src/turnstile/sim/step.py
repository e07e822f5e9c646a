"""The engine model's step executor: one iteration (:meth:`StepExecutor.step`) and the exact
fast-forward over event-free decode iterations (:meth:`StepExecutor.leap`).

A step is schedule → time → apply, as nano-vllm's: the batch scheduler picks the decodes and
prefill chunks, the :class:`~turnstile.sim.perf.PerfModel` prices them from O(1) running sums,
and the effects (first tokens, finishes) land at the end of the step.
"""

from __future__ import annotations

import heapq

from turnstile.sim.batch_scheduler import BatchScheduler
from turnstile.sim.block_pool import BlockPool
from turnstile.sim.perf import PerfModel, RooflinePerf
from turnstile.sim.request import SimRequest, StepOutcome

#: pins expiring within this of ``now`` expire now (so ``now + (t - now)`` rounding is harmless)
EPS = 1e-9


class StepExecutor:
    """Runs iterations of one engine over its batch scheduler and block pool."""

    engine_id: str
    perf: PerfModel
    pool: BlockPool
    sched: BatchScheduler
    #: seconds to copy one block back from the CPU tier
    reload_s_per_block: float

    def _init_counters(self) -> None:
        self.decode_tokens = 0
        self.iterations = 0
        self.busy_s = 0.0
        self.idle_wait_s = 0.0

    def step(self, now: float) -> StepOutcome | None:
        """Run one iteration starting at ``now``; ``None`` when there is nothing to do."""
        pool = self.pool
        s = self.sched
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
        dur = self.perf.step_time(prefill_tokens, n_dec, s.kv_sum + n_dec + ctx_read, attn2)
        if reload_blocks:
            dur += reload_blocks * self.reload_s_per_block
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
        return StepOutcome(dur, started, first_token, finished, end_s=end)

    def leap(self, out: StepOutcome, until: float) -> None:
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
        end = out.end_s
        s = self.sched
        n_dec = s.n_dec
        if (
            end >= until
            or not n_dec
            or out.finished
            or out.first_token
            or not out.busy
            or s.prefilling
        ):
            return
        pool = self.pool
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
        pin_heap = pool.pin_heap
        pin_t = pin_heap[0][0] if pin_heap else float("inf")  # no pin changes in a leap
        blk_avail = s.blk_avail
        perf = self.perf
        step_time = perf.step_time
        roof = type(perf) is RooflinePerf
        if roof:
            c_tok = perf._flop_s * n_dec
            attn_s = perf._attn_s
            weights_s = perf._weights_s
            kv_s = perf._kv_s
            overhead_s = perf._overhead_s
            ar_tok = perf._ar_tok_s * n_dec
        phase = s.phase
        bs = s.bs
        it0 = s.it
        kv = s.kv_sum + n_dec  # KV tokens the next iteration's decodes read
        busy_s = self.busy_s
        # the decodes' new blocks are allocated in one go after the loop: nothing reads the pool
        # in between, eviction keeps ``free + n_evict``, and one eviction of the sum evicts the
        # same units in the same order as one per iteration would. Not so with an offload tier
        # that overflows: a unit evicted again moves to the tier's recent end, which changes what
        # the tier drops, so with a tier each eviction happens in its own iteration.
        free = pool.free
        avail = free + pool.n_evict
        taken = 0
        tier = pool.cpu_cap > 0
        check_pin = pin_t != float("inf")
        total = 0.0
        stop = s.next_finish() + 1  # no further than the next finish
        it = it0
        for it in range(it0, stop):
            if end >= until or (check_pin and pin_t <= end + EPS):
                break
            need = phase[it % bs]
            if need:
                if need > avail:
                    break  # preemption: left to step()
                if blocked and avail - need > blk_avail:
                    break  # step() would try the admission again
                avail -= need
                taken += need
                if tier and taken > free:
                    pool.take(taken)
                    pool.private += taken
                    taken = 0
                    free = pool.free
            elif blocked and avail > blk_avail:
                break
            if roof:  # RooflinePerf.step_time(0, n_dec, kv, 0.0), the same float operations
                compute = c_tok + attn_s * kv
                memory = weights_s + kv_s * kv
                dur = (compute if compute > memory else memory) + overhead_s + ar_tok
            else:
                dur = step_time(0, n_dec, kv, 0.0)
            end += dur
            busy_s += dur
            total += dur
            kv += n_dec
        else:
            it = stop
        k = it - it0
        if not k:
            return
        if taken:
            pool.take(taken)
            pool.private += taken
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
