"""A loopback HTTP/1.1 proxy in front of one engine that injects faults and counts generations.

Used by ``benchmarks/chaos.py``: every byte between the gateway and an engine goes through it.

* **Counting**: each completion request forwarded (``POST .../completions``) is logged with its
  ``x-request-id`` (the gateway forwards the client's) and whether its response was complete
  (a streamed ``data: [DONE]``, the last chunk of a chunked body, or ``Content-Length`` bytes)
  or cut. A turn generated to the end twice is a duplicate; a cut one re-run is a partial.
* **Faults** (set on the object, from any thread): ``fail_status`` answers completion requests
  itself with that status (the engine "returns 5xx"); ``delay_s`` sleeps before forwarding each
  piece of a response (a slow engine); ``stall_until`` holds every response byte until that
  ``time.monotonic()`` (a stalled one). When the engine is gone the client connection is reset,
  as a dead port would.

Requests on a kept-alive connection are handled one at a time, which is how the gateway's
client uses them (no pipelining).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FaultProxy", "Generation", "ProxyProcess"]

_LIVE: set[asyncio.Task[Any] | None] = set()


@dataclass
class Generation:
    request_id: str
    started_s: float
    complete: bool = False
    status: int = 0
    ended_s: float = -1.0


@dataclass
class FaultProxy:
    upstream_host: str
    upstream_port: int
    fail_status: int = 0
    delay_s: float = 0.0
    stall_until: float = 0.0
    generations: list[Generation] = field(default_factory=list)
    port: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _server: asyncio.AbstractServer | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> FaultProxy:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._server = loop.run_until_complete(
                asyncio.start_server(self._serve, "127.0.0.1", self.port or 0, limit=1 << 20))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, daemon=True, name="fault-proxy")
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return

        async def close() -> None:
            assert self._server is not None
            self._server.close()
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()

        asyncio.run_coroutine_threadsafe(close(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5)
        self._loop = None

    # ------------------------------------------------------------------ serving
    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        up: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        me = asyncio.current_task()
        _LIVE.add(me)  # a strong reference while it waits on a peer that may vanish
        try:
            while True:
                try:
                    head = await cr.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = _header_int(head, b"content-length")
                body = await cr.readexactly(length) if length > 0 else b""
                completion = head.startswith(b"POST ") and b"completions" in head.split(b" ", 2)[1]
                gen = None
                if completion:
                    gen = Generation(_header(head, b"x-request-id"), time.monotonic())
                    if self.fail_status:
                        await _answer(cw, self.fail_status)
                        continue
                for fresh in (up is None, True):  # a kept-alive upstream may have closed
                    if up is None:
                        try:
                            up = await asyncio.open_connection(
                                self.upstream_host, self.upstream_port, limit=1 << 20)
                        except OSError:
                            _reset(cw)
                            return
                    up[1].write(head + body)
                    ok = await self._relay(up[0], cw, gen)
                    if ok is not None or fresh:
                        break
                    up[1].close()
                    up = None
                if not ok:
                    _reset(cw)
                    return
                if ok == "close":
                    up[1].close()
                    up = None
        except (ConnectionError, asyncio.IncompleteReadError):
            _reset(cw)
        finally:
            _LIVE.discard(me)
            if up is not None:
                up[1].close()
            cw.close()

    async def _pace(self) -> None:
        wait = self.stall_until - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        if self.delay_s > 0:
            await asyncio.sleep(self.delay_s)

    async def _relay(self, ur: asyncio.StreamReader, cw: asyncio.StreamWriter,
                     gen: Generation | None) -> bool | str | None:
        """One response, upstream to client: True (or "close" when the upstream closes the
        connection after it), False when upstream broke after its head, None when it sent
        nothing at all (not logged as a generation)."""
        try:
            head = await ur.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            return False if e.partial else None
        except ConnectionError:
            return None
        status = int(head.split(b" ", 2)[1])
        if gen is not None:
            gen.status = status
            self.generations.append(gen)
        await self._pace()
        cw.write(head)
        length = _header_int(head, b"content-length")
        chunked = "chunked" in _header(head, b"transfer-encoding").lower()
        sse = "event-stream" in _header(head, b"content-type")
        tail = b""
        left = length
        while True:
            if not chunked and length >= 0 and left <= 0:
                break
            data = await ur.read(65536 if chunked or length < 0 else min(left, 65536))
            if not data:
                if not chunked and length < 0:  # a body framed by close: complete
                    if gen is not None:
                        gen.complete, gen.ended_s = status == 200, time.monotonic()
                    return "close"
                return False
            await self._pace()
            cw.write(data)
            await cw.drain()
            left -= len(data)
            tail = (tail + data)[-64:]
            if gen is not None and sse and b"data: [DONE]" in tail:
                gen.complete = status == 200
            if chunked and tail.endswith(b"0\r\n\r\n"):
                break
        if gen is not None and not sse:
            gen.complete = status == 200  # the whole body went through
        if gen is not None and gen.complete:
            gen.ended_s = time.monotonic()
        await cw.drain()
        return "close" if _header(head, b"connection").lower() == "close" else True


def _header(head: bytes, name: bytes) -> str:
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == name:
            return v.strip().decode("latin-1")
    return ""


def _header_int(head: bytes, name: bytes) -> int:
    v = _header(head, name)
    return int(v) if v.isdigit() else -1


async def _answer(cw: asyncio.StreamWriter, status: int) -> None:
    body = b'{"error":{"message":"injected failure","type":"server_error"}}'
    cw.write(f"HTTP/1.1 {status} Injected\r\nContent-Type: application/json\r\n"
             f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await cw.drain()


def _reset(cw: asyncio.StreamWriter) -> None:
    """Close with RST (what a client sees from a dead process's port)."""
    sock = cw.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    cw.close()


class ProxyProcess:
    """A :class:`FaultProxy` in a process of its own (a load generator in the parent process
    cannot starve it, nor the engine health checks that go through it). ``set(...)`` changes
    its fault attributes; ``generations()`` fetches its log."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._lock = threading.Lock()
        self.proc = ctx.Process(target=_proxy_child, args=(child, upstream_host, upstream_port),
                                daemon=True, name="fault-proxy")
        self.proc.start()
        self.port: int = self._conn.recv()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _ask(self, *msg: object) -> object:
        with self._lock:
            self._conn.send(msg)
            return self._conn.recv()

    def set(self, **faults: float) -> None:
        self._ask("set", faults)

    def generations(self) -> list[Generation]:
        return self._ask("generations")  # type: ignore[return-value]

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError, EOFError):
                self._ask("stop")
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()


def _proxy_child(conn: Any, host: str, port: int) -> None:
    proxy = FaultProxy(host, port).start()
    conn.send(proxy.port)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg[0] == "set":
            for k, v in msg[1].items():
                setattr(proxy, k, v)
            conn.send(None)
        elif msg[0] == "generations":
            conn.send(list(proxy.generations))
        else:
            conn.send(None)
            break
    proxy.stop()
