"""A clone stands on its own: no tracked file names a development machine's absolute path, and
the product (src/, docs/, README.md, benchmarks/, scripts/) never points outside the checkout.

**Machine paths** (every tracked file, text or data). Forbidden:

* the development machines' workspace, ``/work/...`` (where checkouts and shared data live);
* home directories: ``/root/...``, ``/home/<user>/...``, ``/Users/<user>/...``;
* per-run temporary names, which no reader can recreate: ``/tmp/tmpXXXXXXXX``,
  ``/tmp/<prefix>-XXXXXXXX`` (``tempfile.mkdtemp``'s 8 random characters, at least one a digit),
  ``/tmp/pytest-of-<user>/``, a ``/tmp`` name ending in 12 or more hex digits.

A path counts only where it starts a path (not inside a URL or a longer path such as
``verl/workers/...``). Allowed: repository-relative paths, ``$TURNSTILE_TRACES/...``,
placeholders (``DIR``, ``PATH``), and plain scratch folders in example commands
(``--out /tmp/fid``), which any machine can recreate by running the command.

**Outside the checkout** (src/, docs/, README.md, benchmarks/, scripts/): no ``../shared``, no
``shared/traces``, no ``DESIGN.md`` (the design is docs/design.md). tests/ and the Makefile may
fall back to a sibling ``shared/traces`` (the development machines' copy); the product may not.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_START = r"(?<![\w.~$/-])"  # the path starts here: not inside a URL, a word or a longer path
MACHINE_PATH = re.compile(
    _START + r"(?:/work(?:/|\b)"
    r"|/root/"
    r"|/home/[A-Za-z_][\w.-]*/"
    r"|/Users/[A-Za-z_][\w.-]*/"
    r"|/tmp/tmp[\w]{6,}"
    r"|/tmp/[\w.-]*[-_](?=[a-z_]*[0-9])[a-z0-9_]{8}(?![\w-])"
    r"|/tmp/pytest-of-"
    r"|/tmp/[\w.-]*[0-9a-f]{12,}(?![\w]))")
OUTSIDE = re.compile(r"\.\./shared|(?<![\w.-])shared/traces|DESIGN\.md")
PRODUCT = ("src/", "docs/", "README.md", "benchmarks/", "scripts/")


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]


def _hits(pattern: re.Pattern[str], files: list[str]) -> list[str]:
    found = []
    for rel in files:
        text = (ROOT / rel).read_bytes().decode("utf-8", errors="replace")
        for m in pattern.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{rel}:{line}: {m.group(0)}")
    return found


def test_no_tracked_file_names_a_development_machine_path() -> None:
    this = str(Path(__file__).resolve().relative_to(ROOT))  # its examples name such paths
    hits = _hits(MACHINE_PATH, [p for p in tracked_files() if p != this])
    assert not hits, "absolute paths of a development machine:\n" + "\n".join(hits[:40])


def test_the_product_never_points_outside_the_checkout() -> None:
    files = [p for p in tracked_files() if p.startswith(PRODUCT)]
    hits = _hits(OUTSIDE, files)
    assert not hits, "references outside the repository:\n" + "\n".join(hits[:40])


def test_the_design_doc_is_in_the_repository() -> None:
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    for heading in ("## Architecture", "## Metrics", "## Goals in numbers",
                    "## How policies are judged"):
        assert heading in text


@pytest.mark.parametrize("text", [
    "--trace /work/shared/traces/x", "python=/root/.cache/x", "cd /home/alice/repo",
    "/Users/bob/src", "out: /tmp/turnstile-aiperf-teb8pi3u/x", "/tmp/tmpa1b2c3d4",
    "/tmp/aiperf_mmap_6da85fae962a", "/tmp/pytest-of-root/pytest-3", '"/work"'])
def test_the_rule_catches(text: str) -> None:
    assert MACHINE_PATH.search(text), text


@pytest.mark.parametrize("text", [
    "--out /tmp/fid", "/tmp/ss-compiled3", "/tmp/peers-venv/bin/pip", "/tmp/turnstile-sim-speed",
    "verl/workers/rollout/router.py", "https://example.com/work/x", "$TURNSTILE_TRACES/x",
    "benchmarks/results/real-ab/run23", "~/.cache/aiperf", "/tmp/vidur-venv/bin/python"])
def test_the_rule_allows(text: str) -> None:
    assert not MACHINE_PATH.search(text), text
