"""The transport for blocking callers that time-stamp every streamed line themselves (the
calibration client, one thread per simulated session): standard library only, the same retry
rule as :mod:`.client`.
"""

from __future__ import annotations

import http.client
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping

from turnstile.transport.retry import RetryRule, retry_sync

__all__ = ["get", "nothing_received", "open_post"]


def nothing_received(exc: BaseException) -> bool:
    """True when the server sent no response byte (safe to send the request again)."""
    return isinstance(exc, ConnectionRefusedError | http.client.RemoteDisconnected)


def open_post(url: str, body: bytes, headers: Mapping[str, str], *, timeout: float,
              retry: RetryRule | None = None
              ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """POST ``body`` to ``url``; returns the connection and the response once its status and
    headers are in (the caller reads the body, line by line if it likes, and closes the
    connection). Sent again under the retry rule while nothing came back; the errors are
    ``OSError`` and ``http.client.HTTPException``."""
    parts = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    target = parts.path + (f"?{parts.query}" if parts.query else "")

    def send() -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = cls(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
        try:
            conn.request("POST", target, body=body, headers=dict(headers))
            return conn, conn.getresponse()
        except BaseException:
            conn.close()
            raise

    return retry_sync(send, retry if retry is not None else RetryRule(), nothing_received)


def get(url: str, *, timeout: float) -> bytes | None:
    """The body of ``GET url``; None when it fails (no answer, an error status)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return bytes(resp.read())
    except (urllib.error.URLError, OSError):
        return None
