"""``replay`` tells the truth: a run whose turns all failed exits 1 with the target's own
first error, verbatim; ``--target`` takes an OpenAI client's ``base_url`` (``.../v1``)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from turnstile.cli import main

REASON = "the request exceeds the available context size, try increasing it"


@pytest.fixture
def refusing_engine() -> Iterator[tuple[str, list[str]]]:
    """An OpenAI-shaped engine that answers the replay's one-token calibration requests and
    refuses every turn with HTTP 400 and an OpenAI error body; records the paths asked."""
    paths: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, doc: dict) -> None:
            body = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            paths.append(self.path)
            self._send(200, {"data": [{"id": "tiny"}]} if self.path == "/v1/models" else {})

        def do_POST(self) -> None:
            paths.append(self.path)
            req = json.loads(self.rfile.read(int(self.headers["content-length"])))
            if self.path != "/v1/chat/completions":
                self._send(404, {"error": {"message": "no such route"}})
            elif req.get("max_tokens") == 1:
                n = len(req["messages"][0]["content"]) // 4
                self._send(200, {"choices": [{"message": {"content": "x"}}],
                                 "usage": {"prompt_tokens": n, "completion_tokens": 1}})
            else:
                self._send(400, {"error": {"code": 400, "message": REASON,
                                           "type": "exceed_context_size_error"}})

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", paths
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.timeout(120)
def test_all_turns_failed_exits_1_with_the_engines_reason(
        refusing_engine: tuple[str, list[str]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    url, paths = refusing_engine
    with pytest.raises(SystemExit) as e:
        main(["replay", "--target", f"{url}/v1", "--workflows", "2", "--max-turns", "1",
              "--rate", "50", "-o", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert e.value.code == 1, (out, err)
    assert REASON in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: no turn was answered")
    # the /v1 base URL: every request went to /v1/..., none to /v1/v1/...
    assert "/v1/chat/completions" in paths and not any(p.startswith("/v1/v1") for p in paths)
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert REASON in doc["policies"][0]["replay"]["first_error"]
