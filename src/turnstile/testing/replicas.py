"""Gateway replicas as separate processes (``python -m turnstile.gateway serve``), so a test or
a benchmark can kill one the hard way (SIGKILL) and restart it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from turnstile.engines.llama_server import free_port

__all__ = ["GatewayProcess", "write_config"]


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_config(path: Path, engines: list[tuple[str, str]], policy: str,
                 **gateway: Any) -> Path:
    """A gateway TOML file: ``engines`` as (url, kind), ``gateway``: [gateway] keys."""
    lines = ["[gateway]", *(f"{k} = {_toml(v)}" for k, v in gateway.items()),
             "[policy]", f"spec = {_toml(policy)}"]
    for url, kind in engines:
        lines += ["[[engines]]", f"url = {_toml(url)}", f"kind = {_toml(kind)}"]
    path.write_text("\n".join(lines) + "\n")
    return path


class GatewayProcess:
    """One replica: ``start()`` waits for ``/health``; ``kill()`` is SIGKILL (no clean-up)."""

    def __init__(self, config: Path, *, replica_id: str, port: int | None = None,
                 log_level: str = "warning") -> None:
        self.config = config
        self.replica_id = replica_id
        self.port = port or free_port()
        self.log_level = log_level
        self.proc: subprocess.Popen[bytes] | None = None
        fd, self.log = tempfile.mkstemp(prefix=f"turnstile-{replica_id}-", suffix=".log")
        os.close(fd)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> GatewayProcess:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "turnstile.gateway", "serve", "--config",
                 str(self.config), "--port", str(self.port), "--replica-id", self.replica_id,
                 "--log-level", self.log_level],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.replica_id} exited:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {self.replica_id} not healthy:\n{self.tail()}")
            time.sleep(0.05)

    def tail(self, n: int = 3000) -> str:
        return Path(self.log).read_text(errors="replace")[-n:]

    def cpu_s(self) -> float:
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def close(self) -> None:
        self.stop()
        if os.path.exists(self.log):
            os.unlink(self.log)
