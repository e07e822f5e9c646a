"""The idle rule by which an open session ends when its client never says so.

A client does not announce that its session is over: it simply sends no further turn. The
gateway closes a session that has had no turn running or waiting for longer than
``session_idle_s`` (:data:`SESSION_IDLE_S` by default), looking for such sessions every
:func:`sweep_period_s`; only then does the scheduler (and every policy) learn that the session
ended. The simulator's unannounced-end mode (:class:`~turnstile.sim.cluster.ClusterSim`'s
``session_idle_s``) closes sessions by the same rule, so a policy is simulated on what the gateway
can know.
"""

from __future__ import annotations

import math

__all__ = ["SESSION_IDLE_S", "idle_close_s", "idle_expired", "sweep_period_s"]

#: seconds without a turn after which the gateway closes a session (its default)
SESSION_IDLE_S = 300.0


def sweep_period_s(session_idle_s: float) -> float:
    """How often the gateway looks for sessions idle longer than ``session_idle_s`` (a closed
    session is found up to one period late)."""
    return min(1.0, max(session_idle_s / 4, 0.05))


def idle_expired(now_s: float, last_active_s: float, session_idle_s: float) -> bool:
    """Whether a session whose last turn ended at ``last_active_s`` (and that has none running
    or waiting) is closed by a sweep at ``now_s``."""
    return now_s - last_active_s > session_idle_s


def idle_close_s(last_active_s: float, session_idle_s: float) -> float:
    """When a sweep closes a session that stays idle from ``last_active_s``: the first sweep
    (sweeps at whole multiples of :func:`sweep_period_s` from time 0) at which
    :func:`idle_expired` holds."""
    period = sweep_period_s(session_idle_s)
    k = math.floor((last_active_s + session_idle_s) / period)
    while not idle_expired(k * period, last_active_s, session_idle_s):
        k += 1
    return k * period
