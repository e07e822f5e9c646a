"""A throw-away ``redis-server`` on a free loopback port (tests and benchmarks).

The binary comes from ``TURNSTILE_REDIS_SERVER`` or PATH (``scripts/install_redis.sh``, run by
``make test``, installs Debian's package when missing). Nothing is persisted: no RDB
snapshots, no append-only file, a temporary working directory.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from turnstile.engines.llama_server import free_port

__all__ = ["RedisServer", "find_redis_server"]


def find_redis_server() -> str | None:
    env = os.environ.get("TURNSTILE_REDIS_SERVER")
    if env and os.access(env, os.X_OK):
        return env
    return shutil.which("redis-server")


class RedisServer:
    """``with RedisServer() as r: r.url`` — a redis-server process until exit."""

    def __init__(self, binary: str | None = None, port: int | None = None) -> None:
        found = binary or find_redis_server()
        if found is None:
            raise FileNotFoundError("redis-server not found: run scripts/install_redis.sh "
                                    "(make redis) or set TURNSTILE_REDIS_SERVER")
        self.binary = found
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        self._dir = tempfile.TemporaryDirectory(prefix="turnstile-redis-")
        log = Path(self._dir.name) / "redis.log"
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self._dir.name, "--logfile", str(log),
             "--protected-mode", "yes"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {log.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
