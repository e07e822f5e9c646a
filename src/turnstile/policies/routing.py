"""Routing policies: which engine a released turn runs on."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from turnstile.core.state import ClusterView, EngineLoad, TurnRecord, WorkflowRecord
from turnstile.policies.base import ROUTING


class StatelessRouting:
    """Routing that learns nothing from finished workflows (the core's hook is a no-op)."""

    def on_workflow_done(self, workflow: WorkflowRecord, now: float) -> None:
        return None


class NoHealthyEngineError(RuntimeError):
    pass


def _healthy(view: ClusterView) -> list[EngineLoad]:
    engines = view.healthy()
    if not engines:
        raise NoHealthyEngineError("no healthy engine to route to")
    return engines


@ROUTING.register("round-robin")
class RoundRobinRouting(StatelessRouting):
    """Baseline: engines in turn, skipping unhealthy ones."""

    name: ClassVar[str] = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, turn: TurnRecord, view: ClusterView, now: float) -> str:
        ids = view.ids
        for _ in range(len(ids)):
            engine = view[ids[self._next % len(ids)]]
            self._next += 1
            if engine.healthy and engine.accepting:
                return engine.id
        raise NoHealthyEngineError("no healthy engine to route to")


class PinnedRouting(StatelessRouting):
    """Each workflow to the engine a given map names (``workflow id → engine id``): a replay
    of a run whose engine choices are fixed beforehand (the fidelity protocol's static
    assignment). Not in the registry: it needs the map."""

    name: ClassVar[str] = "pinned"

    def __init__(self, engines: dict[str, str]) -> None:
        self.engines = engines

    def route(self, turn: TurnRecord, view: ClusterView, now: float) -> str:
        wid = turn.workflow.id
        try:
            return self.engines[wid]
        except KeyError:
            raise KeyError(f"workflow {wid!r} has no pinned engine") from None


@ROUTING.register("least-loaded")
class LeastLoadedRouting(StatelessRouting):
    """Baseline: the engine with the fewest outstanding tokens per unit of speed.

    Ties go to the engine listed first, so the choice is deterministic.
    """

    name: ClassVar[str] = "least-loaded"

    def route(self, turn: TurnRecord, view: ClusterView, now: float) -> str:
        return min(_healthy(view), key=lambda e: e.outstanding_tokens / e.weight).id


def _own_paused(turn: TurnRecord, engine: EngineLoad) -> int:
    """This session's own paused context on ``engine``: it stops being shadow load on release."""
    wf = turn.workflow
    return wf.paused_tokens if wf.paused_engine == engine.id else 0


def _shadow_load(turn: TurnRecord, engine: EngineLoad, shadow: float) -> float:
    """Outstanding tokens plus ``shadow`` × other sessions' paused context, per unit of speed."""
    paused = engine.paused_context_tokens - _own_paused(turn, engine)
    return (engine.outstanding_tokens + shadow * paused) / engine.weight


@ROUTING.register("least-loaded-shadow")
class LeastLoadedShadowRouting(StatelessRouting):
    """Least-loaded, counting the "shadow load" of sessions paused in a tool call.

    Rule: load = (outstanding_tokens + shadow × paused_context_tokens) / weight, where the paused
    context of the session being routed is left out (it is resumed, not added). The ablation of
    ``least-loaded`` that isolates shadow load (Coda, 2026: load-based routers see paused
    sessions as zero load). Ties go to the engine listed first.
    """

    name: ClassVar[str] = "least-loaded-shadow"

    def __init__(self, *, shadow: float = 1.0) -> None:
        self.shadow = shadow

    def route(self, turn: TurnRecord, view: ClusterView, now: float) -> str:
        return min(_healthy(view), key=lambda e: _shadow_load(turn, e, self.shadow)).id


@ROUTING.register("kv-affinity")
class KvAffinityRouting(StatelessRouting):
    """Session affinity that leaves the session's engine only when that engine would queue it.

    Rule: send a turn to ``workflow.last_engine`` (where its KV may still be) when that engine
    is healthy and either the cluster is balanced — ``max − min ≤ balance_abs_tokens`` or
    ``max ≤ balance_rel × min`` over the healthy engines' outstanding_tokens / weight — or the
    engine would start it now: no queue reported, and its prompt fits beside the engine's
    outstanding tokens (unknown capacity: fits). Otherwise, and for a workflow's first turn,
    least-loaded among the engines with a free slot (:attr:`EngineLoad.has_free_slot`) and the
    session's own engine, where any has one (on slot-limited engines; a paged engine always
    has one). Moving a session costs the re-prefill of its whole context; an imbalance of
    outstanding tokens (which count cached context as well) costs nothing while the engine
    still admits the turn. ``kv-affinity-balanced`` is the previous rule (SGLang router's
    balance guard alone): on SWE-bench-like sessions it moved one turn in seven on 4
    lightly loaded engines, each move a whole-context miss (hit rate 71% vs 97%, simulated).
    """

    name: ClassVar[str] = "kv-affinity"

    def __init__(
        self, *, balance_abs_tokens: float = 32_768.0, balance_rel: float = 1.5
    ) -> None:
        self.balance_abs_tokens = balance_abs_tokens
        self.balance_rel = balance_rel

    def balanced(self, engines: list[EngineLoad]) -> bool:
        loads = [e.outstanding_tokens / e.weight for e in engines]
        hi, lo = max(loads), min(loads)
        return hi - lo <= self.balance_abs_tokens or hi <= self.balance_rel * lo

    def route(self, turn: TurnRecord, view: ClusterView, now: float) -> str:
        engines = _healthy(view)
        if len(engines) == 1:  # both rules below pick it
            return engines[0].id
        last = turn.workflow.last_engine
        if last is not None and last in view and view[last] in engines:
            if self.balanced(engines):
                return last
            e = view[last]
            if e.queue_len <= 0 and (e.capacity_tokens <= 0 or e.outstanding_tokens
                                     + turn.prompt_tokens <= e.capacity_tokens):
                return last
        return self.least_loaded(engines, last)

    @staticmethod
    def least_loaded(engines: list[EngineLoad], last: str | None) -> str:
        """The least-loaded engine with a free slot (or the session's own, ``last``)."""
        # on slot-limited engines, a session goes only where a slot is free (or stays where
        # its KV is): one sent to an engine whose slots all hold sessions evicts one of them,
        # whose next turn misses and evicts another (measured on 4 engines of 4 slots at 2x
        # saturation: 23% of turns moved, 62% of same-engine turns missed their whole context)
        room = [e for e in engines if e.has_free_slot or e.id == last]
        return min(room or engines, key=lambda e: e.outstanding_tokens / e.weight).id


@ROUTING.register("kv-affinity-balanced")
class KvAffinityBalancedRouting(KvAffinityRouting):
    """SGLang router's cache-aware balance guard: leave the last engine whenever the cluster
    is unbalanced, as ``kv-affinity`` did before 2026-12-07 (kept for comparison)."""

    name: ClassVar[str] = "kv-affinity-balanced"

    def route(self, turn: TurnRecord, view: ClusterView, now: float) -> str:
        engines = _healthy(view)
        last = turn.workflow.last_engine
        if last is not None and last in view and view[last] in engines and self.balanced(engines):
            return last
        return self.least_loaded(engines, last)


@ROUTING.register("composite")
class CompositeRouting(StatelessRouting):
    """Coda-style routing score: KV residency, load with shadow load, length compatibility.

    Rule (Coda, 2026), highest score wins (ties: the engine listed first)::

        score(e) = w_kv × hit(e) − w_load × load(e) / norm − w_len × |log2 p − ema_e| / k

    ``hit(e)`` is the share of the prompt ``p`` the engine may hold — context_tokens / p when the
    session's previous turn ran on ``e`` and ``e`` still lists it in ``cached_sessions``, else 0.
    ``load(e) = (outstanding_tokens + shadow × paused_context_tokens) / weight`` (paused
    sessions' KV is real memory pressure; the routed session's own paused context is left out),
    normalized by the cluster's maximum load but at least a floor, so that a nearly idle cluster
    does not look imbalanced: ``load_floor_tokens``, or ``load_floor_frac`` of the largest
    engine's KV capacity (per unit of speed) where that is smaller. Without the second, engines
    with little KV (a few thousand tokens) would never look loaded, and the length term alone
    would route: one short prompt steers every later session away from an engine. ``ema_e`` is
    the moving average of log2 prompt lengths routed to ``e`` (none yet: no penalty).
    ``composite-noshadow`` is the same with ``shadow=0``.
    """

    name: ClassVar[str] = "composite"

    def __init__(
        self,
        *,
        w_kv: float = 1.0,
        w_load: float = 1.0,
        w_len: float = 0.25,
        len_scale_log2: float = 4.0,
        shadow: float = 1.0,
        load_floor_tokens: float = 32_768.0,
        load_floor_frac: float = 0.25,
        alpha: float = 0.1,
    ) -> None:
        self.w_kv = w_kv
        self.w_load = w_load
        self.w_len = w_len
        self.len_scale_log2 = len_scale_log2
        self.shadow = shadow
        self.load_floor_tokens = load_floor_tokens
        self.load_floor_frac = load_floor_frac
        self.alpha = alpha
        self._ema_log2: dict[str, float] = {}

    def hit(self, turn: TurnRecord, engine: EngineLoad) -> float:
        wf = turn.workflow
        if wf.last_engine != engine.id or wf.id not in engine.cached_sessions:
            return 0.0
        return min(turn.turn.context_tokens / max(turn.prompt_tokens, 1), 1.0)

    def scores(self, turn: TurnRecord, view: ClusterView) -> dict[str, float]:
        engines = _healthy(view)
        loads = [_shadow_load(turn, e, self.shadow) for e in engines]
        floor = self.load_floor_tokens
        capacity = max(e.capacity_tokens / e.weight for e in engines)
        if capacity and self.load_floor_frac * capacity < floor:
            floor = self.load_floor_frac * capacity
        norm = max(*loads, floor)
        x = math.log2(max(turn.prompt_tokens, 1))
        out: dict[str, float] = {}
        for e, load in zip(engines, loads, strict=True):
            ema = self._ema_log2.get(e.id)
            mismatch = 0.0 if ema is None else abs(x - ema) / self.len_scale_log2
            out[e.id] = (
                self.w_kv * self.hit(turn, e) - self.w_load * load / norm - self.w_len * mismatch
            )
        return out

    def route(self, turn: TurnRecord, view: ClusterView, now: float) -> str:
        scores = self.scores(turn, view)
        best = max(scores, key=scores.__getitem__)  # first maximum: the engine listed first
        x = math.log2(max(turn.prompt_tokens, 1))
        ema = self._ema_log2.get(best)
        self._ema_log2[best] = x if ema is None else ema + self.alpha * (x - ema)
        return best


@ROUTING.register("hinted")
class HintedRouting:
    """Follow the client's engine choice: an outside router (e.g. a rollout manager's C-MLFQ)
    picks the engine and the scheduler only holds and orders.

    Rule: route to ``turn.engine_hint`` (the gateway's ``x-turnstile-engine`` request header)
    when it names an engine in the view that is healthy; otherwise (no hint, an unknown or
    unhealthy engine) ask the ``fallback`` routing policy (default ``kv-affinity``).
    """

    name: ClassVar[str] = "hinted"

    option_choices: ClassVar[dict[str, Any]] = {
        "fallback": lambda: tuple(n for n in ROUTING.names() if n != "hinted")}

    def __init__(self, *, fallback: str = "kv-affinity", **fallback_params: object) -> None:
        if fallback == "hinted":
            raise ValueError("the hinted routing policy cannot fall back to itself")
        self.fallback = ROUTING.create(fallback, **fallback_params)
        self.hinted = 0  # turns routed to their hint
        self.fell_back = 0  # turns routed by the fallback

    def on_workflow_done(self, workflow: WorkflowRecord, now: float) -> None:
        self.fallback.on_workflow_done(workflow, now)

    def route(self, turn: TurnRecord, view: ClusterView, now: float) -> str:
        hint = turn.engine_hint
        if hint is not None and hint in view and view[hint].healthy and view[hint].accepting:
            self.hinted += 1
            return hint
        self.fell_back += 1
        return self.fallback.route(turn, view, now)
