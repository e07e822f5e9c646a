"""The async HTTP transport: one interface for the gateway's engine adapters and the replayer.

:class:`HttpTransport` sends a request and hands back a :class:`Response` whose body is read
whole or streamed. Requests go through the measured fast path
(:class:`~turnstile.transport.fast.FastHttpClient`) for plain ``http://`` origins, through
``httpx`` otherwise (``https``, or an ``httpx`` client given by a test with a mock transport);
either way they are sent again only under the one retry rule (:mod:`.retry`). Control-plane
calls (``get``, ``post_json``: health, metrics, slots) use ``httpx`` with their own timeout.

Errors are the underlying client's: :class:`~turnstile.transport.fast.ConnectFailed`,
:class:`~turnstile.transport.fast.NothingReceived`,
:class:`~turnstile.transport.fast.BrokenResponse` and :class:`TimeoutError` from the fast path,
``httpx.TransportError`` from the other (the caller maps them: the adapters to
``UpstreamError``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import httpx

from turnstile.transport.fast import ConnectFailed, FastHttpClient, NothingReceived
from turnstile.transport.retry import RetryRule, retry_async

__all__ = ["HttpTransport", "Response", "nothing_received"]


def nothing_received(exc: BaseException) -> bool:
    """True when the other side sent no response byte (safe to send the request again)."""
    if isinstance(exc, ConnectFailed | NothingReceived | httpx.ConnectError):
        return True
    if isinstance(exc, httpx.RemoteProtocolError):
        text = str(exc).lower()
        return "without sending" in text or "disconnected" in text
    return False


class Response:
    """A response whose status and headers are in; the body is streamed (:meth:`chunks`,
    :meth:`lines`) or read whole (:meth:`read`). :meth:`aclose` frees the connection."""

    __slots__ = ("_chunks", "_close", "content_type", "headers", "status")

    def __init__(self, status: int, content_type: str, headers: Mapping[str, str],
                 chunks: AsyncIterator[bytes], close: Callable[[], Awaitable[None]]) -> None:
        self.status = status
        self.content_type = content_type
        self.headers = headers
        self._chunks = chunks
        self._close = close

    def chunks(self) -> AsyncIterator[bytes]:
        return self._chunks

    async def read(self) -> bytes:
        try:
            parts = [c async for c in self._chunks]
        finally:
            await self._close()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def lines(self) -> AsyncIterator[str]:
        """The body as text lines (server-sent events), without their line ends."""
        buf = ""
        async for chunk in self._chunks:
            buf += chunk.decode("utf-8", errors="replace")
            *done, buf = buf.split("\n")
            for line in done:
                yield line.rstrip("\r")
        if buf:
            yield buf.rstrip("\r")

    async def aclose(self) -> None:
        await self._close()

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close()


class HttpTransport:
    """One origin (``base_url``), keep-alive, with default ``headers`` on every request."""

    def __init__(
        self,
        base_url: str,
        *,
        headers: Mapping[str, str] | None = None,
        client: httpx.AsyncClient | None = None,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 600.0,
        control_timeout_s: float = 2.0,
        retry: RetryRule | None = None,
        max_keepalive: int = 256,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = dict(headers or {})
        self.retry = retry if retry is not None else RetryRule()
        self.control_timeout = httpx.Timeout(control_timeout_s, connect=connect_timeout_s)
        self._owns_client = client is None
        self.client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s, pool=read_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=max_keepalive),
        )
        #: for :meth:`get` with ``fresh_connection``: a new connection each time (health
        #: checks: a server that stopped listening, its kept-alive connections maybe silent, is
        #: found at once)
        self._fresh_client = client or httpx.AsyncClient(
            timeout=self.control_timeout, limits=httpx.Limits(max_keepalive_connections=0))
        #: the measured fast path, unless an httpx client was given (tests pass one with a
        #: MockTransport) or the origin is https
        self.fast: FastHttpClient | None = None
        if client is None and self.base_url.startswith("http://"):
            self.fast = FastHttpClient(self.base_url, connect_timeout_s=connect_timeout_s,
                                       read_timeout_s=read_timeout_s, max_idle=max_keepalive)

    async def aclose(self) -> None:
        if self.fast is not None:
            await self.fast.aclose()
        if self._owns_client:
            await self.client.aclose()
            await self._fresh_client.aclose()

    async def post(self, path: str, content: bytes,
                   headers: Mapping[str, str] | None = None) -> Response:
        """POST ``content``; returns once the status and headers are in (the body is read
        from the response), sent again under the retry rule while nothing came back."""
        hdrs = {**self.headers, **headers} if headers else self.headers
        fast = self.fast
        if fast is not None:
            raw = await retry_async(lambda: fast.post(path, content, hdrs), self.retry,
                                    nothing_received)
            return Response(raw.status, raw.content_type, raw.headers, raw.iter_raw(),
                            raw.aclose)
        request = self.client.build_request("POST", self.base_url + path, content=content,
                                            headers=hdrs)
        r = await retry_async(lambda: self.client.send(request, stream=True), self.retry,
                              nothing_received)
        return Response(r.status_code, r.headers.get("content-type", "application/json"),
                        r.headers, r.aiter_bytes(), r.aclose)

    # ------------------------------------------------------------------ control plane
    async def get(self, path: str, *, timeout: httpx.Timeout | float | None = None,
                  fresh_connection: bool = False) -> httpx.Response:
        """``GET path`` (control timeout unless given); ``fresh_connection``: on a new
        connection, not a kept-alive one (health checks)."""
        client = self._fresh_client if fresh_connection else self.client
        return await client.get(self.base_url + path, headers=self.headers,
                                timeout=timeout if timeout is not None else self.control_timeout)

    async def post_json(self, path: str, body: Any, *,
                        timeout: httpx.Timeout | float | None = None,
                        headers: Mapping[str, str] | None = None) -> httpx.Response:
        hdrs = {**self.headers, **headers} if headers else self.headers
        return await self.client.post(self.base_url + path, json=body, headers=hdrs,
                                      timeout=timeout if timeout is not None
                                      else self.control_timeout)
