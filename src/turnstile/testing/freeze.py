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
from collections.abc import Callable, Iterator

__all__ = ["freezing", "frozen"]


def frozen(pid: int) -> Callable[[], None]:
    """Stop the process ``pid``; return what continues it (nothing where it is gone)."""
    os.kill(pid, signal.SIGSTOP)

    def go_on() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
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
