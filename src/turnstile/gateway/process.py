"""The gateway as a separate process: its TOML config written from values, and
``python -m turnstile.gateway serve --config`` started, waited for, stopped or killed.

The one way the tools that drive a real gateway do it: the real-engine A/B
(:mod:`turnstile.calibrate.ab_real`), the live rollout (:mod:`turnstile.rollout.live`) and
the replica tests and benchmarks (:mod:`turnstile.testing.replicas`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from turnstile.engines.process import cpu_seconds, free_port
from turnstile.transport.blocking import wait_ready

__all__ = ["GatewayProcess", "config_toml", "toml_value"]


def toml_value(v: Any) -> str:
    """``v`` as a TOML value: a boolean, a number, an array of these, or a string."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def config_toml(gateway: Mapping[str, Any], engines: Sequence[Mapping[str, Any]], *,
                policy_params: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """A gateway config (docs/gateway.md): the ``[gateway]`` keys, constructor arguments per
    policy kind (``[policy.<kind>]``), and one ``[[engines]]`` table per engine."""
    lines = ["[gateway]", *(f"{k} = {toml_value(v)}" for k, v in gateway.items()), ""]
    for kind, params in (policy_params or {}).items():
        lines += [f"[policy.{kind}]", *(f"{k} = {toml_value(v)}" for k, v in params.items()),
                  ""]
    for engine in engines:
        lines += ["[[engines]]", *(f"{k} = {toml_value(v)}" for k, v in engine.items()), ""]
    return "\n".join(lines)


class GatewayProcess:
    """``turnstile serve --config config`` on ``port`` (its own free port when not given; the
    flag wins over the file's), with ``args`` added. ``start()`` returns once ``/health``
    answers 200; its output goes to ``log`` (a temporary file when not given, removed by
    :meth:`close`)."""

    def __init__(self, config: Path, *, port: int | None = None, args: Sequence[str] = (),
                 log: Path | None = None, name: str = "gateway") -> None:
        self.config = config
        self.port = port or free_port()
        self.args = list(args)
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self._temp_log = log is None
        if log is None:
            fd, tmp = tempfile.mkstemp(prefix=f"turnstile-{name}-", suffix=".log")
            os.close(fd)
            log = Path(tmp)
        self.log = log

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> Self:
        """Start it and wait for ``/health``; ``RuntimeError`` (with the log's tail) when it
        exits first, ``TimeoutError`` (after stopping it) when it does not answer in time."""
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "turnstile.gateway", "serve", "--config",
                 str(self.config), "--port", str(self.port), *self.args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        got = wait_ready(self.url + "/health", timeout_s=timeout_s, process=self.proc)
        if got == "exited":
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode} "
                               f"(log: {self.log}):\n{self.tail()}")
        if got == "timeout":
            self.stop()
            raise TimeoutError(f"{self.name} did not answer /health within {timeout_s:g} s "
                               f"(log: {self.log}):\n{self.tail()}")
        return self

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def cpu_s(self) -> float:
        """CPU seconds the process has used (Linux ``/proc``)."""
        assert self.proc is not None
        return cpu_seconds(self.proc.pid)

    def kill(self) -> None:
        """SIGKILL: no clean-up (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGINT (a clean shutdown), SIGKILL after ``timeout_s``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def close(self) -> None:
        """Stop it; remove the log when it is a temporary file."""
        self.stop()
        if self._temp_log:
            self.log.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
