"""Range-checked number flags shared by every command: NaN, infinities and values outside the
range are a usage error (one line naming the flag, exit code 2) before any work starts.

A float option takes ``typer.Option(parser=number(gt=0))``; integers use typer's own
``min=``/``max=`` (``int()`` already refuses ``nan`` and ``inf``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import typer

__all__ = ["FRACTION", "NON_NEGATIVE", "POSITIVE", "check_finite", "number", "out_path"]


def _bounds(gt: float | None, ge: float | None, le: float | None) -> str:
    parts = [f"> {gt:g}" if gt is not None else "", f">= {ge:g}" if ge is not None else "",
             f"<= {le:g}" if le is not None else ""]
    return " and ".join(p for p in parts if p)


def check_finite(value: float, *, gt: float | None = None, ge: float | None = None,
                 le: float | None = None) -> str | None:
    """Why ``value`` is out of range (``None`` when it is in range): not finite, or not
    ``> gt``, ``>= ge``, ``<= le``."""
    want = _bounds(gt, ge, le)
    if not math.isfinite(value):
        return "expected a finite number" + (f" {want}" if want else "")
    if ((gt is not None and not value > gt) or (ge is not None and not value >= ge)
            or (le is not None and not value <= le)):
        return f"expected a number {want}"
    return None


def number(*, gt: float | None = None, ge: float | None = None,
           le: float | None = None) -> Callable[[str], float]:
    """A typer ``parser`` for a float flag: a finite number within the bounds."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise typer.BadParameter(f"{text!r} is not a number") from None
        why = check_finite(value, gt=gt, ge=ge, le=le)
        if why:
            raise typer.BadParameter(f"{text}: {why}")
        return value

    parse.__name__ = "float"
    return parse


POSITIVE = number(gt=0)  #: rates, divisors, timeouts
NON_NEGATIVE = number(ge=0)  #: scales that may switch a term off (0)
FRACTION = number(gt=0, le=1)  #: a share of a whole


def out_path(text: str | Path) -> Path:
    """A typer ``parser`` for an output path: an empty one (``--out ""``) is a mistake, not
    the current folder."""
    if isinstance(text, Path):  # the option's default
        return text
    if not text.strip():
        raise typer.BadParameter("empty: give a file or folder name")
    return Path(text)
