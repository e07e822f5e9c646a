"""The life of an engine server run as a subprocess: start on a free loopback port, wait until
``GET /health`` answers 200, capture its output in a log file, stop or kill it.

:class:`ServerProcess` is the part llama.cpp's ``llama-server`` and vLLM's OpenAI server share;
each engine's module gives the command line, the environment, the checks before start and how
its processes end (:mod:`turnstile.engines.llama_server`, :mod:`turnstile.engines.vllm_server`).
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Self

from turnstile.transport.blocking import wait_ready

__all__ = ["ServerProcess", "cpu_seconds", "free_port", "stop_process"]


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host`` (free when asked; another process could take it after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """End ``proc`` where it still runs: SIGTERM, then SIGKILL after ``timeout_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ServerProcess:
    """An engine's HTTP server on 127.0.0.1, a context manager: ``start`` (``__enter__``)
    returns once ``GET /health`` answers 200; ``stop`` (``__exit__``) ends it.

    Where no port is given, a free one is picked, and picked again (``_PORT_ATTEMPTS`` tries in
    all) when the server's log says another process took it meanwhile. Process output goes to
    a log file (``log_path``; a temporary one, removed on stop, where none is given); its tail
    is in start-up errors.

    A subclass sets the class attributes and gives :meth:`command`; it may override
    :meth:`environment`, :meth:`_prepare`, :meth:`_end` and :meth:`_abort`.
    """

    HOST = "127.0.0.1"
    _PORT_ATTEMPTS = 3
    #: the error this engine's failures raise
    _error: ClassVar[type[Exception]] = RuntimeError
    #: the engine's name in error messages
    _name: ClassVar[str] = "server"
    #: prefix of the temporary log file
    _log_prefix: ClassVar[str] = "server-"
    #: seconds between health checks during start-up
    _poll_s: ClassVar[float] = 0.05
    #: default ``timeout_s`` of :meth:`stop`
    _stop_timeout_s: ClassVar[float] = 10.0
    #: start the server as the leader of a process group (session) of its own
    _new_session: ClassVar[bool] = False
    #: log text (lower case) that means the port was taken
    _conflict_markers: ClassVar[tuple[str, ...]] = ("address already in use",)

    def __init__(
        self,
        port: int | None,
        *,
        alias: str,
        startup_timeout_s: float,
        log_path: str | os.PathLike[str] | None,
    ) -> None:
        self.requested_port = port
        self.alias = alias
        self.startup_timeout_s = startup_timeout_s
        self._log_path = Path(log_path) if log_path is not None else None
        self._owns_log = log_path is None
        self.port: int | None = None
        self.process: subprocess.Popen[bytes] | None = None

    # -- what an engine gives -----------------------------------------------------------------

    def command(self, port: int) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str] | None:
        """The server's environment; ``None``: this process's."""
        return None

    def _prepare(self) -> None:
        """Checks (and set-up) before the first launch; raise ``_error`` to refuse."""

    def _end(self, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
        """End a running server: SIGTERM, then SIGKILL after ``timeout_s``."""
        stop_process(proc, timeout_s)

    def _abort(self, proc: subprocess.Popen[bytes]) -> None:
        """End a server that failed to start (its log is kept for the error message)."""
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    # -- public -------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise self._error("server not started")
        return f"http://{self.HOST}:{self.port}"

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> Self:
        if self.process is not None:
            raise self._error("server already started")
        self._prepare()
        if self._log_path is None:
            fd, name = tempfile.mkstemp(prefix=self._log_prefix, suffix=".log")
            os.close(fd)
            self._log_path = Path(name)
        attempts = 1 if self.requested_port is not None else self._PORT_ATTEMPTS
        try:
            for attempt in range(attempts):
                port = self.requested_port if self.requested_port is not None else free_port()
                try:
                    self._launch(port)
                    return self
                except self._error:
                    # An automatically chosen port may have been taken meanwhile: retry.
                    if attempt + 1 == attempts or not self._port_conflict():
                        raise
        except BaseException:
            self.stop()  # the error message already carries the log tail
            raise
        raise AssertionError("unreachable")

    def stop(self, timeout_s: float | None = None) -> None:
        proc, self.process = self.process, None
        if proc is not None:
            self._end(proc, self._stop_timeout_s if timeout_s is None else timeout_s)
        if self._owns_log and self._log_path is not None:
            self._log_path.unlink(missing_ok=True)
            self._log_path = None

    def log_tail(self, max_lines: int = 40) -> str:
        if self._log_path is None or not self._log_path.exists():
            return ""
        text = self._log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-max_lines:])

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- internals ----------------------------------------------------------------------------

    def _launch(self, port: int) -> None:
        assert self._log_path is not None
        cmd = self.command(port)
        with self._log_path.open("wb") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=self.environment(),
                                    start_new_session=self._new_session)
        self.process = proc
        self.port = port
        try:
            self._wait_healthy(proc, cmd)
        except BaseException:
            self.process = None
            self._abort(proc)
            raise

    def _wait_healthy(self, proc: subprocess.Popen[bytes], cmd: Sequence[str]) -> None:
        url = f"{self.base_url}/health"
        got = wait_ready(url, timeout_s=self.startup_timeout_s, process=proc,
                         poll_s=self._poll_s, request_timeout_s=2.0)
        if got == "exited":
            raise self._error(
                f"{self._name} exited with code {proc.returncode} during start-up\n"
                f"command: {shlex.join(cmd)}\n--- log tail ---\n{self.log_tail()}")
        if got == "timeout":
            raise self._error(
                f"{self._name} not healthy after {self.startup_timeout_s:.0f} s at {url}\n"
                f"--- log tail ---\n{self.log_tail()}")

    def _port_conflict(self) -> bool:
        tail = self.log_tail(80).lower()
        return any(s in tail for s in self._conflict_markers)
