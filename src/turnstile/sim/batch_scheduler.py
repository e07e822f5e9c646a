"""The engine model's batch scheduler: the waiting queue, the running batch, admission, chunked
prefill and preemption (by recompute), over a :class:`~turnstile.sim.block_pool.BlockPool`.

Decodes advance in lockstep, so the running batch is kept as aggregates and never looped over:
the number of decoders, the sum of their KV lengths, a histogram of their positions modulo
``block_size`` (how many cross into a new block at each iteration) and a bucket of decoders per
finishing iteration. A decoder's KV length and outputs follow from the iteration it started
decoding at (``_i0``, ``_n0``, ``_o0``).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Any

from turnstile.sim.block_pool import BlockPool
from turnstile.sim.engine_config import EngineConfig
from turnstile.sim.lanes import Lanes
from turnstile.sim.request import DECODE, DONE, PREFILL, WAITING, SimRequest
from turnstile.sim.slot_pool import SlotPool


class BatchScheduler:
    """Which requests run in the next iteration, and how far each prefill gets."""

    def __init__(self, config: EngineConfig, pool: BlockPool | SlotPool,
                 session_marks: dict[str, int] | None = None) -> None:
        c = config
        self.pool = pool
        self.bs = c.block_size
        self.max_seqs = c.max_num_seqs
        self.max_tokens = c.max_batched_tokens
        self.prio = c.priority_scheduling
        # queues: by (priority, arrival) or FIFO
        self.heap: list[tuple[float, int, SimRequest]] = []
        self.fifo: deque[SimRequest] = deque()
        self.waiting: list[Any] | deque[SimRequest] = self.heap if self.prio else self.fifo
        self._seq = 0
        self.running: dict[SimRequest, None] = {}
        self.prefilling: list[SimRequest] = []
        #: the running requests' slots, for a perf model that prices a step by the forward
        #: passes its slots cut it into (set by the engine: see ``turnstile.sim.lanes``)
        self.lanes: Lanes | None = None
        # the decoders, as aggregates
        self.it = 0
        self.n_dec = 0
        self.kv_sum = 0  # sum of decoders' KV lengths at the start of iteration ``it``
        self.phase = [0] * self.bs  # decoders needing a new block at iteration i: [i % bs]
        self.fin: dict[int, list[SimRequest]] = {}
        #: the keys of ``fin`` (and some already gone, dropped lazily): the next finish in O(1)
        self.fin_heap: list[int] = []
        #: session -> tokens of its context ever computed (recompute is judged against it)
        self.marks: dict[str, int] = {} if session_marks is None else session_marks
        # admission memo: the head request failed with this much memory/budget at this version
        self.blk_req: SimRequest | None = None
        self.blk_avail = 0
        self.blk_budget = 0
        self.blk_ver = -1
        # counters
        self.prompt_tokens = 0  # tokens to process over all admissions (prompt + outputs)
        self.hit_tokens = 0
        self.prefilled_tokens = 0
        self.recomputed_tokens = 0
        self.preemptions = 0
        self.submitted = 0
        self.finished = 0

    def add(self, req: SimRequest) -> None:
        """Queue a new request."""
        req._seq = self._seq
        self._seq += 1
        req._state = WAITING
        self.submitted += 1
        if self.prio:
            heapq.heappush(self.heap, (req.priority, req._seq, req))
        else:
            self.fifo.append(req)

    def head(self) -> SimRequest:
        return self.heap[0][2] if self.prio else self.fifo[0]

    # -- prefill and admission -------------------------------------------------------------------

    def schedule_prefills(
        self,
        n_dec: int,
        started: list[SimRequest],
        done_prefill: list[SimRequest],
        now: float,
    ) -> tuple[int, float, int, int]:
        """Continue chunked prefills, then admit waiting requests. Returns (prefill tokens,
        attention pairs, prefix tokens read, blocks reloaded from the CPU tier)."""
        budget = self.max_tokens - n_dec
        bs = self.bs
        pool = self.pool
        prefill_tokens = 0
        attn2 = 0.0
        ctx_read = 0
        reload_blocks = 0
        lanes = self.lanes
        if self.prefilling and budget > 0:
            keep: list[SimRequest] = []
            for req in self.prefilling:
                if budget <= 0:
                    keep.append(req)
                    continue
                c = req.num_computed
                chunk = req._target - c
                if chunk > budget:
                    chunk = budget
                have = -(-c // bs)
                new = -(-(c + chunk) // bs) - have
                avail = pool.free + pool.n_evict
                if new > avail:
                    chunk = (have + avail) * bs - c
                    if chunk <= 0:
                        keep.append(req)  # stalled on memory
                        continue
                    new = avail
                if new:
                    pool.take(new)
                    pool.private += new
                attn2 += chunk * c + chunk * (chunk + 1) / 2
                ctx_read += c
                prefill_tokens += chunk
                budget -= chunk
                self.computed(req, c, chunk)
                if lanes is not None:
                    lanes.chunk(req, chunk, c)
                if req.num_computed == req._target:
                    done_prefill.append(req)
                else:
                    keep.append(req)
            self.prefilling = keep
        waiting = self.waiting
        if waiting and budget > 0 and len(self.running) < self.max_seqs:
            prio = self.prio
            while waiting and budget > 0 and len(self.running) < self.max_seqs:
                req = self.heap[0][2] if prio else self.fifo[0]
                avail = pool.free + pool.n_evict
                if (
                    req is self.blk_req
                    and avail <= self.blk_avail
                    and budget >= self.blk_budget
                    and pool.ver == self.blk_ver
                ):
                    break  # nothing that could let it in has changed
                got = self.admit(req, budget)
                if got < 0:
                    self.blk_req = req
                    self.blk_avail = avail
                    self.blk_budget = budget
                    self.blk_ver = pool.ver
                    break
                if prio:
                    heapq.heappop(self.heap)
                else:
                    self.fifo.popleft()
                if req.started_s < 0:
                    req.started_s = now
                    req.cached_tokens = req.num_computed
                    started.append(req)
                reload_blocks += got
                c = req.num_computed
                chunk = req._target - c
                if chunk > budget:
                    chunk = budget
                attn2 += chunk * c + chunk * (chunk + 1) / 2
                ctx_read += c
                prefill_tokens += chunk
                budget -= chunk
                self.computed(req, c, chunk)
                self.running[req] = None
                if lanes is not None:
                    lanes.admit(req, pool.slot_of(req))
                    lanes.chunk(req, chunk, c)
                if req.num_computed == req._target:
                    done_prefill.append(req)
                else:
                    req._state = PREFILL
                    self.prefilling.append(req)
        return prefill_tokens, attn2, ctx_read, reload_blocks

    def admit(self, req: SimRequest, budget: int) -> int:
        """Check-then-commit: match the prefix, allocate blocks for the first chunk. Returns
        the blocks reloaded from the CPU tier, or -1 when the first chunk does not fit."""
        pool = self.pool
        bs = self.bs
        target = req.prompt_tokens + req.num_output
        match = pool.match_prefix(req, target)
        hit = match.n_hit * bs
        chunk = target - hit
        if chunk > budget:
            chunk = budget
        new = -(-(hit + chunk) // bs) - match.n_hit
        # each pool takes its own match type (the one its match_prefix returned)
        if not pool.can_allocate(match, new):  # type: ignore[arg-type]
            return -1
        pool.allocate(req, match, new)  # type: ignore[arg-type]
        req._target = target
        req.num_computed = hit
        self.prompt_tokens += target
        self.hit_tokens += hit
        return match.reload

    def computed(self, req: SimRequest, c: int, chunk: int) -> None:
        """Account ``chunk`` prefilled tokens after ``c`` (recompute is judged per session)."""
        end = c + chunk
        req.num_computed = end
        self.prefilled_tokens += chunk
        marks = self.marks
        mark = marks.get(req.session, 0)
        if c < mark:
            self.recomputed_tokens += (end if end < mark else mark) - c
        if end > mark:
            marks[req.session] = end

    # -- decode and finish -----------------------------------------------------------------------

    def start_decoding(
        self,
        reqs: list[SimRequest],
        it: int,
        end: float,
        first_token: list[SimRequest],
        finished: list[SimRequest],
    ) -> None:
        """Prefill complete in iteration ``it``: it sampled one output token; continue as a
        decoder from the next iteration (or finish, if that was the last token)."""
        bs = self.bs
        nxt = it + 1
        for req in reqs:
            req.num_output += 1
            if req.first_token_s < 0:
                req.first_token_s = end
                first_token.append(req)
            n0 = req.num_computed
            left = req.output_tokens - req.num_output
            if left <= 0:
                self.finish(req, n0, end, finished)
                continue
            req._state = DECODE
            req._i0 = nxt
            req._n0 = n0
            req._o0 = req.num_output
            fin_it = nxt + left - 1
            req._fin_it = fin_it
            bucket = self.fin.get(fin_it)
            if bucket is None:
                self.fin[fin_it] = [req]
                heapq.heappush(self.fin_heap, fin_it)
            else:
                bucket.append(req)
            self.phase[(nxt - n0) % bs] += 1
            self.kv_sum += n0
            self.n_dec += 1
            if self.lanes is not None:
                self.lanes.start_decoding(req)

    def next_finish(self) -> int:
        """The iteration at whose end the next decoder finishes (there are decoders)."""
        heap, fin = self.fin_heap, self.fin
        while heap[0] not in fin:
            heapq.heappop(heap)
        return heap[0]

    def finish_decoders(self, bucket: list[SimRequest], nxt: int, end: float,
                        finished: list[SimRequest]) -> None:
        """The decoders of ``bucket`` emitted their last token in the iteration before ``nxt``
        (the decode sums already include it)."""
        bs = self.bs
        phase = self.phase
        for req in bucket:
            kv_len = req._n0 + nxt - req._i0
            self.kv_sum -= kv_len
            phase[(req._i0 - req._n0) % bs] -= 1
            self.n_dec -= 1
            self.finish(req, kv_len, end, finished)

    def finish(self, req: SimRequest, kv_len: int, end: float, out: list[SimRequest]) -> None:
        del self.running[req]
        if self.lanes is not None:
            self.lanes.release(req)
        req.num_output = req.output_tokens
        req.num_computed = kv_len
        req.finished_s = end
        req._state = DONE
        marks = self.marks
        if kv_len > marks.get(req.session, 0):
            marks[req.session] = kv_len
        self.pool.release(req, kv_len)
        self.pool.remember_session(req, kv_len)
        self.finished += 1
        out.append(req)

    # -- preemption ------------------------------------------------------------------------------

    def victim(self) -> SimRequest:
        """The running request to preempt: lowest priority (highest value), latest arrival."""
        if self.prio:
            return max(self.running, key=lambda r: (r.priority, r._seq))
        return max(self.running, key=lambda r: r._seq)

    def preempt_for_decode(self, it: int) -> int:
        """Preempt until iteration ``it``'s decode blocks fit; returns the (new) block need."""
        pool = self.pool
        need = self.phase[it % self.bs]
        while need > pool.free + pool.n_evict and self.running:
            self.preempt(self.victim(), it)
            need = self.phase[it % self.bs] if self.n_dec else 0
        return need

    def preempt(self, req: SimRequest, it: int) -> None:
        """Stop ``req`` at the start of iteration ``it``; its blocks go back (full ones to the
        prefix cache) and it waits to be recomputed, ahead of its equals."""
        del self.running[req]
        if self.lanes is not None:
            self.lanes.release(req)
        if req._state == DECODE:
            steps = it - req._i0
            kv_len = req._n0 + steps
            req.num_output = req._o0 + steps
            self.kv_sum -= kv_len
            self.phase[(req._i0 - req._n0) % self.bs] -= 1
            self.n_dec -= 1
            bucket = self.fin[req._fin_it]
            bucket.remove(req)
            if not bucket:
                del self.fin[req._fin_it]
        else:
            self.prefilling.remove(req)
            kv_len = req.num_computed
            self.prompt_tokens -= req._target - kv_len  # the part it never got through
        marks = self.marks
        if kv_len > marks.get(req.session, 0):
            marks[req.session] = kv_len
        self.pool.release(req, kv_len)
        req.num_computed = 0
        req._n_hit = req._n_exp = 0
        req.preempted += 1
        self.preemptions += 1
        req._state = WAITING
        if self.prio:
            heapq.heappush(self.heap, (req.priority, req._seq, req))
        else:
            self.fifo.appendleft(req)

    # -- checks ----------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Recount the decode aggregates and the block pool from scratch (tests)."""
        bs = self.bs
        it = self.it
        held: list[tuple[SimRequest, int]] = []
        kv_sum = n_dec = 0
        phase = [0] * bs
        for req in self.running:
            if req._state == DECODE:
                kv_len = req._n0 + it - req._i0
                kv_sum += kv_len
                n_dec += 1
                phase[(req._i0 - req._n0) % bs] += 1
                assert req in self.fin[req._fin_it]
            else:
                assert req._state == PREFILL and req in self.prefilling
                kv_len = req.num_computed
            held.append((req, kv_len))
        self.pool.check_integrity(held)
        assert kv_sum == self.kv_sum and n_dec == self.n_dec, (kv_sum, self.kv_sum)
        assert phase == self.phase, (phase, self.phase)
        assert len(self.prefilling) + n_dec == len(self.running)
        assert sum(len(b) for b in self.fin.values()) == n_dec
        assert self.prompt_tokens == self.hit_tokens + self.prefilled_tokens + sum(
            r._target - r.num_computed for r in self.prefilling
        )
        if self.lanes is not None:
            self.lanes.check_integrity(self.running, {r for r in self.running
                                                      if r._state == DECODE})
