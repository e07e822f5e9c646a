"""Headless Chromium for the report tests: find it (``TURNSTILE_CHROMIUM``, else on ``PATH``;
``bash scripts/install_chromium.sh`` installs it), dump a page's DOM after the browser parsed
it, and take a screenshot."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["NOT_FOUND", "browser_or_skip", "chromium", "dump_dom", "screenshot"]

NOT_FOUND = ("headless Chromium not found: report.html was NOT rendered in a browser "
             "(bash scripts/install_chromium.sh, or set TURNSTILE_CHROMIUM)")


def chromium() -> str | None:
    env = os.environ.get("TURNSTILE_CHROMIUM")
    if env and Path(env).is_file():
        return env
    for name in ("chromium", "chromium-browser", "google-chrome", "headless_shell"):
        found = shutil.which(name)
        if found:
            return found
    return None


def browser_or_skip() -> str:
    """Chromium's path for a test; where it is absent, a skip with a warning (a failure when
    ``CI`` is set: the report must have rendered in a browser there)."""
    import warnings

    import pytest

    browser = chromium()
    if browser is None:
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail(NOT_FOUND + " (CI is set, so this is an error, not a skip)")
        warnings.warn(NOT_FOUND, stacklevel=2)
        pytest.skip(NOT_FOUND)
    return browser


def _flags(profile: Path) -> list[str]:
    return ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", f"--user-data-dir={profile}"]


def dump_dom(browser: str, page: Path, profile: Path, timeout_s: float = 120) -> str:
    """The DOM Chromium built from ``page`` (a local file)."""
    return subprocess.run([browser, *_flags(profile), "--dump-dom", page.resolve().as_uri()],
                          capture_output=True, text=True, timeout=timeout_s,
                          check=True).stdout


def screenshot(browser: str, page: Path, shot: Path, profile: Path,
               size: tuple[int, int] = (1100, 1400), timeout_s: float = 120) -> Path:
    subprocess.run([browser, *_flags(profile), f"--window-size={size[0]},{size[1]}",
                    f"--screenshot={shot}", page.resolve().as_uri()],
                   capture_output=True, timeout=timeout_s, check=True)
    return shot
