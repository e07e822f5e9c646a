"""A small HTTP/1.1 client for the forwarding hot path (asyncio streams, keep-alive pool): the
measured fast path behind :class:`~turnstile.transport.client.HttpTransport`.

``httpx`` costs ~1 ms of CPU per proxied request here (its connection pool scans every
connection on each request), which alone would cap the gateway near 300 requests/s. aiohttp's
client was measured against this one in the same run (``benchmarks/gateway_overhead.py
--no-llama --clients hand,aiohttp --rounds 3 --requests 1500 --seconds 5``, zero-cost engine,
2 cores shared with other jobs, load average 5.2–5.5; medians of 3 interleaved rounds):

=========  ==================  ==============  ================  ===================
client     added P50 non-str.  added P50 str.  gateway CPU/req   req/s via gateway
=========  ==================  ==============  ================  ===================
this one   0.87 ms             1.23 ms         0.66 ms (≈1,520   764
                                               req/s per core)
aiohttp    1.02 ms             1.89 ms         0.81 ms (≈1,240   679
(3.14.5)                                       req/s per core)
=========  ==================  ==============  ================  ===================

aiohttp stays under 2 ms added P50 (streamed: barely; 2.4 ms non-streamed in an earlier
single round) but misses 1,000 requests/s through the gateway in that run (679/s, where this
client gets 764/s) and costs 23 % more CPU per request, so this client stays. This client
does only what forwarding to an engine on a trusted network needs: ``POST`` with a
``Content-Length`` body, responses framed by ``Content-Length``, chunked encoding or connection
close, keep-alive reuse, connect/read timeouts. Control-plane calls (health, metrics, slots)
go through the transport's ``httpx`` client.

Failure taxonomy (what the retry rule, :mod:`turnstile.transport.retry`, needs):

* :class:`ConnectFailed` — no connection; nothing was sent.
* :class:`NothingReceived` — the request was written but the connection closed before any
  response byte (typically a kept-alive connection the server had closed): safe to resend.
* :class:`BrokenResponse` — the connection failed after some response bytes.
* :class:`TimeoutError` (builtin) — connect or read timed out.
* :class:`EngineLost` — :meth:`FastHttpClient.abort` dropped the connection (the gateway declared
  the engine dead): never sent again to this origin.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["BrokenResponse", "ConnectFailed", "EngineLost", "FastHttpClient", "NothingReceived",
           "RawResponse"]

_MAX_HEADER = 64 * 1024


class ConnectFailed(ConnectionError):
    pass


class NothingReceived(ConnectionError):
    pass


class BrokenResponse(ConnectionError):
    pass


class EngineLost(ConnectionError):
    pass


@dataclass(slots=True, eq=False)  # hashed by identity (the busy set)
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    dropped: bool = False

    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()

    def abort(self) -> None:
        """Drop the connection now (no FIN handshake): a pending read sees EOF at once."""
        self.dropped = True
        with contextlib.suppress(Exception):
            self.writer.transport.abort()


class RawResponse:
    """A response whose body is read (or streamed) from a pooled connection."""

    __slots__ = ("_chunked", "_client", "_complete", "_conn", "_done", "_epoch", "_keep",
                 "_length", "content_type", "headers", "status")

    def __init__(self, client: FastHttpClient, conn: _Conn, status: int, content_type: str,
                 length: int | None, chunked: bool, keep: bool,
                 headers: dict[str, str] | None = None) -> None:
        self._client = client
        self._conn = conn
        self.status = status
        self.content_type = content_type
        #: the response headers, names in lower case
        self.headers = headers if headers is not None else {}
        self._length = length
        self._chunked = chunked
        self._keep = keep
        self._done = False
        self._complete = False  # the body was read to its end
        self._epoch = client.aborts

    async def read(self) -> bytes:
        parts = [c async for c in self.iter_raw()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def iter_raw(self) -> AsyncIterator[bytes]:
        """Yield body bytes as they arrive; returns the connection to the pool at the end."""
        r = self._conn.reader
        timeout = self._client.read_timeout_s
        try:
            if self._chunked:
                last = False
                while not last:
                    async with asyncio.timeout(timeout):
                        parts, last = await _read_chunks(r)
                    if parts:
                        yield parts[0] if len(parts) == 1 else b"".join(parts)
            elif self._length is not None:
                left = self._length
                while left > 0:
                    async with asyncio.timeout(timeout):
                        data = await r.read(min(left, 1 << 16))
                    if not data:
                        raise BrokenResponse("connection closed mid-body")
                    left -= len(data)
                    yield data
            else:  # until the server closes the connection
                self._keep = False
                while True:
                    async with asyncio.timeout(timeout):
                        data = await r.read(1 << 16)
                    if not data:
                        break
                    yield data
                if self._client.aborts != self._epoch:  # EOF framing: an abort looks like it
                    raise EngineLost("connection dropped: the engine was declared dead")
            self._complete = True
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as e:
            self._keep = False
            if isinstance(e, BrokenResponse | EngineLost):
                raise
            if self._client.aborts != self._epoch:
                raise EngineLost("connection dropped: the engine was declared dead") from e
            raise BrokenResponse(f"response broken: {type(e).__name__}: {e}") from e
        finally:
            self._finish()

    def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        self._client._busy.discard(self._conn)
        # a body not read to its end (cancelled, broken) leaves the connection unusable
        if self._keep and self._complete and not self._conn.writer.is_closing():
            self._client._release(self._conn)
        else:
            self._conn.close()

    async def aclose(self) -> None:
        self._finish()


async def _read_chunks(r: asyncio.StreamReader) -> tuple[list[bytes], bool]:
    """Read one chunk of a chunked body, then every further chunk already buffered (without
    waiting); returns the data and whether the terminating chunk was read."""
    parts: list[bytes] = []
    while True:
        line = await r.readuntil(b"\r\n")
        size = int(line.split(b";", 1)[0], 16)
        if size == 0:
            while (await r.readuntil(b"\r\n")) != b"\r\n":
                pass  # trailers
            return parts, True
        data = await r.readexactly(size + 2)
        parts.append(data[:-2])
        # StreamReader keeps what the socket delivered in ``_buffer``; when another whole chunk
        # is there, take it now (no await suspends: the bytes are already in memory)
        buffered = getattr(r, "_buffer", None)
        if buffered is None:
            return parts, False
        nl = buffered.find(b"\r\n")
        if nl < 0:
            return parts, False
        try:
            nxt = int(bytes(buffered[:nl]).split(b";", 1)[0], 16)
        except ValueError:
            return parts, False
        if len(buffered) < nl + 2 + nxt + 2 + (2 if nxt == 0 else 0):
            return parts, False


class FastHttpClient:
    """Keep-alive HTTP/1.1 ``POST`` client for one origin (``http://host:port``)."""

    def __init__(self, base_url: str, *, connect_timeout_s: float = 2.0,
                 read_timeout_s: float = 600.0, max_idle: int = 256) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http":
            raise ValueError(f"FastHttpClient speaks plain http only, got {base_url!r}")
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.prefix = u.path.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_idle = max_idle
        self._idle: deque[_Conn] = deque()
        #: connections with a request in flight (until its response is read or dropped)
        self._busy: set[_Conn] = set()
        #: how many times :meth:`abort` ran; a request begun before an abort never retries
        self.aborts = 0
        self._host_header = f"{self.host}:{self.port}".encode()

    @property
    def in_flight(self) -> int:
        return len(self._busy)

    def abort(self) -> int:
        """The engine is gone: drop every connection, in flight or idle. A request waiting for
        its response fails with :class:`EngineLost`, a body being read with
        :class:`EngineLost` too (:class:`BrokenResponse` semantics: bytes may have arrived).
        Returns the number of requests dropped (not counting those dropped before)."""
        self.aborts += 1
        busy = [c for c in self._busy if not c.dropped]
        for conn in busy:
            conn.abort()
        while self._idle:
            self._idle.pop().close()
        return len(busy)

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()

    def _release(self, conn: _Conn) -> None:
        if len(self._idle) < self.max_idle and conn.usable():
            self._idle.append(conn)
        else:
            conn.close()

    async def _connect(self) -> _Conn:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(self.host, self.port,
                                                               limit=_MAX_HEADER)
        except TimeoutError:
            raise
        except OSError as e:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {e}") from e
        return _Conn(reader, writer)

    async def post(self, path: str, content: bytes, headers: dict[str, str]) -> RawResponse:
        """Send a POST and read the status and headers; the body is read from the result."""
        head = [b"POST ", (self.prefix + path).encode(), b" HTTP/1.1\r\nHost: ",
                self._host_header, b"\r\nContent-Length: ", str(len(content)).encode(), b"\r\n"]
        for k, v in headers.items():
            head += [k.encode(), b": ", v.encode("latin-1"), b"\r\n"]
        head.append(b"\r\n")
        data = b"".join(head) + content
        epoch = self.aborts
        while True:
            reused = bool(self._idle)
            conn = self._idle.pop() if reused else await self._connect()
            if reused and not conn.usable():
                conn.close()
                continue
            if self.aborts != epoch:
                conn.close()
                raise EngineLost("the engine was declared dead")
            self._busy.add(conn)
            try:
                return await self._exchange(conn, data)
            except NothingReceived as e:
                self._busy.discard(conn)
                conn.close()
                if self.aborts != epoch:
                    raise EngineLost("connection dropped: the engine was declared dead") from e
                if reused:
                    continue  # a stale kept-alive connection: send again on a fresh one
                raise
            except BaseException:
                self._busy.discard(conn)
                conn.close()
                raise

    async def _exchange(self, conn: _Conn, data: bytes) -> RawResponse:
        try:
            conn.writer.write(data)
        except (ConnectionError, RuntimeError) as e:
            raise NothingReceived(str(e)) from e
        r = conn.reader
        try:
            async with asyncio.timeout(self.read_timeout_s):
                raw = await r.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                raise NothingReceived("connection closed before the response") from e
            raise BrokenResponse("connection closed inside the response headers") from e
        except ConnectionError as e:
            raise NothingReceived(f"{type(e).__name__}: {e}") from e
        except asyncio.LimitOverrunError as e:
            raise BrokenResponse("response headers too large") from e
        lines = raw[:-4].split(b"\r\n")
        try:
            status = int(lines[0].split(b" ", 2)[1])
        except (IndexError, ValueError) as e:
            raise BrokenResponse(f"bad status line {lines[0][:80]!r}") from e
        length: int | None = None
        chunked = False
        keep = True
        ctype = "application/json"
        hdrs: dict[str, str] = {}
        for line in lines[1:]:
            k, _, v = line.partition(b":")
            k = k.strip().lower()
            v = v.strip()
            hdrs[k.decode("latin-1")] = v.decode("latin-1")
            if k == b"content-length":
                length = int(v)
            elif k == b"transfer-encoding":
                chunked = b"chunked" in v.lower()
            elif k == b"connection":
                keep = v.lower() != b"close"
            elif k == b"content-type":
                ctype = v.decode("latin-1")
        if chunked:
            length = None
        return RawResponse(self, conn, status, ctype, length, chunked, keep, hdrs)
