"""``serve --record`` skips probes: replay's tokenizer calibration (two one-token requests)
and any request marked ``x-turnstile-probe: 1`` are served but never recorded as sessions."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import httpx

from turnstile.bench.replay import calibrate, target_transport
from turnstile.gateway.embedded import GatewayServer
from turnstile.testing.fake_engine import FakeServer
from turnstile.transport import PROBE_HEADER
from turnstile.workload.jsonl import read_workload


async def _calibrate(url: str) -> float:
    transport = target_transport(url)
    try:
        return await calibrate(transport, "tiny")
    finally:
        await transport.aclose()


def test_probes_are_served_and_not_recorded(
        tmp_path: Path, fake_engines: Callable[..., FakeServer],
        gateways: Callable[..., GatewayServer]) -> None:
    eng = fake_engines()
    path = tmp_path / "rec.jsonl"
    gw = gateways([eng.url], record=str(path))
    assert asyncio.run(_calibrate(gw.url)) > 0  # replay's calibration: served
    body = {"model": "tiny", "messages": [{"role": "user", "content": "are you there"}],
            "max_tokens": 2}
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers={PROBE_HEADER: "1"},
                   timeout=10)
    assert r.status_code == 200
    keyed = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=10,
                       headers={PROBE_HEADER: "1", "x-session-id": "probe-keyed"})
    assert keyed.status_code == 200
    real = httpx.post(gw.url + "/v1/chat/completions", json={**body, "messages": [
        {"role": "user", "content": "real work"}]}, headers={"x-session-id": "work"},
        timeout=10)
    assert real.status_code == 200
    assert len(eng.engine.requests) == 5  # every one reached the engine
    gw.stop()
    assert [wf.id for wf in read_workload(path)] == ["work"]
