"""Host contention's arithmetic, with fake engines: paired busy/alone ratios, per neighbour."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from turnstile.calibrate import contention
from turnstile.calibrate.contention import measure_host_contention


class FakeHost:
    """Probe times that grow by ``slowdown`` per neighbour serving at the moment."""

    def __init__(self, slowdown: float) -> None:
        self.slowdown = slowdown
        self.serving = 0
        self.lock = threading.Lock()
        self.served = 0

    def factor(self) -> float:
        return 1.0 + self.slowdown * self.serving


class FakeProber:
    def __init__(self, host: FakeHost, info: Any = None, *_: Any, **__: Any) -> None:
        self.host = host
        self.info = info
        self.chunk = 2048
        self.calls: list[str] = []

    # the probed engine
    def ttft(self, new_tokens: int, cached_prefix: int = 0) -> float:
        self.calls.append("ttft")
        return 0.001 * (new_tokens + cached_prefix / 10) * self.host.factor()

    def decode(self, k: int, context: int, gen: int) -> Any:
        self.calls.append("decode")
        return SimpleNamespace(step_s=0.01 * k * self.host.factor())

    # a neighbour
    def warm_up(self) -> None:
        pass

    def serve_one(self, prompt_tokens: int, output_tokens: int, should_stop: Any) -> None:
        with self.host.lock:
            self.host.serving += 1
            self.host.served += 1
        try:
            while not should_stop():
                time.sleep(0.002)
        finally:
            with self.host.lock:
                self.host.serving -= 1


@pytest.mark.parametrize("neighbours", [1, 2])
def test_contention_is_the_median_paired_slowdown_per_neighbour(monkeypatch, neighbours):
    host = FakeHost(0.05)
    monkeypatch.setattr(contention, "EngineProber", lambda info, *a, **k: FakeProber(host, info))
    monkeypatch.setattr(contention, "NEIGHBOUR_STREAMS", 1)
    probed = FakeProber(host)
    ticks: list[str] = []
    got = measure_host_contention(probed, [object()] * neighbours, rounds=2,
                                  on_progress=ticks.append)
    # every neighbour streams while the busy side is timed: 5% per neighbour
    assert got.neighbours == neighbours
    assert got.per_engine == pytest.approx(0.05)
    assert set(got.probes) == {"prefill 256", "cache hit 768+48", "decode 2x512"}
    for p in got.probes.values():
        assert p["ratio"] == pytest.approx(1 + 0.05 * neighbours)
    assert len(ticks) == 2 * 3 * 2 and host.served >= 2 * neighbours
    assert host.serving == 0  # the load stopped with its round


def test_contention_never_goes_below_zero_and_needs_a_neighbour(monkeypatch):
    host = FakeHost(-0.1)  # a faster engine under load: noise, not negative contention
    monkeypatch.setattr(contention, "EngineProber", lambda info, *a, **k: FakeProber(host, info))
    monkeypatch.setattr(contention, "NEIGHBOUR_STREAMS", 1)
    assert measure_host_contention(FakeProber(host), [object()], rounds=1).per_engine == 0.0
    with pytest.raises(ValueError, match="neighbour"):
        measure_host_contention(FakeProber(host), [], rounds=1)


def test_a_probe_that_cannot_be_timed_drops_its_pair(monkeypatch):
    host = FakeHost(0.1)
    monkeypatch.setattr(contention, "EngineProber", lambda info, *a, **k: FakeProber(host, info))
    monkeypatch.setattr(contention, "NEIGHBOUR_STREAMS", 1)
    probed = FakeProber(host)
    probed.decode = lambda *a: None  # type: ignore[method-assign]
    got = measure_host_contention(probed, [object()], rounds=2)
    assert set(got.probes) == {"prefill 256", "cache hit 768+48"}
    assert got.per_engine == pytest.approx(0.1)
