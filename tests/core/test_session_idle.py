"""The idle rule shared by the gateway's sweep and the simulator's unannounced ends."""

from __future__ import annotations

import pytest

from turnstile.core.session_idle import SESSION_IDLE_S, idle_close_s, idle_expired, sweep_period_s
from turnstile.gateway.config import GatewayConfig


def test_the_gateway_closes_by_the_shared_rule_and_default():
    assert GatewayConfig().session_idle_s == SESSION_IDLE_S
    assert not idle_expired(400.0, 100.0, 300.0)  # exactly the idle time: still open
    assert idle_expired(400.01, 100.0, 300.0)


@pytest.mark.parametrize(("last", "idle"), [(0.0, 300.0), (12.34, 300.0), (7.0, 0.1),
                                            (99.9, 0.4), (1e6 + 0.3, 300.0)])
def test_the_close_is_the_first_sweep_after_the_idle_time(last, idle):
    t = idle_close_s(last, idle)
    period = sweep_period_s(idle)
    assert idle_expired(t, last, idle)
    assert not idle_expired((round(t / period) - 1) * period, last, idle)
    assert t / period == pytest.approx(round(t / period))  # on a sweep
