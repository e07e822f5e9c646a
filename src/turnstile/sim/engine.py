"""An iteration-level model of a continuous-batching engine.

One :meth:`EngineModel.step` is one engine iteration: every running decode emits one token,
chunked prefills continue, and waiting requests are admitted while the token budget,
``max_num_seqs`` and free KV blocks allow. Its duration comes from a
:class:`~turnstile.sim.perf.PerfModel` fed with O(1) running sums.

KV memory is paged in blocks of ``block_size`` tokens with a prefix cache (automatic prefix caching
of whole blocks): the full blocks of a finished (or preempted) request stay cached, unused ones sit
in an LRU list until an allocation evicts them (to the CPU offload tier when there is one),
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
* ``resume(outcome, now, until)`` (optional), at ``now = outcome.end_s``: when the leap stopped
  only at ``until`` and nothing reached the engine since (no submit, retention or step), it
  continues the same decode run in ``outcome`` instead of a ``step``; False means "call
  ``step``".
* ``step_and_leap(now, until, decodes_only(now))`` (optional) is ``step`` then ``leap`` in one
  call; a pure decode iteration (``decodes_only``) runs as the leap's first, without a step.
* ``lazy = True`` (set by :class:`~turnstile.sim.cluster.ClusterSim`; not with an offload
  tier): ``leap``, ``step_and_leap`` and ``resume`` only *plan* the leap, to its natural end or
  the optional ``horizon``, ending at ``lazy_end``; nothing is recorded until the driver calls
  ``fire(outcome)`` at that end or ``materialise(t)`` when something reaches the engine
  earlier (before ``submit``/``retain``), which records the iterations starting before ``t``.
* Requests are :class:`SimRequest` objects the driver creates; the engine fills in progress
  fields. ``num_output`` of a *decoding* request is only brought up to date at events
  (preemption, finish); everything else is exact at all times.

The model is split into small parts; this module is the façade:

* :mod:`turnstile.sim.request`: :class:`SimRequest` and :class:`StepOutcome`;
* :mod:`turnstile.sim.engine_config`: :class:`EngineConfig`;
* :mod:`turnstile.sim.block_pool`: the block pool and prefix cache (check-then-commit
  ``match_prefix`` / ``can_allocate`` / ``allocate``, ``release`` inserts, ``evict``), with
  retention (pin / offload / discard) in :mod:`turnstile.sim.kv_retention`;
* :mod:`turnstile.sim.slot_pool`: slot-limited KV instead (``EngineConfig.kv_slots``: one
  sequence per slot), behind the same interface;
* :mod:`turnstile.sim.batch_scheduler`: waiting queue, running batch, admission, chunked
  prefill, preemption;
* :mod:`turnstile.sim.step`: the step executor (``step`` and ``leap``).

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
iteration. The session-named blocks of a session form one *segment* that caches, evicts (tail first,
as paged engines free blocks in reverse) and offloads as a range in O(1); hash-named blocks are
cached one hash block at a time. The LRU therefore orders segments and hash blocks, not single
blocks: a segment's tail is evicted first, and a whole segment is as recent as its last release.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from turnstile.sim.batch_scheduler import BatchScheduler
from turnstile.sim.block_pool import BlockPool
from turnstile.sim.engine_config import EngineConfig
from turnstile.sim.engine_profile import EngineProfile, profile_for
from turnstile.sim.lanes import Lanes
from turnstile.sim.perf import PerfModel
from turnstile.sim.request import NEW, SimRequest, StepOutcome
from turnstile.sim.slot_pool import SlotPool
from turnstile.sim.step import StepExecutor

if TYPE_CHECKING:
    from turnstile.core.actions import RetentionDecision

__all__ = ["EngineConfig", "EngineModel", "SimRequest", "StepOutcome"]


class EngineModel(StepExecutor):
    """One simulated engine (one model replica, possibly tensor-parallel)."""

    def __init__(
        self,
        engine_id: str,
        config: EngineConfig,
        perf: PerfModel,
        *,
        session_marks: dict[str, int] | None = None,
        profile: EngineProfile | None = None,
    ) -> None:
        """``session_marks`` (optional) maps session → tokens of its context ever computed; pass
        one dict to every engine of a cluster so a session re-prefilled on *another* engine
        counts as recomputed too (by default recompute is judged per engine). ``profile``: what
        the modelled engine does differently (default: the profile of the engine ``perf``
        was fitted on, else the generic one); its ``server_slot`` rule places requests in
        slots."""
        self.engine_id = engine_id
        self.config = config
        self.perf = perf
        if profile is None:
            profile = profile_for(getattr(perf, "engine", ""))
        self.profile = profile
        # slot-limited KV has the block pool's interface
        self.pool = (SlotPool(config, profile.server_slot) if config.kv_slots
                     else BlockPool(config))
        self.sched = BatchScheduler(config, self.pool, session_marks)
        lane_ubatch = int(getattr(perf, "lane_ubatch", 0) or 0)
        if lane_ubatch:  # the perf model prices the passes the slots cut a step into
            self.sched.lanes = Lanes(config.kv_slots or config.max_num_seqs, lane_ubatch,
                                     profile.server_slot)
        self.reload_s_per_block = (
            config.block_size * perf.kv_bytes_per_token / (config.cpu_bandwidth_gbps * 1e9)
            if self.pool.cpu_cap
            else 0.0
        )
        self._init_executor()

    # -- driver API ----------------------------------------------------------------------------

    def submit(self, req: SimRequest, now: float) -> None:
        """Queue ``req`` (it waits until the next ``step``)."""
        if req._state != NEW:
            raise ValueError(f"{req!r} was already submitted")
        if req.prompt_tokens < 1 or req.output_tokens < 1:
            raise ValueError(f"{req!r}: prompt_tokens and output_tokens must be >= 1")
        kv_max = req.prompt_tokens + req.output_tokens - 1  # the last token is never stored
        need = -(-kv_max // self.config.block_size)
        if need > self.config.num_gpu_blocks:
            raise ValueError(
                f"{req!r} needs {need} KV blocks ({kv_max} tokens) but engine "
                f"{self.engine_id} has {self.config.num_gpu_blocks}: it can never run"
            )
        if self.config.kv_slots and kv_max > self.config.slot_tokens:
            raise ValueError(
                f"{req!r} needs {kv_max} KV tokens but a slot of engine {self.engine_id} holds "
                f"{self.config.slot_tokens}: it can never run"
            )
        self._cut_out = None
        if self.config.kv_slots:
            self.pool.forward(req, now)  # type: ignore[union-attr]
        self.sched.add(req)

    def has_work(self) -> bool:
        return bool(self.sched.running or self.sched.waiting)

    def retain(self, session: str, decision: RetentionDecision, now: float) -> None:
        """Apply a retention decision to ``session``'s cached blocks (those of its last finished
        request): ``pin`` makes them unevictable until ``now + ttl_s``; ``offload`` moves the
        unused ones to the CPU tier now (no tier: same as ``lru``); ``discard`` frees the unused
        ones and drops their CPU copies now; ``lru`` leaves them to the LRU. Blocks a running
        request holds are never moved or freed. On an engine whose profile cannot pin
        (``kv_pinning=False``) every decision is ``lru``: a no-op, as behind the gateway."""
        if not self.profile.kv_pinning:
            return
        self._cut_out = None
        self.pool.retain(session, decision, now)

    def session_blocks(self, session: str) -> tuple[int, int]:
        """(GPU, CPU) blocks still cached of ``session``'s last finished request."""
        return self.pool.session_blocks(session)

    @property
    def next_pin_expiry(self) -> float | None:
        return self.pool.next_pin_expiry

    @property
    def queue_len(self) -> int:
        """Requests waiting to be admitted."""
        return len(self.sched.waiting)

    def stats(self) -> dict[str, Any]:
        n = self.config.num_gpu_blocks
        pool, s = self.pool, self.sched
        return {
            "engine": self.engine_id,
            "queue_len": len(s.waiting),
            "running": len(s.running),
            "decoding": s.n_dec,
            #: fraction of GPU KV blocks not reclaimable now (running requests + pinned)
            "kv_used_frac": 1.0 - (pool.free + pool.n_evict) / n,
            "kv_cached_blocks": n - pool.free - pool.private,
            "kv_evictable_blocks": pool.n_evict,
            "kv_free_blocks": pool.free,
            "cpu_cached_blocks": pool.cpu_used,
            "prompt_tokens": s.prompt_tokens,
            "hit_tokens": s.hit_tokens,
            "prefilled_tokens": s.prefilled_tokens,
            "recomputed_tokens": s.recomputed_tokens,
            "decode_tokens": self.decode_tokens,
            "preemptions": s.preemptions,
            "evicted_blocks": pool.evicted_blocks,
            "offloaded_blocks": pool.offloaded_blocks,
            "reloaded_blocks": pool.reloaded_blocks,
            "iterations": self.iterations,
            "busy_s": self.busy_s,
            "idle_wait_s": self.idle_wait_s,
            "submitted": s.submitted,
            "finished": s.finished,
        }

    def check_integrity(self) -> None:
        """Recompute every aggregate from scratch and compare (tests; O(blocks + requests))."""
        self.sched.check_integrity()

    def __repr__(self) -> str:
        return (
            f"<EngineModel {self.engine_id} running={len(self.sched.running)} "
            f"waiting={len(self.sched.waiting)} it={self.sched.it}>"
        )
