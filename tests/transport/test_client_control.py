"""The async transport's control-plane GET: kept-alive by default, a new connection each time
for health checks (a server that stopped listening is found at once)."""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from turnstile.transport.client import HttpTransport


def test_health_gets_use_a_fresh_connection_each_time() -> None:
    connections: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive

        def setup(self) -> None:
            connections.append(1)
            super().setup()

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"

    async def run() -> tuple[int, int]:
        t = HttpTransport(url, headers={"authorization": "Bearer k"})
        try:
            for _ in range(3):
                assert (await t.get("/health")).status_code == 200
            kept = len(connections)
            for _ in range(3):
                assert (await t.get("/health", fresh_connection=True)).status_code == 200
            return kept, len(connections) - kept
        finally:
            await t.aclose()

    try:
        assert asyncio.run(run()) == (1, 3)
    finally:
        httpd.shutdown()
        httpd.server_close()
