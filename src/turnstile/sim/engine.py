"""An iteration-level model of a continuous-batching engine (vLLM-like).

One :meth:`EngineModel.step` is one engine iteration: every running decode emits one token,
chunked prefills continue, and waiting requests are admitted while the token budget,
``max_num_seqs`` and free KV blocks allow. Its duration comes from a
:class:`~turnstile.sim.perf.PerfModel` fed with O(1) running sums.

KV memory is paged in blocks of ``block_size`` tokens with a prefix cache (vLLM automatic
prefix caching): the full blocks of a finished (or preempted) request stay cached, unused ones
sit in an LRU list until an allocation evicts them (to the CPU offload tier when there is one),
and a new request reuses the longest cached run of its leading blocks. Preemption is by
recompute.

Contract with the driver (the cluster event loop):

* ``submit(req, now)`` queues a request; ``step(now)`` runs one iteration starting at ``now``
  and returns a :class:`StepOutcome` whose effects all happen at ``now + duration_s``; the
  driver calls ``step`` again at that time. ``step`` returns ``None`` only when the engine has
  no work at all. When requests wait but none can be admitted (KV held by pinned sessions and
  nothing running), it returns an empty outcome (``busy=False``) lasting until the next pin
  expires.
* ``leap(outcome, until)`` (optional) extends that outcome over the following event-free decode
  iterations that start before ``until`` (the driver's next event); the driver then calls
  ``step`` again at ``outcome.end_s``. Results are identical to stepping one at a time.
* Requests are :class:`SimRequest` objects the driver creates; the engine fills in progress
  fields. ``num_output`` of a *decoding* request is only brought up to date at events
  (preemption, finish); everything else is exact at all times.

How blocks are named (what makes two requests share KV):

* ``block_hashes`` (optional, e.g. Mooncake hash ids) name the prompt's leading full blocks,
  ``hash_block_tokens`` tokens each (default ``block_size``); equal hashes are equal content,
  shared across sessions. Only hash blocks that lie wholly inside the prompt are used.
* Every later block (all of them without ``block_hashes``) is named by the session and its
  position: a session's turn n+1 extends turn n's prompt and output, so its blocks match.

Hot-path design (≥ 200k iterations/s for a decode-heavy engine): decodes advance in lockstep,
so the engine never loops over running sequences. It keeps the number of decoders, the sum of
their context lengths, a histogram of their positions modulo ``block_size`` (how many cross a
block boundary, i.e. need a new block, at each iteration) and a bucket of decoders per finishing
iteration. The session-named blocks of a session form one *segment* that caches, evicts (tail
first, as vLLM frees blocks in reverse) and offloads as a range in O(1); hash-named blocks are
cached one hash block at a time. The LRU therefore orders segments and hash blocks, not single
blocks: a segment's tail is evicted first, and a whole segment is as recent as its last release.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from turnstile.core.actions import RetentionDecision
from turnstile.sim.perf import (
    GpuSpec,
    ModelSpec,
    PerfModel,
    RooflinePerf,
    as_model,
    kv_capacity_tokens,
)

# request states (engine-private)
_NEW = 0
_WAITING = 1
_PREFILL = 2
_DECODE = 3
_DONE = 4
#: pins expiring within this of ``now`` expire now (so ``now + (t - now)`` rounding is harmless)
_EPS = 1e-9
# where _sync puts a segment in the LRU
_KEEP, _MRU, _FIRST = 0, 1, 2


@dataclass(slots=True, kw_only=True)
class EngineConfig:
    """Engine knobs, named after vLLM's. Keyword-only."""

    num_gpu_blocks: int
    block_size: int = 16
    #: blocks of the CPU offload tier (0 = no tier: evicted blocks are gone)
    num_cpu_blocks: int = 0
    #: host link bandwidth of the offload tier, in gigaBYTES per second (PCIe 4.0 x16 ≈ 25)
    cpu_bandwidth_gbps: float = 25.0
    max_num_seqs: int = 256
    #: token budget per iteration (decodes count 1 each; the rest goes to chunked prefill)
    max_batched_tokens: int = 8192
    enable_prefix_cache: bool = True
    #: admit waiting requests by (priority, arrival); False = FIFO by arrival
    priority_scheduling: bool = True
    #: tokens named by one entry of ``SimRequest.block_hashes`` (0 = ``block_size``); a
    #: multiple of ``block_size``, e.g. 512 for Mooncake's hash ids on 16-token KV blocks
    hash_block_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_gpu_blocks < 1 or self.block_size < 1:
            raise ValueError("num_gpu_blocks and block_size must be >= 1")
        if self.num_cpu_blocks < 0:
            raise ValueError("num_cpu_blocks must be >= 0")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_batched_tokens < self.max_num_seqs:
            # as in vLLM: every running decode must fit in one iteration's budget
            raise ValueError(
                f"max_batched_tokens ({self.max_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs})"
            )
        if self.hash_block_tokens < 0 or self.hash_block_tokens % self.block_size:
            raise ValueError(
                f"hash_block_tokens ({self.hash_block_tokens}) must be a multiple of "
                f"block_size ({self.block_size})"
            )
        if self.num_cpu_blocks and self.cpu_bandwidth_gbps <= 0:
            raise ValueError("cpu_bandwidth_gbps must be > 0 with an offload tier")

    @property
    def capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    @classmethod
    def sized_for(
        cls,
        gpu: GpuSpec | str,
        model: ModelSpec | str,
        tp: int = 1,
        *,
        gpu_mem_util: float = 0.9,
        cpu_offload_gb: float = 0.0,
        **kwargs: Any,
    ) -> EngineConfig:
        """A config whose KV blocks fill a ``tp``-GPU engine, plus ``cpu_offload_gb`` of host
        memory per GPU for the offload tier. Other fields are passed through."""
        bs = int(kwargs.pop("block_size", 16))
        tokens = kv_capacity_tokens(gpu, model, tp, gpu_mem_util)
        cpu_blocks = 0
        if cpu_offload_gb > 0:
            per_token = as_model(model).kv_bytes_per_token(tp)
            cpu_blocks = int(cpu_offload_gb * 1e9 // (per_token * bs))
        return cls(num_gpu_blocks=tokens // bs, block_size=bs, num_cpu_blocks=cpu_blocks, **kwargs)


class SimRequest:
    """One request as the engine sees it. Created by the driver; progress filled by the engine.

    ``rid`` is opaque to the engine. ``block_hashes`` (optional) name the prompt's leading hash
    blocks (``EngineConfig.hash_block_tokens`` tokens each); see the module docstring.
    """

    __slots__ = (
        "_fin_it",
        "_i0",
        "_m",
        "_n0",
        "_n_exp",
        "_n_hit",
        "_o0",
        "_seg",
        "_seq",
        "_state",
        "_target",
        "arrival_s",
        "block_hashes",
        "cached_tokens",
        "finished_s",
        "first_token_s",
        "num_computed",
        "num_output",
        "output_tokens",
        "preempted",
        "priority",
        "prompt_tokens",
        "rid",
        "session",
        "started_s",
    )

    def __init__(
        self,
        rid: Hashable,
        session: str,
        prompt_tokens: int,
        output_tokens: int,
        priority: float = 0.0,
        block_hashes: tuple[int, ...] | None = None,
        arrival_s: float = 0.0,
    ) -> None:
        self.rid = rid
        self.session = session
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.priority = priority
        self.block_hashes = block_hashes
        self.arrival_s = arrival_s
        # engine-filled
        #: tokens whose KV is computed (or hit) in the current admission
        self.num_computed = 0
        #: output tokens emitted so far (exact at events; see the module docstring)
        self.num_output = 0
        #: prefix-cache hit (tokens) at the first admission
        self.cached_tokens = 0
        self.started_s = -1.0
        self.first_token_s = -1.0
        self.finished_s = -1.0
        #: times preempted (and later recomputed)
        self.preempted = 0
        # engine-private
        self._state = _NEW
        self._seq = -1
        self._target = 0  # tokens to compute in the current admission (prompt + outputs so far)
        self._n_hit = 0  # leading blocks shared with the prefix cache
        self._n_exp = 0  # ... of which hash blocks (each hash_block_tokens // block_size blocks)
        self._m = 0  # leading blocks named by block_hashes (the session segment starts here)
        self._seg: _Seg | None = None  # the session segment it holds a prefix of
        self._i0 = 0  # decode: first decode iteration
        self._n0 = 0  # decode: KV length at _i0
        self._o0 = 0  # decode: outputs emitted at _i0
        self._fin_it = 0  # decode: iteration at whose end it finishes

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def __repr__(self) -> str:
        return (
            f"<SimRequest {self.rid!r} {self.session} p={self.prompt_tokens} "
            f"o={self.num_output}/{self.output_tokens}>"
        )


@dataclass(slots=True)
class StepOutcome:
    """What one iteration did. Everything happens at ``now + duration_s``."""

    duration_s: float
    #: requests scheduled for the first time this step (their ``started_s`` is ``now``)
    started: list[SimRequest] = field(default_factory=list)
    #: requests that emitted their first output token at the end of this step
    first_token: list[SimRequest] = field(default_factory=list)
    #: requests that finished at the end of this step; their KV went to the prefix cache
    finished: list[SimRequest] = field(default_factory=list)
    #: False for an idle wait (requests queued, KV held by pins, nothing runnable)
    busy: bool = True
    #: when it ends: ``now + duration_s`` after one iteration; after :meth:`EngineModel.leap`
    #: the end of the last iteration, summed one iteration at a time as stepping would
    end_s: float = 0.0
    #: iterations it covers (more than 1 after :meth:`EngineModel.leap`)
    iterations: int = 1


class _Seg:
    """The session-named blocks of one session (from block ``lo`` on) on one engine.

    Blocks ``[lo, g)`` are cached on the GPU and ``[g, c)`` in the CPU tier (``c == g``: none).
    Running requests holding a prefix are ``users`` (request → end block); the evictable part
    is ``[floor, g)`` with ``floor`` the longest held prefix, unless the segment is pinned.
    """

    __slots__ = ("c", "ev", "g", "key", "lo", "pin_until", "users")

    def __init__(self, key: tuple[str, int], lo: int) -> None:
        self.key = key
        self.lo = self.g = self.c = lo
        self.users: dict[SimRequest, int] = {}
        self.pin_until = 0.0  # > 0 while pinned
        self.ev = 0  # evictable blocks as last counted in the engine's total

    def floor(self) -> int:
        return max(self.users.values()) if self.users else self.lo

    def __repr__(self) -> str:
        return f"<Seg {self.key} gpu=[{self.lo},{self.g}) cpu=[{self.g},{self.c})>"


class EngineModel:
    """One simulated engine (one model replica, possibly tensor-parallel)."""

    def __init__(
        self,
        engine_id: str,
        config: EngineConfig,
        perf: PerfModel,
        *,
        session_marks: dict[str, int] | None = None,
    ) -> None:
        """``session_marks`` (optional) maps session → tokens of its context ever computed; pass
        one dict to every engine of a cluster so a session re-prefilled on *another* engine
        counts as recomputed too (by default recompute is judged per engine)."""
        self.engine_id = engine_id
        self.config = config
        self.perf = perf
        c = config
        self._bs = c.block_size
        self._r = (c.hash_block_tokens or c.block_size) // c.block_size
        self._max_seqs = c.max_num_seqs
        self._max_tokens = c.max_batched_tokens
        self._prio = c.priority_scheduling
        self._caching = c.enable_prefix_cache
        self._cpu_cap = c.num_cpu_blocks if c.enable_prefix_cache else 0
        self._reload_s_per_block = (
            c.block_size * perf.kv_bytes_per_token / (c.cpu_bandwidth_gbps * 1e9)
            if self._cpu_cap
            else 0.0
        )
        # queues
        self._heap: list[tuple[float, int, SimRequest]] = []
        self._fifo: deque[SimRequest] = deque()
        self._waiting: list[Any] | deque[SimRequest] = self._heap if self._prio else self._fifo
        self._seq = 0
        self._running: dict[SimRequest, None] = {}
        self._prefilling: list[SimRequest] = []
        # decode aggregates
        self._it = 0
        self._n_dec = 0
        self._kv_sum = 0  # sum of decoders' KV lengths at the start of iteration _it
        self._phase = [0] * self._bs  # decoders needing a new block at iteration i: [i % bs]
        self._fin: dict[int, list[SimRequest]] = {}
        # blocks: num_gpu_blocks == _free + _private + cached (hash blocks + segments)
        self._free = c.num_gpu_blocks
        self._private = 0  # blocks of running requests not (yet) in the prefix cache
        self._gpu: dict[Hashable, int] = {}  # cached hash block -> refcount
        self._pin: dict[Hashable, float] = {}  # pinned hash block -> pinned until
        self._segs: dict[tuple[str, int], _Seg] = {}
        #: evictable units, oldest first: hash blocks (rc 0, unpinned) and segments (ev > 0)
        self._lru: OrderedDict[Any, None] = OrderedDict()
        self._n_evict = 0  # blocks they hold
        self._cpu: OrderedDict[Any, None] = OrderedDict()  # offload tier, oldest first
        self._cpu_used = 0
        self._pin_heap: list[tuple[float, int, list[Hashable], _Seg | None]] = []
        #: session -> (full blocks, block_hashes, named blocks) of its last finished request
        self._sessions: dict[str, tuple[int, tuple[int, ...] | None, int]] = {}
        self._marks: dict[str, int] = {} if session_marks is None else session_marks
        # admission memo: the head request failed with this much memory/budget at this version
        self._ver = 0
        self._blk_req: SimRequest | None = None
        self._blk_avail = 0
        self._blk_budget = 0
        self._blk_ver = -1
        # counters
        self.prompt_tokens = 0  # tokens to process over all admissions (prompt + outputs)
        self.hit_tokens = 0
        self.prefilled_tokens = 0
        self.recomputed_tokens = 0
        self.decode_tokens = 0
        self.preemptions = 0
        self.evicted_blocks = 0
        self.offloaded_blocks = 0
        self.reloaded_blocks = 0
        self.iterations = 0
        self.busy_s = 0.0
        self.idle_wait_s = 0.0
        self.submitted = 0
        self.finished = 0

    # -- driver API ----------------------------------------------------------------------------

    def submit(self, req: SimRequest, now: float) -> None:
        """Queue ``req`` (it waits until the next ``step``)."""
        if req._state != _NEW:
            raise ValueError(f"{req!r} was already submitted")
        if req.prompt_tokens < 1 or req.output_tokens < 1:
            raise ValueError(f"{req!r}: prompt_tokens and output_tokens must be >= 1")
        kv_max = req.prompt_tokens + req.output_tokens - 1  # the last token is never stored
        need = -(-kv_max // self._bs)
        if need > self.config.num_gpu_blocks:
            raise ValueError(
                f"{req!r} needs {need} KV blocks ({kv_max} tokens) but engine "
                f"{self.engine_id} has {self.config.num_gpu_blocks}: it can never run"
            )
        req._seq = self._seq
        self._seq += 1
        req._state = _WAITING
        self.submitted += 1
        if self._prio:
            heapq.heappush(self._heap, (req.priority, req._seq, req))
        else:
            self._fifo.append(req)

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def step(self, now: float) -> StepOutcome | None:
        """Run one iteration starting at ``now``; ``None`` when there is nothing to do."""
        if self._pin_heap and self._pin_heap[0][0] <= now + _EPS:
            self._expire_pins(now + _EPS)
        if not self._running and not self._waiting:
            return None
        it = self._it
        n_dec = self._n_dec
        # 1. decodes: one token each; some cross into a new block
        if n_dec:
            need = self._phase[it % self._bs]
            if need:
                if need > self._free:
                    if need > self._free + self._n_evict:
                        need = self._preempt_for_decode(it, now)
                        n_dec = self._n_dec
                    self._take(need)
                else:
                    self._free -= need
                self._private += need
        # 2. prefills (continued, then admitted), retrying after a preemption if all stalled
        started: list[SimRequest] = []
        done_prefill: list[SimRequest] = []
        if self._prefilling or self._waiting:
            while True:
                pre = self._schedule_prefills(n_dec, started, done_prefill, now)
                if n_dec or pre[0] or not self._running:
                    break
                # every running request is a prefill stalled on memory: free the least important
                self._preempt(self._victim(), it, now)
            prefill_tokens, attn2, ctx_read, reload_blocks = pre
        else:  # pure decode (running and not prefilling, so n_dec > 0): nothing to schedule
            prefill_tokens, attn2, ctx_read, reload_blocks = 0, 0.0, 0, 0
        if not n_dec and not prefill_tokens:
            return self._idle(now)
        # 3. duration
        dur = self.perf.step_time(prefill_tokens, n_dec, self._kv_sum + n_dec + ctx_read, attn2)
        if reload_blocks:
            dur += reload_blocks * self._reload_s_per_block
        end = now + dur
        # 4. effects at the end of the step
        finished: list[SimRequest] = []
        if n_dec:
            self._kv_sum += n_dec
            self.decode_tokens += n_dec
            bucket = self._fin.pop(it, None)
            if bucket:
                bs = self._bs
                phase = self._phase
                for req in bucket:
                    kv_len = req._n0 + it + 1 - req._i0
                    self._kv_sum -= kv_len
                    phase[(req._i0 - req._n0) % bs] -= 1
                    self._n_dec -= 1
                    self._finish(req, kv_len, end, finished)
        first_token: list[SimRequest] = []
        if done_prefill:
            self._prefills_done(done_prefill, it, end, first_token, finished)
        self._it = it + 1
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
        n_dec = self._n_dec
        if (
            end >= until
            or not n_dec
            or out.finished
            or out.first_token
            or not out.busy
            or self._prefilling
        ):
            return
        waiting = self._waiting
        blocked = False
        if waiting:
            # admission is impossible for the whole leap: the batch is full, the budget is
            # spent, or the head request's memo says it does not fit (memory only shrinks here)
            if len(self._running) >= self._max_seqs or self._max_tokens - n_dec <= 0:
                pass
            elif (
                (waiting[0][2] if self._prio else waiting[0]) is self._blk_req
                and self._max_tokens - n_dec >= self._blk_budget
                and self._ver == self._blk_ver
            ):
                blocked = True
            else:
                return
        pin_heap = self._pin_heap
        pin_t = pin_heap[0][0] if pin_heap else float("inf")  # no pin changes in a leap
        blk_avail = self._blk_avail
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
        phase = self._phase
        fin = self._fin
        bs = self._bs
        it = self._it
        kv_sum = self._kv_sum
        busy_s = self.busy_s
        total = 0.0
        k = 0
        bucket = None
        while end < until and pin_t > end + _EPS:
            need = phase[it % bs]
            free = self._free
            avail = free + self._n_evict
            if blocked and avail - need > blk_avail:
                break  # step() would try the admission again
            if need:
                if need > free:
                    if need > avail:
                        break  # preemption: left to step()
                    self._take(need)
                else:
                    self._free = free - need
                self._private += need
            if roof:  # RooflinePerf.step_time(0, n_dec, kv, 0.0), the same float operations
                kv = kv_sum + n_dec
                compute = c_tok + attn_s * kv
                memory = weights_s + kv_s * kv
                dur = (compute if compute > memory else memory) + overhead_s + ar_tok
            else:
                dur = step_time(0, n_dec, kv_sum + n_dec, 0.0)
            end += dur
            busy_s += dur
            total += dur
            kv_sum += n_dec
            k += 1
            it += 1
            bucket = fin.pop(it - 1, None)
            if bucket:
                break
        if not k:
            return
        self._it = it
        self._kv_sum = kv_sum
        self.busy_s = busy_s
        self.iterations += k
        self.decode_tokens += n_dec * k
        out.iterations += k
        out.duration_s += total
        out.end_s = end
        if bucket:
            finished = out.finished
            for req in bucket:
                kv_len = req._n0 + it - req._i0
                self._kv_sum -= kv_len
                phase[(req._i0 - req._n0) % bs] -= 1
                self._n_dec -= 1
                self._finish(req, kv_len, end, finished)

    def retain(self, session: str, decision: RetentionDecision, now: float) -> None:
        """Apply a retention decision to ``session``'s cached blocks (those of its last finished
        request): ``pin`` makes them unevictable until ``now + ttl_s``; ``offload`` moves the
        unused ones to the CPU tier now (no tier: same as ``lru``); ``discard`` frees the unused
        ones and drops their CPU copies now; ``lru`` leaves them to the LRU. Blocks a running
        request holds are never moved or freed."""
        action = decision.action
        if action == "lru" or not self._caching:
            return
        rec = self._sessions.get(session)
        if rec is None:
            return
        full, bh, m = rec
        hashes = bh[: min(m, full) // self._r] if bh else ()
        seg = self._segs.get((session, m))
        self._ver += 1
        if action == "pin":
            self._pin_session(hashes, seg, now + decision.ttl_s, now)
        elif action == "offload":
            if self._cpu_cap:
                self._offload_session(hashes, seg)
        elif action == "discard":
            self._discard_session(hashes, seg)
        else:
            raise ValueError(f"unknown retention action {action!r}")

    def stats(self) -> dict[str, Any]:
        n = self.config.num_gpu_blocks
        return {
            "engine": self.engine_id,
            "queue_len": len(self._waiting),
            "running": len(self._running),
            "decoding": self._n_dec,
            #: fraction of GPU KV blocks not reclaimable now (running requests + pinned)
            "kv_used_frac": 1.0 - (self._free + self._n_evict) / n,
            "kv_cached_blocks": n - self._free - self._private,
            "kv_evictable_blocks": self._n_evict,
            "kv_free_blocks": self._free,
            "cpu_cached_blocks": self._cpu_used,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "decode_tokens": self.decode_tokens,
            "preemptions": self.preemptions,
            "evicted_blocks": self.evicted_blocks,
            "offloaded_blocks": self.offloaded_blocks,
            "reloaded_blocks": self.reloaded_blocks,
            "iterations": self.iterations,
            "busy_s": self.busy_s,
            "idle_wait_s": self.idle_wait_s,
            "submitted": self.submitted,
            "finished": self.finished,
        }

    # -- cache queries (routing by KV residency) -------------------------------------------------

    def session_blocks(self, session: str) -> tuple[int, int]:
        """(GPU, CPU) blocks still cached of ``session``'s last finished request."""
        rec = self._sessions.get(session)
        if rec is None:
            return (0, 0)
        full, bh, m = rec
        r = self._r
        on_gpu = on_cpu = 0
        for h in bh[: min(m, full) // r] if bh else ():
            if h in self._gpu:
                on_gpu += r
            elif h in self._cpu:
                on_cpu += r
        seg = self._segs.get((session, m))
        if seg is not None:
            on_gpu += seg.g - seg.lo
            on_cpu += seg.c - seg.g
        return on_gpu, on_cpu

    @property
    def next_pin_expiry(self) -> float | None:
        return self._pin_heap[0][0] if self._pin_heap else None

    # -- scheduling ------------------------------------------------------------------------------

    def _schedule_prefills(
        self,
        n_dec: int,
        started: list[SimRequest],
        done_prefill: list[SimRequest],
        now: float,
    ) -> tuple[int, float, int, int]:
        """Continue chunked prefills, then admit waiting requests. Returns (prefill tokens,
        attention pairs, prefix tokens read, blocks reloaded from the CPU tier)."""
        budget = self._max_tokens - n_dec
        bs = self._bs
        prefill_tokens = 0
        attn2 = 0.0
        ctx_read = 0
        reload_blocks = 0
        if self._prefilling and budget > 0:
            keep: list[SimRequest] = []
            for req in self._prefilling:
                if budget <= 0:
                    keep.append(req)
                    continue
                c = req.num_computed
                chunk = req._target - c
                if chunk > budget:
                    chunk = budget
                have = -(-c // bs)
                new = -(-(c + chunk) // bs) - have
                avail = self._free + self._n_evict
                if new > avail:
                    chunk = (have + avail) * bs - c
                    if chunk <= 0:
                        keep.append(req)  # stalled on memory
                        continue
                    new = avail
                if new:
                    self._take(new)
                    self._private += new
                attn2 += chunk * c + chunk * (chunk + 1) / 2
                ctx_read += c
                prefill_tokens += chunk
                budget -= chunk
                self._computed(req, c, chunk)
                if req.num_computed == req._target:
                    done_prefill.append(req)
                else:
                    keep.append(req)
            self._prefilling = keep
        waiting = self._waiting
        if waiting and budget > 0 and len(self._running) < self._max_seqs:
            prio = self._prio
            while waiting and budget > 0 and len(self._running) < self._max_seqs:
                req = waiting[0][2] if prio else waiting[0]
                avail = self._free + self._n_evict
                if (
                    req is self._blk_req
                    and avail <= self._blk_avail
                    and budget >= self._blk_budget
                    and self._ver == self._blk_ver
                ):
                    break  # nothing that could let it in has changed
                got = self._admit(req, budget, avail)
                if got < 0:
                    self._blk_req = req
                    self._blk_avail = avail
                    self._blk_budget = budget
                    self._blk_ver = self._ver
                    break
                if prio:
                    heapq.heappop(self._heap)
                else:
                    self._fifo.popleft()
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
                self._computed(req, c, chunk)
                self._running[req] = None
                if req.num_computed == req._target:
                    done_prefill.append(req)
                else:
                    req._state = _PREFILL
                    self._prefilling.append(req)
        return prefill_tokens, attn2, ctx_read, reload_blocks

    def _named(self, bh: tuple[int, ...] | None, prompt_tokens: int) -> int:
        """Leading blocks named by ``bh``: whole hash blocks inside the prompt."""
        if not bh:
            return 0
        n = prompt_tokens // (self._r * self._bs)
        return (n if n < len(bh) else len(bh)) * self._r

    def _admit(self, req: SimRequest, budget: int, avail: int) -> int:
        """Check-then-commit: find the prefix hit, allocate blocks for the first chunk. Returns
        the blocks reloaded from the CPU tier, or -1 when the first chunk does not fit."""
        bs, r = self._bs, self._r
        target = req.prompt_tokens + req.num_output
        maxk = (target - 1) // bs  # at least one token is always computed
        bh = req.block_hashes
        m = self._named(bh, req.prompt_tokens)
        n_exp = exp_cpu = exp_take = 0
        seg: _Seg | None = None
        seg_hit = seg_reload = seg_take = 0
        if self._caching and maxk:
            gpu, cpu, lru = self._gpu, self._cpu, self._lru
            if m:
                jmax = (m if m < maxk else maxk) // r
                while n_exp < jmax:
                    h = bh[n_exp]  # type: ignore[index]
                    rc = gpu.get(h)
                    if rc is None:
                        if h not in cpu:
                            break
                        exp_cpu += 1
                    elif rc == 0 and h in lru:
                        exp_take += 1
                    n_exp += 1
            if n_exp * r == m < maxk:
                seg = self._segs.get((req.session, m))
                if seg is not None and seg.c > m:
                    end = seg.c if seg.c < maxk else maxk
                    seg_hit = end - m
                    if end > seg.g:
                        seg_reload = end - seg.g
                    elif not seg.pin_until:
                        floor = seg.floor()
                        if end > floor:
                            seg_take = end - floor
                    if seg_reload and not seg.pin_until:
                        seg_take = seg.ev  # all of [floor, g) becomes held
        n_hit = n_exp * r + seg_hit
        hit = n_hit * bs
        chunk = target - hit
        if chunk > budget:
            chunk = budget
        new = -(-(hit + chunk) // bs) - n_hit
        reload = exp_cpu * r + seg_reload
        if new + reload > avail - exp_take * r - seg_take:
            return -1
        # commit
        if n_exp:
            gpu, cpu, lru = self._gpu, self._cpu, self._lru
            for j in range(n_exp):
                h = bh[j]  # type: ignore[index]
                rc = gpu.get(h)
                if rc is None:  # reloaded from the CPU tier
                    del cpu[h]
                    self._cpu_used -= r
                    gpu[h] = 1
                else:
                    if rc == 0 and h in lru:
                        del lru[h]
                        self._n_evict -= r
                    gpu[h] = rc + 1
        if seg_hit:
            assert seg is not None
            end = m + seg_hit
            if seg_reload:
                self._cpu_used -= seg_reload
                seg.g = end
                if seg.c == end:
                    del self._cpu[seg]
            seg.users[req] = end
            self._sync(seg, _KEEP)
            req._seg = seg
        self._take(new + reload)  # ``reload`` of them now hold the reloaded blocks
        self._private += new
        self.reloaded_blocks += reload
        req._n_hit = n_hit
        req._n_exp = n_exp
        req._m = m
        req._target = target
        req.num_computed = hit
        self.prompt_tokens += target
        self.hit_tokens += hit
        return reload

    def _computed(self, req: SimRequest, c: int, chunk: int) -> None:
        """Account ``chunk`` prefilled tokens after ``c`` (recompute is judged per session)."""
        end = c + chunk
        req.num_computed = end
        self.prefilled_tokens += chunk
        marks = self._marks
        mark = marks.get(req.session, 0)
        if c < mark:
            self.recomputed_tokens += (end if end < mark else mark) - c
        if end > mark:
            marks[req.session] = end

    def _prefills_done(
        self,
        reqs: list[SimRequest],
        it: int,
        end: float,
        first_token: list[SimRequest],
        finished: list[SimRequest],
    ) -> None:
        """Prefill complete: the step sampled one output token; continue as a decoder."""
        bs = self._bs
        nxt = it + 1
        for req in reqs:
            req.num_output += 1
            if req.first_token_s < 0:
                req.first_token_s = end
                first_token.append(req)
            n0 = req.num_computed
            left = req.output_tokens - req.num_output
            if left <= 0:
                self._finish(req, n0, end, finished)
                continue
            req._state = _DECODE
            req._i0 = nxt
            req._n0 = n0
            req._o0 = req.num_output
            fin_it = nxt + left - 1
            req._fin_it = fin_it
            bucket = self._fin.get(fin_it)
            if bucket is None:
                self._fin[fin_it] = [req]
            else:
                bucket.append(req)
            self._phase[(nxt - n0) % bs] += 1
            self._kv_sum += n0
            self._n_dec += 1

    def _finish(self, req: SimRequest, kv_len: int, end: float, out: list[SimRequest]) -> None:
        del self._running[req]
        req.num_output = req.output_tokens
        req.num_computed = kv_len
        req.finished_s = end
        req._state = _DONE
        marks = self._marks
        if kv_len > marks.get(req.session, 0):
            marks[req.session] = kv_len
        self._release(req, kv_len)
        if self._caching:
            self._sessions[req.session] = (kv_len // self._bs, req.block_hashes, req._m)
        self.finished += 1
        out.append(req)

    def _idle(self, now: float) -> StepOutcome:
        """Requests wait, nothing can run: KV is held by pinned sessions. Wait for a pin."""
        t = self.next_pin_expiry
        if t is None:
            raise RuntimeError(
                f"engine {self.engine_id}: {len(self._waiting)} requests wait, none can be "
                f"admitted and nothing holds memory (free={self._free}): a bug"
            )
        dur = max(t - now, 0.0)
        self.idle_wait_s += dur
        return StepOutcome(dur, busy=False, end_s=now + dur)

    # -- preemption ------------------------------------------------------------------------------

    def _victim(self) -> SimRequest:
        """The running request to preempt: lowest priority (highest value), latest arrival."""
        if self._prio:
            return max(self._running, key=lambda r: (r.priority, r._seq))
        return max(self._running, key=lambda r: r._seq)

    def _preempt_for_decode(self, it: int, now: float) -> int:
        """Preempt until this iteration's decode blocks fit; returns the (new) block need."""
        need = self._phase[it % self._bs]
        while need > self._free + self._n_evict and self._running:
            self._preempt(self._victim(), it, now)
            need = self._phase[it % self._bs] if self._n_dec else 0
        return need

    def _preempt(self, req: SimRequest, it: int, now: float) -> None:
        del self._running[req]
        if req._state == _DECODE:
            steps = it - req._i0
            kv_len = req._n0 + steps
            req.num_output = req._o0 + steps
            self._kv_sum -= kv_len
            self._phase[(req._i0 - req._n0) % self._bs] -= 1
            self._n_dec -= 1
            bucket = self._fin[req._fin_it]
            bucket.remove(req)
            if not bucket:
                del self._fin[req._fin_it]
        else:
            self._prefilling.remove(req)
            kv_len = req.num_computed
            self.prompt_tokens -= req._target - kv_len  # the part it never got through
        marks = self._marks
        if kv_len > marks.get(req.session, 0):
            marks[req.session] = kv_len
        self._release(req, kv_len)
        req.num_computed = 0
        req._n_hit = req._n_exp = 0
        req.preempted += 1
        self.preemptions += 1
        req._state = _WAITING
        if self._prio:
            heapq.heappush(self._heap, (req.priority, req._seq, req))
        else:
            self._fifo.appendleft(req)

    # -- blocks ----------------------------------------------------------------------------------

    def _take(self, n: int) -> None:
        """Allocate ``n`` free blocks, evicting unused cached ones (oldest first) as needed."""
        free = self._free
        if n <= free:
            self._free = free - n
            return
        lru = self._lru
        cap = self._cpu_cap
        r = self._r
        evicted = 0
        while free + evicted < n:
            k = next(iter(lru))
            if type(k) is _Seg:
                t = n - free - evicted
                if t >= k.ev:
                    t = k.ev
                    del lru[k]
                k.ev -= t
                k.g -= t  # the CPU range [g, c) grows down with it when there is a tier
                if cap:
                    self._cpu_used += t
                    self._cpu[k] = None
                    self._cpu.move_to_end(k)
                    self.offloaded_blocks += t
                else:
                    k.c = k.g
                    if k.g == k.lo and not k.users and not k.pin_until:
                        del self._segs[k.key]
                self._n_evict -= t
                evicted += t
            else:
                del lru[k]
                del self._gpu[k]
                self._n_evict -= r
                evicted += r
                if cap:
                    self._cpu[k] = None
                    self._cpu_used += r
                    self.offloaded_blocks += r
        self.evicted_blocks += evicted
        self._free = free + evicted - n
        if cap and self._cpu_used > cap:
            self._cpu_room()

    def _cpu_room(self) -> None:
        """Drop the oldest CPU-tier blocks (segment tails first) until the tier fits."""
        cpu = self._cpu
        cap = self._cpu_cap
        while self._cpu_used > cap:
            k = next(iter(cpu))
            if type(k) is _Seg:
                t = min(k.c - k.g, self._cpu_used - cap)
                k.c -= t
                self._cpu_used -= t
                if k.c == k.g:
                    del cpu[k]
                    if k.g == k.lo and not k.users and not k.pin_until:
                        del self._segs[k.key]
            else:
                del cpu[k]
                self._cpu_used -= self._r

    def _sync(self, seg: _Seg, where: int) -> None:
        """Recount a segment's evictable blocks after a change; place it in the LRU."""
        ev = 0 if seg.pin_until else seg.g - seg.floor()
        self._n_evict += ev - seg.ev
        seg.ev = ev
        lru = self._lru
        if ev > 0:
            if where == _MRU:
                lru[seg] = None
                lru.move_to_end(seg)
            elif where == _FIRST:
                lru[seg] = None
                lru.move_to_end(seg, last=False)
            elif seg not in lru:
                lru[seg] = None
        else:
            lru.pop(seg, None)
            if seg.c == seg.lo and not seg.users and not seg.pin_until:
                self._segs.pop(seg.key, None)

    def _release(self, req: SimRequest, kv_len: int) -> None:
        """Give back ``req``'s blocks: full ones join the prefix cache (its session segment
        becomes the most recent, ahead of its hash blocks, tail first), the rest are freed."""
        bs, r = self._bs, self._r
        n_hit = req._n_hit
        private = -(-kv_len // bs) - n_hit
        freed = private
        seg = req._seg
        if seg is not None:
            del seg.users[req]
            req._seg = None
        if self._caching:
            self._ver += 1
            full = kv_len // bs
            m = req._m
            n_exp = req._n_exp
            if full > m:  # session-named blocks [m, full)
                if seg is None:
                    key = (req.session, m)
                    seg = self._segs.get(key)
                    if seg is None:
                        seg = self._segs[key] = _Seg(key, m)
                if full > seg.g:
                    start = m + n_hit - n_exp * r  # where our private session blocks begin
                    if start < seg.g:
                        start = seg.g  # [start, g) duplicates cached content: freed
                    if seg.c > seg.g:  # CPU copies of [g, full) are superseded
                        self._cpu_used -= (seg.c if seg.c < full else full) - seg.g
                    freed -= full - start
                    seg.g = full
                    if seg.c <= full:
                        seg.c = full
                        self._cpu.pop(seg, None)
            if seg is not None:
                self._sync(seg, _MRU)
            bh = req.block_hashes
            if bh:
                gpu, cpu, lru, pin = self._gpu, self._cpu, self._lru, self._pin
                order: list[Hashable] = []  # becoming evictable, tail first
                for j in range((m if m < full else full) // r - 1, n_exp - 1, -1):
                    h = bh[j]
                    if h in gpu:
                        continue  # the same content was cached meanwhile: ours is freed
                    if h in cpu:
                        del cpu[h]
                        self._cpu_used -= r
                    gpu[h] = 0
                    freed -= r
                    order.append(h)
                for j in range(n_exp - 1, -1, -1):
                    h = bh[j]
                    rc = gpu[h] - 1
                    gpu[h] = rc
                    if rc == 0 and h not in pin:
                        order.append(h)
                if order:
                    lru.update(dict.fromkeys(order))
                    self._n_evict += r * len(order)
        elif seg is not None:
            self._sync(seg, _KEEP)
        self._private -= private
        self._free += freed

    # -- retention -------------------------------------------------------------------------------

    def _pin_session(
        self, hashes: tuple[int, ...], seg: _Seg | None, until: float, now: float
    ) -> None:
        if until <= now:
            return
        gpu, lru, pin = self._gpu, self._lru, self._pin
        pinned: list[Hashable] = []
        for h in hashes:
            if h not in gpu:
                continue
            if pin.get(h, -1.0) < until:
                pin[h] = until
            if h in lru:
                del lru[h]
                self._n_evict -= self._r
            pinned.append(h)
        if seg is not None and seg.g > seg.lo:
            if seg.pin_until < until:
                seg.pin_until = until
            self._sync(seg, _KEEP)
        else:
            seg = None
        if pinned or seg is not None:
            heapq.heappush(self._pin_heap, (until, self._seq, pinned, seg))
            self._seq += 1

    def _expire_pins(self, now: float) -> None:
        heap, pin, gpu, lru = self._pin_heap, self._pin, self._gpu, self._lru
        self._ver += 1
        while heap and heap[0][0] <= now:
            _, _, hashes, seg = heapq.heappop(heap)
            for h in hashes:  # prefix first, each put at the front: the tail goes first
                until = pin.get(h)
                if until is None or until > now:
                    continue
                del pin[h]
                if gpu.get(h) == 0:
                    lru[h] = None
                    lru.move_to_end(h, last=False)
                    self._n_evict += self._r
            if seg is not None and 0 < seg.pin_until <= now:
                seg.pin_until = 0.0
                self._sync(seg, _FIRST)  # ahead of its hash blocks: evicted first

    def _offload_session(self, hashes: tuple[int, ...], seg: _Seg | None) -> None:
        r = self._r
        cpu = self._cpu
        if seg is not None:
            seg.pin_until = 0.0
            floor = seg.floor()
            t = seg.g - floor
            if t > 0:
                seg.g = floor  # [floor, c) is now in the tier
                self._free += t
                self._cpu_used += t
                self.offloaded_blocks += t
                cpu[seg] = None
                cpu.move_to_end(seg)
            self._sync(seg, _KEEP)
        gpu = self._gpu
        for h in reversed(hashes):  # tail first: it is evicted first from the tier
            if gpu.get(h) == 0:
                self._drop_gpu(h)
                cpu[h] = None
                self._cpu_used += r
                self.offloaded_blocks += r
        if self._cpu_used > self._cpu_cap:
            self._cpu_room()

    def _discard_session(self, hashes: tuple[int, ...], seg: _Seg | None) -> None:
        if seg is not None:
            seg.pin_until = 0.0
            floor = seg.floor()
            if seg.c > seg.g:
                self._cpu_used -= seg.c - seg.g
                del self._cpu[seg]
            self._free += seg.g - floor
            seg.g = seg.c = floor
            self._sync(seg, _KEEP)
        gpu, cpu = self._gpu, self._cpu
        for h in hashes:
            if gpu.get(h) == 0:
                self._drop_gpu(h)
            elif h in cpu:
                del cpu[h]
                self._cpu_used -= self._r

    def _drop_gpu(self, h: Hashable) -> None:
        """Free an unused cached hash block now."""
        del self._gpu[h]
        if h in self._lru:
            del self._lru[h]
            self._n_evict -= self._r
        self._pin.pop(h, None)
        self._free += self._r

    # -- checks ----------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Recompute every aggregate from scratch and compare (tests; O(blocks + requests))."""
        c = self.config
        r = self._r
        gpu, lru, cpu, pin = self._gpu, self._lru, self._cpu, self._pin
        assert self._free >= 0, self._free
        cached = len(gpu) * r + sum(s.g - s.lo for s in self._segs.values())
        assert self._free + self._private + cached == c.num_gpu_blocks, (
            self._free,
            self._private,
            cached,
        )
        segs = set(map(id, self._segs.values()))
        n_evict = 0
        for k in lru:
            if type(k) is _Seg:
                assert id(k) in segs and k.ev > 0, k
            else:
                assert gpu[k] == 0 and k not in pin
                n_evict += r
        for h, rc in gpu.items():
            assert rc >= 0 and h not in cpu
            if rc == 0 and h not in pin:
                assert h in lru
        assert pin.keys() <= gpu.keys()
        cpu_used = 0
        for k in cpu:
            if type(k) is _Seg:
                assert id(k) in segs and k.c > k.g, k
                cpu_used += k.c - k.g
            else:
                cpu_used += r
        assert cpu_used == self._cpu_used <= self._cpu_cap, (cpu_used, self._cpu_used)
        for key, s in self._segs.items():
            assert s.key == key and key[1] == s.lo <= s.g <= s.c, s
            assert (s.c > s.g) == (s in cpu), s
            floor = s.floor()
            assert s.lo <= floor <= s.g, s
            ev = 0 if s.pin_until else s.g - floor
            assert s.ev == ev and (ev > 0) == (s in lru), (s, s.ev, ev)
            n_evict += ev
            for u, end in s.users.items():
                assert u in self._running and u._seg is s and end > s.lo
        assert n_evict == self._n_evict, (n_evict, self._n_evict)
        bs = self._bs
        it = self._it
        refs: dict[Hashable, int] = {}
        private = kv_sum = n_dec = 0
        phase = [0] * bs
        for req in self._running:
            if req._state == _DECODE:
                kv_len = req._n0 + it - req._i0
                kv_sum += kv_len
                n_dec += 1
                phase[(req._i0 - req._n0) % bs] += 1
                assert req in self._fin[req._fin_it]
            else:
                assert req._state == _PREFILL and req in self._prefilling
                kv_len = req.num_computed
            private += -(-kv_len // bs) - req._n_hit
            for j in range(req._n_exp):
                h = req.block_hashes[j]  # type: ignore[index]
                refs[h] = refs.get(h, 0) + 1
            if req._seg is not None:
                assert req._seg.users[req] == req._n_hit - req._n_exp * r + req._m
        assert private == self._private, (private, self._private)
        assert kv_sum == self._kv_sum and n_dec == self._n_dec, (kv_sum, self._kv_sum)
        assert phase == self._phase, (phase, self._phase)
        for h, rc in gpu.items():
            assert rc == refs.get(h, 0), (h, rc, refs.get(h, 0))
        assert len(self._prefilling) + n_dec == len(self._running)
        assert sum(len(b) for b in self._fin.values()) == n_dec
        assert self.prompt_tokens == self.hit_tokens + self.prefilled_tokens + sum(
            r._target - r.num_computed for r in self._prefilling
        )

    def __repr__(self) -> str:
        return (
            f"<EngineModel {self.engine_id} running={len(self._running)} "
            f"waiting={len(self._waiting)} it={self._it}>"
        )
