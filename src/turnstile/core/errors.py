"""The core's exception (its own module: the scheduler module is compiled by ``make compiled``,
and mypyc cannot compile a subclass of ``RuntimeError``)."""

from __future__ import annotations


class SchedulerError(RuntimeError):
    """An event that contradicts the state machine (a driver bug), with the turn it concerns."""
