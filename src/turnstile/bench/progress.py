"""The consoles and the progress bar every long command shares.

A bar shows what runs, done / total, elapsed time and the time remaining (ETA); it draws on
stderr only when that is a terminal and ``--quiet`` was not given, so logs and pipes get the
results alone.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

__all__ = ["QUIET_HELP", "err_console", "out_console", "progress_bar"]

QUIET_HELP = "No progress bar (it is off anyway when stderr is not a terminal)"


def out_console() -> Console:
    """stdout; 160 columns wide when it is not a terminal (CI logs, pipes), so tables keep
    their headers."""
    return Console(width=None if Console().is_terminal else 160)


def err_console() -> Console:
    """stderr, for warnings and progress (soft-wrapped: one message stays one line)."""
    return Console(stderr=True, soft_wrap=True)


def progress_bar(console: Console | None = None, *, quiet: bool = False) -> Progress:
    """A transient bar with ETA on ``console`` (default stderr), disabled when ``quiet`` or
    when the console is not a terminal."""
    con = console or err_console()
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                    console=con, transient=True, disable=quiet or not con.is_terminal)
