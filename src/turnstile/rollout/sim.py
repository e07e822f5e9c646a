"""A fast rollout simulator: buckets of continuous-batching engines on a virtual clock.

Each engine is modelled at iteration level — a vLLM-like continuous-batching loop whose iteration
time comes from :class:`turnstile.sim.perf.PerfModel` (``RooflinePerf`` for the named GPU, model
and TP by default) — but it does not pay one Python event per iteration. Between two events that
change its batch (a sequence finishing its turn, a prefill chunk, a new request joining) the batch
is constant, and only the KV read grows, by one token per decoding sequence per iteration. The
engine therefore *leaps*: it evaluates ``step_time`` at the first and last iteration of the span
and sums the arithmetic series (exact when step time is affine in the KV read, as the roofline
is within each of its two regimes; an upper bound at a regime change). A request arriving in the
middle of a leap cuts it at the end of the iteration in progress, where the request joins, as in
a real engine. ``max_leap_iters=1`` gives the plain iteration-by-iteration loop (the reference
the tests compare against).

Engines model KV memory in tokens: a turn reserves its prompt and output on admission; a finished
turn's KV stays cached (LRU) while its trajectory runs tools, and is evicted when an admission
needs the room; a turn whose trajectory's KV is cached on its engine prefills only its new input,
otherwise its whole prompt (a migration, or an eviction, re-prefills). Admission is FCFS with
head-of-line blocking on memory, ``max_num_seqs`` running, and chunked prefill under a token
budget.

The driver runs trajectories through a :class:`~turnstile.rollout.routing.RolloutRouter`: a turn
is placed when it becomes ready, tool calls run for their durations after the turn, and the
router hears every turn end, tool return and trajectory end. The engine pool is elastic:
engines join (after a weight-loading delay) and drain (no new placements; the trajectories whose
KV lives there either finish there or migrate at their next turn, never dropped) at any time.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from turnstile.rollout.routing import RolloutRouter
from turnstile.rollout.state import EngineInfo, PoolView, ToolResult, TrajectoryState
from turnstile.rollout.workload import RolloutTrajectory
from turnstile.sim.kernel import EventQueue
from turnstile.sim.perf import PerfModel, RooflinePerf, kv_capacity_tokens, load_gpu, load_model

__all__ = [
    "BatchResult",
    "Bucket",
    "DrainMode",
    "RolloutSim",
    "SimConfig",
    "format_mix",
    "parse_mix",
    "simulate_batch",
]

DrainMode = Literal["finish", "migrate"]

# event kinds
_ENGINE, _TOOL, _POOL, _ARRIVE = range(4)


@dataclass(frozen=True, slots=True)
class Bucket:
    """``count`` engines of tensor parallelism ``tp``."""

    tp: int
    count: int

    @property
    def gpus(self) -> int:
        return self.tp * self.count

    @property
    def name(self) -> str:
        return f"tp{self.tp}x{self.count}"


def parse_mix(text: str) -> tuple[Bucket, ...]:
    """``"tp1x8,tp2x2,tp4x1"`` → buckets (counts of 0 are dropped)."""
    out: list[Bucket] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        p = part.lower()
        if not p.startswith("tp") or "x" not in p:
            raise ValueError(f"bad bucket {part!r}: expected tpNxM, e.g. tp2x4")
        tp_s, n_s = p[2:].split("x", 1)
        tp, n = int(tp_s), int(n_s)
        if tp < 1 or n < 0:
            raise ValueError(f"bad bucket {part!r}")
        if n:
            out.append(Bucket(tp, n))
    if not out:
        raise ValueError(f"no engines in mix {text!r}")
    return tuple(sorted(out, key=lambda b: b.tp))


def format_mix(buckets: Iterable[Bucket]) -> str:
    return ",".join(b.name for b in sorted(buckets, key=lambda b: b.tp) if b.count)


@dataclass(frozen=True)
class SimConfig:
    """Engine and pool knobs of the rollout simulator."""

    gpu: str = "H100"
    model: str = "qwen3-8b"
    gpu_mem_util: float = 0.9
    #: KV capacity per engine in tokens (None: from the GPU memory, the model and the TP)
    kv_tokens: int | None = None
    max_num_seqs: int = 128
    max_batched_tokens: int = 8192
    #: 0: leap to the next event; n: at most n iterations per leap (1 = no leaping)
    max_leap_iters: int = 0
    #: an engine joining the pool loads weights for this long before it takes work
    engine_start_s: float = 20.0
    #: what a draining engine's trajectories do: finish there, or move at their next turn
    drain_mode: DrainMode = "finish"
    #: tp → performance model (tests inject simple ones); default: the roofline of gpu/model
    perf: Callable[[int], PerfModel] | None = None

    def perf_for(self, tp: int) -> PerfModel:
        if self.perf is not None:
            return self.perf(tp)
        return RooflinePerf(load_gpu(self.gpu), load_model(self.model), tp=tp)

    def kv_for(self, tp: int) -> int:
        if self.kv_tokens is not None:
            return self.kv_tokens
        return kv_capacity_tokens(load_gpu(self.gpu), load_model(self.model), tp,
                                  self.gpu_mem_util)

    def describe(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "model": self.model,
            "gpu_mem_util": self.gpu_mem_util,
            "kv_tokens": self.kv_tokens,
            "max_num_seqs": self.max_num_seqs,
            "max_batched_tokens": self.max_batched_tokens,
            "max_leap_iters": self.max_leap_iters,
            "engine_start_s": self.engine_start_s,
            "drain_mode": self.drain_mode,
            "perf": "custom" if self.perf is not None else "roofline",
        }


# ------------------------------------------------------------------------------ records


class _Traj:
    __slots__ = ("batch", "charged", "pinned", "spec", "state", "turn")

    def __init__(self, spec: RolloutTrajectory, batch: int, arrival_s: float) -> None:
        self.spec = spec
        self.batch = batch
        self.turn = 0
        self.pinned = False
        #: context tokens counted in its home engine's ``open_tokens``
        self.charged = 0
        self.state = TrajectoryState(
            spec.id,
            spec.prompt_id,
            sample=spec.sample,
            step=spec.step,
            arrival_s=arrival_s,
            prompt_tokens=spec.prompt_tokens,
            hint=spec.hint,
        )


class _Req:
    __slots__ = ("context", "enq_s", "fin_it", "hit", "left", "output", "prompt", "reserve",
                 "s_term", "seq", "traj")

    def __init__(self, traj: _Traj, prompt: int, context: int, output: int, enq_s: float,
                 seq: int) -> None:
        self.traj = traj
        self.prompt = prompt
        #: tokens of the prompt that an earlier turn of the trajectory computed (cacheable)
        self.context = context
        self.output = output
        self.enq_s = enq_s
        self.seq = seq
        self.hit = 0
        self.left = 0
        self.reserve = prompt + output
        self.fin_it = 0
        self.s_term = 0


class _Engine:
    """One continuous-batching engine with leaping decode spans (see the module docstring)."""

    __slots__ = (
        "S", "_mixed", "busy", "busy_s", "cache", "cached_total", "cap", "decode_tokens",
        "evictions", "fin", "hit_tokens", "idx", "info", "it", "leap", "max_leap", "max_seqs",
        "max_tokens", "n_dec", "perf", "prefill_tokens", "prefilling", "recomputed_tokens",
        "released_s", "retired", "spans", "started_s", "step", "t", "used", "version", "waiting",
    )  # fmt: skip

    def __init__(self, idx: int, info: EngineInfo, perf: PerfModel, cfg: SimConfig,
                 start_s: float) -> None:
        self.idx = idx
        self.info = info
        self.perf = perf
        self.step = perf.step_time
        self.cap = info.capacity_tokens
        self.max_seqs = cfg.max_num_seqs
        self.max_tokens = cfg.max_batched_tokens
        self.max_leap = cfg.max_leap_iters
        self.it = 0
        self.t = start_s
        self.started_s = start_s
        self.released_s = -1.0
        self.retired = False
        self.n_dec = 0
        self.S = 0  # kv read at iteration it = S + n_dec * it
        self.fin: list[tuple[int, int, _Req]] = []
        self.prefilling: deque[_Req] = deque()
        self.waiting: deque[_Req] = deque()
        self.used = 0
        self.cache: OrderedDict[str, int] = OrderedDict()
        self.cached_total = 0
        self.busy = False
        self.version = 0
        self.leap = (0.0, 0, 0.0, 0.0)  # t0, n, a, b
        self._mixed: list[tuple[_Req, int]] | None = None
        self.busy_s = 0.0
        self.spans = 0
        self.hit_tokens = 0
        self.prefill_tokens = 0
        self.recomputed_tokens = 0
        self.decode_tokens = 0
        self.evictions = 0

    # -- admission and scheduling --------------------------------------------------------------
    def admit(self, now: float) -> None:
        waiting, cache = self.waiting, self.cache
        while waiting and len(self.prefilling) + self.n_dec < self.max_seqs:
            req = waiting[0]
            tid = req.traj.state.id
            cached = cache.get(tid, 0)
            free = self.cap - self.used - self.cached_total + cached
            if req.reserve > free:
                for other in list(cache):
                    if other == tid:
                        continue
                    tok = cache.pop(other)
                    self.cached_total -= tok
                    free += tok
                    self.evictions += 1
                    if req.reserve <= free:
                        break
                if req.reserve > free and (self.n_dec or self.prefilling):
                    return  # head-of-line: wait for running turns to free memory
            waiting.popleft()
            if cached:
                del cache[tid]
                self.cached_total -= cached
            hit = min(cached, req.context)
            req.hit = hit
            req.left = max(1, req.prompt - hit)
            self.used += req.reserve
            self.hit_tokens += hit
            self.prefill_tokens += req.left
            if req.context > hit:
                self.recomputed_tokens += req.context - hit
            self.prefilling.append(req)
            req.traj.state.wait_s += now - req.enq_s

    def schedule(self, q: EventQueue) -> None:
        """Start the next span at ``self.t`` (or go idle)."""
        if self.prefilling:
            budget = self.max_tokens - self.n_dec
            chunks: list[tuple[_Req, int]] = []
            pf = 0
            kv = self.S + self.n_dec * self.it
            attn2 = 0.0
            for req in self.prefilling:
                if budget <= 0:
                    break
                c = min(req.left, budget)
                done_before = req.prompt - req.left
                kv += done_before
                attn2 += c * done_before + c * (c + 1) / 2
                chunks.append((req, c))
                pf += c
                budget -= c
            dt = self.step(pf, self.n_dec, kv, attn2)
            self._mixed = chunks
            self.leap = (self.t, 1, dt, 0.0)
            self._push(q, self.t + dt)
            return
        if self.n_dec:
            n = self.fin[0][0] - self.it
            if self.max_leap and n > self.max_leap:
                n = self.max_leap
            kv0 = self.S + self.n_dec * self.it
            a = self.step(0, self.n_dec, kv0)
            if n > 1:
                z = self.step(0, self.n_dec, kv0 + self.n_dec * (n - 1))
                b = (z - a) / (n - 1)
            else:
                b = 0.0
            self._mixed = None
            self.leap = (self.t, n, a, b)
            self.info.tpot_s = a
            self._push(q, self.t + a * n + b * n * (n - 1) / 2)
            return
        self.busy = False
        self.info.tpot_s = self.info.idle_tpot_s
        self.info.running = 0
        self.info.queued = len(self.waiting)

    def _push(self, q: EventQueue, t_end: float) -> None:
        self.busy = True
        self.info.running = self.n_dec + len(self.prefilling)
        self.info.queued = len(self.waiting)
        self.version += 1
        self.spans += 1
        q.push(t_end, _ENGINE, (self.idx, self.version))

    def cut(self, now: float, q: EventQueue) -> None:
        """A request arrived mid-leap: end the leap with the iteration in progress."""
        if not self.busy or self._mixed is not None:
            return
        t0, n, a, b = self.leap
        if n <= 1:
            return
        el = now - t0
        if b > 1e-15:
            c = a - b / 2
            k = int((-c + math.sqrt(c * c + 2 * b * el)) / b)
        else:
            k = int(el / a) if a > 0 else n
        m = min(max(k + 1, 1), n)
        # floating-point guard: the m-th iteration must end at or after now
        while m < n and t0 + a * m + b * m * (m - 1) / 2 < now:
            m += 1
        if m >= n:
            return
        self.leap = (t0, m, a, b)
        self._push(q, t0 + a * m + b * m * (m - 1) / 2)

    def complete(self, now: float) -> list[_Req]:
        """The span ended at ``now``: advance iterations, return the turns that finished."""
        t0, n, _, _ = self.leap
        self.busy_s += now - t0
        done: list[_Req] = []
        if self._mixed is not None:
            self.it += 1
            self.decode_tokens += self.n_dec
            for req, c in self._mixed:
                req.left -= c
                if req.left <= 0:
                    self.prefilling.remove(req)
                    if req.output <= 1:
                        done.append(req)
                    else:
                        req.s_term = req.prompt + 1 - self.it
                        req.fin_it = self.it + req.output - 1
                        self.S += req.s_term
                        self.n_dec += 1
                        heapq.heappush(self.fin, (req.fin_it, req.seq, req))
            self._mixed = None
        else:
            self.it += n
            self.decode_tokens += self.n_dec * n
        self.t = now
        fin = self.fin
        while fin and fin[0][0] <= self.it:
            _, _, req = heapq.heappop(fin)
            self.n_dec -= 1
            self.S -= req.s_term
            done.append(req)
        for req in done:
            self.used -= req.reserve
            tid = req.traj.state.id
            tok = req.prompt + req.output
            self.cache[tid] = tok
            self.cached_total += tok
        return done

    def drop_cache(self, traj_id: str) -> None:
        tok = self.cache.pop(traj_id, 0)
        self.cached_total -= tok

    @property
    def idle(self) -> bool:
        return not (self.busy or self.waiting or self.prefilling or self.n_dec)


# ------------------------------------------------------------------------------ results


@dataclass
class BatchResult:
    """One batch (rollout step) in the simulator."""

    batch: int
    start_s: float
    n: int
    done: int = 0
    end_s: float = -1.0
    #: completion time of each trajectory, relative to the batch start
    finish_s: dict[str, float] = field(default_factory=dict)
    output_tokens: int = 0

    @property
    def makespan_s(self) -> float:
        return self.end_s - self.start_s if self.end_s >= 0 else math.nan


class RolloutSim:
    """Trajectories → router → bucket engines, on a virtual clock (see the module docstring)."""

    def __init__(
        self,
        buckets: Sequence[Bucket],
        router: RolloutRouter,
        config: SimConfig | None = None,
    ) -> None:
        self.config = config or SimConfig()
        self.router = router
        self.q = EventQueue()
        self.engines: list[_Engine] = []
        self._by_id: dict[str, int] = {}
        self.pool = PoolView([])
        self._perf: dict[int, PerfModel] = {}
        self._trajs: dict[str, _Traj] = {}
        self.batches: list[BatchResult] = []
        self._seq = 0
        self.now = 0.0
        self.events = 0
        self.migrations = 0
        self.retired: list[tuple[str, int, float]] = []  # (engine id, tp, released at)
        #: trajectory ids in completion order
        self.done_order: list[str] = []
        #: ready turns waiting for any engine to accept work (the pool is being rebuilt)
        self._parked: list[_Traj] = []
        #: called with (engine, time) when a drained engine retires and frees its GPUs
        self.on_retire: Callable[[_Engine, float], Any] | None = None
        for b in buckets:
            self._add_engines(b.tp, b.count, 0.0)
        self._rebuild_view()

    # -- pool -----------------------------------------------------------------------------------
    def _perf_for(self, tp: int) -> PerfModel:
        p = self._perf.get(tp)
        if p is None:
            p = self._perf[tp] = self.config.perf_for(tp)
        return p

    def _add_engines(self, tp: int, count: int, start_s: float) -> list[str]:
        perf = self._perf_for(tp)
        cap = self.config.kv_for(tp)
        idle = perf.step_time(0, 1, 8192)
        pf = perf.step_time(8192, 0, 0, 8192 * 8193 / 2) / 8192
        kv_s = max(0.0, (perf.step_time(0, 1, 8192 + 65536) - idle) / 65536)
        ids = []
        for _ in range(count):
            idx = len(self.engines)
            info = EngineInfo(f"e{idx}-tp{tp}", f"tp{tp}", 0, tp, capacity_tokens=cap,
                              idle_tpot_s=idle, prefill_s_per_token=pf,
                              kv_read_s_per_token=kv_s)
            eng = _Engine(idx, info, perf, self.config, start_s)
            if start_s > self.now:
                info.accepting = False
                eng.retired = True  # not yet joined
                self.q.push(start_s, _POOL, ("join", idx))
            self.engines.append(eng)
            self._by_id[info.id] = idx
            ids.append(info.id)
        return ids

    def _rebuild_view(self) -> None:
        self.pool.rebuild([e.info for e in self.engines if not e.retired])

    def add_engines(self, tp: int, count: int, at_s: float | None = None) -> list[str]:
        """Engines of ``tp`` join at ``at_s`` (default now) plus the weight-loading delay."""
        at = self.now if at_s is None else at_s
        return self._add_engines(tp, count, at + self.config.engine_start_s)

    def drain(self, engine_ids: Iterable[str], at_s: float | None = None,
              mode: DrainMode | None = None) -> None:
        """Stop placing new work on these engines from ``at_s``; their trajectories finish there
        (``finish``) or move at their next turn (``migrate``); each engine retires when empty."""
        at = self.now if at_s is None else at_s
        m = mode or self.config.drain_mode
        for eid in engine_ids:
            if eid not in self._by_id:
                raise KeyError(f"unknown engine {eid!r}")
            self.q.push(max(at, self.now), _POOL, ("drain", self._by_id[eid], m))

    def active_buckets(self) -> tuple[Bucket, ...]:
        counts: dict[int, int] = {}
        for e in self.engines:
            if not e.retired and e.info.accepting:
                counts[e.info.tp] = counts.get(e.info.tp, 0) + 1
        return tuple(Bucket(tp, n) for tp, n in sorted(counts.items()))

    def gpus_in_use(self) -> int:
        """GPUs held by engines that have not retired (joining and draining ones included)."""
        return sum(e.info.tp for e in self.engines if e.released_s < 0)

    # -- workload --------------------------------------------------------------------------------
    def add_batch(self, trajectories: Sequence[RolloutTrajectory], at_s: float | None = None
                  ) -> BatchResult:
        at = self.now if at_s is None else at_s
        res = BatchResult(len(self.batches), at, len(trajectories))
        self.batches.append(res)
        trs = []
        for spec in trajectories:
            if spec.id in self._trajs:
                raise ValueError(f"trajectory {spec.id!r} added twice")
            tr = _Traj(spec, res.batch, at)
            self._trajs[spec.id] = tr
            trs.append(tr)
        self.q.push(at, _ARRIVE, trs)
        return res

    def trajectory(self, traj_id: str) -> TrajectoryState:
        return self._trajs[traj_id].state

    def open_trajectories(self) -> list[TrajectoryState]:
        return [t.state for t in self._trajs.values() if not t.state.done]

    # -- run -------------------------------------------------------------------------------------
    def run_until(self, t_s: float = math.inf, stop: Callable[[], bool] | None = None) -> float:
        """Process events up to time ``t_s`` (or until ``stop()``); returns the clock."""
        q = self.q
        engines = self.engines
        while q:
            nt = q.peek_time()
            assert nt is not None
            if nt > t_s:
                break
            now, kind, payload = q.pop()
            self.now = now
            self.events += 1
            if kind == _ENGINE:
                idx, ver = payload
                eng = engines[idx]
                if ver != eng.version:
                    continue
                for req in eng.complete(now):
                    self._turn_finished(req, eng, now)
                eng.admit(now)
                eng.schedule(q)
                if eng.idle:
                    self._maybe_retire(eng, now)
            elif kind == _TOOL:
                self._tool_done(payload, now)
            elif kind == _ARRIVE:
                for tr in payload:
                    self._submit(tr, now)
            else:
                self._pool_event(payload, now)
            if stop is not None and stop():
                break
        if t_s != math.inf and self.now < t_s and (stop is None or not stop()):
            self.now = t_s
        return self.now

    def run_batch(self, batch: BatchResult, frac: float = 1.0) -> float:
        """Run until ``frac`` of ``batch``'s trajectories are done; returns the time."""
        need = min(batch.n, max(1, math.ceil(frac * batch.n))) if batch.n else 0
        if batch.done < need:
            self.run_until(stop=lambda: batch.done >= need)
        if batch.done < need:
            raise RuntimeError(f"simulation ended with batch {batch.batch} at {batch.done}/{need}")
        return self.now

    def run(self) -> float:
        return self.run_until()

    # -- internals -------------------------------------------------------------------------------
    def _submit(self, tr: _Traj, now: float) -> None:
        st = tr.state
        prev = st.engine
        pinned = None
        if prev is not None:
            e_prev = self.engines[self._idx(prev)]
            if not e_prev.info.accepting and tr.pinned:
                pinned = prev
        if pinned is None and not self.pool.accepting():
            self._parked.append(tr)  # no engine accepts work yet: wait for one to join
            return
        eid = pinned if pinned is not None else self.router.place(st, self.pool, now)
        eng = self.engines[self._idx(eid)]
        if eng.retired or (not eng.info.accepting and pinned is None):
            raise RuntimeError(f"router {self.router.name} placed {st.id} on closed engine {eid}")
        if prev != eid:
            if prev is not None:
                old = self.engines[self._idx(prev)]
                old.info.open_trajectories -= 1
                old.info.open_tokens -= tr.charged
                old.info.open_attained_tokens -= st.attained_output_tokens
                old.drop_cache(st.id)
                st.migrations += 1
                self.migrations += 1
                if old.info.accepting is False and old.idle:
                    self._maybe_retire(old, now)
            eng.info.open_trajectories += 1
            tr.charged = st.context_tokens
            eng.info.open_tokens += tr.charged
            eng.info.open_attained_tokens += st.attained_output_tokens
            st.engine = eid
        turn = tr.spec.workflow.turns[tr.turn]
        self._seq += 1
        req = _Req(tr, turn.prompt_tokens, turn.context_tokens, turn.output_tokens, now, self._seq)
        eng.waiting.append(req)
        eng.info.queued = len(eng.waiting)
        if eng.busy:
            eng.cut(now, self.q)
        else:
            eng.t = now
            eng.admit(now)
            eng.schedule(self.q)

    def _idx(self, engine_id: str) -> int:
        return self._by_id[engine_id]

    def _turn_finished(self, req: _Req, eng: _Engine, now: float) -> None:
        tr = req.traj
        st = tr.state
        st.turns_done += 1
        st.attained_output_tokens += req.output
        st.attained_prompt_tokens += req.prompt
        st.context_tokens = req.prompt + req.output
        eng.info.open_tokens += st.context_tokens - tr.charged
        tr.charged = st.context_tokens
        eng.info.open_attained_tokens += req.output
        eng.info.queued = len(eng.waiting)
        self.router.on_turn_finished(st, req.output, now)
        turn = tr.spec.workflow.turns[tr.turn]
        tr.turn += 1
        if tr.turn >= len(tr.spec.workflow.turns):
            st.done_s = now
            self.done_order.append(st.id)
            eng.info.open_trajectories -= 1
            eng.info.open_tokens -= tr.charged
            eng.info.open_attained_tokens -= st.attained_output_tokens
            tr.charged = 0
            eng.drop_cache(st.id)
            self.router.on_trajectory_done(st, now)
            b = self.batches[tr.batch]
            b.done += 1
            b.finish_s[st.id] = now - b.start_s
            b.output_tokens += st.attained_output_tokens
            if b.done == b.n:
                b.end_s = now
            return
        self.q.push(now + turn.tool_duration_s, _TOOL, tr)

    def _tool_done(self, tr: _Traj, now: float) -> None:
        st = tr.state
        prev = tr.spec.workflow.turns[tr.turn - 1]
        for c in prev.tools:
            res = ToolResult(c.name, c.status, c.result_tokens, c.duration_s)
            st.tool_keys.append(res.key)
            if c.status == "error":
                st.errors += 1
            elif c.status == "timeout":
                st.timeouts += 1
            self.router.on_tool_result(st, res, now)
        self._submit(tr, now)

    def _pool_event(self, payload: tuple[Any, ...], now: float) -> None:
        what = payload[0]
        eng = self.engines[payload[1]]
        if what == "join":
            eng.retired = False
            eng.info.accepting = True
            eng.t = now
            self._rebuild_view()
            if self._parked:
                # after every engine joining at this instant (priority 0) has joined
                self.q.push(now, _POOL, ("unpark", payload[1]), priority=1)
        elif what == "unpark":
            parked, self._parked = self._parked, []
            for tr in parked:
                self._submit(tr, now)
        elif what == "drain":
            eng.info.accepting = False
            mode: DrainMode = payload[2]
            if mode == "finish":
                for tr in self._trajs.values():
                    if tr.state.engine == eng.info.id and not tr.state.done:
                        tr.pinned = True
            if eng.idle:
                self._maybe_retire(eng, now)

    def _maybe_retire(self, eng: _Engine, now: float) -> None:
        if eng.info.accepting or eng.retired or not eng.idle or eng.info.open_trajectories > 0:
            return
        eng.retired = True
        eng.released_s = now
        self.retired.append((eng.info.id, eng.info.tp, now))
        self._rebuild_view()
        if self.on_retire is not None:
            self.on_retire(eng, now)

    # -- reporting -------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        es = self.engines
        return {
            "events": self.events,
            "spans": sum(e.spans for e in es),
            "iterations": sum(e.it for e in es),
            "migrations": self.migrations,
            "prefill_tokens": sum(e.prefill_tokens for e in es),
            "recomputed_tokens": sum(e.recomputed_tokens for e in es),
            "hit_tokens": sum(e.hit_tokens for e in es),
            "decode_tokens": sum(e.decode_tokens for e in es),
            "evictions": sum(e.evictions for e in es),
            "busy_s": {e.info.id: round(e.busy_s, 3) for e in es},
        }


def simulate_batch(
    trajectories: Sequence[RolloutTrajectory],
    buckets: Sequence[Bucket],
    router: RolloutRouter,
    config: SimConfig | None = None,
) -> tuple[BatchResult, RolloutSim, float]:
    """Run one batch to completion; returns the batch result, the simulator and the wall time."""
    t0 = time.perf_counter()
    sim = RolloutSim(buckets, router, config)
    res = sim.add_batch(trajectories, 0.0)
    sim.run_batch(res)
    return res, sim, time.perf_counter() - t0
