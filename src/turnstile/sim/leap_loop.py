"""The engine model's decode leap loops: how far a run of event-free decode iterations goes and
what it sums (iterations, new blocks, end time, busy time), without recording anything; the step
executor (:mod:`turnstile.sim.step`) plans leaps with them and records the result.

:meth:`LeapLoops._run` is the general loop (any performance model, pins, an offload tier);
:meth:`LeapLoops._run_roofline` the common case (a roofline model, no pin, no tier), which works
out what memory allows before the loop and only sums step times, with numpy for long leaps
(:mod:`turnstile.sim.leap_sums`, the same float operations).
"""

from __future__ import annotations

import importlib.util

from turnstile.sim.batch_scheduler import BatchScheduler
from turnstile.sim.block_pool import BlockPool
from turnstile.sim.leap_sums import LeapSums, first_at_or_after, leap_durations, running_sums
from turnstile.sim.perf import PerfModel
from turnstile.sim.request import SimRequest, StepOutcome
from turnstile.sim.roofline_perf import RooflinePerf
from turnstile.sim.slot_pool import SlotPool
from turnstile.sim.tp_perf import TpRooflinePerf

#: pins expiring within this of ``now`` expire now (so ``now + (t - now)`` rounding is harmless)
EPS = 1e-9
#: a RooflinePerf's decode-only step_time terms for ``n_dec`` decoders (see :meth:`_plan`)
#: and, for a TpRooflinePerf, its all-reduce term (constant: the decoders do not change)
_Roof = tuple[float, float, float, float, float, float, float]
#: what a leap relies on: (n_dec, blocked, blk_avail, next pin expiry, stop iteration, roof,
#: the request whose chunked prefill takes every iteration's whole token budget, or None)
LeapPlan = tuple[int, bool, int, float | None, int, _Roof | None, SimRequest | None]
NO_PLAN: LeapPlan = (0, False, 0, None, 0, None, None)
#: the stop iteration of a leap without decoders (none finishes)
_NO_STOP = 1 << 62
#: a leap's result, not yet recorded: (iterations, new decode blocks, n_dec, next KV read,
#: end, busy_s, duration, stop iteration); see ``StepExecutor._commit``
LeapResult = tuple[int, int, int, int, float, float, float, int]
#: leaps of at least this many iterations sum their step times with numpy (:mod:`leap_sums`:
#: the same float operations). Its fixed cost, about 10 µs a leap, is some 75 iterations of
#: the CPython loop; but a lazily planned leap recorded early is cut from numpy's kept sums,
#: where the loop would run again: the rollout run counted fewest instructions at 48 (of
#: 32, 48, 96). The compiled build's loop is C, faster than numpy's calls: it never does
_NUMPY_MIN = (48 if importlib.util.find_spec("turnstile._compiled_build") is None
              else 1 << 62)


class LeapLoops:
    """The leap loops of one engine (the base of its step executor)."""

    perf: PerfModel
    pool: BlockPool | SlotPool
    sched: BatchScheduler
    busy_s: float
    #: the outcome (and plan) of a leap stopped only by ``until`` (see ``StepExecutor.resume``)
    _cut_out: StepOutcome | None
    _cut_plan: LeapPlan
    #: the step and end times of the last roofline leap summed by numpy (else None)
    _sums: LeapSums | None

    def _plan(self, n_dec: int, blocked: bool) -> LeapPlan:
        """What a leap of ``n_dec`` decoders relies on; all of it holds until something reaches
        the engine (see ``StepExecutor.resume``)."""
        s = self.sched
        pin_heap = self.pool.pin_heap
        perf = self.perf
        roof: _Roof | None = None
        if isinstance(perf, RooflinePerf) and (
            type(perf) is RooflinePerf or type(perf) is TpRooflinePerf
        ):  # its step_time(0, n_dec, kv, 0.0) inlined in _run
            # TpRooflinePerf.step_time is RooflinePerf's (its ``_ar_tok_s`` is 0.0) plus the
            # all-reduce of n_dec tokens; adding 0.0 changes no positive float, so one formula
            # (roofline + overhead + ar_tok + comm) gives both models' sums bit for bit
            comm = 0.0
            if isinstance(perf, TpRooflinePerf) and perf._n_ar:
                comm = perf.comm_s(n_dec)
            roof = (perf._flop_s * n_dec, perf._attn_s, perf._weights_s, perf._kv_s,
                    perf._overhead_s, perf._ar_tok_s * n_dec, comm)
        return (n_dec, blocked, s.blk_avail,
                pin_heap[0][0] if pin_heap else None,  # no pin changes in a leap
                s.next_finish() + 1,  # no further than the next finish
                roof, None)

    def _prefill_plan(self) -> LeapPlan | None:
        """The plan of a leap over the chunked prefill of the first prefilling request, when
        it takes the whole token budget of the next iteration without completing (so nothing is
        admitted, no other prefill advances, no first token comes); None when it does not."""
        s = self.sched
        n_dec = s.n_dec
        budget = s.max_tokens - n_dec
        req = s.prefilling[0]
        if budget <= 0 or req._target - req.num_computed <= budget:
            return None
        pin_heap = self.pool.pin_heap
        return (n_dec, False, 0, pin_heap[0][0] if pin_heap else None,
                s.next_finish() + 1 if n_dec else _NO_STOP, None, req)

    def _run_prefill(self, out: StepOutcome, plan: LeapPlan, until: float) -> LeapResult | None:
        """The leap's iterations from ``out.end_s`` on when a chunked prefill takes each one's
        whole budget (see :meth:`_prefill_plan`): each decodes (new blocks by ``phase``) and
        prefills ``budget`` more tokens of the same request, as ``step`` would, with the same
        ``step_time`` arguments. It stops before the iteration that would complete the prefill,
        that the memory cannot take in full (a partial chunk or a preemption: left to
        ``step``), or that starts at or after ``until`` or a pin expiry; and after the one in
        which decoders finish. Changes nothing in the engine (no offload tier: see
        ``StepExecutor.leap``)."""
        n_dec, _, _, pin_t, stop, _, req = plan
        assert req is not None
        s = self.sched
        pool = self.pool
        budget = s.max_tokens - n_dec
        phase = s.phase
        bs = s.bs
        step_time = self.perf.step_time
        lanes = s.lanes
        passes = None if lanes is None else lanes.prefill_passes(req, budget)
        c = req.num_computed
        left = req._target - c
        have = -(-c // bs)
        avail = pool.free + pool.n_evict
        taken = 0
        end = out.end_s
        busy_s = self.busy_s
        total = 0.0
        kv = s.kv_sum + n_dec  # KV tokens the next iteration's decodes read
        it0 = s.it
        it = it0
        while it < stop:
            if end >= until:
                self._cut_out = out
                self._cut_plan = plan
                break
            if left <= budget or (pin_t is not None and pin_t <= end + EPS):
                break
            after = -(-(c + budget) // bs)
            need = phase[it % bs] + after - have
            if need > avail:
                break
            avail -= need
            taken += need
            # as step(): attention pairs 0.0 + chunk·c + chunk(chunk+1)/2, KV read kv + c
            if passes is None:
                dur = step_time(budget, n_dec, kv + c, budget * c + budget * (budget + 1) / 2)
            else:
                dur = step_time(budget, n_dec, kv + c, budget * c + budget * (budget + 1) / 2,
                                passes)
            end += dur
            busy_s += dur
            total += dur
            kv += n_dec
            c += budget
            left -= budget
            have = after
            it += 1
        if it > it0:
            return (it - it0, taken, n_dec, kv, end, busy_s, total, stop)
        return None

    def _run(self, out: StepOutcome, plan: LeapPlan, until: float) -> LeapResult | None:
        """The leap's decode iterations from ``out.end_s`` on (see ``StepExecutor.leap``): what
        ``StepExecutor._commit`` records (None: no iteration). Without an offload tier it changes
        nothing in the engine, so it can run ahead (see ``lazy``)."""
        self._sums = None  # set by a leap summed by numpy (read after the call: not narrowed)
        if plan[6] is not None:
            return self._run_prefill(out, plan, until)
        if plan[5] is not None and plan[3] is None and not self.pool.cpu_cap:
            return self._run_roofline(out, plan, until)
        n_dec, blocked, blk_avail, pin_t, stop, roof, _ = plan
        s = self.sched
        pool = self.pool
        if roof is not None:
            c_tok, attn_s, weights_s, kv_s, overhead_s, ar_tok, comm = roof
        step_time = self.perf.step_time
        # the decoders, and so their slots, do not change in a leap
        passes = None if s.lanes is None else s.lanes.decode_passes()
        end = out.end_s
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
        total = 0.0
        it = it0
        for it in range(it0, stop):
            if end >= until:
                self._cut_out = out
                self._cut_plan = plan
                break
            if pin_t is not None and pin_t <= end + EPS:
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
            if roof is not None:  # the same float operations as the perf model's step_time
                compute = c_tok + attn_s * kv
                memory = weights_s + kv_s * kv
                dur = (compute if compute > memory else memory) + overhead_s + ar_tok + comm
            elif passes is None:
                dur = step_time(0, n_dec, kv, 0.0)
            else:
                dur = step_time(0, n_dec, kv, 0.0, passes)
            end += dur
            busy_s += dur
            total += dur
            kv += n_dec
        else:
            it = stop
        if it > it0:
            return (it - it0, taken, n_dec, kv, end, busy_s, total, stop)
        return None

    def _run_roofline(self, out: StepOutcome, plan: LeapPlan, until: float) -> LeapResult | None:
        """:meth:`_run` for the common case (a roofline model, no pin, no offload tier),
        with the same iterations and float sums. Which iterations memory allows is worked out
        before the loop from the block-need histogram (``phase``), so the loop only sums
        durations; and when one roofline term is the larger over the whole KV range by a wide
        margin, the other is not computed."""
        n_dec, blocked, blk_avail, _, stop, roof, _ = plan
        assert roof is not None  # _run's condition
        c_tok, attn_s, weights_s, kv_s, overhead_s, ar_tok, comm = roof
        s = self.sched
        pool = self.pool
        phase = s.phase
        bs = s.bs
        it0 = s.it
        left = stop - it0
        avail = pool.free + pool.n_evict
        # how many iterations the memory allows: the first iteration whose new blocks do not fit
        # stops the leap (a preemption, left to step()); with a blocked admission, the first
        # iteration leaves at most the memory the admission failed with (avail only shrinks)
        cap = left
        need0 = phase[it0 % bs]
        if need0 > avail or (blocked and avail - need0 > blk_avail):
            cap = 0
        else:
            per_cycle = sum(phase)
            if per_cycle * -(-left // bs) > avail:  # may run out within ``left``
                full = avail // per_cycle
                acc = full * per_cycle
                for t in range(bs):
                    acc += phase[(it0 + t) % bs]
                    if acc > avail:
                        break
                mem_cap = full * bs + t
                if mem_cap < cap:
                    cap = mem_cap
        end = out.end_s
        kv = s.kv_sum + n_dec  # KV tokens the next iteration's decodes read
        kv_last = kv + n_dec * (cap - 1 if cap else 0)
        total = 0.0
        k = cap
        # the larger roofline term at both ends of the KV range, by far more than rounding: it
        # is the larger in between too (both terms are linear in the KV tokens)
        lo_c, lo_m = c_tok + attn_s * kv, weights_s + kv_s * kv
        hi_c, hi_m = c_tok + attn_s * kv_last, weights_s + kv_s * kv_last
        linear = True
        if lo_m > lo_c * (1 + 1e-9) and hi_m > hi_c * (1 + 1e-9):
            base, per_kv = weights_s, kv_s  # memory-bound throughout
        elif lo_c > lo_m * (1 + 1e-9) and hi_c > hi_m * (1 + 1e-9):
            base, per_kv = c_tok, attn_s  # compute-bound throughout
        else:
            linear = False
            base = per_kv = 0.0
        if cap >= _NUMPY_MIN:
            sums = leap_durations(end, kv, n_dec, cap, roof, linear, base, per_kv)
            ends = sums[0]
            k = cap if ends[cap] < until else first_at_or_after(ends, cap, until)
            if k < left and ends[k] >= until:  # cut by ``until``, as below
                self._cut_out = out
                self._cut_plan = plan
            self._sums = sums
            return self._sums_result(sums, k, n_dec, kv, stop)
        busy_s = self.busy_s
        if linear and not ar_tok and not comm:
            # x + 0.0 is x for every positive x: the same sums without the zero terms (no
            # all-reduce: a roofline model, or TP 1)
            for j in range(cap):
                if end >= until:
                    k = j
                    break
                dur = base + per_kv * kv + overhead_s
                end += dur
                busy_s += dur
                total += dur
                kv += n_dec
        elif linear:
            for j in range(cap):
                if end >= until:
                    k = j
                    break
                dur = base + per_kv * kv + overhead_s + ar_tok + comm
                end += dur
                busy_s += dur
                total += dur
                kv += n_dec
        else:
            for j in range(cap):
                if end >= until:
                    k = j
                    break
                compute = c_tok + attn_s * kv
                memory = weights_s + kv_s * kv
                dur = (compute if compute > memory else memory) + overhead_s + ar_tok + comm
                end += dur
                busy_s += dur
                total += dur
                kv += n_dec
        if k < left and end >= until:
            # cut by ``until`` (checked first, as in _run, also where memory would stop it)
            self._cut_out = out
            self._cut_plan = plan
        if not k:
            return None
        return (k, self._taken(it0, k), n_dec, kv, end, busy_s, total, stop)

    def _taken(self, it0: int, k: int) -> int:
        """The decode blocks iterations ``it0 .. it0 + k - 1`` take (one per decoder crossing
        into a new block)."""
        s = self.sched
        phase = s.phase
        bs = s.bs
        full, rest = divmod(k, bs)
        taken = full * sum(phase) if full else 0
        if rest:
            r0 = it0 % bs
            r1 = r0 + rest
            taken += sum(phase[r0:r1]) if r1 <= bs else sum(phase[r0:]) + sum(phase[:r1 - bs])
        return taken

    def _sums_result(self, sums: LeapSums, k: int, n_dec: int, kv: int,
                     stop: int) -> LeapResult | None:
        """The first ``k`` iterations of a leap summed by numpy (``kv``: the KV tokens the first
        one reads); None when k is 0. Its new blocks (-1) and busy and duration sums are left
        to ``StepExecutor._commit`` (:meth:`commit_sums`): a planned leap recorded early is cut
        first, and the sums of its planned end would be thrown away."""
        if not k:
            return None
        return (k, -1, n_dec, kv + n_dec * k, float(sums[0][k]), 0.0, 0.0, stop)

    def commit_sums(self, sums: LeapSums | None, k: int) -> tuple[int, float, float]:
        """A numpy-summed leap's new decode blocks, busy time and duration over its first
        ``k`` iterations (from the engine's current iteration and busy time)."""
        assert sums is not None  # a result with -1 blocks comes from _sums_result
        busy_s, total = running_sums(self.busy_s, sums[1], k)
        return self._taken(self.sched.it, k), busy_s, total
