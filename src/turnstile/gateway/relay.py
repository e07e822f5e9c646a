"""Forwarding one released turn to its engine and relaying the answer (whole or streamed).

The relay drives a turn's life at the engine and reports it through :class:`TurnEvents` (the
service implements them on the scheduler): ``started`` when forwarded, ``first_token`` at the
first streamed token, ``finished`` with the engine's real ``usage.completion_tokens``, and
``failed`` when an attempt failed before anything reached the client — then
:class:`RetryableFailure` is raised and the service's one retry loop re-readies the turn. After
bytes were streamed, a failure becomes an SSE error event (the HTTP status was already sent).

Nothing reaches the client before the turn's first token: a stream's leading events (the role
chunk) are held until a token, a finish or ``[DONE]`` arrives, so a turn whose engine dies or
aborts it before its first token is re-routed, not cut short. A stream that ends without
``[DONE]``, or that the engine marks aborted (:meth:`EngineAdapter.aborted_event`), ends with an
error event; a whole reply the engine marks aborted (:meth:`EngineAdapter.aborted_reply`) is
re-routed.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

from turnstile.gateway.adapters import (
    EngineAdapter,
    ForwardHints,
    UpstreamError,
    UpstreamHTTPError,
)
from turnstile.gateway.metrics import GatewayMetrics
from turnstile.gateway.protocol import (
    SSE_HEADERS,
    Outcome,
    collect_delta,
    collect_message,
    completion_tokens,
    error_body,
    has_token,
    started,
)
from turnstile.gateway.sessions import PendingTurn

__all__ = ["Relay", "RetryableFailure", "TurnEvents"]

log = logging.getLogger("turnstile.gateway")


class RetryableFailure(Exception):
    """A forwarding attempt failed before anything reached the client."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


class TurnEvents(Protocol):
    def turn_started(self, p: PendingTurn) -> ForwardHints: ...

    def turn_first_token(self, p: PendingTurn) -> None: ...

    def turn_finished(self, p: PendingTurn, output_tokens: int | None, usage: dict[str, Any] | None,
                 *, cancelled: bool = False) -> None: ...

    def turn_failed(self, p: PendingTurn, engine_down: bool, reason: str) -> None: ...

    def engine_failed(self, engine_id: str, *, dead: bool = True) -> None: ...


class Relay:
    def __init__(self, adapters: dict[str, EngineAdapter], events: TurnEvents,
                 metrics: GatewayMetrics, now: Callable[[], float]) -> None:
        self.adapters = adapters
        self.events = events
        self.metrics = metrics
        self.now = now

    def _end(self, adapter: EngineAdapter, hints: ForwardHints) -> None:
        hints.now_s = self.now()
        adapter.end(hints)

    @staticmethod
    def headers(p: PendingTurn) -> list[tuple[bytes, bytes]]:
        rec = p.rec
        hold_ms = 0.0 if rec is None else max(rec.released_s - rec.ready_s, 0.0) * 1e3
        return [(b"x-request-id", p.request_id.encode()),
                (b"x-session-id", p.session.id.encode()),
                (b"x-turnstile-engine", p.engine.encode()),
                (b"x-turnstile-hold-ms", f"{hold_ms:.3f}".encode())]

    async def forward(self, p: PendingTurn) -> Outcome:
        adapter = self.adapters[p.engine]
        hints = self.events.turn_started(p)
        try:
            await adapter.begin(hints)
        except BaseException:  # cancelled while restoring offloaded KV
            self._end(adapter, hints)
            self.events.turn_finished(p, 0, None, cancelled=True)
            raise
        if log.isEnabledFor(logging.DEBUG):  # where a session's KV goes: cache-miss forensics
            log.debug("forward %s turn %s -> %s slot %s at %.4f", p.session.id,
                      None if p.rec is None else p.rec.index, p.engine, hints.slot, hints.now_s)
        if p.stream:
            return await self._forward_stream(p, adapter, hints)
        try:
            resp = await adapter.complete(p.path, p.body, hints)
        except (UpstreamHTTPError, UpstreamError) as e:
            return self._failed_before_reply(p, adapter, hints, e)
        except BaseException:
            self._end(adapter, hints)
            self.events.turn_finished(p, 0, None, cancelled=True)
            raise
        usage = None
        with contextlib.suppress(ValueError):
            if adapter.aborted_reply(resp.json()):
                self._end(adapter, hints)
                self.events.engine_failed(p.engine, dead=False)  # not again until re-checked
                self.events.turn_failed(p, False, "the engine aborted the turn")
                raise RetryableFailure(f"engine {p.engine} aborted the turn")
        self._end(adapter, hints)
        with contextlib.suppress(ValueError, AttributeError, TypeError, IndexError):
            obj = resp.json()
            usage = obj.get("usage")
            if p.reply_text is not None and p.reply_args is not None:
                collect_message(obj, p.reply_text, p.reply_args)
        self.events.turn_finished(p, completion_tokens(usage), usage)
        return Outcome(resp.status, [(b"content-type", resp.content_type.encode()),
                                     *self.headers(p)], body=resp.body)

    def _failed_before_reply(self, p: PendingTurn, adapter: EngineAdapter, hints: ForwardHints,
                             e: UpstreamHTTPError | UpstreamError) -> Outcome:
        """The engine failed the turn before any reply reached the client: an error status is
        passed on (4xx) or retried (5xx); no answer at all is retried elsewhere."""
        self._end(adapter, hints)
        if isinstance(e, UpstreamHTTPError):
            return self._http_error(p, e)
        self.events.turn_failed(p, e.engine_down, str(e))
        raise RetryableFailure(str(e), 502 if e.engine_down else 504) from None

    def _http_error(self, p: PendingTurn, e: UpstreamHTTPError) -> Outcome:
        if e.status >= 500:
            self.events.turn_failed(p, False, f"HTTP {e.status}")
            raise RetryableFailure(f"engine {p.engine} answered HTTP {e.status}", e.status)
        # the engine refused the request itself (bad parameters, context overflow): pass it on;
        # a session that this request opened never was one (closed as soon as it is over)
        s = p.session
        if s.turns == 0 and not s.waiters:
            s.ephemeral = s.refused = True
        self.events.turn_finished(p, 0, None)
        return Outcome(e.status, [(b"content-type", e.content_type.encode()),
                                  *self.headers(p)], body=e.body)

    async def _forward_stream(self, p: PendingTurn, adapter: EngineAdapter,
                              hints: ForwardHints) -> Outcome:
        gen = adapter.stream_batches(p.path, p.body, hints)
        first: list[bytes] = []
        failed: str | None = None
        try:
            while True:  # hold the leading events (a role chunk) until the first token
                first += await gen.__anext__()
                failed, begun = _leading(adapter, first)
                if failed is not None or begun:
                    break
        except StopAsyncIteration:
            self._end(adapter, hints)
            self.events.engine_failed(p.engine, dead=False)
            self.events.turn_failed(p, False, "stream ended before its first token")
            raise RetryableFailure(f"engine {p.engine} closed the stream before its first "
                                   "token") from None
        except (UpstreamHTTPError, UpstreamError) as e:
            return self._failed_before_reply(p, adapter, hints, e)
        except BaseException:
            await gen.aclose()
            self._end(adapter, hints)
            self.events.turn_finished(p, 0, None, cancelled=True)
            raise
        if failed is not None:
            await gen.aclose()
            self._end(adapter, hints)
            self.events.engine_failed(p.engine, dead=False)
            self.events.turn_failed(p, False, failed)
            raise RetryableFailure(f"engine {p.engine}: {failed}")
        return await started(Outcome(200, [*SSE_HEADERS, *self.headers(p)],
                                     events=self._relay(p, adapter, hints, gen, first)))

    async def _relay(self, p: PendingTurn, adapter: EngineAdapter, hints: ForwardHints,
                     gen: AsyncGenerator[list[bytes], None], first: list[bytes]
                     ) -> AsyncGenerator[bytes, None]:
        """Pass the engine's events on (each burst in one write), watching for the first
        token and the usage (and collecting the reply when affinity keys need it); finishes
        the turn however the stream ends."""
        chunks = 0
        usage: dict[str, Any] | None = None
        got_token = False
        completed = False
        done = False  # [DONE] seen
        reply = p.reply_text
        args = p.reply_args if p.reply_args is not None else []
        batch = first
        try:
            while True:
                out: list[bytes] = []
                failure: UpstreamError | None = None
                for ev in batch:
                    forward = True
                    failure = _mid_stream_failure(adapter, ev)
                    if failure is not None:
                        break  # what came before it still goes to the client
                    if ev.startswith(b"data: [DONE]"):
                        done = True
                    elif ev.startswith(b"data: {"):
                        if not got_token or reply is not None or b'"usage"' in ev:
                            try:
                                obj = json.loads(ev[6:])
                            except ValueError:
                                obj = None
                            if isinstance(obj, dict):
                                choices = obj.get("choices")
                                if choices:
                                    chunks += 1
                                    if not got_token and has_token(choices):
                                        got_token = True
                                        self.events.turn_first_token(p)
                                    if reply is not None:
                                        collect_delta(choices, reply, args)
                                u = obj.get("usage")
                                if isinstance(u, dict):
                                    usage = u
                                    if not choices and not p.client_usage:
                                        forward = False  # the usage chunk only we asked for
                        else:
                            chunks += 1
                    if forward:
                        out.append(ev)
                if out:
                    yield out[0] if len(out) == 1 else b"".join(out)
                if failure is not None:
                    raise failure
                try:
                    batch = await gen.__anext__()
                except StopAsyncIteration:
                    if not done:
                        raise UpstreamError("the stream ended without [DONE]",
                                            engine_down=False, streamed=True) from None
                    completed = True
                    return
        except UpstreamError as e:
            self.metrics.turns_failed.labels(p.engine, "mid_stream").inc()
            if e.engine_down:
                self.events.engine_failed(p.engine, dead=False)  # health decides the rest
            msg = f"engine {p.engine} failed mid-stream: {e}"
            yield b"data: " + error_body(msg, "upstream_error", 502) + b"\n\n"
        finally:
            await gen.aclose()
            self._end(adapter, hints)
            out_tokens = completion_tokens(usage)
            self.events.turn_finished(p, out_tokens if out_tokens is not None else chunks, usage,
                                 cancelled=not completed)


def _mid_stream_failure(adapter: EngineAdapter, ev: bytes) -> UpstreamError | None:
    """An event after the first token saying the turn failed at the engine: an abort, or the
    engine's own error event (vLLM's "EngineCore encountered an issue" as it shuts down). The
    gateway ends the stream with its own error event, as for a dropped connection, and books
    the turn as failed, rather than passing the engine's error on and then its [DONE]."""
    if adapter.aborted_event(ev):
        return UpstreamError("the engine aborted the turn", engine_down=False, streamed=True)
    if not ev.startswith(b'data: {"error"'):
        return None
    try:
        err = json.loads(ev[6:])["error"]
    except (ValueError, KeyError, TypeError):
        err = None
    msg = err.get("message") if isinstance(err, dict) else err
    return UpstreamError(f"the engine reported an error: {msg}", engine_down=False,
                         streamed=True)


def _leading(adapter: EngineAdapter, events: list[bytes]) -> tuple[str | None, bool]:
    """Scan a stream's events before its first token: ``(failure, begun)`` — ``failure`` when
    the engine reported an error, aborted the turn, or ended the stream with neither a token
    nor a finish reason (vLLM does that to a request it drops before running it): nothing went
    to the client, so the turn is re-routed; ``begun`` once a token or a finish arrived (the
    stream goes to the client)."""
    finished = False
    for ev in events:
        if ev.startswith(b"data: [DONE]"):
            return (None, True) if finished else ("the stream ended with no token", False)
        if adapter.aborted_event(ev):
            return "the engine aborted the turn", False
        if not ev.startswith(b"data: {"):
            continue
        try:
            obj = json.loads(ev[6:])
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if obj.get("error") is not None:
            err = obj["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            return f"error event before the first token: {msg}", False
        choices = obj.get("choices")
        if choices and has_token(choices):
            return None, True
        finished = finished or any(isinstance(c, dict) and c.get("finish_reason")
                                   for c in choices or ())
    # a finish with no token yet: the stream has begun (it may still carry the usage)
    return None, finished
