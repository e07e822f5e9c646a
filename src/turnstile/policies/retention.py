"""Retention policies: how long a session's KV is kept across a tool call.

The learned policies share one online estimator of tool latency, :class:`ToolLatencyEstimator`,
fed with the real duration of each tool call when it returns (``now − turn.finished_s``); they
never read a tool's duration from the trace.
"""

from __future__ import annotations

from typing import ClassVar

from turnstile.core.actions import LRU, RetentionDecision
from turnstile.core.interfaces import ReleasePolicy
from turnstile.core.state import EngineLoad, TurnRecord
from turnstile.policies.base import RETENTION
from turnstile.policies.estimators import ToolLatencyEstimator, latency_key

__all__ = ["ToolLatencyEstimator", "tool_key"]


@RETENTION.register("lru")
class LruRetention:
    """Baseline: no pinning; the engine's prefix cache evicts least-recently-used blocks."""

    name: ClassVar[str] = "lru"

    def on_tool_start(self, turn: TurnRecord, engine: EngineLoad, now: float) -> RetentionDecision:
        return LRU

    def on_tool_end(self, turn: TurnRecord, now: float) -> None:
        pass

    def bind(self, release: ReleasePolicy) -> None:
        pass


#: the latency key of the tool calls after a turn (kept under its old name)
tool_key = latency_key


@RETENTION.register("ttl")
class TtlRetention:
    """Continuum's KV time-to-live across tool calls, from learned tool latency.

    Rule (Continuum, 2025): learn each tool's latency distribution online (last ``window`` calls
    per tool name); on tool start pin the session's KV for ``quantile_q(tool) × margin``, capped
    at ``max_ttl_s``. An unseen tool gets ``default_ttl_s``. A tool whose learned quantile is
    already above ``max_ttl_s`` gets LRU: pinning through a call that long wastes memory.
    """

    name: ClassVar[str] = "ttl"

    def __init__(
        self,
        *,
        q: float = 0.9,
        margin: float = 1.2,
        max_ttl_s: float = 120.0,
        default_ttl_s: float = 2.0,
        window: int = 256,
    ) -> None:
        if not 0.0 < q <= 1.0:
            raise ValueError(f"q must be in (0, 1], got {q}")
        self.q = q
        self.margin = margin
        self.max_ttl_s = max_ttl_s
        self.default_ttl_s = default_ttl_s
        self.estimator = ToolLatencyEstimator(window)

    def expected_tool_s(self, turn: TurnRecord) -> float | None:
        """The learned ``q`` quantile of this turn's tool latency; None for an unseen tool."""
        return self.estimator.quantile(tool_key(turn), self.q)

    def on_tool_start(self, turn: TurnRecord, engine: EngineLoad, now: float) -> RetentionDecision:
        tool_s = self.expected_tool_s(turn)
        if tool_s is None:
            return _pin(min(self.default_ttl_s, self.max_ttl_s))
        if tool_s > self.max_ttl_s:
            return LRU
        return _pin(min(tool_s * self.margin, self.max_ttl_s))

    def on_tool_end(self, turn: TurnRecord, now: float) -> None:
        self.estimator.observe(tool_key(turn), now - turn.finished_s)

    def bind(self, release: ReleasePolicy) -> None:
        pass


def _pin(ttl_s: float) -> RetentionDecision:
    return RetentionDecision("pin", ttl_s)


@RETENTION.register("budget-keep")
class BudgetKeepRetention(TtlRetention):
    """Keep the KV of a session whose next turn will be released soon; tied to the release budget.

    Rule (turnstile; extends Continuum's TTL to release control as in "Decoupling Readiness from
    Release", 2026): a held turn's KV must survive the tool call *and* the time the release
    policy keeps the next turn waiting. Pin for ``quantile_q(tool) × margin + expected hold``,
    where the hold comes from the bound release policy's ``expected_hold_s(workflow, now)``
    (PolicySet calls :meth:`bind`; unbound, or with a release policy that does not estimate its
    holds, the hold is 0 and this is ``ttl``). If that total exceeds ``max_ttl_s`` the session
    is not worth the memory: LRU.
    """

    name: ClassVar[str] = "budget-keep"

    #: the bound release policy (see :meth:`bind`); None: no hold
    release: ReleasePolicy | None = None

    def bind(self, release: ReleasePolicy) -> None:
        self.release = release

    def hold_s(self, turn: TurnRecord, now: float) -> float:
        if self.release is None:
            return 0.0
        hold = self.release.expected_hold_s(turn.workflow, now)
        return 0.0 if hold is None else max(hold, 0.0)

    def on_tool_start(self, turn: TurnRecord, engine: EngineLoad, now: float) -> RetentionDecision:
        tool_s = self.expected_tool_s(turn)
        base = self.default_ttl_s if tool_s is None else tool_s * self.margin
        ttl = base + self.hold_s(turn, now)
        return LRU if ttl > self.max_ttl_s else _pin(ttl)


@RETENTION.register("infercept")
class InferceptRetention:
    """InferCept's preserve / swap / discard choice by memory×time waste (token·seconds).

    Rule (InferCept, 2024): with ``T`` the expected tool time (learned mean per tool, else
    ``default_tool_s``) and ``C`` = prompt + output tokens of the finished turn::

        preserve = C × T                                   (KV held idle through the call)
        swap     = C × 2 × (swap_overhead_s + C × kv_bytes_per_token / swap_bw_bytes_per_s)
                                                           (KV held while copied out and back)
        discard  = C / prefill_tokens_per_s × max(outstanding_tokens, C)
                                                           (recompute stalls the running batch)

    The cheapest wins (ties in that order): pin for ``1.5 T``, offload for ``3 T``, or discard.
    ``swap_overhead_s`` is the fixed per-transfer cost of moving a paged KV (many small block
    copies plus bookkeeping); without it a pure-bandwidth swap beats recomputing at any size,
    and InferCept's observation that short contexts are best discarded would be lost.
    """

    name: ClassVar[str] = "infercept"

    def __init__(
        self,
        *,
        default_tool_s: float = 2.0,
        kv_bytes_per_token: float = 131_072.0,
        swap_bw_bytes_per_s: float = 25e9,
        swap_overhead_s: float = 0.005,
        prefill_tokens_per_s: float = 10_000.0,
        window: int = 256,
    ) -> None:
        self.default_tool_s = default_tool_s
        self.kv_bytes_per_token = kv_bytes_per_token
        self.swap_bw_bytes_per_s = swap_bw_bytes_per_s
        self.swap_overhead_s = swap_overhead_s
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.estimator = ToolLatencyEstimator(window)

    def expected_tool_s(self, turn: TurnRecord) -> float:
        mean = self.estimator.mean(tool_key(turn))
        return self.default_tool_s if mean is None else mean

    def wastes(self, turn: TurnRecord, engine: EngineLoad) -> tuple[float, float, float]:
        """(preserve, swap, discard) waste in token·seconds for this tool call."""
        tool_s = self.expected_tool_s(turn)
        c = float(turn.prompt_tokens + turn.output_tokens)
        preserve = c * tool_s
        transfer_s = self.swap_overhead_s + c * self.kv_bytes_per_token / self.swap_bw_bytes_per_s
        swap = c * 2.0 * transfer_s
        discard = c / self.prefill_tokens_per_s * max(float(engine.outstanding_tokens), c)
        return preserve, swap, discard

    def on_tool_start(self, turn: TurnRecord, engine: EngineLoad, now: float) -> RetentionDecision:
        preserve, swap, discard = self.wastes(turn, engine)
        tool_s = self.expected_tool_s(turn)
        if preserve <= swap and preserve <= discard:
            return _pin(1.5 * tool_s)
        if swap <= discard:
            return RetentionDecision("offload", 3.0 * tool_s)
        return RetentionDecision("discard")

    def on_tool_end(self, turn: TurnRecord, now: float) -> None:
        self.estimator.observe(tool_key(turn), now - turn.finished_s)

    def bind(self, release: ReleasePolicy) -> None:
        pass
