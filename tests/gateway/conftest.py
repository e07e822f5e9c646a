"""Fixtures for the gateway tests: fake engines and gateways served on loopback ports, all
stopped at the end of each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

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
