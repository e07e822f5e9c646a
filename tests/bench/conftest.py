"""Hand-made scheduler records with known times, for the bench tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from turnstile.core.state import TurnRecord, TurnState, WorkflowRecord
from turnstile.workload.model import Turn

#: (ready, released, started, first token, finished, output tokens)
TurnTimes = tuple[float, float, float, float, float, int]


def make_workflow(
    wf_id: str,
    arrival_s: float,
    turns: Sequence[TurnTimes],
    *,
    prompt_tokens: int = 100,
    done: bool = True,
) -> WorkflowRecord:
    """A workflow whose turns carry exactly the given times (no scheduler involved)."""
    wf = WorkflowRecord(wf_id, arrival_s, "default", None)
    for i, (ready, released, started, first, finished, out) in enumerate(turns):
        rec = TurnRecord(wf, i, Turn(input_tokens=prompt_tokens, output_tokens=max(out, 1)))
        rec.ready_s, rec.released_s, rec.started_s = ready, released, started
        rec.first_token_s, rec.finished_s = first, finished
        rec.output_tokens = out
        rec.state = TurnState.DONE if finished >= 0 else TurnState.RUNNING
        wf.turns.append(rec)
    if done:
        wf.finished_s = max(t[4] for t in turns)
    return wf


@pytest.fixture
def wf() -> Callable[..., WorkflowRecord]:
    """The :func:`make_workflow` factory."""
    return make_workflow
