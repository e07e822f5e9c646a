"""The engine adapter interface (see :mod:`turnstile.gateway.adapters` for the contract and the
retry rule), its request/response types, and the HTTP, SSE and Prometheus helpers every kind
of adapter shares.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from turnstile.core.actions import RetentionDecision
from turnstile.transport.client import HttpTransport, Response
from turnstile.transport.fast import BrokenResponse, EngineLost
from turnstile.transport.retry import RetryRule

__all__ = [
    "FEATURES",
    "EngineAdapter",
    "EngineStats",
    "ForwardHints",
    "UpstreamError",
    "UpstreamHTTPError",
    "UpstreamResponse",
    "parse_prometheus",
    "split_sse",
]

JSON_HEADERS = {"content-type": "application/json"}
log = logging.getLogger("turnstile.gateway")

#: engine features a policy may rely on (:meth:`EngineAdapter.check_config` says which it has):
#: ``priority`` — the request's admission priority orders the engine's queue; ``cached_tokens``
#: — the usage reports the prompt tokens served from the prefix cache; ``prefix_caching`` —
#: the engine reuses a session's KV for its next turn; ``slot_pinning`` — a session's KV can be
#: pinned, offloaded and restored (retention decisions)
FEATURES = ("priority", "cached_tokens", "prefix_caching", "slot_pinning")


class UpstreamError(Exception):
    """The engine could not be reached or failed mid-response.

    ``engine_down``: the failure says the engine itself is gone (refused or dropped
    connection), not just this request. ``streamed``: some events had already been yielded.
    """

    def __init__(self, message: str, *, engine_down: bool, streamed: bool = False) -> None:
        super().__init__(message)
        self.engine_down = engine_down
        self.streamed = streamed


class UpstreamHTTPError(Exception):
    """The engine answered with a non-2xx status (before any event was streamed)."""

    def __init__(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        super().__init__(f"engine answered HTTP {status}: {body[:200]!r}")
        self.status = status
        self.body = body
        self.content_type = content_type


@dataclass(slots=True)
class UpstreamResponse:
    """A complete non-streaming response (2xx)."""

    status: int
    body: bytes
    content_type: str = "application/json"
    _json: Any = None

    def json(self) -> Any:
        if self._json is None:
            self._json = json.loads(self.body)
        return self._json


@dataclass(slots=True)
class EngineStats:
    """What one ``/metrics`` scrape says; ``None`` where the engine does not report it."""

    queue_len: int | None = None
    running: int | None = None
    kv_used_frac: float | None = None
    #: cumulative counters under turnstile's names (``prompt_tokens``, ``prefix_hit_tokens``, …)
    counters: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class ForwardHints:
    """Per-turn facts an adapter may use when forwarding (the body is never the place)."""

    session_id: str
    request_id: str
    #: admission priority from the scheduler (lower runs first)
    priority: float = 0.0
    #: engine-specific placement chosen in :meth:`EngineAdapter.begin` (llama.cpp: the slot)
    slot: int | None = None
    #: the gateway's clock when the hint is handed over (set again before :meth:`end`): the
    #: one clock adapters keep their timers on
    now_s: float = 0.0


# --------------------------------------------------------------------------- helpers
def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format (parsed by prometheus-client) → ``{sample name: value summed over
    label sets}``.

    Histogram/summary series keep their suffixed names (``_bucket``, ``_sum``, ``_count``),
    counters theirs (``_total``); NaN samples are skipped. A malformed line ends the parse:
    the samples before it are kept (an engine's stats are then partial, never an error).
    """
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if not math.isnan(s.value):
                    out[s.name] = out.get(s.name, 0.0) + s.value
    except ValueError as e:
        log.debug("malformed Prometheus text (%s); kept %d samples", e, len(out))
    return out


def split_sse(buffer: bytearray) -> list[bytes]:
    """Pop every complete server-sent event (terminated by a blank line) off ``buffer``."""
    events: list[bytes] = []
    if b"\r" in buffer:
        buffer[:] = buffer.replace(b"\r\n", b"\n")
    start = 0
    while True:
        end = buffer.find(b"\n\n", start)
        if end < 0:
            break
        events.append(bytes(buffer[start : end + 2]))
        start = end + 2
    if start:
        del buffer[:start]
    return events


def _first(metrics: Mapping[str, float], *names: str) -> float | None:
    for n in names:
        if n in metrics:
            return metrics[n]
    return None


# --------------------------------------------------------------------------- base class
class EngineAdapter:
    """One engine behind the gateway. Subclasses override the engine-specific hooks only."""

    kind: ClassVar[str] = "openai"
    #: what only this kind of engine answers (200): (path, a key of its JSON object, or
    #: ``"[]"`` for a JSON array) — how the start-up check tells a wrongly declared kind
    signature: ClassVar[tuple[tuple[str, str], ...]] = ()
    #: ``/metrics`` names for the scheduler's engine stats (first match wins)
    running_metrics: ClassVar[tuple[str, ...]] = ()
    waiting_metrics: ClassVar[tuple[str, ...]] = ()
    kv_metrics: ClassVar[tuple[str, ...]] = ()
    #: ``/metrics`` counter → turnstile counter name (see bench.metrics.ENGINE_STAT_KEYS)
    counter_metrics: ClassVar[Mapping[str, str]] = {}
    health_path: ClassVar[str] = "/health"
    metrics_path: ClassVar[str | None] = "/metrics"

    def __init__(
        self,
        base_url: str,
        *,
        engine_id: str | None = None,
        api_key: str | None = None,
        client: httpx.AsyncClient | None = None,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 600.0,
        control_timeout_s: float = 2.0,
        retries: int = 1,
        weight: float = 1.0,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.id = engine_id or httpx.URL(self.base_url).netloc.decode()
        self.weight = weight
        self.options = dict(options or {})
        headers = {"content-type": "application/json"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        #: the one HTTP transport (its fast path for plain http; resent at once, ``retries``
        #: times, only while the engine sent nothing back)
        self.transport = HttpTransport(
            self.base_url, headers=headers, client=client, connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s, control_timeout_s=control_timeout_s,
            retry=RetryRule(retries=retries, backoff_s=0.0),
        )
        #: what :meth:`check_config` found, per :data:`FEATURES` name: True (the engine does
        #: it), False (it ignores it), None (unknown); with :attr:`config_notes`, the evidence
        self.features: dict[str, bool | None] = dict.fromkeys(FEATURES)
        self.config_notes: dict[str, str] = {}
        #: the longest context (prompt + output tokens) the engine accepts, where it says
        self.max_model_len: int | None = None
        #: ``time.monotonic()`` when the engine last sent bytes of a reply (a busy engine whose
        #: health endpoint is slow to answer is still alive: see :meth:`replied_since`)
        self.last_reply_s = float("-inf")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self.base_url}>"

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Discover what the engine offers (slots, …); called once, errors are not fatal."""

    async def check_config(self) -> None:
        """Learn what the engine is configured to do (:attr:`features`, :attr:`max_model_len`)
        from its endpoints or a probe; called once at start, after :meth:`start`. Errors are
        not fatal (the facts stay unknown). The base class knows nothing."""

    def config_hint(self, feature: str) -> str:
        """How to turn ``feature`` on for this kind of engine (for the warning)."""
        return ""

    async def aclose(self) -> None:
        await self.transport.aclose()

    # ------------------------------------------------------------------ forwarding
    def prepare(self, body: dict[str, Any], hints: ForwardHints) -> dict[str, Any]:
        """Engine-specific request fields (priority, slot, cache); returns a (shallow) copy."""
        return body

    async def begin(self, hints: ForwardHints) -> None:
        """A turn is about to be forwarded here (choose a slot, restore offloaded KV)."""

    def end(self, hints: ForwardHints) -> None:
        """The turn forwarded with ``hints`` is over (finished, failed or cancelled)."""

    async def retain(self, session_id: str, decision: RetentionDecision, now_s: float) -> None:
        """Carry out a retention decision for a session paused in a tool call."""

    def aborted_reply(self, reply: Any) -> bool:
        """A 2xx whole reply that the engine itself aborted (no real answer: re-route it)."""
        return False

    def aborted_event(self, event: bytes) -> bool:
        """A streamed event saying the engine aborted the turn (cheap: runs on every event)."""
        return False

    def _request_headers(self, hints: ForwardHints) -> dict[str, str]:
        return {"x-request-id": hints.request_id}

    def _content(self, path: str, body: dict[str, Any], hints: ForwardHints) -> bytes:
        return json.dumps(self.prepare(body, hints), separators=(",", ":")).encode()

    async def complete(
        self, path: str, body: dict[str, Any], hints: ForwardHints
    ) -> UpstreamResponse:
        """POST a non-streaming request; raises UpstreamError / UpstreamHTTPError."""
        resp = await self._send(path, self._content(path, body, hints),
                                self._request_headers(hints))
        try:
            data = await resp.read()
        except (BrokenResponse, EngineLost, TimeoutError, httpx.TransportError) as e:
            raise self._error(e) from e
        self.last_reply_s = time.monotonic()
        if resp.status >= 300:
            raise UpstreamHTTPError(resp.status, data, resp.content_type)
        return UpstreamResponse(resp.status, data, resp.content_type)

    async def stream(
        self, path: str, body: dict[str, Any], hints: ForwardHints
    ) -> AsyncGenerator[bytes, None]:
        """POST a streaming request and yield complete SSE events (``data: …\\n\\n``)."""
        batches = self.stream_batches(path, body, hints)
        try:
            async for batch in batches:
                for event in batch:
                    yield event
        finally:
            await batches.aclose()

    async def stream_batches(
        self, path: str, body: dict[str, Any], hints: ForwardHints
    ) -> AsyncGenerator[list[bytes], None]:
        """Like :meth:`stream`, but yields every event already received at once (a burst of
        tokens costs one write downstream instead of one each)."""
        resp = await self._send(path, self._content(path, body, hints),
                                self._request_headers(hints))
        chunks, status, ctype = resp.chunks(), resp.status, resp.content_type
        streamed = False
        try:
            if status >= 300:
                data = b"".join([c async for c in chunks])
                raise UpstreamHTTPError(status, data, ctype)
            buf = bytearray()
            try:
                async for chunk in chunks:
                    self.last_reply_s = time.monotonic()
                    buf += chunk
                    events = split_sse(buf)
                    if events:
                        streamed = True
                        yield events
            except (BrokenResponse, EngineLost, TimeoutError, httpx.TransportError) as e:
                raise self._error(e, streamed=streamed) from e
            if buf.strip():
                yield [bytes(buf) + b"\n\n"]
        finally:
            await resp.aclose()

    def _error(self, e: BaseException, *, streamed: bool = False) -> UpstreamError:
        if isinstance(e, TimeoutError | httpx.TimeoutException) and not isinstance(
            e, httpx.ConnectTimeout
        ):
            return UpstreamError(f"{self.id}: timed out", engine_down=False, streamed=streamed)
        return UpstreamError(f"{self.id}: {type(e).__name__}: {e}", engine_down=True,
                             streamed=streamed)

    async def _send(self, path: str, content: bytes, headers: dict[str, str]) -> Response:
        try:
            return await self.transport.post(path, content, headers)
        except (ConnectionError, TimeoutError, httpx.TransportError) as e:
            raise self._error(e) from e

    def abort_inflight(self) -> int:
        """The gateway declared the engine dead: drop every request in flight to it now, so
        that each fails at once (and is re-routed, or ends its stream with an error event)
        instead of waiting for a read timeout. Returns how many were dropped. (Requests sent
        through an injected ``httpx`` client are not tracked.)"""
        fast = self.transport.fast
        return fast.abort() if fast is not None else 0

    # ------------------------------------------------------------------ control
    async def _get(self, path: str) -> httpx.Response:
        return await self.transport.get(path)

    async def _post_json(self, path: str, body: Any) -> httpx.Response:
        return await self.transport.post_json(path, body)

    def in_flight(self) -> int:
        """Requests sent to the engine and not yet answered in full (0 when not tracked)."""
        fast = self.transport.fast
        return fast.in_flight if fast is not None else 0

    def replied_since(self, t: float) -> bool:
        """Whether the engine sent reply bytes at or after ``time.monotonic()`` time ``t``."""
        return self.last_reply_s >= t

    async def health(self) -> bool:
        return await self.health_state() == "up"

    async def health_state(self, timeout_s: float | None = None) -> str:
        """``"up"`` (the health endpoint answered 200); ``"gone"`` (connection refused or
        reset: no server there any more); ``"unhealthy"`` (it answered, not 200: loading,
        draining or broken); ``"silent"`` (no answer within the control timeout, or
        ``timeout_s``: hung, or only slow)."""
        timeout = None if timeout_s is None else httpx.Timeout(timeout_s)
        try:
            # a new connection each time: a server that stopped listening (shutting down,
            # its kept-alive connections maybe silent) is found at once
            resp = await self.transport.get(self.health_path, fresh_connection=True,
                                            timeout=timeout)
        except httpx.TimeoutException:
            return "silent"
        except httpx.HTTPError:
            return "gone"
        return "up" if resp.status_code == 200 else "unhealthy"

    async def models(self) -> list[str]:
        """Model ids served (``GET /v1/models``); empty when unknown."""
        try:
            resp = await self._get("/v1/models")
            if resp.status_code != 200:
                return []
            data = resp.json().get("data") or []
        except (httpx.HTTPError, ValueError, AttributeError):
            return []
        out: list[str] = []
        for m in data:
            if isinstance(m, dict) and isinstance(m.get("id"), str):
                out.append(m["id"])
                out.extend(a for a in m.get("aliases") or () if isinstance(a, str))
        return list(dict.fromkeys(out))

    async def stats(self) -> EngineStats | None:
        """Scrape ``/metrics``; None when the engine has none (or is unreachable)."""
        if self.metrics_path is None:
            return None
        try:
            resp = await self._get(self.metrics_path)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        return self.stats_from_metrics(parse_prometheus(resp.text))

    def stats_from_metrics(self, m: Mapping[str, float]) -> EngineStats:
        running = _first(m, *self.running_metrics)
        waiting = _first(m, *self.waiting_metrics)
        kv = _first(m, *self.kv_metrics)
        counters = {ours: m[theirs] for theirs, ours in self.counter_metrics.items() if theirs in m}
        return EngineStats(
            queue_len=None if waiting is None else int(waiting),
            running=None if running is None else int(running),
            kv_used_frac=kv,
            counters=counters,
        )

    async def tokenize(self, text: str) -> int | None:
        """Token count of ``text`` by the engine's tokenizer; None when unsupported."""
        return None
