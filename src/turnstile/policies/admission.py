"""Admission policies: the order an engine admits the turns queued at it.

An admission policy is asked once per turn, at release, for a *static* priority (lower runs
first, ties in arrival order). Anything time-dependent, such as aging, must therefore be folded
into that one number; the policies below do it by anchoring the key at the turn's ``ready_s``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar, Literal

from turnstile.core.state import EngineLoad, TurnRecord
from turnstile.policies.base import ADMISSION

KvTier = Literal["gpu", "cpu", "gone"]
#: where a session's KV is for the engine a turn was routed to: ``kv_tier(turn, engine)``
KvTierFn = Callable[[TurnRecord, EngineLoad], KvTier]


@ADMISSION.register("fcfs")
class FcfsAdmission:
    """Baseline: one priority for all, so the engine admits in arrival order."""

    name: ClassVar[str] = "fcfs"

    def priority(self, turn: TurnRecord, engine: EngineLoad, now: float) -> float:
        return 0.0


def resident_kv_tier(turn: TurnRecord, engine: EngineLoad) -> KvTier:
    """Default residency guess: the session's KV is on GPU where its previous turn ran.

    The core un-pauses a session (drops it from ``engine.cached_sessions``) just before it asks
    for the admission priority, so ``workflow.last_engine`` is the residency signal here;
    ``cached_sessions`` is checked too for drivers that keep it. Nothing here knows about
    offloads: a driver or retention policy that does can inject its own ``kv_tier``.
    """
    wf = turn.workflow
    if wf.last_engine == engine.id or wf.id in engine.cached_sessions:
        return "gpu"
    return "gone"


@ADMISSION.register("tiered-aging")
class TieredAgingAdmission:
    """Coda's tiered-aging admission: cheapest state preparation first, aged by waiting time.

    Rule (Coda, 2026): the cost of preparing a turn's state on this engine is, in tokens,
    ``input_tokens`` when the session's KV is on GPU, ``input + context × reload_factor`` when it
    sits in CPU memory (offloaded), and ``input + context`` when it is gone (recompute). The
    engine admits by a static key, so aging is encoded as::

        priority = ready_s + min(cost / tokens_per_s, w_max_s)

    A cheap turn is preferred by up to ``w_max_s`` seconds over an expensive one that became
    ready at the same time; each second a turn has waited since it became ready counts as a
    second of discount against newer turns (tool time is not waiting: ``ready_s`` is set when the
    tool returns). A turn that has waited ``w_max_s`` therefore precedes every turn that becomes
    ready later, however cheap — the starvation bound. ``kv_tier`` (``turn, engine -> "gpu" |
    "cpu" | "gone"``) tells where the KV is; the default, :func:`resident_kv_tier`, knows only
    "on the engine the previous turn ran on" (GPU) or not (gone).
    """

    name: ClassVar[str] = "tiered-aging"

    def __init__(
        self,
        *,
        tokens_per_s: float = 10_000.0,
        reload_factor: float = 0.1,
        w_max_s: float = 30.0,
        kv_tier: KvTierFn | None = None,
    ) -> None:
        if tokens_per_s <= 0:
            raise ValueError(f"tokens_per_s must be > 0, got {tokens_per_s}")
        self.tokens_per_s = tokens_per_s
        self.reload_factor = reload_factor
        self.w_max_s = w_max_s
        self.kv_tier: KvTierFn = kv_tier if kv_tier is not None else resident_kv_tier

    def cost_tokens(self, turn: TurnRecord, engine: EngineLoad) -> float:
        """State-preparation cost of ``turn`` on ``engine``, in prefill-equivalent tokens."""
        t = turn.turn
        tier = self.kv_tier(turn, engine)
        if tier == "gpu":
            return float(t.input_tokens)
        if tier == "cpu":
            return t.input_tokens + t.context_tokens * self.reload_factor
        return float(t.input_tokens + t.context_tokens)

    def priority(self, turn: TurnRecord, engine: EngineLoad, now: float) -> float:
        delay_s = min(self.cost_tokens(turn, engine) / self.tokens_per_s, self.w_max_s)
        return turn.ready_s + delay_s


@ADMISSION.register("compat-batching")
class CompatBatchingAdmission:
    """Coda's compatibility-aware batching, reduced to a static admission key.

    Rule (after Coda, 2026): mixing very different context lengths in one batch hurts both, so
    an engine should admit work of similar length together. Each engine keeps an exponential
    moving average of ``log2(prompt_tokens)`` of the turns released to it (its current "typical"
    length). A turn whose prompt is within a factor ``split_ratio`` of that typical length is
    admitted FIFO (``priority = ready_s``); one further away is deferred by ``bucket_s`` seconds
    per doubling of distance::

        d = |log2(prompt) - ema_log2|
        priority = ready_s + (bucket_s × d  if d > log2(split_ratio) else 0)

    So turns compatible with the engine's current mix go first, outliers wait a bounded time
    (at most ``bucket_s × ~17`` for any real prompt) and keep FIFO order among equals. This is a
    static approximation — the engine does not tell the policy what it is batching right now,
    and the EMA (updated on every release, weight ``alpha``) stands in for that majority.
    """

    name: ClassVar[str] = "compat-batching"

    def __init__(
        self, *, bucket_s: float = 0.5, split_ratio: float = 4.0, alpha: float = 0.1
    ) -> None:
        if split_ratio < 1.0:
            raise ValueError(f"split_ratio must be >= 1, got {split_ratio}")
        self.bucket_s = bucket_s
        self.split_log2 = math.log2(split_ratio)
        self.alpha = alpha
        self._ema_log2: dict[str, float] = {}

    def priority(self, turn: TurnRecord, engine: EngineLoad, now: float) -> float:
        x = math.log2(max(turn.prompt_tokens, 1))
        ema = self._ema_log2.get(engine.id)
        if ema is None:
            self._ema_log2[engine.id] = x
            return turn.ready_s
        self._ema_log2[engine.id] = ema + self.alpha * (x - ema)
        d = abs(x - ema)
        return turn.ready_s + (self.bucket_s * d if d > self.split_log2 else 0.0)
