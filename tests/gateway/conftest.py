"""Fixtures for the gateway tests: fake engines and gateways served on loopback ports, all
stopped at the end of each test; two real vLLM engines, started once for their module."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from turnstile.engines.tiny_hf_model import write_tiny_hf_model
from turnstile.engines.vllm_server import VllmServerProcess, start_all
from turnstile.gateway.embedded import GatewayServer, start_gateway
from turnstile.testing.fake_engine import FakeServer, start_fake


@pytest.fixture
def fake_engines() -> Iterator[Callable[..., FakeServer]]:
    started: list[FakeServer] = []

    def start(**kw: Any) -> FakeServer:
        s = start_fake(**kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def gateways() -> Iterator[Callable[..., GatewayServer]]:
    started: list[GatewayServer] = []

    def start(engines: list[Any], **kw: Any) -> GatewayServer:
        g = start_gateway(engines, **kw)
        started.append(g)
        return g

    yield start
    for g in started:
        g.stop()


class VllmEngines:
    """Two vLLM engines on the tiny random-weight Llama (``--max-num-seqs 4``, 2048 tokens,
    prefix caching, priority scheduling, cached-token details), each bound to a CPU of its
    own where there are two. :meth:`revive` restarts one that a test killed."""

    def __init__(self, model: Path, python: Path, n: int = 2) -> None:
        cpus = sorted(os.sched_getaffinity(0))
        self.model = model
        self.python = python
        self.servers = [self._server(str(cpus[i % len(cpus)])) for i in range(n)]
        self.start_s = 0.0

    def _server(self, cpus: str, **kw: Any) -> VllmServerProcess:
        return VllmServerProcess(self.model, max_num_seqs=4, cpus=cpus, python=self.python,
                                 **kw)

    def start(self) -> None:
        t0 = time.monotonic()
        start_all(self.servers)
        self.start_s = time.monotonic() - t0

    def revive(self, i: int, **kw: Any) -> VllmServerProcess:
        """Engine ``i`` running (restarted if dead, or if ``kw`` — VllmServerProcess
        arguments — are given)."""
        old = self.servers[i]
        if old.alive and old.signalled is None and not kw:
            return old
        old.stop()
        self.servers[i] = self._server(old.cpus or "0", **kw).start()
        return self.servers[i]

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


@pytest.fixture(scope="module")
def vllm_engines(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[VllmEngines]:
    """Started once for the module that uses them (one does: test_vllm_real.py), and stopped
    when it is done, so that ~3 GB and two engine processes do not idle through the rest of
    the suite."""
    engines = VllmEngines(write_tiny_hf_model(tmp_path_factory.mktemp("vllm-model")),
                          vllm_python)
    engines.start()
    yield engines
    engines.stop()
