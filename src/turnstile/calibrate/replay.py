"""A minimal closed-loop replay of workflows against real engines, for fidelity measurements.

Each workflow (a chain of turns) runs in its own thread: it arrives at ``arrival_s``, sends each
turn as soon as it is ready (eager release, no gateway in between), streams the answer, sleeps
for the turn's tool calls (and the next turn's think time), then sends the next turn. Workflow
``i`` (in arrival order) is pinned to engine ``i mod len(targets)``, the same static assignment
the fidelity simulation uses, so routing is not part of what is compared.

Prompts are token ids, built so the engine's prefix cache behaves as in a real conversation:
turn ``n``'s prompt is the previous turn's prompt, then the tokens the engine *generated* for it
(returned ids: llama.cpp ``return_tokens``, vLLM ``return_token_ids``), then ``input_tokens`` new
random ids, cut to the turn's ``context_tokens`` + ``input_tokens``. When an engine does not
return ids, random stand-ins take the outputs' place and only the previous prompt can hit.

Why not the gateway's ``turnstile replay``: this driver needs exact token-level prompts (so the
context and prefix hits match the simulated turn) and a fixed engine per session; the gateway
speaks chat messages and routes by policy. Results are the scheduler's records
(:class:`~turnstile.core.state.WorkflowRecord`), so :func:`turnstile.bench.metrics.compute_metrics`
applies unchanged.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnstile.calibrate.client import EngineRequestError, stream_completion
from turnstile.core.state import TurnRecord, TurnState, WorkflowRecord
from turnstile.workload.model import Workflow

__all__ = ["ReplayRun", "TurnLog", "assign_round_robin", "replay_workflows"]


@dataclass(slots=True)
class TurnLog:
    """What happened to one turn (times in seconds from the start of the run)."""

    workflow: str
    index: int
    engine: int
    ready_s: float
    sent_s: float
    first_token_s: float
    finished_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int | None
    error: str | None = None
    #: the engine's own timings when it reports them (llama.cpp ``timings``)
    timings: dict[str, float] | None = None


@dataclass
class ReplayRun:
    records: list[WorkflowRecord]
    turns: list[TurnLog]
    makespan_s: float
    wall_s: float
    errors: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def assign_round_robin(workflows: Sequence[Workflow], n: int) -> dict[str, int]:
    """Workflow id → engine index: ``i mod n`` in arrival order."""
    order = sorted(workflows, key=lambda w: (w.arrival_s, w.id))
    return {w.id: i % n for i, w in enumerate(order)}


def _rng_for(wf_id: str, seed: int) -> random.Random:
    digest = hashlib.sha256(f"{seed}:{wf_id}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def replay_workflows(
    workflows: Sequence[Workflow],
    targets: Sequence[str],
    *,
    apis: Sequence[str] | None = None,
    models: Sequence[str | None] | None = None,
    assignment: dict[str, int] | None = None,
    seed: int = 0,
    token_range: tuple[int, int] = (33, 127),
    timeout: float = 600.0,
    on_turn: Callable[[TurnLog], None] | None = None,
) -> ReplayRun:
    """Replay ``workflows`` (chains) against ``targets`` in real time. ``apis[i]`` is the wire
    format for target ``i`` (``llamacpp`` or ``openai``, see :mod:`turnstile.calibrate.client`)."""
    for wf in workflows:
        if not wf.is_chain:
            raise ValueError(f"{wf.id}: the replay drives chains only (DAG turns found)")
    n = len(targets)
    if n == 0:
        raise ValueError("no targets")
    apis = list(apis) if apis is not None else ["openai"] * n
    models = list(models) if models is not None else [None] * n
    assign = assignment if assignment is not None else assign_round_robin(workflows, n)
    logs: list[TurnLog] = []
    errors: list[str] = []
    lock = threading.Lock()
    lo, hi = token_range
    t0 = time.perf_counter() + 0.05

    def run(wf: Workflow) -> None:
        rng = _rng_for(wf.id, seed)
        eng = assign[wf.id]
        history: list[int] = []
        ready = wf.arrival_s
        for i, turn in enumerate(wf.turns):
            ready += turn.think_s if i else 0.0
            _sleep_until(t0 + ready)
            ctx = min(turn.context_tokens, len(history))
            new = turn.prompt_tokens - ctx
            prompt = history[:ctx] + [rng.randrange(lo, hi) for _ in range(new)]
            ready_s = time.perf_counter() - t0
            err: str | None = None
            try:
                res = stream_completion(
                    targets[eng],
                    prompt,
                    turn.output_tokens,
                    api=apis[eng],  # type: ignore[arg-type]
                    model=models[eng],
                    return_ids=True,
                    timeout=timeout,
                )
                first = res.first_token_s - t0
                fin = res.end_s - t0
                out_ids = res.output_ids
                if out_ids is None:
                    out_ids = [rng.randrange(lo, hi) for _ in range(res.completion_tokens)]
                log = TurnLog(
                    wf.id,
                    i,
                    eng,
                    ready_s,
                    res.send_s - t0,
                    first,
                    res.token_times[-1] - t0 if res.token_times else fin,
                    res.prompt_tokens,
                    res.completion_tokens,
                    res.cached_tokens,
                    timings=res.timings,
                )
            except EngineRequestError as exc:
                err = str(exc)
                now = time.perf_counter() - t0
                log = TurnLog(wf.id, i, eng, ready_s, ready_s, -1.0, now, len(prompt), 0, None, err)
                out_ids = []
            with lock:
                logs.append(log)
                if err:
                    errors.append(f"{wf.id}#{i}: {err}")
            if on_turn is not None:
                on_turn(log)
            if err:
                return
            history = prompt + out_ids
            ready = log.finished_s + turn.tool_duration_s

    wall0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(wf,), daemon=True) for wf in workflows]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - wall0
    records = _records(workflows, logs)
    makespan = max((lg.finished_s for lg in logs), default=0.0)
    return ReplayRun(records, sorted(logs, key=lambda g: (g.workflow, g.index)), makespan,
                     wall, errors)


def _sleep_until(t: float) -> None:
    while True:
        left = t - time.perf_counter()
        if left <= 0:
            return
        time.sleep(min(left, 0.5))


def _records(workflows: Sequence[Workflow], logs: Sequence[TurnLog]) -> list[WorkflowRecord]:
    """Scheduler records of the run (what ``compute_metrics`` reads)."""
    by_key = {(lg.workflow, lg.index): lg for lg in logs}
    out: list[WorkflowRecord] = []
    for wf in workflows:
        rec = WorkflowRecord(wf.id, wf.arrival_s, wf.tenant, wf)
        done = True
        for i, turn in enumerate(wf.turns):
            tr = TurnRecord(rec, i, turn)
            lg = by_key.get((wf.id, i))
            if lg is not None and lg.error is None:
                tr.ready_s = lg.ready_s
                tr.released_s = lg.sent_s
                tr.started_s = lg.sent_s
                tr.first_token_s = lg.first_token_s
                tr.finished_s = lg.finished_s
                tr.output_tokens = lg.output_tokens
                tr.engine = f"e{lg.engine}"
                tr.state = TurnState.DONE
            else:
                done = False
            rec.turns.append(tr)
        rec.remaining = 0 if done else 1
        if done and rec.turns:
            rec.finished_s = rec.turns[-1].finished_s
        out.append(rec)
    return out
