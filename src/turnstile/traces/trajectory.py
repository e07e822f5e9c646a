"""Agent trajectories: mini-swe-agent (``*.traj.json``) and SWE-agent (``*.traj``), plain or
gzipped, one file per task instance, or a folder of them (searched recursively).

**mini-swe-agent** (``{"info": {...}, "messages": [...], "trajectory_format":
"mini-swe-agent-1..."}``): one workflow per file, one turn per ``assistant`` message.

* Tokens from the message's ``extra.response.usage`` (the LiteLLM response the agent saved):
  ``prompt_tokens``, ``completion_tokens``, and cached prompt tokens from
  ``prompt_tokens_details.cached_tokens`` (OpenAI style) or ``cache_read_input_tokens``
  (Anthropic style). Without usage: the prompt's and the reply's characters ÷ 4 (counted in the
  notes).
* Context: every turn's messages extend the previous turn's (the agent appends), so
  ``context_tokens`` = previous prompt + output, checked on the canonical text.
* Tool: the messages between one assistant message and the next are the command's result (the
  bash output): one ``ToolCall("bash")``, status ``ok`` for return code 0, ``error`` for
  another code, ``timeout`` when the agent itself reported a time-out, ``unknown`` without a
  code; ``result_tokens`` = the result's characters ÷ 4. The return code is the message's
  ``extra.returncode`` or, in the observation text, ``<returncode>N</returncode>`` (what
  mini-swe-agent shows the model). A time-out is only the agent's own signal:
  ``extra.interrupt_type == "ExecutionTimeoutError"`` or its timeout template ("… timed out
  and has been killed"), never the word in a command's output (``timeout-2.3.1`` in a pytest
  header is not a time-out).
* Tool time: when both carry ``extra.timestamp`` (newer versions stamp the reply when it arrived
  and the observation when the command ended), their difference. Otherwise from the responses'
  ``created`` stamps (whole seconds; ≈ when the provider started the call):
  ``created(i+1) − created(i) − llm_time(i)``, clamped at 0, where the LLM-time estimate is
  ``(prompt − cached) / prefill_tok_s + output / decode_tok_s`` (5,000 and 50 tokens/s by
  default: a hosted frontier model's order of magnitude). Turns with neither: tool time 0.
* Arrival: the first call's start relative to the earliest file of the load (the instances of a
  batch ran in parallel or one after another: batch order, not user arrivals).

**SWE-agent** (``{"trajectory": [{"action", "observation", "execution_time", "query", ...}],
"info": {"model_stats": {"tokens_sent", "tokens_received", ...}}}``): one turn per step. Steps
carry no per-call usage or timestamps: prompt = the step's ``query`` messages' characters ÷ 4
and output = the ``response`` characters ÷ 4, both scaled so their sums match
``model_stats.tokens_sent`` / ``tokens_received`` when present; tool time = ``execution_time``
(measured by SWE-agent); status ``timeout`` only from SWE-agent's own message ("… was
cancelled because it took more than N seconds", or the older "EXECUTION TIMED OUT"), else
``unknown``; arrival 0 for every file.

Notes count what the import had to bend: tool times clamped to 0 (the created-stamp gap was
shorter than the LLM-time estimate), prompts clamped below the context carried from the
previous turn, and runaway outputs (≥ :data:`RUNAWAY_OUTPUT_TOKENS`). Where a log has no
timestamps at all, tool time is modelled as zero, and ``LoadedTrace.warnings`` says so (``traces
info`` and ``bench`` print it).

Prefix block hashes are computed from the messages (:mod:`.prefix`), so instances that share a
system prompt and task template share leading blocks.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

from turnstile.traces.base import (
    JsonPath,
    LoadedTrace,
    TraceFormatError,
    counted_notes,
    read_json_file,
    tokens_from_chars,
)
from turnstile.traces.observed import ObservedCall, ObservedThread, build_workflow
from turnstile.traces.prefix import (
    BLOCK_CHARS,
    chain_hashes,
    hash_block_tokens,
    prompt_text,
    tokens_per_char,
)
from turnstile.workload.model import ToolCall, ToolStatus, Workflow

PREFILL_TOK_S = 5000.0
DECODE_TOK_S = 50.0
SUFFIXES = (".traj.json", ".traj.json.gz", ".traj", ".traj.gz")
#: mini-swe-agent's timeout template ("The last command <command>…</command> timed out and has
#: been killed."), and its exception name
_MINI_TIMEOUT = re.compile(r"timed out and has been killed|ExecutionTimeoutError")
#: SWE-agent's command_cancelled_timeout_template, and the older "EXECUTION TIMED OUT ..."
_SWE_TIMEOUT = re.compile(r"was cancelled because it took more than \d+ seconds|"
                          r"EXECUTION TIMED OUT")
_RETURNCODE = re.compile(r"<returncode>\s*(-?\d+)\s*</returncode>")
#: an output this long is a runaway turn (a model that did not stop), flagged in the notes
RUNAWAY_OUTPUT_TOKENS = 32_000


def is_trajectory_path(path: Path) -> bool:
    """A trajectory file, or a folder holding some (at any depth)."""
    if path.is_file():
        return path.name.lower().endswith(SUFFIXES)
    return path.is_dir() and next(_files(path), None) is not None


def _files(folder: Path) -> Iterator[Path]:
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name.lower().endswith(SUFFIXES):
            yield p


def _content_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict)
                   and isinstance(p.get("text"), str))
    return 0


def _llm_time(prompt: int, cached: int | None, output: int, prefill: float, decode: float
              ) -> float:
    return max(0, prompt - (cached or 0)) / prefill + output / decode


class _Mini:
    """One mini-swe-agent file → calls (see the module docstring)."""

    def __init__(self, path: Path, data: dict[str, Any], c: Counter[str], prefill: float,
                 decode: float) -> None:
        self.j = JsonPath(path)
        self.path, self.data, self.c = path, data, c
        self.prefill, self.decode = prefill, decode

    def usage(self, m: dict[str, Any], where: str) -> tuple[int | None, int | None, int | None,
                                                         float | None]:
        j = self.j
        extra = j.get(m, where, "extra", (dict,))
        if extra is None:
            return None, None, None, None
        resp = j.get(extra, f"{where}.extra", "response", (dict,))
        if resp is None:
            return None, None, None, None
        rw = f"{where}.extra.response"
        created = j.get(resp, rw, "created", (int, float))
        usage = j.get(resp, rw, "usage", (dict,))
        if usage is None:
            return None, None, None, created
        uw = f"{rw}.usage"
        prompt = j.count(usage, uw, "prompt_tokens")
        out = j.count(usage, uw, "completion_tokens")
        cached = None
        details = j.get(usage, uw, "prompt_tokens_details", (dict,))
        if details is not None:
            cached = j.count(details, f"{uw}.prompt_tokens_details", "cached_tokens")
        if cached is None:
            cached = j.count(usage, uw, "cache_read_input_tokens")
        if prompt is not None and cached is not None and cached > prompt:
            raise j.fail(f"{uw}", f"cached tokens ({cached}) exceed prompt_tokens ({prompt})")
        return prompt, out, cached, created

    def calls(self) -> list[ObservedCall]:
        j, c = self.j, self.c
        msgs = j.get(self.data, "$", "messages", (list,), required=True)
        assistants = []
        for i, m in enumerate(msgs):
            role = j.get(m, f"$.messages[{i}]", "role", (str,), required=True)
            if role == "assistant":
                assistants.append(i)
        if not assistants:
            raise j.fail("$.messages", "no assistant message (no LLM call to import)")
        calls: list[ObservedCall] = []
        stamps: list[tuple[float | None, float | None, float | None]] = []
        prev_text = ""
        for n, i in enumerate(assistants):
            where = f"$.messages[{i}]"
            m = msgs[i]
            text = prompt_text(msgs[:i])
            prompt, out, cached, created = self.usage(m, where)
            if prompt is None or prompt < 1:
                c["prompt_estimated"] += 1
                prompt = tokens_from_chars(len(text))
            if out is None or out < 1:
                c["output_estimated"] += 1
                out = tokens_from_chars(_content_chars(m.get("content")))
            cached = min(cached, prompt) if cached is not None else None
            nxt = assistants[n + 1] if n + 1 < len(assistants) else len(msgs)
            result = msgs[i + 1:nxt]
            tool = self.tool(result, f"$.messages[{i + 1}:{nxt}]") if result else None
            reply_ts = self.timestamp(m, where)
            obs_ts = self.timestamp(result[-1], f"$.messages[{nxt - 1}]") if result else None
            stamps.append((created, reply_ts, obs_ts))
            calls.append(ObservedCall(
                start_s=0.0, end_s=0.0, prompt_tokens=prompt, output_tokens=out,
                cached_tokens=cached, block_hashes=chain_hashes(text), prompt_chars=len(text),
                extends_previous=text.startswith(prev_text) if n else None,
                tools=(tool,) if tool is not None else ()))
            prev_text = text
        self.timeline(calls, stamps)
        return calls

    def timestamp(self, m: Any, where: str) -> float | None:
        extra = self.j.get(m, where, "extra", (dict,))
        if extra is None:
            return None
        return self.j.get(extra, f"{where}.extra", "timestamp", (int, float))

    def tool(self, result: list[Any], where: str) -> ToolCall:
        chars, code, timeout = 0, None, False
        for m in result:
            if not isinstance(m, dict):
                raise self.j.fail(where, "expected message objects")
            chars += _content_chars(m.get("content"))
            extra_v = m.get("extra")
            extra: dict[str, Any] = extra_v if isinstance(extra_v, dict) else {}
            rc = extra.get("returncode")
            content = m.get("content")
            text = content if isinstance(content, str) else ""
            if isinstance(content, list):
                text = "".join(p["text"] for p in content if isinstance(p, dict)
                               and isinstance(p.get("text"), str))
            if isinstance(rc, int) and not isinstance(rc, bool):
                code = rc
            else:
                found = _RETURNCODE.search(text[:500])
                if found is not None:
                    code = int(found.group(1))
            if (extra.get("interrupt_type") == "ExecutionTimeoutError"
                    or _MINI_TIMEOUT.search(text[:500])):
                timeout = True
        status: ToolStatus = "timeout" if timeout else (
            "unknown" if code is None else ("ok" if code == 0 else "error"))
        return ToolCall("bash", 0.0, status, tokens_from_chars(chars) if chars else 0)

    def timeline(self, calls: list[ObservedCall],
                 stamps: list[tuple[float | None, float | None, float | None]]) -> None:
        """Fill start/end and the tool durations (module docstring, "Tool time")."""
        c = self.c
        n = len(calls)
        t = 0.0
        for k, call in enumerate(calls):
            created, reply_ts, obs_ts = stamps[k]
            llm = _llm_time(call.prompt_tokens, call.cached_tokens, call.output_tokens,
                            self.prefill, self.decode)
            if reply_ts is not None:
                call.end_s = reply_ts
                prev_obs = stamps[k - 1][2] if k else None
                if prev_obs is not None and prev_obs <= reply_ts:
                    call.start_s = prev_obs  # the command's end: the next request went out
                elif created is not None and created <= reply_ts:
                    call.start_s = float(created)
                else:
                    call.start_s = reply_ts - llm
            elif created is not None:
                call.start_s = float(created)
                call.end_s = call.start_s + llm
            else:
                call.start_s = t
                call.end_s = t + llm
            duration: float | None = None
            if reply_ts is not None and obs_ts is not None:
                duration = max(0.0, obs_ts - reply_ts)
                c["tool_time_from_timestamps"] += 1
                if obs_ts < reply_ts and call.tools:
                    c["tool_time_clamped_to_zero"] += 1
            elif k + 1 < n and created is not None and stamps[k + 1][0] is not None:
                gap = float(stamps[k + 1][0]) - float(created)  # type: ignore[arg-type]
                duration = max(0.0, gap - llm)
                c["tool_time_from_created"] += 1
                if gap < llm and call.tools:
                    c["tool_time_clamped_to_zero"] += 1
            elif call.tools:
                c["tool_time_unknown"] += 1
            if call.tools:
                tool = call.tools[0]
                call.tools = (ToolCall(tool.name, round(duration or 0.0, 6), tool.status,
                                       tool.result_tokens),)
            t = call.end_s + (duration or 0.0)


def _swe_agent_calls(path: Path, data: dict[str, Any], c: Counter[str], prefill: float,
                     decode: float) -> list[ObservedCall]:
    j = JsonPath(path)
    steps = j.get(data, "$", "trajectory", (list,), required=True)
    if not steps:
        raise j.fail("$.trajectory", "empty (no LLM call to import)")
    texts, outs, tools = [], [], []
    for i, st in enumerate(steps):
        where = f"$.trajectory[{i}]"
        query = j.get(st, where, "query", (list,))
        if query is None:
            c["query_missing"] += 1
            query = []
        texts.append(prompt_text(query))
        response = j.get(st, where, "response", (str,)) or ""
        outs.append(tokens_from_chars(len(response)))
        dur = j.get(st, where, "execution_time", (int, float))
        obs = j.get(st, where, "observation", (str,)) or ""
        status: ToolStatus = "timeout" if _SWE_TIMEOUT.search(obs[:500]) else "unknown"
        tools.append(ToolCall("bash", round(max(0.0, float(dur or 0.0)), 6), status,
                              tokens_from_chars(len(obs)) if obs else 0))
        if dur is None:
            c["execution_time_missing"] += 1
    prompts = [tokens_from_chars(len(t)) for t in texts]
    info = j.get(data, "$", "info", (dict,)) or {}
    stats = j.get(info, "$.info", "model_stats", (dict,)) or {}
    sent = j.count(stats, "$.info.model_stats", "tokens_sent")
    received = j.count(stats, "$.info.model_stats", "tokens_received")
    if sent and sum(prompts):
        scale = sent / sum(prompts)
        prompts = [max(1, round(p * scale)) for p in prompts]
        c["prompt_scaled_to_tokens_sent"] += 1
    if received and sum(outs):
        scale = received / sum(outs)
        outs = [max(1, round(o * scale)) for o in outs]
    calls = []
    t = 0.0
    for k, text in enumerate(texts):
        llm = _llm_time(prompts[k], None, outs[k], prefill, decode)
        calls.append(ObservedCall(
            start_s=t, end_s=t + llm, prompt_tokens=prompts[k], output_tokens=outs[k],
            block_hashes=chain_hashes(text), prompt_chars=len(text),
            extends_previous=text.startswith(texts[k - 1]) if k else None, tools=(tools[k],)))
        t += llm + tools[k].duration_s
    return calls


def load_trajectories(path: str | Path, *, prefill_tok_s: float = PREFILL_TOK_S,
                      decode_tok_s: float = DECODE_TOK_S) -> LoadedTrace:
    """Load one trajectory file or a folder of them (rules in the module docstring)."""
    p = Path(path)
    files = [p] if p.is_file() else list(_files(p))
    if not files:
        raise TraceFormatError(p, "", f"no trajectory files ({', '.join(SUFFIXES)})")
    c: Counter[str] = Counter()
    per_file: list[tuple[Path, str, list[ObservedCall], dict[str, str]]] = []
    for f in files:
        data = read_json_file(f)
        if not isinstance(data, dict):
            raise TraceFormatError(f, "$", "expected a JSON object")
        name = f.name
        for suffix in SUFFIXES:
            if name.lower().endswith(suffix):
                name = name[: -len(suffix)]
                break
        meta = {"source": "", "instance": name}
        if "messages" in data:
            fmt = data.get("trajectory_format")
            meta["source"] = str(fmt) if isinstance(fmt, str) else "mini-swe-agent"
            calls = _Mini(f, data, c, prefill_tok_s, decode_tok_s).calls()
            c["mini_swe_agent_files"] += 1
        elif "trajectory" in data:
            meta["source"] = "swe-agent"
            calls = _swe_agent_calls(f, data, c, prefill_tok_s, decode_tok_s)
            c["swe_agent_files"] += 1
        else:
            raise TraceFormatError(f, "$", "neither 'messages' (mini-swe-agent) nor "
                                   "'trajectory' (SWE-agent): not an agent trajectory")
        info_v = data.get("info")
        info: dict[str, Any] = info_v if isinstance(info_v, dict) else {}
        if isinstance(info.get("exit_status"), str):
            meta["exit_status"] = info["exit_status"]
        per_file.append((f, name, calls, meta))
    for _f, _name, calls, _meta in per_file:
        for prev, call in pairwise(calls):
            # the cases where build_workflow carries the previous prompt + output as context
            grows = call.extends_previous or (call.extends_previous is None
                                              and not call.block_hashes
                                              and call.prompt_tokens >= prev.prompt_tokens)
            if grows and prev.prompt_tokens + prev.output_tokens > call.prompt_tokens - 1:
                c["prompt_clamped_to_context"] += 1
        c["runaway_outputs"] += sum(call.output_tokens >= RUNAWAY_OUTPUT_TOKENS for call in calls)
    origin = min(cs[0].start_s for _, _, cs, m in per_file if m["source"] != "swe-agent") \
        if c["mini_swe_agent_files"] else 0.0
    workflows: list[Workflow] = []
    ids: Counter[str] = Counter()
    for _f, name, calls, meta in per_file:
        ids[name] += 1
        wid = name if ids[name] == 1 else f"{name}~{ids[name]}"
        o = calls[0].start_s if meta["source"] == "swe-agent" else origin
        workflows.append(build_workflow(wid, [ObservedThread(calls)], origin_s=o, meta=meta))
    workflows.sort(key=lambda w: (w.arrival_s, w.id))
    ratio = tokens_per_char((call.prompt_tokens, call.prompt_chars)
                            for _, _, cs, _ in per_file for call in cs)
    notes = [
        "trajectories: one workflow per file, one turn per assistant message (mini-swe-agent) "
        "or trajectory step (SWE-agent); the command's output is the tool result",
        f"trajectories: tool time from reply/observation timestamps where both exist, else "
        f"created(i+1) − created(i) − LLM-time estimate ((prompt − cached)/{prefill_tok_s:g} + "
        f"output/{decode_tok_s:g} s), clamped at 0",
        "trajectories: arrival = first call relative to the earliest file (batch order, not "
        "user arrivals)",
    ]
    explain = {
        "prompt_estimated": "calls without usage.prompt_tokens: prompt = characters ÷ 4",
        "output_estimated": "calls without usage.completion_tokens: output = characters ÷ 4",
        "tool_time_from_created": "tool times from created stamps (whole seconds) minus the "
        "LLM-time estimate",
        "tool_time_unknown": "tool calls with no timing at all: duration 0",
        "prompt_scaled_to_tokens_sent": "SWE-agent files: per-step characters ÷ 4 scaled to "
        "model_stats.tokens_sent / tokens_received",
        "execution_time_missing": "SWE-agent steps without execution_time: duration 0",
        "query_missing": "SWE-agent steps without query messages: empty prompt text (no hashes)",
        "tool_time_clamped_to_zero": "tool times clamped to 0 (the gap between two calls was "
        "shorter than the LLM-time estimate, or the observation stamp precedes the reply's)",
        "prompt_clamped_to_context": "prompts shorter than the previous prompt + output they "
        "extend: context capped at prompt − 1 (the provider counted fewer tokens than the "
        "transcript grew)",
        "runaway_outputs": f"runaway outputs (≥ {RUNAWAY_OUTPUT_TOKENS:,} tokens, max "
        f"{max((x.output_tokens for _, _, cs, _ in per_file for x in cs), default=0):,})",
    }
    notes.extend(counted_notes("trajectories", c, explain))
    n_tools = sum(len(call.tools or ()) for _, _, cs, _ in per_file for call in cs)
    untimed = c["tool_time_unknown"] + c["execution_time_missing"]
    warnings = []
    if n_tools and untimed:
        warnings.append(
            f"tool time is modelled as zero for {untimed:,} of {n_tools:,} tool calls: the log "
            "has no timestamps for them (no extra.timestamp, response created stamp or "
            "execution_time), so a simulation sees back-to-back LLM calls")
    counts = dict(c)
    counts.update(sessions=len(workflows), llm_calls=sum(len(w.turns) for w in workflows),
                  tool_calls=sum(len(t.tools) for w in workflows for t in w.turns), skipped=0)
    return LoadedTrace(name=f"trajectories:{p.name}", source=str(p), workflows=workflows,
                       notes=notes, counts=counts, warnings=warnings,
                       hash_block_tokens=hash_block_tokens(ratio, BLOCK_CHARS))
