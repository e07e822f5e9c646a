"""Host steadiness: is the machine quiet enough to judge a simulator against it?

A fidelity run compares the simulator with a real replay. Where the host's speed moves under
the engine (a shared VM's neighbours, frequency changes), the same work takes another time from
one minute to the next, and no model predicts closer than that. So the run checks its host:

* :func:`measure_steadiness` times the same work several times on an engine: a fresh prompt of
  the same length each time, computed from scratch (llama.cpp's own ``timings.prompt_ms``);
* :func:`steadiness_verdict` reads a run's checks: the host was quiet when each check's spread
  (coefficient of variation) stays under ``cv_max`` and the checks' medians stay within
  ``drift_max`` of each other.

On this project's 2-core VM a quiet host shows 3-4% CV (a 420-token prefill in 720-770 ms on the
fidelity model); during the quiet-host runs P-S, the sessions' first turns, the same work
within a few tokens, took 1.5x longer at worst than at best (15% CV).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from turnstile.calibrate.client import discover
from turnstile.calibrate.probes import EngineProber

__all__ = ["Steadiness", "measure_steadiness", "steadiness_verdict"]


@dataclass(frozen=True)
class Steadiness:
    """One check: the same ``prompt_tokens``-token prefill timed ``len(times_s)`` times."""

    label: str
    prompt_tokens: int
    times_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.times_s or min(self.times_s) <= 0:
            raise ValueError(f"a check needs positive times, got {self.times_s}")

    @property
    def median_s(self) -> float:
        return float(np.median(self.times_s))

    @property
    def cv(self) -> float:
        """Standard deviation over mean (0 for a single time)."""
        a = np.asarray(self.times_s, dtype=float)
        return float(a.std() / a.mean())

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "prompt_tokens": self.prompt_tokens,
                "times_s": [round(t, 5) for t in self.times_s],
                "median_s": self.median_s, "cv": self.cv}


def measure_steadiness(
    url: str,
    label: str,
    *,
    prompt_tokens: int = 400,
    repeats: int = 8,
    seed: int = 0,
    token_range: tuple[int, int] = (33, 127),
    timeout: float = 120.0,
) -> Steadiness:
    """Time ``repeats`` fresh ``prompt_tokens``-token prompts on the engine at ``url``, one at a
    time. ``seed`` draws the prompts: a check must not repeat another's (or a profile's), or the
    engine's prompt cache serves it."""
    if repeats < 1 or prompt_tokens < 1:
        raise ValueError(f"need repeats >= 1 and prompt_tokens >= 1, got {repeats}, "
                         f"{prompt_tokens}")
    prober = EngineProber(discover(url), prompt_tokens, seed, token_range, timeout)
    return Steadiness(label, prompt_tokens,
                      tuple(prober.prompt_time(prompt_tokens) for _ in range(repeats)))


def steadiness_verdict(checks: Sequence[Steadiness], *, cv_max: float = 0.05,
                       drift_max: float = 0.10) -> tuple[bool, str]:
    """Whether ``checks`` show a quiet host, and a line saying so with the figures."""
    if not checks:
        raise ValueError("no steadiness checks")
    worst = max(c.cv for c in checks)
    medians = [c.median_s for c in checks]
    drift = max(medians) / min(medians) - 1.0
    quiet = worst <= cv_max and drift <= drift_max
    each = "; ".join(f"{c.label} {1e3 * c.median_s:.0f} ms ±{100 * c.cv:.1f}%" for c in checks)
    line = (f"Host steadiness (the same {checks[0].prompt_tokens}-token prefill, "
            f"{len(checks[0].times_s)}x per check, median ± CV): {each}; checks "
            f"{100 * drift:.1f}% apart. ")
    if quiet:
        line += (f"A quiet host (each CV ≤ {100 * cv_max:.0f}%, checks within "
                 f"{100 * drift_max:.0f}%).")
    else:
        line += (f"**Not a quiet host** (CV ≤ {100 * cv_max:.0f}% and checks within "
                 f"{100 * drift_max:.0f}% wanted): the same work took different times, so the "
                 "real runs differ from each other too; expect a noise floor above the goal.")
    return quiet, line
