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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from turnstile.core.clock import WallClock
from turnstile.core.state import TurnRecord, TurnState, WorkflowRecord
from turnstile.workload.model import Turn, Workflow

__all__ = ["ReplaySpec", "Replayer", "calibrate", "load_workflows", "run_replay", "synth_text"]

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

        kw = {"subset": spec.subset} if spec.subset else {}
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


class Replayer:
    """Plays workflows as closed-loop agents against an OpenAI-compatible target (one
    :meth:`agent` per workflow), keeping per-turn records, the targets' usage counters and, when
    the engine reports them, its per-request timings."""

    def __init__(self, spec: ReplaySpec, client: httpx.AsyncClient, chars_per_token: float
                 ) -> None:
        self.spec = spec
        self.client = client
        self.chars_per_token = chars_per_token
        self.clock = WallClock()
        self.records: list[WorkflowRecord] = []
        self.errors: dict[str, int] = {}
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

    async def agent(self, wf: Workflow) -> None:
        spec = self.spec
        delay = wf.arrival_s - self.clock.now()
        if delay > 0:
            await asyncio.sleep(delay)
        plan = plan_workflow(wf, spec.max_context, spec.max_tokens, spec.max_turns)
        self.scales.append(plan.scale)
        rec_wf = WorkflowRecord(wf.id, self.clock.now(), wf.tenant, None)
        self.records.append(rec_wf)
        rng = random.Random(f"{spec.seed}:{wf.id}")
        messages: list[dict[str, str]] = []
        context = 0
        for i, (n_in, n_out) in enumerate(zip(plan.inputs, plan.outputs, strict=True)):
            text = synth_text(n_in, self.chars_per_token, rng)
            if i == 0:
                text = f"session {wf.id}\n{text}"
            messages.append({"role": "user", "content": text})
            turn = Turn(input_tokens=n_in, output_tokens=n_out, context_tokens=context)
            rec = TurnRecord(rec_wf, i, turn)
            rec_wf.turns.append(rec)
            ok, reply, usage = await self.send(rec, wf.id, messages, n_out)
            if not ok:
                return  # the workflow stops at a failed turn (it stays unfinished)
            messages.append({"role": "assistant", "content": reply})
            prompt = int(usage.get("prompt_tokens", 0))
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            # new this turn: what the prompt adds to the previous prompt and reply
            self.recomputed_tokens += max(0, (prompt - cached) - max(0, prompt - context))
            context = prompt + rec.output_tokens
            if i + 1 < len(plan.inputs):
                tool_s = wf.turns[i].tool_duration_s * spec.time_scale
                if tool_s > 0:
                    await asyncio.sleep(tool_s)
        rec_wf.finished_s = max(t.finished_s for t in rec_wf.turns)

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
            async with self.client.stream("POST", "/v1/chat/completions", json=body,
                                          headers=headers) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    self._error(f"HTTP {resp.status_code}")
                    return False, "", {}
                self._released(rec, resp.headers)
                if spec.stream:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        obj = json.loads(line[6:])
                        if "error" in obj:
                            self._error("stream error")
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
                    obj = json.loads(await resp.aread())
                    usage = obj.get("usage") or {}
                    if isinstance(obj.get("timings"), dict):
                        self.engine_timings[(session, rec.index)] = obj["timings"]
                    reply.append(obj["choices"][0]["message"].get("content") or "")
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
            self._error(type(e).__name__)
            return False, "", {}
        rec.finished_s = self.clock.now()
        if rec.first_token_s < 0:
            rec.first_token_s = rec.finished_s
        rec.output_tokens = int(usage.get("completion_tokens", len(reply)))
        rec.state = TurnState.DONE
        self.prompt_tokens += int(usage.get("prompt_tokens", 0))
        details = usage.get("prompt_tokens_details") or {}
        self.cached_tokens += int(details.get("cached_tokens") or 0)
        return True, "".join(reply), usage

    def _released(self, rec: TurnRecord, headers: httpx.Headers) -> None:
        hold_ms = headers.get("x-turnstile-hold-ms")
        hold = float(hold_ms) / 1e3 if hold_ms else 0.0
        rec.released_s = rec.ready_s + hold
        rec.started_s = rec.released_s
        engine = headers.get("x-turnstile-engine")
        if engine:
            rec.engine = engine
            self.engines[engine] = self.engines.get(engine, 0) + 1

    def _error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def calibrate(client: httpx.AsyncClient, model: str) -> float:
    """Characters per token of the target's tokenizer, from one small request."""
    rng = random.Random(0)
    # short texts: an engine with small slots (a few hundred tokens) must still answer them
    texts = [synth_text(40, 4.0, rng), synth_text(120, 4.0, rng)]
    counts = []
    for text in texts:
        r = await client.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1})
        r.raise_for_status()
        counts.append(int(r.json()["usage"]["prompt_tokens"]))
    # the difference removes the chat template's fixed tokens
    ratio = (len(texts[1]) - len(texts[0])) / max(counts[1] - counts[0], 1)
    return min(max(ratio, 0.5), 8.0)


async def run_replay(spec: ReplaySpec, workflows: list[Workflow], trace_info: dict[str, Any],
                     out_dir: str | Path) -> tuple[Path, str]:
    """Play ``workflows`` against ``spec.target``; write ``results.json``; return its path and a
    one-line summary."""
    from turnstile import __version__
    from turnstile.bench.metrics import compute_metrics
    from turnstile.bench.report import write_results

    headers = {"authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=len(workflows) + 4)
    async with httpx.AsyncClient(base_url=spec.target, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(spec.timeout_s, connect=5.0)) as client:
        health: dict[str, Any] = {}
        try:
            r = await client.get("/health")
            if r.headers.get("content-type", "").startswith("application/json"):
                health = r.json()
        except (httpx.HTTPError, ValueError):
            pass
        chars_per_token = spec.chars_per_token
        if chars_per_token is None:
            chars_per_token = await calibrate(client, spec.model)
        rep = Replayer(spec, client, chars_per_token)
        start = rep.clock.now()
        await asyncio.gather(*(rep.agent(wf) for wf in workflows))
        makespan = rep.clock.now() - start
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
    if spec.save_detailed:
        from turnstile.bench.detailed import DETAILED_KEY, detailed_samples

        result[DETAILED_KEY] = detailed_samples(rep.records)
    path = write_results(out_dir, [result], config, trace_info, simulated=False, kind="replay")
    from turnstile.bench.html_report import write_html_report
    from turnstile.bench.report import load_results

    write_html_report(out_dir, load_results(path), policies=[result],
                      title=f"turnstile replay against {spec.target}")
    flow = metrics["flow_time_s"]
    p95 = flow.get("p95")
    summary = (f"{label}: {metrics['workflows']} workflows, {metrics['turns']} turns done "
               f"({metrics['workflows_unfinished']} unfinished, errors {rep.errors or 0}); "
               f"flow P95 {p95 if p95 is None else round(p95, 3)} s; "
               f"prefix hit rate {metrics['prefix_hit_rate']}")
    return path, summary
