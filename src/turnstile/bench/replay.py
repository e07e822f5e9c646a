"""``turnstile replay``: play a trace's workflows as closed-loop agents against a real target.

Each workflow becomes an agent: at its arrival time it sends its first turn; it waits for the
reply, sleeps the tool's duration (× ``time_scale``), and sends the next turn with the grown
context (its earlier messages, the engine's real replies, and the new input). The target is the
gateway or an engine directly (both speak OpenAI), so the same workload can be played with and
without turnstile.

Prompt text is synthesized: a per-session first line (so each session has its own prefix and the
engine's prefix cache works as it would for real agents), then filler words drawn per session
and turn. A calibration request measures the target tokenizer's characters per token first, so
a turn of ``n`` trace tokens is sent as about ``n`` tokens. Trace token counts are scaled down,
per workflow, to fit ``max_context`` (the tiny test engine has 2k tokens per slot), and output
is capped at ``max_tokens``; the factors are written in the results.

Times are taken on the client (one wall clock): ``ready_s`` when a turn is sent, the first
streamed token, the end of the reply. The gateway's hold time comes back in a response header
(``x-turnstile-hold-ms``) and gives ``released_s``. The results go through the same
:func:`~turnstile.bench.metrics.compute_metrics` and :func:`~turnstile.bench.report.write_results`
as ``turnstile bench`` (labelled ``simulated: false``), so simulated and real runs compare line by
line. DAG workflows are played as chains (turns in index order).
"""

from __future__ import annotations

import asyncio
import json
import math
import platform
import random
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import numpy as np

from turnstile.core.clock import Clock, WallClock
from turnstile.core.state import TurnRecord, TurnState, WorkflowRecord
from turnstile.transport import PROBE_HEADER
from turnstile.transport.client import HttpTransport
from turnstile.workload.model import Turn, Workflow

__all__ = ["ReplaySession", "ReplaySpec", "Replayer", "calibrate", "load_workflows",
           "play_workflow", "run_replay", "synth_text", "target_transport"]

_WORDS = ("alpha", "beta", "gamma", "delta", "lambda", "sigma", "omega", "kappa", "theta",
          "zeta", "vector", "tensor", "kernel", "buffer", "cache", "token", "thread", "socket",
          "parser", "module", "render", "commit", "branch", "review", "patch", "build",
          "deploy")
#: template overhead per message in tokens (role markers)
_MESSAGE_OVERHEAD = 6


@dataclass
class ReplaySpec:
    target: str
    trace: str | None = None
    rate: float = 1.0
    workflows: int = 20
    time_scale: float = 1.0
    max_context: int = 2048
    max_tokens: int = 64
    max_turns: int | None = None
    model: str = "tiny"
    stream: bool = True
    arrivals: str = "poisson"
    label: str | None = None
    api_key: str | None = None
    subset: str | None = None
    seed: int = 0
    timeout_s: float = 300.0
    #: characters per token of the target's tokenizer; ``None``: measured with a calibration
    #: request through the target first. Give it when the target is a gateway whose policies
    #: should see only the sessions (the calibration request is a session of its own: it is
    #: routed, and its KV retained, like any other)
    chars_per_token: float | None = None
    #: add every workflow's and turn's samples to results.json (``--save-detailed``)
    save_detailed: bool = False


def load_workflows(spec: ReplaySpec) -> tuple[list[Workflow], dict[str, Any]]:
    """The sessions to play, on their arrival times, and where they came from."""
    from turnstile.workload import synth

    if spec.trace is None:
        base = synth.generate(synth.DEFAULT_SPEC, spec.workflows, spec.seed)
        info: dict[str, Any] = {"path": None, "name": "synthetic (fitted to agentcgroup)"}
    else:
        from turnstile.traces import load_trace

        kw: dict[str, Any] = {"subset": spec.subset} if spec.subset else {}
        loaded = load_trace(spec.trace, **kw)
        if not loaded.workflows:
            raise ValueError(f"{spec.trace}: no workflows")
        base = loaded.workflows
        info = {"path": spec.trace, "name": loaded.name, "notes": loaded.notes}
    if spec.arrivals == "trace":
        wfs = sorted(base, key=lambda w: w.arrival_s)[: spec.workflows]
        t0 = wfs[0].arrival_s
        wfs = [w.shifted(w.arrival_s - t0) for w in wfs]
        info.update(arrivals="trace", rate=None)
    elif spec.arrivals == "poisson":
        times = synth.poisson_arrivals(spec.rate, spec.workflows, spec.seed)
        wfs = synth.superimpose(base, times, spec.seed)
        info.update(arrivals=f"poisson (sessions superimposed on Poisson arrivals, seed "
                    f"{spec.seed})", rate=spec.rate)
    else:
        raise ValueError(f"unknown arrival process {spec.arrivals!r}; use poisson or trace")
    return wfs, info


def synth_text(n_tokens: int, chars_per_token: float, rng: random.Random) -> str:
    """About ``n_tokens`` tokens of filler words."""
    target = max(1, round(n_tokens * chars_per_token))
    words: list[str] = []
    size = 0
    while size < target:
        w = rng.choice(_WORDS)
        words.append(w)
        size += len(w) + 1
    return " ".join(words)


@dataclass
class _Plan:
    """A workflow's turns as sent: new input and output tokens per turn, after scaling."""

    inputs: list[int]
    outputs: list[int]
    scale: float


def plan_workflow(wf: Workflow, max_context: int, max_tokens: int,
                  max_turns: int | None) -> _Plan:
    """Scale a workflow's new-input tokens so its whole conversation fits ``max_context``."""
    turns = list(wf.turns[:max_turns] if max_turns else wf.turns)
    outputs = [max(1, min(t.output_tokens, max_tokens)) for t in turns]
    raw_inputs = [turns[0].prompt_tokens] + [t.input_tokens for t in turns[1:]]
    budget = max_context - max_tokens - 16
    # the context when the last turn is sent: all inputs, all earlier outputs, the overhead
    while turns:
        fixed = sum(outputs[:-1]) + _MESSAGE_OVERHEAD * (2 * len(turns)) + 16
        room = budget - fixed
        if room >= len(turns) * 8:
            break
        turns, outputs, raw_inputs = turns[:-1], outputs[:-1], raw_inputs[:-1]
    if not turns:
        return _Plan([8], [max(1, min(wf.turns[0].output_tokens, max_tokens))], 0.0)
    total = sum(raw_inputs)
    scale = min(1.0, room / max(total, 1))
    inputs = [max(8, math.floor(x * scale)) for x in raw_inputs]
    return _Plan(inputs, outputs, scale)


class ReplaySession(Protocol):
    """One workflow's conversation as the replayer plays it: what to send, how to send it."""

    def turn(self, index: int) -> Turn | None:
        """The turn to send next (None: the workflow is over)."""
        ...

    async def send(self, rec: TurnRecord) -> bool:
        """Send ``rec.turn`` and wait for the whole reply, filling ``rec``'s times and output
        (``finished_s`` on the replay's clock); False: it failed and the workflow stops."""
        ...

    def pause_s(self, index: int) -> float:
        """The wait from turn ``index``'s end until the next turn is ready (its tool calls)."""
        ...


async def play_workflow(wf: Workflow, open_session: Callable[[Workflow], ReplaySession],
                        clock: Clock, records: list[WorkflowRecord]) -> None:
    """The one closed loop: at ``wf.arrival_s`` (on ``clock``) open the session, then send each
    turn when it is ready and wait for its reply; the pause after a reply is the session's."""
    delay = wf.arrival_s - clock.now()
    if delay > 0:
        await asyncio.sleep(delay)
    session = open_session(wf)
    rec_wf = WorkflowRecord(wf.id, clock.now(), wf.tenant, None)
    records.append(rec_wf)
    i = 0
    while (turn := session.turn(i)) is not None:
        rec = TurnRecord(rec_wf, i, turn)
        rec_wf.turns.append(rec)
        if not await session.send(rec):
            return  # the workflow stops at a failed turn (it stays unfinished)
        wait = rec.finished_s + session.pause_s(i) - clock.now()
        if wait > 0:
            await asyncio.sleep(wait)
        i += 1
    if rec_wf.turns:
        rec_wf.finished_s = max(t.finished_s for t in rec_wf.turns)


class _ChatSession:
    """A workflow as OpenAI chat messages: synthesized text, the engine's real replies."""

    def __init__(self, rep: Replayer, wf: Workflow) -> None:
        spec = rep.spec
        self.rep = rep
        self.wf = wf
        self.plan = plan_workflow(wf, spec.max_context, spec.max_tokens, spec.max_turns)
        rep.scales.append(self.plan.scale)
        self.rng = random.Random(f"{spec.seed}:{wf.id}")
        self.messages: list[dict[str, str]] = []
        self.context = 0

    def turn(self, index: int) -> Turn | None:
        if index >= len(self.plan.inputs):
            return None
        return Turn(input_tokens=self.plan.inputs[index], output_tokens=self.plan.outputs[index],
                    context_tokens=self.context)

    async def send(self, rec: TurnRecord) -> bool:
        rep = self.rep
        text = synth_text(rec.turn.input_tokens, rep.chars_per_token, self.rng)
        if rec.index == 0:
            text = f"session {self.wf.id}\n{text}"
        self.messages.append({"role": "user", "content": text})
        ok, reply, usage = await rep.send(rec, self.wf.id, self.messages, rec.turn.output_tokens)
        if not ok:
            return False
        self.messages.append({"role": "assistant", "content": reply})
        prompt = int(usage.get("prompt_tokens", 0))
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        # new this turn: what the prompt adds to the previous prompt and reply
        rep.recomputed_tokens += max(0, (prompt - cached) - max(0, prompt - self.context))
        self.context = prompt + rec.output_tokens
        return True

    def pause_s(self, index: int) -> float:
        if index + 1 >= len(self.plan.inputs):
            return 0.0
        return self.wf.turns[index].tool_duration_s * self.rep.spec.time_scale


class Replayer:
    """Plays workflows as closed-loop agents against an OpenAI-compatible target (one
    :meth:`agent` per workflow, :func:`play_workflow` with chat sessions), keeping per-turn
    records, the targets' usage counters and, when the engine reports them, its per-request
    timings."""

    def __init__(self, spec: ReplaySpec, transport: HttpTransport, chars_per_token: float
                 ) -> None:
        self.spec = spec
        self.transport = transport
        self.chars_per_token = chars_per_token
        self.clock = WallClock()
        self.records: list[WorkflowRecord] = []
        self.errors: dict[str, int] = {}
        #: the first failed request's reason, as the target gave it (its error message)
        self.first_error: str | None = None
        #: called after every request, answered or failed (a progress bar's tick)
        self.on_request: Callable[[], None] | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        #: prompt tokens the engines computed although the session had computed them before
        #: (its KV was evicted): processed (prompt − cached) beyond the turn's new tokens
        self.recomputed_tokens = 0
        self.requests = 0
        self.engines: dict[str, int] = {}
        self.scales: list[float] = []
        #: (session, turn index) -> the engine's own per-request timings, when it reports them
        #: (llama.cpp: ``prompt_n``, ``cache_n``, ``prompt_ms``, ``predicted_n``, ``predicted_ms``)
        self.engine_timings: dict[tuple[str, int], dict[str, Any]] = {}
        #: (session, turn index) -> (prompt tokens, of them cached), from each reply's usage
        self.turn_usage: dict[tuple[str, int], tuple[int, int]] = {}

    async def agent(self, wf: Workflow) -> None:
        await play_workflow(wf, lambda w: _ChatSession(self, w), self.clock, self.records)

    async def send(self, rec: TurnRecord, session: str, messages: list[dict[str, str]],
                   max_tokens: int) -> tuple[bool, str, dict[str, Any]]:
        spec = self.spec
        body: dict[str, Any] = {"model": spec.model, "messages": messages,
                                "max_tokens": max_tokens, "stream": spec.stream}
        if spec.stream:
            body["stream_options"] = {"include_usage": True}
        headers = {"x-session-id": session, "x-request-id": f"{session}:{rec.index}"}
        rec.ready_s = self.clock.now()
        rec.state = TurnState.RUNNING
        self.requests += 1
        reply: list[str] = []
        usage: dict[str, Any] = {}
        try:
            resp = await self.transport.post("/v1/chat/completions", json.dumps(body).encode(),
                                             headers)
            async with resp:
                if resp.status != 200:
                    self._error(f"HTTP {resp.status}", _reason(await resp.read()))
                    return False, "", {}
                self._released(rec, resp.headers)
                if spec.stream:
                    async for line in resp.lines():
                        if not line.startswith("data: {"):
                            continue
                        obj = json.loads(line[6:])
                        if "error" in obj:
                            self._error("stream error", _reason(json.dumps(obj).encode()))
                            return False, "", {}
                        for c in obj.get("choices") or ():
                            piece = (c.get("delta") or {}).get("content")
                            if piece:
                                if rec.first_token_s < 0:
                                    rec.first_token_s = self.clock.now()
                                reply.append(piece)
                        if obj.get("usage"):
                            usage = obj["usage"]
                        if isinstance(obj.get("timings"), dict):
                            self.engine_timings[(session, rec.index)] = obj["timings"]
                else:
                    obj = json.loads(await resp.read())
                    usage = obj.get("usage") or {}
                    if isinstance(obj.get("timings"), dict):
                        self.engine_timings[(session, rec.index)] = obj["timings"]
                    reply.append(obj["choices"][0]["message"].get("content") or "")
        except (httpx.HTTPError, ConnectionError, TimeoutError, ValueError, KeyError,
                IndexError) as e:
            self._error(type(e).__name__, f"{type(e).__name__}: {e}")
            return False, "", {}
        finally:
            if self.on_request is not None:
                self.on_request()
        rec.finished_s = self.clock.now()
        if rec.first_token_s < 0:
            rec.first_token_s = rec.finished_s
        rec.output_tokens = int(usage.get("completion_tokens", len(reply)))
        rec.state = TurnState.DONE
        prompt = int(usage.get("prompt_tokens", 0))
        details = usage.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0)
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.turn_usage[(session, rec.index)] = (prompt, cached)
        return True, "".join(reply), usage

    def _released(self, rec: TurnRecord, headers: Mapping[str, str]) -> None:
        hold_ms = headers.get("x-turnstile-hold-ms")
        hold = float(hold_ms) / 1e3 if hold_ms else 0.0
        rec.released_s = rec.ready_s + hold
        rec.started_s = rec.released_s
        engine = headers.get("x-turnstile-engine")
        if engine:
            rec.engine = engine
            self.engines[engine] = self.engines.get(engine, 0) + 1

    def _error(self, kind: str, reason: str = "") -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        if self.first_error is None:
            self.first_error = f"{kind}: {reason}" if reason else kind


def _reason(body: bytes) -> str:
    """An error reply's own message (OpenAI's ``{"error": {"message": ...}}``), else its body,
    on one line and at most 500 characters."""
    text = body.decode("utf-8", "replace")
    try:
        obj = json.loads(text)
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict) and err.get("message"):
            text = str(err["message"])
        elif isinstance(err, str):
            text = err
    except ValueError:
        pass
    return " ".join(text.split())[:500]


def target_transport(target: str, *, api_key: str | None = None, timeout_s: float = 300.0,
                     connections: int = 256) -> HttpTransport:
    """The transport a replay talks to its target through (the gateway or an engine)."""
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    return HttpTransport(target, headers=headers, connect_timeout_s=5.0,
                         read_timeout_s=timeout_s, control_timeout_s=timeout_s,
                         max_keepalive=connections)


async def calibrate(transport: HttpTransport, model: str) -> float:
    """Characters per token of the target's tokenizer, from one small request."""
    rng = random.Random(0)
    # short texts: an engine with small slots (a few hundred tokens) must still answer them
    texts = [synth_text(40, 4.0, rng), synth_text(120, 4.0, rng)]
    counts = []
    for text in texts:
        r = await transport.post_json("/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1},
            headers={PROBE_HEADER: "1"})
        r.raise_for_status()
        counts.append(int(r.json()["usage"]["prompt_tokens"]))
    # the difference removes the chat template's fixed tokens
    ratio = (len(texts[1]) - len(texts[0])) / max(counts[1] - counts[0], 1)
    return min(max(ratio, 0.5), 8.0)


async def run_replay(spec: ReplaySpec, workflows: list[Workflow], trace_info: dict[str, Any],
                     out_dir: str | Path, *, on_request: Callable[[], None] | None = None
                     ) -> tuple[Path, str]:
    """Play ``workflows`` against ``spec.target``; write ``results.json``; return its path and a
    one-line summary. ``on_request`` is called after every request (a progress tick);
    ``results.json``'s ``replay.first_error`` keeps the first failure's reason verbatim."""
    from turnstile import __version__
    from turnstile.bench.metrics import compute_metrics
    from turnstile.bench.report import write_results

    transport = target_transport(spec.target, api_key=spec.api_key, timeout_s=spec.timeout_s,
                                 connections=len(workflows) + 4)
    try:
        health: dict[str, Any] = {}
        try:
            r = await transport.get("/health")
            if r.headers.get("content-type", "").startswith("application/json"):
                health = r.json()
        except (httpx.HTTPError, ValueError):
            pass
        chars_per_token = spec.chars_per_token
        if chars_per_token is None:
            chars_per_token = await calibrate(transport, spec.model)
        rep = Replayer(spec, transport, chars_per_token)
        rep.on_request = on_request
        start = rep.clock.now()
        await asyncio.gather(*(rep.agent(wf) for wf in workflows))
        makespan = rep.clock.now() - start
    finally:
        await transport.aclose()
    label = spec.label or health.get("policy") or "direct"
    metrics = compute_metrics(
        rep.records,
        engine_stats={"target": {"prompt_tokens": rep.prompt_tokens,
                                 "prefix_hit_tokens": rep.cached_tokens,
                                 "recomputed_prefill_tokens": rep.recomputed_tokens}},
        makespan_s=makespan,
    )
    scales = np.array(rep.scales or [1.0])
    result = {
        "policy": label,
        "simulated": False,
        "metrics": metrics,
        "replay": {"target": spec.target, "requests": rep.requests, "errors": rep.errors,
                   "first_error": rep.first_error,
                   "wall_s": makespan, "chars_per_token": chars_per_token,
                   "token_scale_mean": float(scales.mean()),
                   "token_scale_min": float(scales.min()),
                   "engines": rep.engines},
    }
    config = {
        "turnstile": __version__,
        "python": platform.python_version(),
        "driver": "replay",
        "replay": {k: v for k, v in asdict(spec).items() if k != "api_key"},
        "target_health": health,
    }
    from turnstile.bench.detailed import DETAILED_KEY, detailed_samples

    samples = detailed_samples(rep.records)  # the report's CDFs; results.json only if asked
    if spec.save_detailed:
        result[DETAILED_KEY] = samples
    path = write_results(out_dir, [result], config, trace_info, simulated=False, kind="replay")
    from turnstile.bench.html_report import write_html_report
    from turnstile.bench.report import load_results

    write_html_report(out_dir, load_results(path), policies=[{**result, DETAILED_KEY: samples}],
                      title=f"turnstile replay against {spec.target}")
    from turnstile.bench.report import format_seconds

    hit = metrics["prefix_hit_rate"]
    errors = ", ".join(f"{k} ×{n}" for k, n in (rep.errors or {}).items()) or "none"
    summary = (f"{label}: {metrics['workflows']} workflows, {metrics['turns']} turns done "
               f"({metrics['workflows_unfinished']} unfinished; errors: {errors}); flow P95 "
               f"{format_seconds(metrics['flow_time_s'].get('p95'))}; prefix hit rate "
               f"{'–' if hit is None else f'{100 * hit:.1f}%'}")
    return path, summary
