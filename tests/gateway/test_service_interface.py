"""The gateway's helpers reach the service only through its public interface: each helper's
host Protocol names no private member, and the Gateway provides every member (mypy checks the
types where the service passes itself to each helper)."""

from __future__ import annotations

import pytest

from turnstile.gateway.config import GatewayConfig, parse_engine_flag
from turnstile.gateway.driving import ReleaseHost
from turnstile.gateway.metrics import GatewayState
from turnstile.gateway.recovery import RecoveryHost
from turnstile.gateway.relay import TurnEvents
from turnstile.gateway.replicas import ReplicaHost
from turnstile.gateway.service import Gateway

HOSTS = [ReleaseHost, GatewayState, TurnEvents, RecoveryHost, ReplicaHost]


def members(protocol: type) -> set[str]:
    names = {n for n in vars(protocol) if not n.startswith("__") and n != "_is_protocol"}
    names |= set(getattr(protocol, "__annotations__", {}))
    return {n for n in names if not n.startswith("_abc_")}


@pytest.mark.parametrize("protocol", HOSTS, ids=lambda p: p.__name__)
def test_helpers_use_only_the_public_interface(protocol: type) -> None:
    names = members(protocol)
    assert names
    assert not [n for n in names if n.startswith("_")]
    gw = Gateway(GatewayConfig(engines=[parse_engine_flag("http://127.0.0.1:9")]))
    assert [n for n in names if not hasattr(gw, n)] == []


def test_an_engine_added_later_gets_its_retention_decisions() -> None:
    """The endpoint picker adds engines after start through ``ReleaseDriver.engine_added``:
    retention decisions then reach the adapters that act on them (llama.cpp's slot pins), and
    only those."""
    from types import SimpleNamespace

    from turnstile.core.actions import Retain, RetentionDecision
    from turnstile.core.state import TurnRecord, WorkflowRecord
    from turnstile.gateway.adapters import LlamaCppAdapter, OpenAIAdapter
    from turnstile.gateway.driving import ReleaseDriver
    from turnstile.workload import Turn

    spawned: list[object] = []

    def spawn(coro: object) -> None:
        spawned.append(coro)
        coro.close()  # type: ignore[attr-defined]

    host = SimpleNamespace(
        adapters={}, health=SimpleNamespace(up=lambda e: True),
        clock=SimpleNamespace(now=lambda: 0.0), spawn=spawn,
        scheduler=SimpleNamespace(next_wakeup=lambda now: None))
    driver = ReleaseDriver(host)  # type: ignore[arg-type]
    llama = LlamaCppAdapter("http://127.0.0.1:9", engine_id="llama")
    plain = OpenAIAdapter("http://127.0.0.1:10", engine_id="plain")
    host.adapters.update({"llama": llama, "plain": plain})
    driver.engine_added(llama)
    driver.engine_added(plain)
    rec = TurnRecord(WorkflowRecord("s", 0.0, "default", None), 0, Turn(10, 5))
    driver.apply([Retain(rec, "plain", RetentionDecision("pin", 5.0))])
    assert spawned == []  # the plain adapter ignores retention: nothing spawned
    driver.apply([Retain(rec, "llama", RetentionDecision("pin", 5.0))])
    assert len(spawned) == 1
