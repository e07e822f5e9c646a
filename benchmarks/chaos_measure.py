"""The chaos suite's clients and measurements (``benchmarks/chaos.py`` runs the phases): retrying
agents and raw streams that log every attempt, and the table's figures judged from those logs
and the fault proxies' generation counts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import httpx

from turnstile.testing.fault_proxy import Generation

TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]

# ============================================================================ clients
@dataclass
class Attempt:
    start_s: float
    head_s: float = -1.0  # response status received
    engine: str = ""  # x-turnstile-engine
    events: list[float] = field(default_factory=list)  # body pieces
    end_s: float = -1.0
    outcome: str = ""


@dataclass
class TurnLog:
    rid: str
    sent_s: float
    done_s: float = -1.0
    attempts: list[Attempt] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)

    def ended(self, a: Attempt) -> bool:
        """Stamp the end of attempt ``a``; True (the turn is done) where it succeeded."""
        a.end_s = time.monotonic()
        if a.outcome == "ok":
            self.done_s = a.end_s
        return a.outcome == "ok"


class Clients:
    """Retrying OpenAI clients over one or more gateway replicas."""

    def __init__(self, targets: Callable[[], list[str]], max_tokens: int, turn_deadline_s: float
                 ) -> None:
        self.targets = targets
        self.max_tokens = max_tokens
        self.deadline_s = turn_deadline_s
        self.turns: list[TurnLog] = []
        limits = httpx.Limits(max_connections=5000, max_keepalive_connections=5000)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=2.0), limits=limits)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def turn(self, rid: str, body: dict[str, Any], headers: dict[str, str],
                   home: int = 0) -> TurnLog:
        log = TurnLog(rid, time.monotonic())
        self.turns.append(log)
        headers = {**headers, "x-request-id": rid}
        tries = 0
        while time.monotonic() - log.sent_s < self.deadline_s:
            targets = self.targets()
            url = targets[(home + tries) % len(targets)] + "/v1/chat/completions"
            a = Attempt(time.monotonic())
            log.attempts.append(a)
            wait = min(0.1 * 2 ** min(tries, 3), 1.0)
            tries += 1
            try:
                async with self.http.stream("POST", url, json=body, headers=headers) as r:
                    a.head_s = time.monotonic()
                    a.engine = r.headers.get("x-turnstile-engine", "")
                    log.statuses.append(r.status_code)
                    data = b""
                    async for piece in r.aiter_bytes():
                        a.events.append(time.monotonic())
                        data += piece
                    if r.status_code == 200 and (not body.get("stream") or (
                            b"data: [DONE]" in data and b'"error"' not in data)):
                        a.outcome = "ok"
                    else:
                        a.outcome = f"http {r.status_code}" if r.status_code != 200 else "cut"
                        if r.status_code == 429:
                            wait = float(r.headers.get("retry-after", "1"))
            except (httpx.HTTPError, OSError) as e:
                a.outcome = type(e).__name__
            if log.ended(a):
                return log
            await asyncio.sleep(wait)
        return log

    async def agent(self, sid: str, turns: int, tool_s: float, home: int) -> None:
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": f"task {sid}: fix the tests"}]
        for k in range(turns):
            body = {"model": "tiny", "messages": msgs, "max_tokens": self.max_tokens,
                    "stream": k % 3 != 2, "tools": TOOLS}
            log = await self.turn(f"{sid}-t{k}", body, {"x-session-id": sid}, home)
            if log.done_s < 0:
                return  # lost: the agent cannot go on
            msgs = [*msgs, {"role": "assistant", "content": f"step {k}"},
                    {"role": "user", "content": f"tool output {k} " + "x" * 40}]
            await asyncio.sleep(tool_s)


async def raw_stream(targets: list[str], rid: str, body: bytes, deadline_s: float,
                     home: int) -> TurnLog:
    """One streamed turn over a plain socket (``Connection: close``), retried with the same
    request id (after ``Retry-After`` on a 429) until ``deadline_s``."""
    log = TurnLog(rid, time.monotonic())
    tries = 0
    while time.monotonic() - log.sent_s < deadline_s:
        host, port = targets[(home + tries) % len(targets)].removeprefix("http://").split(":")
        tries += 1
        a = Attempt(time.monotonic())
        log.attempts.append(a)
        wait = 0.2
        w = None
        try:
            r, w = await asyncio.open_connection(host, int(port), limit=1 << 20)
            w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
                    b"Content-Type: application/json\r\nConnection: close\r\n"
                    b"x-request-id: " + rid.encode() + b"\r\nContent-Length: "
                    + str(len(body)).encode() + b"\r\n\r\n" + body)
            head = await r.readuntil(b"\r\n\r\n")
            a.head_s = time.monotonic()
            status = int(head.split(b" ", 2)[1])
            log.statuses.append(status)
            data = b""
            while chunk := await r.read(65536):
                a.events.append(time.monotonic())
                data += chunk
            if status == 200 and b"data: [DONE]" in data and b'"error"' not in data:
                a.outcome = "ok"
            else:
                a.outcome = f"http {status}"
                if status == 429:
                    wait = 1.0
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ValueError, IndexError) as e:
            a.outcome = type(e).__name__
        finally:
            if w is not None:
                w.close()
        if log.ended(a):
            return log
        await asyncio.sleep(wait)
    return log


# ============================================================================ phases
@dataclass
class Row:
    fault: str
    injected: int
    sent: int = 0
    completed: int = 0
    lost: int = 0
    duplicated: int = 0
    #: of ``duplicated``: the earlier complete generation ended within 1 s before the fault (a
    #: gateway or replica killed while its answer was in transit or not yet marked answered)
    dup_at_fault: int = 0
    partial: int = 0
    answered_s: float = 0.0
    recovered_s: float = 0.0
    peak_mb: float = 0.0
    rps: float = 0.0
    note: str = ""
    #: the fault came with a stream under way (None: no fault injected)
    hit: bool | None = None


def judge(row: Row, logs: list[TurnLog], gens: list[Generation], faults: list[float],
          wall_s: float, window_s: float = 5.0, engine: str = "") -> Row:
    """The row's figures. ``answered``: over the attempts under way within ``window_s`` after a
    fault, the longest silence (no status, byte or end) after the fault; for a fault of one
    ``engine`` (its id's ``:port``), only the attempts that ran there or whose turn the fault
    touched (an attempt failed)."""
    rids = {t.rid for t in logs}
    row.sent = len(logs)
    row.completed = sum(1 for t in logs if t.done_s >= 0)
    row.lost = row.sent - row.completed
    complete: dict[str, list[float]] = {}
    cut: dict[str, int] = {}
    for g in gens:
        if g.request_id in rids:
            if g.complete:
                complete.setdefault(g.request_id, []).append(g.ended_s)
            else:
                cut[g.request_id] = cut.get(g.request_id, 0) + 1
    dups = [sorted(ends) for ends in complete.values() if len(ends) > 1]
    row.duplicated = len(dups)
    row.dup_at_fault = sum(1 for ends in dups if any(
        all(t0 - 1.0 <= e <= t0 + 0.05 for e in ends[:-1]) for t0 in faults))
    row.partial = sum(1 for rid in cut if rid in complete)
    answered, recovered = 0.0, 0.0
    for t0 in faults:
        for t in logs:
            touched = any(a.outcome not in ("", "ok") and a.end_s > t0 for a in t.attempts)
            for a in t.attempts:
                if a.start_s > t0 + window_s or 0 <= a.end_s <= t0:
                    continue
                if engine and not touched and not a.engine.endswith(engine):
                    continue  # an engine fault: the turns it touched or that ran there
                end = a.end_s if a.end_s >= 0 else time.monotonic()
                ev = sorted([max(a.start_s, t0), end, *(e for e in (a.head_s, *a.events)
                                                        if e > t0)])
                answered = max(answered, *(y - x for x, y in pairwise(ev)))
        later = [t.done_s for t in logs if t.sent_s >= t0 and t.done_s >= 0]
        recovered = (min(later) - t0) if later else float("nan")
    row.answered_s, row.recovered_s = answered, recovered
    row.rps = row.completed / wall_s if wall_s > 0 else 0.0
    return row


def streaming(clients: Clients) -> str:
    """The engine of an attempt mid-response (its head and bytes in, not its end); "" if none."""
    for t in clients.turns:
        a = t.attempts[-1] if t.attempts else None
        if a is not None and a.head_s >= 0 and a.end_s < 0 and a.events and a.engine:
            return a.engine
    return ""


# ============================================================================ table
def table(rows: list[Row]) -> str:
    head = ("| fault | injected | turns sent | completed | lost | duplicated | partial re-runs "
            "| answered (s) | recovered (s) | peak MB | req/s | note |")
    out = [head, "|" + "---|" * 12]
    for r in rows:
        dup = f"{r.duplicated}" + (f" ({r.dup_at_fault} at the kill)" if r.dup_at_fault else "")
        out.append(f"| {r.fault} | {r.injected} | {r.sent} | {r.completed} | {r.lost} "
                   f"| {dup} | {r.partial} | {r.answered_s:.3f} | {r.recovered_s:.2f} "
                   f"| {r.peak_mb:.0f} | {r.rps:.1f} | {r.note} |")
    return "\n".join(out)
