"""Token-id sessions for the one replayer, for fidelity measurements against real engines.

Each workflow (a chain of turns) is played by the closed loop ``turnstile replay`` uses
(:func:`turnstile.bench.replay.play_workflow`) with a token-id session: it arrives at
``arrival_s``, sends each turn as soon as it is ready (eager release, no gateway in between),
streams the answer (a blocking measurement call in a worker thread of its own, which
time-stamps each token), waits for the turn's tool calls (and the next turn's think time), then
sends the next turn. Workflow ``i`` (in arrival order) is pinned to engine
``i mod len(targets)``, the same static assignment the fidelity simulation uses, so routing is
not part of what is compared.

Prompts are token ids, built so the engine's prefix cache behaves as in a real conversation:
turn ``n``'s prompt is the previous turn's prompt, then the tokens the engine *generated* for it
(returned ids: llama.cpp ``return_tokens``, vLLM ``return_token_ids``), then ``input_tokens`` new
random ids, cut to the turn's ``context_tokens`` + ``input_tokens``. When an engine does not
return ids, random stand-ins take the outputs' place and only the previous prompt can hit.

Why not ``turnstile replay``'s chat sessions: this driver needs exact token-level prompts (so
the context and prefix hits match the simulated turn) and a fixed engine per session; the
gateway speaks chat messages and routes by policy. Results are the scheduler's records
(:class:`~turnstile.core.state.WorkflowRecord`), so :func:`turnstile.bench.metrics.compute_metrics`
applies unchanged.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

from turnstile.bench.replay import play_workflow
from turnstile.calibrate.client import Api, EngineRequestError, StreamResult, stream_completion
from turnstile.core.state import TurnRecord, TurnState, WorkflowRecord
from turnstile.workload.model import Turn, Workflow

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


class _TokenSession:
    """A workflow as token-id prompts on its pinned engine (the module docstring): each turn
    is one blocking :func:`stream_completion` in a worker thread, so every streamed token is
    time-stamped as it arrives, whatever the other sessions do."""

    def __init__(self, run: _Run, wf: Workflow) -> None:
        self.run = run
        self.wf = wf
        self.rng = _rng_for(wf.id, run.seed)
        self.eng = run.assign[wf.id]
        self.history: list[int] = []

    def turn(self, index: int) -> Turn | None:
        return self.wf.turns[index] if index < len(self.wf.turns) else None

    def pause_s(self, index: int) -> float:
        nxt = self.wf.turns[index + 1].think_s if index + 1 < len(self.wf.turns) else 0.0
        return self.wf.turns[index].tool_duration_s + nxt

    async def send(self, rec: TurnRecord) -> bool:
        run, turn, rng, eng, i = self.run, rec.turn, self.rng, self.eng, rec.index
        lo, hi = run.token_range
        ctx = min(turn.context_tokens, len(self.history))
        new = turn.prompt_tokens - ctx
        prompt = self.history[:ctx] + [rng.randrange(lo, hi) for _ in range(new)]
        ready_s = run.now()
        err: str | None = None

        def call() -> StreamResult:
            return stream_completion(run.targets[eng], prompt, turn.output_tokens,
                                     api=run.apis[eng], model=run.models[eng], return_ids=True,
                                     timeout=run.timeout)

        try:
            res = await asyncio.get_running_loop().run_in_executor(run.pool, call)
            t0 = run.t0
            fin = res.end_s - t0
            out_ids = res.output_ids
            if out_ids is None:
                out_ids = [rng.randrange(lo, hi) for _ in range(res.completion_tokens)]
            log = TurnLog(self.wf.id, i, eng, ready_s, res.send_s - t0, res.first_token_s - t0,
                          res.token_times[-1] - t0 if res.token_times else fin,
                          res.prompt_tokens, res.completion_tokens, res.cached_tokens,
                          timings=res.timings)
        except EngineRequestError as exc:
            err = str(exc)
            log = TurnLog(self.wf.id, i, eng, ready_s, ready_s, -1.0, run.now(), len(prompt), 0,
                          None, err)
            out_ids = []
        run.logs.append(log)
        if err:
            run.errors.append(f"{self.wf.id}#{i}: {err}")
        if run.on_turn is not None:
            run.on_turn(log)
        if err:
            return False
        self.history = prompt + out_ids
        rec.finished_s = log.finished_s
        return True


@dataclass
class _Run:
    targets: Sequence[str]
    apis: list[Api]
    models: list[str | None]
    assign: dict[str, int]
    seed: int
    token_range: tuple[int, int]
    timeout: float
    on_turn: Callable[[TurnLog], None] | None
    pool: ThreadPoolExecutor
    #: the run's origin on ``time.perf_counter`` (turn times are seconds from it)
    t0: float = field(default_factory=lambda: time.perf_counter() + 0.05)
    logs: list[TurnLog] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def now(self) -> float:
        return time.perf_counter() - self.t0


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
    """Replay ``workflows`` (chains) against ``targets`` in real time, through the one closed
    loop (:func:`turnstile.bench.replay.play_workflow`). ``apis[i]`` is the wire format for
    target ``i`` (``llamacpp`` or ``openai``, see :mod:`turnstile.calibrate.client`)."""
    for wf in workflows:
        if not wf.is_chain:
            raise ValueError(f"{wf.id}: the replay drives chains only (DAG turns found)")
    n = len(targets)
    if n == 0:
        raise ValueError("no targets")
    assign = assignment if assignment is not None else assign_round_robin(workflows, n)

    async def play(run: _Run) -> None:
        records: list[WorkflowRecord] = []
        await asyncio.gather(*(play_workflow(wf, lambda w: _TokenSession(run, w), run, records)
                               for wf in workflows))

    wall0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, len(workflows))) as pool:
        wire: list[Api] = ([cast(Api, a) for a in apis] if apis is not None
                           else ["openai"] * n)
        run = _Run(targets, wire,
                   list(models) if models is not None else [None] * n, assign, seed,
                   token_range, timeout, on_turn, pool)
        asyncio.run(play(run))
    wall = time.perf_counter() - wall0
    logs = run.logs
    records = _records(workflows, logs)
    makespan = max((lg.finished_s for lg in logs), default=0.0)
    return ReplayRun(records, sorted(logs, key=lambda g: (g.workflow, g.index)), makespan,
                     wall, run.errors)


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
