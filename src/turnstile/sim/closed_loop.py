"""Closed-loop load: a fixed pool of workers, each running one session after another.

Open arrivals (Poisson, a trace's stream) offer load regardless of how fast the cluster serves
it; a pool of agent workers (a CI fleet, an RL rollout actor, a team of coding agents) does not:
a worker starts its next session only when its previous one finished, after ``think_s``. Offered
load is then set by the number of workers, and queueing can never grow without bound.

:func:`run_closed_loop` drives :class:`~turnstile.sim.cluster.ClusterSim` this way: the first
``workers`` sessions arrive spread over ``stagger_s``; every finished session hands the next
unused one to the pool at ``finish + think_s``. Flow time is measured from that arrival, as for
open arrivals.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from turnstile.core.state import WorkflowRecord
from turnstile.policies import PolicySet
from turnstile.sim.cluster import ClusterSim, SimResult
from turnstile.sim.engine_group import EngineGroup
from turnstile.workload.model import Workflow

__all__ = ["run_closed_loop"]


def run_closed_loop(
    sessions: Sequence[Workflow],
    workers: int,
    spec: str,
    groups: Sequence[EngineGroup],
    *,
    think_s: float = 1.0,
    stagger_s: float = 1.0,
    **kw: Any,
) -> SimResult:
    """Run every one of ``sessions`` (in order) on a pool of ``workers`` closed-loop workers
    under policy ``spec``; ``kw`` go to :class:`ClusterSim` (``hash_block_tokens``, ...)."""
    if workers < 1:
        raise ValueError("workers must be >= 1")
    if not sessions:
        raise ValueError("a closed loop needs at least one session")
    n0 = min(workers, len(sessions))
    first = [s.shifted(stagger_s * i / n0) for i, s in enumerate(sessions[:n0])]
    rest = iter(sessions[n0:])
    sim = ClusterSim(first, PolicySet.from_spec(spec), groups, **kw)

    def next_session(_wf: WorkflowRecord, end_s: float) -> None:
        # from the moment the worker's session is over (what the worker knows), announced to
        # the scheduler or not
        nxt = next(rest, None)
        if nxt is not None:
            sim.submit([nxt.shifted(end_s + think_s)])

    sim.on_session_over = next_session
    res = sim.run()
    res.extra.update(closed_loop={"workers": workers, "think_s": think_s,
                                  "sessions": len(sessions)})
    return res
