"""The transport for blocking callers that time-stamp every streamed line themselves (the
calibration client, one thread per simulated session): standard library only, the same retry
rule as :mod:`.client`. Also the one blocking ``GET`` (:func:`request`; :func:`get` for the
body of a success) and the one "wait until a started server answers" loop (:func:`wait_ready`)
for whatever starts an engine, a gateway, a picker or Envoy as a process.
"""

from __future__ import annotations

import http.client
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any, Literal

from turnstile.transport.retry import RetryRule, retry_sync

__all__ = ["get", "nothing_received", "open_post", "post_json", "request", "wait_ready"]


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


#: what :func:`request` raises when no answer came (nothing listening, a timeout, a connection
#: cut or a malformed response)
NO_ANSWER = (OSError, http.client.HTTPException)


def request(url: str, *, timeout: float) -> tuple[int, bytes]:
    """``GET url``: the status and body of the answer, whatever the status. No answer raises
    one of :data:`NO_ANSWER` (``urllib.error.URLError`` where nothing listens)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as e:  # an answer, with an error status
        with e:
            return int(e.code), bytes(e.read())


def get(url: str, *, timeout: float) -> bytes | None:
    """The body of ``GET url``; None when it fails (no answer, an error status)."""
    try:
        status, body = request(url, timeout=timeout)
    except NO_ANSWER:
        return None
    return body if 200 <= status < 300 else None


def post_json(url: str, body: bytes = b"{}", *, timeout: float) -> int:
    """POST a JSON ``body`` to ``url`` and read the reply; its status. An error status raises
    ``urllib.error.HTTPError``, no answer ``OSError``."""
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        resp.read()
        return int(resp.status)


def wait_ready(url: str, *, timeout_s: float, process: subprocess.Popen[Any] | None = None,
               poll_s: float = 0.05, request_timeout_s: float = 1.0
               ) -> Literal["ready", "exited", "timeout"]:
    """Poll ``GET url`` until it answers 200 (``"ready"``), ``process`` (the server just
    started) exits (``"exited"``), or ``timeout_s`` passes (``"timeout"``). No answer yet, or
    another status (503 while a model loads), is polled again after ``poll_s``. The caller
    words the error: it knows the process and its log."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None and process.poll() is not None:
            return "exited"
        try:
            if request(url, timeout=request_timeout_s)[0] == 200:
                return "ready"
        except NO_ANSWER:
            pass  # not listening yet, a connection cut
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(poll_s)
