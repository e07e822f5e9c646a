"""The one retry rule: resend only while nothing came back, bounded attempts and backoff."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from turnstile.transport.client import nothing_received
from turnstile.transport.fast import BrokenResponse, ConnectFailed, NothingReceived
from turnstile.transport.retry import RetryRule, retry_async, retry_sync


def test_rule_numbers() -> None:
    rule = RetryRule(retries=3, backoff_s=0.05, max_backoff_s=0.12)
    assert [rule.delay_s(n) for n in (1, 2, 3)] == [0.05, 0.1, 0.12]
    assert [rule.again(n) for n in (0, 2, 3)] == [True, True, False]
    with pytest.raises(ValueError):
        RetryRule(retries=-1)


def test_resends_only_retryable_failures_up_to_the_bound() -> None:
    calls: list[int] = []

    def refused() -> int:
        calls.append(1)
        raise ConnectFailed("refused")

    with pytest.raises(ConnectFailed):
        retry_sync(refused, RetryRule(retries=2), nothing_received)
    assert len(calls) == 3

    calls.clear()

    def broken() -> int:
        calls.append(1)
        raise BrokenResponse("after a byte")

    with pytest.raises(BrokenResponse):
        retry_sync(broken, RetryRule(retries=2), nothing_received)
    assert len(calls) == 1  # a response byte arrived: never sent again


def test_async_resend_then_success() -> None:
    attempts = iter([NothingReceived("stale"), None])

    async def send() -> str:
        e = next(attempts)
        if e is not None:
            raise e
        return "ok"

    assert asyncio.run(retry_async(send, RetryRule(retries=1), nothing_received)) == "ok"


def test_classifies_httpx_failures() -> None:
    assert nothing_received(httpx.ConnectError("refused"))
    assert nothing_received(httpx.RemoteProtocolError("Server disconnected without sending"))
    assert not nothing_received(httpx.ReadTimeout("slow"))
    assert not nothing_received(httpx.RemoteProtocolError("peer closed mid-body"))
