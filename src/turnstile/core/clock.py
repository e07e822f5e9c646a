"""The one clock seam. The core never reads time; drivers own a Clock and stamp events."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class VirtualClock:
    """Simulated time, advanced by the event loop."""

    __slots__ = ("t",)

    def __init__(self, start_s: float = 0.0) -> None:
        self.t = start_s

    def now(self) -> float:
        return self.t


class WallClock:
    """Monotonic wall time in seconds since the clock was created (gateway, replay)."""

    __slots__ = ("_origin",)

    def __init__(self) -> None:
        self._origin = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self._origin
