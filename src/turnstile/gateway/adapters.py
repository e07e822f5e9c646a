"""Engine adapters: one small async interface in front of every OpenAI-compatible engine.

The gateway speaks to engines only through :class:`EngineAdapter`:

* :meth:`~EngineAdapter.complete` forwards a non-streaming request and returns the whole
  response; :meth:`~EngineAdapter.stream` forwards a streaming one and yields its server-sent
  events one by one (each a complete ``data: ...`` event, blank line included).
* :meth:`~EngineAdapter.health`, :meth:`~EngineAdapter.stats` (a ``/metrics`` scrape),
  :meth:`~EngineAdapter.models` and :meth:`~EngineAdapter.tokenize` for the control loop.
* :meth:`~EngineAdapter.begin` / :meth:`~EngineAdapter.end` bracket each forwarded turn and
  :meth:`~EngineAdapter.retain` carries out a retention decision (pin, offload, discard); the
  base class does nothing, :class:`LlamaCppAdapter` maps them onto llama.cpp's slots.

Retries: an adapter retries a request only when the engine sent nothing back — a refused
connection, or a kept-alive connection the engine had closed — and never after any response
byte arrived, so a completed turn is never run twice. Anything else surfaces as
:class:`UpstreamError` (the gateway re-routes or fails the turn) or :class:`UpstreamHTTPError`
(the engine answered with an error status; the gateway passes 4xx through).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httpx

from turnstile.core.actions import RetentionDecision
from turnstile.gateway.http import (
    BrokenResponse,
    ConnectFailed,
    FastHttpClient,
    NothingReceived,
    RawResponse,
)

__all__ = [
    "ADAPTERS",
    "EngineAdapter",
    "EngineStats",
    "ForwardHints",
    "LlamaCppAdapter",
    "OpenAIAdapter",
    "SglangAdapter",
    "UpstreamError",
    "UpstreamHTTPError",
    "UpstreamResponse",
    "VllmAdapter",
    "make_adapter",
    "parse_prometheus",
    "split_sse",
]

JSON_HEADERS = {"content-type": "application/json"}


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


# --------------------------------------------------------------------------- helpers
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format → ``{metric name: value summed over label sets}``.

    Histogram/summary series keep their suffixed names (``_bucket``, ``_sum``, ``_count``);
    comments and unparsable lines are skipped.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if math.isnan(value):
            continue
        name = m.group(1)
        out[name] = out.get(name, 0.0) + value
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
        self.retries = retries
        self.options = dict(options or {})
        self.control_timeout = httpx.Timeout(control_timeout_s, connect=connect_timeout_s)
        self._headers = {"content-type": "application/json"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._owns_client = client is None
        self.client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s, pool=read_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        #: forwarding goes through the lean client unless an httpx client was given (tests
        #: pass one with a MockTransport) or the engine is behind https
        self.fast: FastHttpClient | None = None
        if client is None and self.base_url.startswith("http://"):
            self.fast = FastHttpClient(self.base_url, connect_timeout_s=connect_timeout_s,
                                       read_timeout_s=read_timeout_s)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self.base_url}>"

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Discover what the engine offers (slots, …); called once, errors are not fatal."""

    async def aclose(self) -> None:
        if self.fast is not None:
            await self.fast.aclose()
        if self._owns_client:
            await self.client.aclose()

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

    def _request_headers(self, hints: ForwardHints) -> dict[str, str]:
        return {**self._headers, "x-request-id": hints.request_id}

    def _content(self, path: str, body: dict[str, Any], hints: ForwardHints) -> bytes:
        return json.dumps(self.prepare(body, hints), separators=(",", ":")).encode()

    async def complete(
        self, path: str, body: dict[str, Any], hints: ForwardHints
    ) -> UpstreamResponse:
        """POST a non-streaming request; raises UpstreamError / UpstreamHTTPError."""
        content = self._content(path, body, hints)
        headers = self._request_headers(hints)
        if self.fast is not None:
            resp = await self._fast_post(path, content, headers)
            try:
                data = await resp.read()
            except (BrokenResponse, TimeoutError) as e:
                raise self._error(e) from e
            if resp.status >= 300:
                raise UpstreamHTTPError(resp.status, data, resp.content_type)
            return UpstreamResponse(resp.status, data, resp.content_type)
        attempt = 0
        while True:
            try:
                r = await self.client.post(self.base_url + path, content=content,
                                           headers=headers)
                break
            except (httpx.ConnectError, httpx.RemoteProtocolError) as e:
                # nothing came back: the request may be sent again
                if attempt >= self.retries or not _nothing_received(e):
                    raise self._error(e) from e
                attempt += 1
            except httpx.TransportError as e:
                raise self._error(e) from e
        ctype = r.headers.get("content-type", "application/json")
        if r.status_code >= 300:
            raise UpstreamHTTPError(r.status_code, r.content, ctype)
        return UpstreamResponse(r.status_code, r.content, ctype)

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
        content = self._content(path, body, hints)
        headers = self._request_headers(hints)
        if self.fast is not None:
            resp = await self._fast_post(path, content, headers)
            chunks = resp.iter_raw()
            status = resp.status
            ctype = resp.content_type
            closer = resp.aclose
        else:
            hresp = await self._httpx_send(path, content, headers)
            chunks = hresp.aiter_bytes()
            status = hresp.status_code
            ctype = hresp.headers.get("content-type", "application/json")
            closer = hresp.aclose
        streamed = False
        try:
            if status >= 300:
                data = b"".join([c async for c in chunks])
                raise UpstreamHTTPError(status, data, ctype)
            buf = bytearray()
            try:
                async for chunk in chunks:
                    buf += chunk
                    events = split_sse(buf)
                    if events:
                        streamed = True
                        yield events
            except (BrokenResponse, TimeoutError, httpx.TransportError) as e:
                raise self._error(e, streamed=streamed) from e
            if buf.strip():
                yield [bytes(buf) + b"\n\n"]
        finally:
            await closer()

    def _error(self, e: BaseException, *, streamed: bool = False) -> UpstreamError:
        if isinstance(e, TimeoutError | httpx.TimeoutException) and not isinstance(
            e, httpx.ConnectTimeout
        ):
            return UpstreamError(f"{self.id}: timed out", engine_down=False, streamed=streamed)
        return UpstreamError(f"{self.id}: {type(e).__name__}: {e}", engine_down=True,
                             streamed=streamed)

    async def _fast_post(self, path: str, content: bytes, headers: dict[str, str]
                         ) -> RawResponse:
        assert self.fast is not None
        attempt = 0
        while True:
            try:
                return await self.fast.post(path, content, headers)
            except (ConnectFailed, NothingReceived) as e:
                # nothing came back: the request may be sent again
                if attempt >= self.retries:
                    raise self._error(e) from e
                attempt += 1
            except (BrokenResponse, TimeoutError) as e:
                raise self._error(e) from e

    async def _httpx_send(self, path: str, content: bytes, headers: dict[str, str]
                          ) -> httpx.Response:
        request = self.client.build_request("POST", self.base_url + path, content=content,
                                            headers=headers)
        attempt = 0
        while True:
            try:
                return await self.client.send(request, stream=True)
            except (httpx.ConnectError, httpx.RemoteProtocolError) as e:
                if attempt >= self.retries or not _nothing_received(e):
                    raise self._error(e) from e
                attempt += 1
            except httpx.TransportError as e:
                raise self._error(e) from e

    # ------------------------------------------------------------------ control
    async def _get(self, path: str) -> httpx.Response:
        return await self.client.get(self.base_url + path, headers=self._headers,
                                     timeout=self.control_timeout)

    async def _post_json(self, path: str, body: Any) -> httpx.Response:
        return await self.client.post(self.base_url + path, json=body, headers=self._headers,
                                      timeout=self.control_timeout)

    async def health(self) -> bool:
        try:
            resp = await self._get(self.health_path)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

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


def _nothing_received(exc: Exception) -> bool:
    """True when the engine sent no response byte (safe to send the request again)."""
    if isinstance(exc, httpx.ConnectError):
        return True
    return "without sending" in str(exc).lower() or "disconnected" in str(exc).lower()


# --------------------------------------------------------------------------- llama.cpp
@dataclass(slots=True)
class _Slot:
    id: int
    owner: str | None = None  # session whose KV the slot holds
    busy: int = 0  # turns forwarded with this id_slot and not over
    pinned_until_s: float = 0.0
    last_used_s: float = 0.0


class LlamaCppAdapter(EngineAdapter):
    """llama.cpp's C++ ``llama-server``.

    * KV affinity inside the engine: each session is pinned to a slot (``id_slot``) with
      ``cache_prompt=true``, so its next turn reuses the slot's KV prefix. A slot is chosen as:
      the session's own slot if idle; else an idle slot nobody pinned (empty first, then least
      recently used); else none (the server picks and queues).
    * Retention: ``pin`` keeps other sessions off the slot for the TTL; ``offload`` saves the
      slot to ``--slot-save-path`` (``POST /slots/{id}?action=save``) so it can be restored into
      any slot later (``action=restore``); ``discard`` erases it. Offload needs the server
      started with ``--slot-save-path``; without it offload degrades to LRU.
    * ``/metrics`` (``--metrics``): ``requests_processing``/``requests_deferred`` and prompt
      token counters; ``/tokenize`` for exact prompt lengths.
    """

    kind = "llama.cpp"
    running_metrics = ("llamacpp:requests_processing",)
    waiting_metrics = ("llamacpp:requests_deferred",)
    counter_metrics: ClassVar[Mapping[str, str]] = {
        "llamacpp:prompt_tokens_total": "prompt_tokens_computed",
        "llamacpp:prompt_tokens_cached_total": "prefix_hit_tokens",
        "llamacpp:tokens_predicted_total": "output_tokens",
    }

    def __init__(self, base_url: str, **kw: Any) -> None:
        super().__init__(base_url, **kw)
        self.slots: list[_Slot] = []
        self.offload_enabled = bool(self.options.get("offload", True))
        #: session → (file name, expiry) of KV saved through the slots API
        self.offloaded: dict[str, tuple[str, float]] = {}
        self.slot_errors = 0

    async def start(self) -> None:
        n = self.options.get("slots")
        if n is None:
            try:
                resp = await self._get("/slots")
                if resp.status_code == 200 and isinstance(resp.json(), list):
                    n = len(resp.json())
            except (httpx.HTTPError, ValueError):
                n = None
        if n is None:
            try:
                resp = await self._get("/props")
                n = int(resp.json().get("total_slots", 0)) if resp.status_code == 200 else 0
            except (httpx.HTTPError, ValueError, AttributeError, TypeError):
                n = 0
        self.slots = [_Slot(i) for i in range(int(n or 0))]

    def prepare(self, body: dict[str, Any], hints: ForwardHints) -> dict[str, Any]:
        out = dict(body)
        out.setdefault("cache_prompt", True)
        if hints.slot is not None:
            out["id_slot"] = hints.slot
        return out

    def choose_slot(self, session_id: str, now_s: float) -> int | None:
        own: _Slot | None = None
        best: _Slot | None = None
        for s in self.slots:
            if s.owner == session_id:
                own = s
            elif s.busy == 0 and s.pinned_until_s <= now_s and (
                best is None
                or (s.owner is None, -s.last_used_s) > (best.owner is None, -best.last_used_s)
            ):
                best = s
        if own is not None and own.busy == 0:
            return own.id
        return None if best is None else best.id

    async def begin(self, hints: ForwardHints) -> None:
        if not self.slots:
            return
        now_s = time.monotonic()
        k = self.choose_slot(hints.session_id, now_s)
        if k is None:
            # every slot busy or pinned: let the server pick; ownership is unknown now
            for s in self.slots:
                if s.owner == hints.session_id:
                    s.owner = None
            return
        slot = self.slots[k]
        for s in self.slots:
            if s.owner == hints.session_id and s is not slot:
                s.owner = None
        restore = self.offloaded.pop(hints.session_id, None)
        if slot.owner != hints.session_id and restore is not None and restore[1] >= now_s:
            try:
                await self._post_json(f"/slots/{k}?action=restore", {"filename": restore[0]})
            except httpx.HTTPError:
                self.slot_errors += 1
        slot.owner = hints.session_id
        slot.busy += 1
        slot.pinned_until_s = 0.0
        slot.last_used_s = now_s
        hints.slot = k

    def end(self, hints: ForwardHints) -> None:
        if hints.slot is not None and hints.slot < len(self.slots):
            slot = self.slots[hints.slot]
            slot.busy = max(0, slot.busy - 1)
            slot.last_used_s = time.monotonic()

    def _owned(self, session_id: str) -> _Slot | None:
        for s in self.slots:
            if s.owner == session_id:
                return s
        return None

    async def retain(self, session_id: str, decision: RetentionDecision, now_s: float) -> None:
        slot = self._owned(session_id)
        if slot is None:
            return
        mono = time.monotonic()
        if decision.action == "pin":
            slot.pinned_until_s = mono + decision.ttl_s
        elif decision.action == "offload" and self.offload_enabled and slot.busy == 0:
            name = "ts-" + re.sub(r"[^A-Za-z0-9_.-]", "_", session_id)[:80] + ".bin"
            try:
                resp = await self._post_json(f"/slots/{slot.id}?action=save", {"filename": name})
            except httpx.HTTPError:
                self.slot_errors += 1
                return
            if resp.status_code == 200:
                self.offloaded[session_id] = (name, mono + max(decision.ttl_s, 1.0))
            else:  # no --slot-save-path: offload is unavailable on this server
                self.offload_enabled = False
        elif decision.action == "discard" and slot.busy == 0:
            try:
                await self._post_json(f"/slots/{slot.id}?action=erase", {})
            except httpx.HTTPError:
                self.slot_errors += 1
                return
            slot.owner = None

    async def tokenize(self, text: str) -> int | None:
        try:
            resp = await self._post_json("/tokenize", {"content": text})
            if resp.status_code != 200:
                return None
            return len(resp.json()["tokens"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None


# --------------------------------------------------------------------------- vLLM
class VllmAdapter(EngineAdapter):
    """vLLM's OpenAI server.

    Sends the admission priority as vLLM's ``priority`` request field (an integer, lower runs
    first; the server must run with ``--scheduling-policy priority``, else set the engine
    option ``priority = false``). Prefix caching is vLLM's own (automatic); retention
    decisions have no per-session API in vLLM and are no-ops. Stats from ``/metrics``.
    """

    kind = "vllm"
    running_metrics = ("vllm:num_requests_running",)
    waiting_metrics = ("vllm:num_requests_waiting",)
    kv_metrics = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    counter_metrics: ClassVar[Mapping[str, str]] = {
        "vllm:prompt_tokens_total": "prompt_tokens",
        "vllm:prefix_cache_hits_total": "prefix_hit_tokens",
        "vllm:prefix_cache_queries_total": "prefix_query_tokens",
        "vllm:num_preemptions_total": "preemptions",
        "vllm:generation_tokens_total": "output_tokens",
    }
    #: the admission priority (seconds or tokens, a float) is scaled to vLLM's integer
    priority_scale: ClassVar[float] = 1000.0

    def prepare(self, body: dict[str, Any], hints: ForwardHints) -> dict[str, Any]:
        if not self.options.get("priority", True):
            return body
        out = dict(body)
        out["priority"] = _int_priority(hints.priority, self.priority_scale)
        return out

    async def tokenize(self, text: str) -> int | None:
        try:
            resp = await self._post_json("/tokenize", {"prompt": text})
            if resp.status_code != 200:
                return None
            data = resp.json()
            return int(data.get("count", len(data.get("tokens", ()))))
        except (httpx.HTTPError, ValueError, TypeError, AttributeError):
            return None


def _int_priority(priority: float, scale: float) -> int:
    if not math.isfinite(priority):
        return 2**62 if priority > 0 else -(2**62)
    return max(-(2**62), min(2**62, math.floor(priority * scale)))


# --------------------------------------------------------------------------- SGLang
class SglangAdapter(EngineAdapter):
    """SGLang's OpenAI-compatible server (``--enable-metrics`` for ``/metrics``).

    SGLang's RadixAttention caches prefixes on its own. With the engine option
    ``priority = true`` (server started with ``--enable-priority-scheduling``) the admission
    priority is sent as ``priority``; SGLang runs *higher* values first unless started with
    ``--schedule-low-priority-values-first`` (option ``low_priority_first = true``), so the
    sign is flipped by default.
    """

    kind = "sglang"
    running_metrics = ("sglang:num_running_reqs",)
    waiting_metrics = ("sglang:num_queue_reqs",)
    kv_metrics = ("sglang:token_usage",)
    counter_metrics: ClassVar[Mapping[str, str]] = {
        "sglang:prompt_tokens_total": "prompt_tokens",
        "sglang:cached_tokens_total": "prefix_hit_tokens",
        "sglang:generation_tokens_total": "output_tokens",
    }

    def prepare(self, body: dict[str, Any], hints: ForwardHints) -> dict[str, Any]:
        if not self.options.get("priority", False):
            return body
        out = dict(body)
        p = _int_priority(hints.priority, 1000.0)
        out["priority"] = p if self.options.get("low_priority_first", False) else -p
        return out


# --------------------------------------------------------------------------- generic
class OpenAIAdapter(EngineAdapter):
    """Any OpenAI-compatible endpoint: forwarding only; health is ``GET /v1/models``."""

    kind = "openai"
    health_path = "/v1/models"
    metrics_path = None


ADAPTERS: dict[str, type[EngineAdapter]] = {
    "llama.cpp": LlamaCppAdapter,
    "llamacpp": LlamaCppAdapter,
    "llama-cpp": LlamaCppAdapter,
    "vllm": VllmAdapter,
    "sglang": SglangAdapter,
    "openai": OpenAIAdapter,
}


def make_adapter(url: str, kind: str = "llama.cpp", **kw: Any) -> EngineAdapter:
    """Build the adapter for ``kind`` (``llama.cpp``, ``vllm``, ``sglang``, ``openai``)."""
    try:
        cls = ADAPTERS[kind.lower()]
    except KeyError:
        valid = ", ".join(sorted({c.kind for c in ADAPTERS.values()}))
        raise ValueError(f"unknown engine kind {kind!r}; valid kinds: {valid}") from None
    return cls(url, **kw)
