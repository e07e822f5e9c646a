"""``turnstile serve --record FILE.jsonl``: every finished session, written as a turnstile workload.

The gateway hands the recorder three observations through a narrow hook:

* :meth:`SessionRecorder.turn_finished` — a turn of a session finished with the engine's
  ``usage`` (prompt, cached and completion tokens), when it became ready and when it ended, and
  the request body. The body is reduced at once to counts and prefix block hashes
  (:mod:`turnstile.traces.prefix`); no content is kept, in memory or on disk.
* :meth:`SessionRecorder.session_closed` — the gateway closed the session: idle for
  ``session_idle_s`` (the gateway's own rule, 300 s by default), or a one-turn session without a
  session id, right after its turn. A client may also end a session explicitly: a request with
  ``x-turnstile-session-end: 1`` is its session's last (:meth:`SessionRecorder.note_end`); the
  session is written as soon as that turn finishes, and a later request with the same id starts
  a new recorded workflow.
* :meth:`SessionRecorder.close` — shutdown: every open session is written as it stands.

A session whose requests carry ``x-turnstile-parent-session: <id>`` is a sub-agent of that
session: while the parent is open, it is kept and written *inside* the parent's workflow as a DAG
branch (:mod:`turnstile.traces.observed`); the parent stays open until its sub-agents are
closed. A sub-agent whose parent already finished (or never went through this gateway) is
written on its own with ``meta.parent_session``.

Each finished session is one JSON line appended with a single ``write``. The gateway creates the
file with its header line at start (:meth:`SessionRecorder.create`), so it is there before any
session ends; its time origin (``meta.origin_unix``) is then ``null``, padded, and filled in place
by the first session written (a recorder used on its own writes the header with the first
session). The work (hashing the prompt, building and writing the workflow) runs on
a background thread, so the gateway's event loop only queues an observation; the thread
``fsync``s whenever its queue is empty (a group commit: one ``fsync`` per finished session when
they come one at a time). A gateway killed at any moment leaves a readable workload holding
every session finished before the kill, give or take the few milliseconds the thread takes (a
torn last line can only come from a machine crash mid-write; the next ``--record`` run on the
same file cuts it off). Restarting on an existing file appends, keeping its header (origin
time, hash block size).

Turns that failed or whose client went away are not recorded, nor probes: requests marked
``x-turnstile-probe: 1`` (replay's tokenizer calibration, the gateway's own start-up check
through another gateway), which only learn about the server. Times are the gateway's: a turn's
start is when it became ready at the gateway (its arrival, or the end of the session's previous
turn if the client sent it early), its end is when the engine's answer was complete.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnstile.traces.observed import ObservedCall, ObservedThread, build_workflow
from turnstile.traces.prefix import (
    BLOCK_CHARS,
    body_text,
    chain_hashes,
    hash_block_tokens,
    text_digest,
)
from turnstile.workload.jsonl import FORMAT_NAME, FORMAT_VERSION, workflow_to_dict

__all__ = ["END_HEADER", "PARENT_HEADER", "SessionRecorder"]

log = logging.getLogger("turnstile.gateway.recorder")

#: request header naming the session that spawned this one (a sub-agent)
PARENT_HEADER = "x-turnstile-parent-session"
#: request header (``1``/``true``) marking the last turn of its session
END_HEADER = "x-turnstile-session-end"
#: the header's rewritable fields start with this key
_RATIO_KEY = b'"hash_block_tokens":'
#: the header's time origin: ``null`` padded to this width until the first session is written
_ORIGIN_KEY, _ORIGIN_WIDTH = b'"origin_unix":', 20


@dataclass
class _Open:
    """A session being recorded: its calls and what the next call's prompt is compared to."""

    sid: str
    tenant: str
    parent: str | None = None
    calls: list[ObservedCall] = field(default_factory=list)
    #: (characters, digest) of the last call's prompt text: does the next one extend it?
    last_text: tuple[int, bytes] | None = None
    #: messages in the last call's request (its next message, if sent, is the reply to it)
    last_messages: int = 0
    closed: bool = False
    #: the client marked a turn as the session's last: write the session when it finishes
    ending: bool = False
    #: finished sub-agents folded into this session: (their calls, their own sub-agents)
    children: list[_Open] = field(default_factory=list)


def _is_reply(messages: list[Any], k: int) -> bool:
    """Is message ``k`` (the first after the previous request's) the reply to that request?"""
    return k < len(messages) and isinstance(messages[k], dict) \
        and messages[k].get("role") == "assistant"


class SessionRecorder:
    """Append finished sessions to a workload file (see the module docstring)."""

    def __init__(self, path: str | Path, *, block_chars: int = BLOCK_CHARS,
                 clock_to_unix_s: float | None = None, background: bool = False) -> None:
        self.path = Path(path)
        self.block_chars = block_chars
        #: add to a gateway clock reading to get Unix time (set by :meth:`bind_clock`)
        self._to_unix = clock_to_unix_s or 0.0
        self._open: dict[str, _Open] = {}
        self._ids: set[str] = set()
        self._fd: int | None = None
        self._origin_unix: float | None = None
        self.sessions_written = 0
        self.turns_skipped = 0
        #: prompt tokens and characters of every recorded turn (the tokens-per-character ratio)
        self._tokens = self._chars = 0
        #: where the header's fixed-width ratio fields start (None: not rewritable)
        self._ratio_at: int | None = None
        self._ratio_written = b""
        #: where the header's time origin is to be filled in (None: written, or not rewritable)
        self._origin_at: int | None = None
        self._dirty = False
        self._read_existing()
        #: ``background``: observations are queued to a writer thread (the gateway's mode)
        self._queue: queue.Queue[tuple[Callable[..., None], tuple[Any, ...]] | None] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._work, name="turnstile-recorder",
                                            daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ the writer thread
    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        if self._queue is None:
            fn(*args)
        else:
            self._queue.put((fn, args))

    def _work(self) -> None:
        q = self._queue
        assert q is not None
        while True:
            item = q.get()
            try:
                if item is None:
                    return
                fn, args = item
                fn(*args)
                if q.empty():
                    self._sync()
            except Exception:  # one bad observation must not stop the recording
                log.exception("recorder failed on an observation")
            finally:
                q.task_done()

    def _sync(self) -> None:
        if self._dirty and self._fd is not None:
            os.fsync(self._fd)
            self._dirty = False

    def flush(self) -> None:
        """Wait until every observation so far is processed and on disk."""
        if self._queue is not None:
            self._queue.join()

    # ------------------------------------------------------------------ file
    def _read_existing(self) -> None:
        """Appending to an earlier recording: keep its header, cut a torn last line."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            log.warning("%s: cutting a torn last line (%d bytes)", self.path, len(data) - end)
            with open(self.path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
            data = data[:end]
        lines = data.splitlines()
        try:
            header = json.loads(lines[0])
        except (ValueError, IndexError):
            header = None
        if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
            raise ValueError(f"{self.path}: exists and is not a turnstile workload; "
                             "record to a new file")
        meta = header.get("meta") or {}
        origin = meta.get("origin_unix", 0.0)
        if origin is None:  # created at a gateway's start, no session written yet
            at = lines[0].find(_ORIGIN_KEY) + len(_ORIGIN_KEY)
            if lines[0][at:at + _ORIGIN_WIDTH] == b"null".ljust(_ORIGIN_WIDTH):
                self._origin_at = at
        else:
            self._origin_unix = float(origin)
        self.block_chars = int(meta.get("hash_block_chars", self.block_chars))
        at = lines[0].find(_RATIO_KEY)
        if at >= 0 and isinstance(meta.get("sample_tokens"), int) \
                and isinstance(meta.get("sample_chars"), int):
            self._ratio_at = at
            self._tokens, self._chars = meta["sample_tokens"], meta["sample_chars"]
            self._ratio_written = lines[0][at:at + len(self._ratio_fields())]
        for raw in lines[1:]:
            try:
                self._ids.add(str(json.loads(raw)["id"]))
            except (ValueError, KeyError, TypeError):
                continue
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def bind_clock(self, clock_now_s: float) -> None:
        """Tell the recorder what the gateway clock reads now (maps its times to Unix time)."""
        self._to_unix = time.time() - clock_now_s

    def _ratio_fields(self) -> bytes:
        """The header's tokens-per-character fields, fixed width (JSON allows the padding)."""
        ratio = self._tokens / self._chars if self._chars else 0.25
        return (f'{_RATIO_KEY.decode()}{hash_block_tokens(ratio, self.block_chars):<8d},'
                f'"tokens_per_char":{ratio:<12.6f},"sample_tokens":{self._tokens:<16d},'
                f'"sample_chars":{self._chars:<16d}').encode()

    def create(self) -> None:
        """Create the file with its header line now, if it is new or empty (the gateway does
        at start: the file is there at once, not only when the first session ends)."""
        if self._fd is None:
            self._append(self._new_file())
            self._sync()

    def _new_file(self) -> bytes:
        """Open the file to write (new, or empty); returns its header line, to be written
        first."""
        meta = {"recorder": "turnstile serve --record", "origin_unix": self._origin_unix,
                "hash_block_chars": self.block_chars,
                "content": "none: token counts, times and prefix block hashes only"}
        head = f'{{"format":"{FORMAT_NAME}","version":{FORMAT_VERSION},"meta":{{'.encode()
        self._ratio_at = len(head)
        self._ratio_written = self._ratio_fields()
        rest = json.dumps(meta, separators=(",", ":")).encode()[1:]
        if self._origin_unix is None:  # no session yet: filled in by the first one
            rest = rest.replace(_ORIGIN_KEY + b"null",
                                _ORIGIN_KEY + b"null".ljust(_ORIGIN_WIDTH), 1)
        header = head + self._ratio_written + b"," + rest + b"}"
        if self._origin_unix is None:
            self._origin_at = header.find(_ORIGIN_KEY) + len(_ORIGIN_KEY)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        empty = self.path.exists() and self.path.stat().st_size == 0
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND
                           | (0 if empty else os.O_EXCL), 0o644)
        return header + b"\n"

    def _append(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self._dirty = True

    def _write(self, line: bytes) -> None:
        if self._fd is None:
            line = self._new_file() + line
        if self._origin_at is not None and self._origin_unix is not None:
            self._rewrite(f"{self._origin_unix:.3f}".encode().ljust(_ORIGIN_WIDTH),
                          self._origin_at)
            self._origin_at = None
        self._append(line)
        self._update_ratio()
        if self._queue is None:
            self._sync()

    def _rewrite(self, data: bytes, at: int) -> None:
        """Overwrite the header's bytes at ``at`` (same width)."""
        fd = os.open(self.path, os.O_WRONLY)  # not O_APPEND: pwrite must not append
        try:
            os.pwrite(fd, data, at)
        finally:
            os.close(fd)

    def _update_ratio(self) -> None:
        """Rewrite the header's ratio fields in place (same width) from every turn so far, so
        ``hash_block_tokens`` rests on the whole recording, not on its first session."""
        if self._ratio_at is None:
            return
        fields = self._ratio_fields()
        if fields == self._ratio_written or len(fields) != len(self._ratio_written):
            return  # unchanged, or a count outgrew its width: keep the last value
        self._rewrite(fields, self._ratio_at)
        self._ratio_written = fields

    # ------------------------------------------------------------------ observations
    def note_parent(self, session_id: str, parent_session: str) -> None:
        """A request of ``session_id`` named ``parent_session`` as its parent."""
        self._submit(self._note_parent, session_id, parent_session)

    def note_end(self, session_id: str) -> None:
        """A request of ``session_id`` said it is the session's last turn."""
        self._submit(self._note_end, session_id)

    def turn_finished(self, session_id: str, tenant: str, body: dict[str, Any], ready_s: float,
                      finished_s: float, usage: dict[str, Any] | None,
                      output_tokens: int | None) -> None:
        """A turn finished with the engine's ``usage``; times are gateway clock readings. The
        body is only read (hashed), never kept."""
        self._submit(self._turn_finished, session_id, tenant, body, ready_s, finished_s, usage,
                     output_tokens)

    def session_closed(self, session_id: str) -> None:
        """The gateway closed the session; write it (or fold it into its open parent)."""
        self._submit(self._session_closed, session_id)

    def close(self) -> None:
        """Shutdown: write every open session as it stands (sub-agents first), close the file."""
        self._submit(self._close)
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._queue = None

    # ------------------------------------------------------------------ (the thread's side)
    def _note_parent(self, session_id: str, parent_session: str) -> None:
        if not parent_session or parent_session == session_id:
            return
        s = self._open.get(session_id)
        if s is None:
            s = self._open[session_id] = _Open(session_id, "default")
        if s.parent is None:
            s.parent = parent_session

    def _note_end(self, session_id: str) -> None:
        s = self._open.get(session_id)
        if s is None:
            s = self._open[session_id] = _Open(session_id, "default")
        s.ending = True

    def _turn_finished(self, session_id: str, tenant: str, body: dict[str, Any], ready_s: float,
                       finished_s: float, usage: dict[str, Any] | None,
                       output_tokens: int | None) -> None:
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if not isinstance(prompt, int) or prompt < 1:
            self.turns_skipped += 1  # no usage: nothing trustworthy to record
            return
        out = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if not isinstance(out, int):
            out = output_tokens or 0
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if not isinstance(cached, int) or not 0 <= cached <= prompt:
            cached = None
        text = body_text(body)
        s = self._open.get(session_id)
        if s is None:
            s = self._open[session_id] = _Open(session_id, tenant)
        s.tenant = tenant
        extends = resends = None
        messages = body.get("messages")
        if s.last_text is not None:
            n, digest = s.last_text
            extends = len(text) >= n and text_digest(text[:n]) == digest
            if extends and isinstance(messages, list):
                resends = _is_reply(messages, s.last_messages)
        s.last_text = (len(text), text_digest(text))
        s.last_messages = len(messages) if isinstance(messages, list) else 0
        start = ready_s + self._to_unix
        if text:
            self._tokens += prompt
            self._chars += len(text)
        s.calls.append(ObservedCall(
            start_s=start, end_s=max(finished_s + self._to_unix, start), prompt_tokens=prompt,
            output_tokens=max(1, out), cached_tokens=cached,
            block_hashes=chain_hashes(text, self.block_chars), prompt_chars=len(text),
            extends_previous=extends, resends_reply=resends))
        if s.ending:
            self._session_closed(session_id)

    def _session_closed(self, session_id: str) -> None:
        s = self._open.get(session_id)
        if s is None:
            return
        s.closed = True
        if not self._has_open_children(session_id):
            self._finish(s)  # else: written when its last sub-agent closes

    def _has_open_children(self, sid: str) -> bool:
        return any(o.parent == sid for o in self._open.values())

    def _finish(self, s: _Open) -> None:
        del self._open[s.sid]
        parent = self._open.get(s.parent) if s.parent else None
        if parent is not None:
            if s.calls or s.children:
                parent.children.append(s)
            if parent.closed and not self._has_open_children(parent.sid):
                self._finish(parent)
            return
        if s.calls:
            self._emit(s)
        else:  # a parent that never ran a turn here: its sub-agents go out on their own
            for c in s.children:
                self._emit(c)

    def _emit(self, s: _Open) -> None:
        threads: list[ObservedThread] = []

        def add(node: _Open, parent: int | None) -> None:
            me = len(threads)
            threads.append(ObservedThread(node.calls, parent if node.calls else None))
            for c in node.children:
                add(c, me if node.calls else parent)

        add(s, None)
        if not threads[0].calls:
            return
        wid = s.sid
        k = 2
        while wid in self._ids:
            wid = f"{s.sid}~{k}"
            k += 1
        meta = {"source": "turnstile-gateway", "session_id": s.sid}
        if s.parent:
            meta["parent_session"] = s.parent
        sub = len(threads) - 1
        if sub:
            meta["subagents"] = str(sub)
        if self._origin_unix is None:  # a new file: time 0 is the earliest turn seen so far
            starts = [c.start_s for t in threads for c in t.calls]
            starts += [c.start_s for o in self._open.values() for c in o.calls]
            self._origin_unix = round(min(starts), 3)
        wf = build_workflow(wid, threads, origin_s=self._origin_unix, tenant=s.tenant,
                            meta=meta, block_chars=self.block_chars)
        line = json.dumps(workflow_to_dict(wf), separators=(",", ":")).encode() + b"\n"
        try:
            self._write(line)
        except OSError:
            log.exception("could not record session %s to %s", s.sid, self.path)
            return
        self._ids.add(wid)
        self.sessions_written += 1

    def _close(self) -> None:
        for s in self._open.values():
            s.closed = True
        while self._open:
            deepest = max(self._open, key=self._depth)
            self._finish(self._open[deepest])
        if self._fd is not None:
            self._sync()
            os.close(self._fd)
            self._fd = None

    def _depth(self, sid: str) -> int:
        d, seen = 0, {sid}
        s = self._open.get(sid)
        while s is not None and s.parent and s.parent not in seen:
            seen.add(s.parent)
            d += 1
            s = self._open.get(s.parent)
        return d
