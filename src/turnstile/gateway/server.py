"""How uvicorn serves the gateway: its HTTP/1.1 protocol with a header-read timeout.

uvicorn (with h11) bounds a request's headers by size (``h11_max_incomplete_event_size``:
``max_header_bytes``) and closes a kept-alive connection idle after a response
(``timeout_keep_alive``), but never times out a request whose line and headers arrive slowly,
or a connection that sends nothing at all: each one holds a socket and a file descriptor for as
long as the client likes. :func:`header_timeout_protocol` gives uvicorn's h11 protocol that
bound: from the moment a connection opens (or a kept-alive one receives the first byte of its
next request) its request line and headers must be complete within ``client_header_timeout_s``,
else the gateway answers ``408`` (OpenAI's error shape, ``connection: close``) and closes it.

The body is bounded where the application reads it (``client_body_timeout_s``,
:mod:`.app`): a request whose declared body does not arrive in time gets the same 408.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from turnstile.gateway.config import GatewayConfig
from turnstile.gateway.protocol import error_body

__all__ = ["header_timeout_protocol", "request_timeout_response", "uvicorn_options"]


def request_timeout_response(what: str, timeout_s: float) -> bytes:
    """A whole ``408`` response (closing the connection) for ``what`` not received in time."""
    body = error_body(f"{what} not received within {timeout_s:g} s", "invalid_request_error",
                      "request_timeout")
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
            + body)


class _HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol; a request's line and headers must arrive within
    :attr:`header_timeout_s` of the connection opening or of its first byte."""

    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first byte of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()  # its headers are in (or the connection is over)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.transport.write(request_timeout_response("request headers", self.header_timeout_s))
        self.transport.close()


def header_timeout_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with a header-read timeout of ``header_timeout_s``."""
    if not header_timeout_s > 0:
        raise ValueError("the header timeout must be > 0")
    return type("HeaderTimeoutProtocol", (_HeaderTimeoutProtocol,),
                {"header_timeout_s": float(header_timeout_s)})


def uvicorn_options(cfg: GatewayConfig) -> dict[str, Any]:
    """The ``uvicorn.Config`` arguments that enforce ``cfg``'s limits on clients."""
    return {"http": header_timeout_protocol(cfg.client_header_timeout_s),
            "h11_max_incomplete_event_size": cfg.max_header_bytes}
