"""The blocking transport's one wait-until-ready loop and its one-shot calls, against small
loopback servers."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.error
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from turnstile.engines.process import free_port
from turnstile.transport.blocking import NO_ANSWER, get, post_json, request, wait_ready


class _Server:
    """A loopback server answering GET with the statuses in ``statuses`` (the last one
    repeated) and recording POSTs."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = statuses
        self.gets = 0
        self.posts: list[tuple[str, bytes]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status = outer.statuses[min(outer.gets, len(outer.statuses) - 1)]
                outer.gets += 1
                self.send_response(status)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def do_POST(self) -> None:
                n = int(self.headers.get("content-length", 0))
                outer.posts.append((self.path, self.rfile.read(n)))
                self.send_response(404 if self.path == "/missing" else 200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def loading() -> Iterator[_Server]:
    s = _Server([503, 503, 200])  # a model loading, then ready
    yield s
    s.close()


def test_wait_ready_polls_past_error_statuses(loading: _Server) -> None:
    assert wait_ready(loading.url + "/health", timeout_s=5.0, poll_s=0.01) == "ready"
    assert loading.gets == 3


def test_wait_ready_times_out_on_a_server_that_never_gets_ready() -> None:
    s = _Server([503])
    try:
        t0 = time.monotonic()
        assert wait_ready(s.url + "/health", timeout_s=0.3, poll_s=0.02) == "timeout"
        assert 0.3 <= time.monotonic() - t0 < 3.0 and s.gets >= 2
    finally:
        s.close()


def test_wait_ready_sees_the_process_exit_and_waits_for_a_late_listener() -> None:
    port = free_port()
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert wait_ready(f"http://127.0.0.1:{port}/", timeout_s=10.0, process=dead) == "exited"
    assert dead.returncode == 3
    late = subprocess.Popen(  # listens after 0.3 s: refused connections are polled again
        [sys.executable, "-c", "import time, http.server as h; time.sleep(0.3); "
         f"h.HTTPServer(('127.0.0.1', {port}), h.SimpleHTTPRequestHandler).serve_forever()"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
    try:
        assert wait_ready(f"http://127.0.0.1:{port}/", timeout_s=20.0, process=late,
                          poll_s=0.02) == "ready"
    finally:
        late.kill()
        late.wait()


def test_one_shot_get_and_post(loading: _Server) -> None:
    assert get(loading.url + "/x", timeout=2.0) is None  # 503: no body handed back
    assert post_json(loading.url + "/reset", timeout=2.0) == 200
    assert post_json(loading.url + "/slots/0?action=erase", b'{"a": 1}', timeout=2.0) == 200
    assert loading.posts == [("/reset", b"{}"), ("/slots/0?action=erase", b'{"a": 1}')]
    with pytest.raises(urllib.error.HTTPError):
        post_json(loading.url + "/missing", timeout=2.0)
    assert get(f"http://127.0.0.1:{free_port()}/", timeout=1.0) is None  # nothing listening


def test_request_gives_any_status_and_raises_without_an_answer(loading: _Server) -> None:
    """The one blocking GET that ``get`` and ``wait_ready`` share: an error status is an
    answer (``replay --target`` checks only that the target answers); no answer raises."""
    assert request(loading.url + "/x", timeout=2.0) == (503, b"ok")
    assert request(loading.url + "/x", timeout=2.0) == (503, b"ok")
    assert request(loading.url + "/x", timeout=2.0) == (200, b"ok")
    assert get(loading.url + "/x", timeout=2.0) == b"ok"
    with pytest.raises(NO_ANSWER):
        request(f"http://127.0.0.1:{free_port()}/", timeout=1.0)
