"""Freeze a process (SIGSTOP) so that a test's scenario holds at any host speed.

A test that needs a turn still running, or an engine still busy, at some moment cannot get it
from a token count or a sleep: on a host 4x faster, 1,900 tokens were over before the kill (a CI
run). A stopped process makes no step and sends no byte; the kernel still completes connections
to its listening sockets and takes the bytes sent to them, so to a client it is an engine that
has the request and is slow to answer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterator

__all__ = ["Throttle", "freezing", "frozen", "frozen_group"]


def frozen(pid: int) -> Callable[[], None]:
    """Stop the process ``pid``; return what continues it (nothing where it is gone)."""
    os.kill(pid, signal.SIGSTOP)

    def go_on() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    return go_on


def frozen_group(pid: int) -> Callable[[], None]:
    """Stop every process in the process group of ``pid`` (a server and the processes it
    started, where it leads a session of its own); return what continues them."""
    pgid = os.getpgid(pid)
    os.killpg(pgid, signal.SIGSTOP)

    def go_on() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGCONT)
    return go_on


@contextlib.contextmanager
def freezing(*pids: int) -> Iterator[None]:
    """The processes ``pids`` stopped within the block, continued as it ends, however."""
    go_on: list[Callable[[], None]] = []
    try:
        for pid in pids:
            go_on.append(frozen(pid))
        yield
    finally:
        for g in go_on:
            g()


class Throttle:
    """Let the process ``pid`` run ``run_s`` of every ``every_s`` (10% by default), so that a
    scenario's set-up takes as long on a fast host as on a slow one, and is then frozen.

    The stops and continues are sent by a shell loop of its own: this process, busy with its
    gateway's threads, may wait for its GIL far longer than ``run_s`` (a stop sent 2 s late let
    an engine run 1,500 steps)."""

    def __init__(self, pid: int, run_s: float = 0.02, every_s: float = 0.2) -> None:
        self.pid = pid
        self._loop: subprocess.Popen[bytes] | None = subprocess.Popen(
            ["sh", "-c", f"while kill -CONT {pid} 2>/dev/null; do sleep {run_s}; "
                         f"kill -STOP {pid}; sleep {every_s - run_s:.3f}; done"],
            start_new_session=True)

    def _end_loop(self) -> None:
        if self._loop is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._loop.pid, signal.SIGKILL)  # the shell and its sleep
            self._loop.wait()
            self._loop = None

    def freeze(self) -> Callable[[], None]:
        """End the throttle with the process stopped; return what continues it."""
        self._end_loop()
        with contextlib.suppress(ProcessLookupError):
            return frozen(self.pid)
        return lambda: None

    def close(self) -> None:
        """End the throttle with the process running."""
        self._end_loop()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)
