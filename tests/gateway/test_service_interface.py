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
