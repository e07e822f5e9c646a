"""OpenAI-style request logs: JSON Lines of chat-completions calls with their usage and times, as
an LLM proxy writes them. One record per line, in one of three shapes:

* **LiteLLM StandardLoggingPayload** (what LiteLLM hands its loggers):
  ``startTime`` / ``endTime`` (Unix seconds), ``prompt_tokens``, ``completion_tokens``,
  ``messages``, ``response``, ``status``, ``trace_id``, ``end_user``, ``metadata``.
* **LiteLLM spend-log rows** (``LiteLLM_SpendLogs``): the same token fields, ISO-8601
  ``startTime`` / ``endTime``, ``request_id``, ``user``, ``end_user``, ``session_id``,
  ``messages`` and/or ``proxy_server_request`` (the request body).
* **Request/response pairs**: ``{"request": <chat-completions body>, "response": <its answer
  with usage>, "start_time" | "timestamp": ..., "end_time": ... | "latency_ms": ...}``.

Times may be Unix seconds, Unix milliseconds or ISO-8601 strings. Tokens come from the record's
own counts, else from ``response.usage`` (cached prompt tokens from
``usage.prompt_tokens_details.cached_tokens``); without any, characters ÷ 4. Failed calls
(``status`` ``failure``/``error``, or an ``error`` and no usage) are skipped and counted.

**Sessions.** ``group_by="auto"`` uses the first of :data:`SESSION_FIELDS` that is set on at
least 90% of the records and groups at least two of them; records without it, or every record
when no field qualifies, are grouped **by shared message prefixes**: a request continues the
session whose latest request's messages are a leading run of its own messages (the longest such
run wins; a session continues one request at a time, so two requests that both extend the same
one start a fork: a new session). ``group_by`` may also name a field (dotted path) or
``prefix``. Within a session, calls are a chain in start-time order; tool time = the gap between
a call's end and the next call's start (tool plus client time; a client that overlaps calls of
one session gets gaps of 0). See :mod:`.observed` for context tokens and hashes.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnstile.traces.base import (
    JsonPath,
    LoadedTrace,
    TraceFormatError,
    counted_notes,
    iter_json_lines,
    parse_utc,
    tokens_from_chars,
)
from turnstile.traces.observed import ObservedCall, ObservedThread, build_workflow
from turnstile.traces.prefix import (
    BLOCK_CHARS,
    canonical_message,
    chain_hashes,
    hash_block_tokens,
    tokens_per_char,
)
from turnstile.workload.model import Workflow

#: fields that name a session, in the order ``group_by="auto"`` tries them
SESSION_FIELDS: tuple[str, ...] = (
    "session_id", "metadata.session_id", "litellm_session_id", "metadata.litellm_session_id",
    "request.metadata.session_id", "trace_id", "metadata.trace_id", "user", "request.user",
    "end_user", "metadata.user_api_key_end_user_id",
)
_START = ("startTime", "start_time", "timestamp", "created_at", "request_time")
_END = ("endTime", "end_time", "completed_at", "response_time_end")


def looks_like_request_log(record: dict[str, Any]) -> bool:
    """The first record of a file: is this a request log (any of the three shapes)?"""
    if "startTime" in record and ("prompt_tokens" in record or "response" in record):
        return True
    if isinstance(record.get("proxy_server_request"), dict):
        return True
    req = record.get("request")
    return isinstance(req, dict) and ("messages" in req or "prompt" in req)


def _dig(record: dict[str, Any], dotted: str) -> Any:
    v: Any = record
    for part in dotted.split("."):
        if not isinstance(v, dict):
            return None
        v = v.get(part)
    return v


@dataclass(slots=True)
class _Req:
    line: int
    start: float
    end: float
    prompt: int
    output: int
    cached: int | None
    hashes: tuple[int, ...]
    chars: int
    #: digests of the canonical messages after each message (prefix identities)
    prefixes: tuple[bytes, ...]
    record: dict[str, Any]


def _time(j: JsonPath, rec: dict[str, Any], where: str, keys: Sequence[str]) -> float | None:
    for k in keys:
        v = rec.get(k)
        if v is None:
            continue
        if isinstance(v, bool):
            raise j.fail(f"{where}.{k}", "expected a time, got bool")
        if isinstance(v, int | float):
            return float(v) / 1000.0 if v > 1e11 else float(v)
        if isinstance(v, str):
            try:
                return float(v) if v.replace(".", "", 1).isdigit() else parse_utc(v)
            except ValueError:
                raise j.fail(f"{where}.{k}", f"not a time: {v[:40]!r}") from None
        raise j.fail(f"{where}.{k}", f"expected a time (number or ISO-8601), got "
                     f"{type(v).__name__}")
    return None


def _messages(rec: dict[str, Any]) -> tuple[list[Any] | None, Any]:
    for holder in (rec, rec.get("request"), rec.get("proxy_server_request"),
                   rec.get("request_body")):
        if isinstance(holder, dict) and isinstance(holder.get("messages"), list):
            return holder["messages"], holder.get("tools")
    return None, None


def _prefix_digests(messages: list[Any], tools: Any) -> tuple[tuple[bytes, ...], str]:
    h = hashlib.blake2b(digest_size=16)
    parts = []
    if tools:
        t = json.dumps({"tools": tools}, ensure_ascii=False, separators=(",", ":"),
                       sort_keys=True)
        parts.append(t)
        h.update(t.encode("utf-8") + b"\n")
    out = []
    for m in messages:
        text = canonical_message(m)
        parts.append(text)
        h.update(text.encode("utf-8") + b"\n")
        out.append(h.copy().digest())
    return tuple(out), "\n".join(parts)


def _parse(path: Path, lineno: int, rec: Any, c: Counter[str]) -> _Req | None:
    j = JsonPath(path)
    where = f"line {lineno}"
    if not isinstance(rec, dict):
        raise j.fail(where, "expected a JSON object")
    status = rec.get("status")
    if isinstance(status, str) and status.lower() in ("failure", "failed", "error"):
        c["skipped_failed"] += 1
        return None
    start = _time(j, rec, f"{where} $", _START)
    if start is None:
        resp = rec.get("response")
        created = resp.get("created") if isinstance(resp, dict) else None
        if isinstance(created, int | float) and not isinstance(created, bool):
            start = float(created)
            c["start_from_created"] += 1
        else:
            raise j.fail(f"{where} $", f"no start time (one of {', '.join(_START)})")
    end = _time(j, rec, f"{where} $", _END)
    if end is None:
        lat_ms = j.get(rec, f"{where} $", "latency_ms", (int, float))
        lat_s = j.get(rec, f"{where} $", "duration_s", (int, float))
        if lat_ms is not None:
            end = start + lat_ms / 1000.0
        elif lat_s is not None:
            end = start + lat_s
        else:
            end = start
            c["no_end_time"] += 1
    if end < start:
        raise j.fail(f"{where} $", f"ends ({end}) before it starts ({start})")
    resp = rec.get("response")
    usage = resp.get("usage") if isinstance(resp, dict) else None
    if usage is None and isinstance(rec.get("usage"), dict):
        usage = rec["usage"]
    uw = f"{where} $.response.usage"
    prompt = j.count(rec, f"{where} $", "prompt_tokens")
    out = j.count(rec, f"{where} $", "completion_tokens")
    cached = None
    if isinstance(usage, dict):
        if prompt is None:
            prompt = j.count(usage, uw, "prompt_tokens")
        if out is None:
            out = j.count(usage, uw, "completion_tokens")
        details = j.get(usage, uw, "prompt_tokens_details", (dict,))
        if details is not None:
            cached = j.count(details, f"{uw}.prompt_tokens_details", "cached_tokens")
    elif usage is not None:
        raise j.fail(uw, f"expected an object, got {type(usage).__name__}")
    if prompt is None and out is None and (rec.get("error") or (
            isinstance(resp, dict) and resp.get("error"))):
        c["skipped_failed"] += 1
        return None
    messages, tools = _messages(rec)
    prefixes: tuple[bytes, ...]
    if messages is None:
        c["no_messages"] += 1
        prefixes, text = (), ""
    else:
        prefixes, text = _prefix_digests(messages, tools)
    if not prompt:
        c["prompt_estimated"] += 1
        prompt = tokens_from_chars(len(text))
    if not out:
        c["output_estimated"] += 1
        out = 1
        if isinstance(resp, dict):
            choices = resp.get("choices")
            if isinstance(choices, list) and choices and isinstance(choices[0], dict):
                msg = choices[0].get("message")
                content = msg.get("content") if isinstance(msg, dict) else None
                if isinstance(content, str):
                    out = tokens_from_chars(len(content))
    if cached is not None and cached > prompt:
        raise j.fail(f"{uw}.prompt_tokens_details.cached_tokens",
                     f"{cached} exceeds the prompt's {prompt} tokens")
    return _Req(lineno, start, end, prompt, out, cached, chain_hashes(text), len(text),
                prefixes, rec)


def _choose_field(reqs: list[_Req]) -> str | None:
    n = len(reqs)
    for f in SESSION_FIELDS:
        vals = [_dig(r.record, f) for r in reqs]
        vals = [v for v in vals if isinstance(v, str | int) and not isinstance(v, bool) and v != ""]
        if len(vals) >= 0.9 * n and len(set(vals)) < len(vals):
            return f
    return None


def _group_by_prefix(reqs: list[_Req]) -> list[list[_Req]]:
    """Module docstring, "Sessions": continue the session whose latest request's messages
    lead this one's (longest first); a session continues one request at a time."""
    sessions: list[list[_Req]] = []
    latest: dict[bytes, int] = {}  # full-messages digest of a session's latest request
    for r in reqs:
        target = None
        for d in reversed(r.prefixes[:-1] if r.prefixes else ()):
            s = latest.get(d)
            if s is not None:
                target = s
                break
        if target is None:
            target = len(sessions)
            sessions.append([])
        else:
            prev = sessions[target][-1]
            latest.pop(prev.prefixes[-1], None)
        sessions[target].append(r)
        if r.prefixes:
            latest[r.prefixes[-1]] = target
    return sessions


def _calls(reqs: list[_Req]) -> list[ObservedCall]:
    out = []
    prev: _Req | None = None
    for r in reqs:
        extends = None
        if prev is not None and prev.prefixes and r.prefixes:
            extends = prev.prefixes[-1] in r.prefixes
        out.append(ObservedCall(r.start, r.end, r.prompt, r.output, r.cached, r.hashes, r.chars,
                                extends))
        prev = r
    return out


def load_request_log(path: str | Path, group_by: str = "auto") -> LoadedTrace:
    """Load an OpenAI-style request log (shapes and session rule in the module docstring)."""
    p = Path(path)
    c: Counter[str] = Counter()
    reqs: list[_Req] = []
    for lineno, rec in iter_json_lines(p):
        r = _parse(p, lineno, rec, c)
        if r is not None:
            reqs.append(r)
    if not reqs:
        raise TraceFormatError(p, "", "no successful requests to import")
    reqs.sort(key=lambda r: (r.start, r.line))
    field = _choose_field(reqs) if group_by == "auto" else (None if group_by == "prefix"
                                                            else group_by)
    groups: list[tuple[str, list[_Req]]] = []
    rest = reqs
    if field is not None:
        by: dict[str, list[_Req]] = {}
        rest = []
        for r in reqs:
            v = _dig(r.record, field)
            if isinstance(v, str | int) and not isinstance(v, bool) and v != "":
                by.setdefault(str(v), []).append(r)
            else:
                rest.append(r)
        if group_by != "auto" and not by:
            raise TraceFormatError(p, "", f"no record has the field {field!r} to group by")
        groups.extend(by.items())
        c["grouped_by_field"] = len(reqs) - len(rest)
    for k, s in enumerate(_group_by_prefix(rest)):
        groups.append((f"prefix-{k}", s))
    c["grouped_by_prefix"] = len(rest)
    origin = reqs[0].start
    models: Counter[str] = Counter()
    workflows: list[Workflow] = []
    for key, rs in groups:
        for r in rs:
            models[str(r.record.get("model") or _dig(r.record, "request.model") or "")] += 1
        meta = {"source": "request-log", "session": key}
        workflows.append(build_workflow(key, [ObservedThread(_calls(rs))], origin_s=origin,
                                        meta=meta))
    workflows.sort(key=lambda w: (w.arrival_s, w.id))
    ratio = tokens_per_char((r.prompt, r.chars) for r in reqs)
    notes = [
        f"request log: sessions grouped by field {field!r} ({c['grouped_by_field']} requests)"
        if field else "request log: no session field; sessions grouped by shared message "
        "prefixes",
        "request log: tool time = gap between a call's end and the next call's start in its "
        "session (tool plus client time); arrival = first call relative to the log's first",
    ]
    if field and c["grouped_by_prefix"]:
        notes.append(f"request log: {c['grouped_by_prefix']} requests without {field!r} grouped "
                     "by shared message prefixes")
    explain = {
        "skipped_failed": "failed requests skipped",
        "no_end_time": "requests without an end time or latency: duration 0",
        "start_from_created": "requests timed by response.created (whole seconds)",
        "no_messages": "requests without messages: no prefix hashes, grouped alone",
        "prompt_estimated": "requests without prompt token counts: characters ÷ 4",
        "output_estimated": "requests without completion token counts: reply characters ÷ 4",
    }
    notes.extend(counted_notes("request log", c, explain))
    counts = dict(c)
    counts.update(sessions=len(workflows), llm_calls=len(reqs), tool_calls=sum(
        len(t.tools) for w in workflows for t in w.turns), skipped=c["skipped_failed"])
    return LoadedTrace(name=f"request-log:{p.name}", source=str(p), workflows=workflows,
                       notes=notes, counts=counts,
                       hash_block_tokens=hash_block_tokens(ratio, BLOCK_CHARS))
