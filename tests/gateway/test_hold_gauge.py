"""``turnstile_oldest_hold_seconds``: the age of the oldest held turn, read at scrape time."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from turnstile.gateway.adapters import parse_prometheus
from turnstile.testing.fake_engine import chat_body

HOLD_ONE = {"policy": "fcfs-workflow",
            "policy_params": {"release": {"max_inflight_per_engine": 1,
                                          "starvation_s": 30.0}}}


def _metrics(url: str) -> dict[str, float]:
    return parse_prometheus(httpx.get(url + "/metrics", timeout=10).text)


def test_oldest_hold_gauge_grows_while_a_turn_is_held_and_is_zero_after(
        fake_engines: Any, gateways: Any) -> None:
    eng = fake_engines(ttft_s=1.0)
    gw = gateways([eng.url], **HOLD_ONE)
    m = _metrics(gw.url)
    assert m["turnstile_oldest_hold_seconds"] == 0.0
    assert m["turnstile_hold_bound_seconds"] == 30.0  # fcfs-workflow's starvation bound

    def call(i: int) -> None:
        httpx.post(gw.url + "/v1/chat/completions", json=chat_body(),
                   headers={"x-session-id": f"s{i}"}, timeout=10)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while gw.gateway.scheduler.held_turns < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    held = _metrics(gw.url)["turnstile_oldest_hold_seconds"]
    assert 0.2 < held < 5.0  # one turn waits behind the other
    for t in threads:
        t.join()
    assert _metrics(gw.url)["turnstile_oldest_hold_seconds"] == 0.0
