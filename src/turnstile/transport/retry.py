"""The one retry rule: send again only while nothing came back, a bounded number of times,
after a bounded backoff.

A request is sent again only when the failure proves the other side received nothing it
could act on (a refused connection, a kept-alive connection it had already closed): a turn
that produced any response byte is never run twice. Each caller names its numbers — the
engine adapters resend at once (``backoff_s=0``), the gateway's re-route loop waits
``min(backoff_s × attempt, max_backoff_s)`` — but the rule is this one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["RetryRule", "retry_async", "retry_sync"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryRule:
    """``retries`` further attempts after the first; attempt ``n`` (1, 2, …) waits
    :meth:`delay_s` before it is sent."""

    retries: int = 1
    backoff_s: float = 0.0
    max_backoff_s: float = 0.5

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(f"retry numbers must be >= 0, got {self}")

    def delay_s(self, attempt: int) -> float:
        return min(self.backoff_s * attempt, self.max_backoff_s)

    def again(self, attempt: int) -> bool:
        """Whether a failed ``attempt`` (0 is the first send) may be followed by another."""
        return attempt < self.retries


async def retry_async(send: Callable[[], Awaitable[T]], rule: RetryRule,
                      retryable: Callable[[BaseException], bool]) -> T:
    """``await send()``, sent again under ``rule`` while it fails with a ``retryable`` error;
    the last error propagates."""
    attempt = 0
    while True:
        try:
            return await send()
        except Exception as e:
            if not (retryable(e) and rule.again(attempt)):
                raise
            attempt += 1
            if rule.delay_s(attempt) > 0:
                await asyncio.sleep(rule.delay_s(attempt))


def retry_sync(send: Callable[[], T], rule: RetryRule,
               retryable: Callable[[BaseException], bool]) -> T:
    """:func:`retry_async` for blocking callers (the measurement client's threads)."""
    attempt = 0
    while True:
        try:
            return send()
        except Exception as e:
            if not (retryable(e) and rule.again(attempt)):
                raise
            attempt += 1
            if rule.delay_s(attempt) > 0:
                time.sleep(rule.delay_s(attempt))
