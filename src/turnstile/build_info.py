"""Whether this install runs the simulator's hot modules compiled with mypyc, or plain Python.

The plain Python sources are the source of truth. ``make compiled`` (``scripts/build_compiled.py``)
builds a wheel in which :data:`COMPILED_MODULES` are C extensions made by mypyc from the same
sources, and installs it into its own venv, ``.venv-compiled``: the extensions never land next to
the sources in ``src/``, so an edited ``.py`` is never shadowed by a stale ``.so`` there. The
build writes ``turnstile/_compiled_build.py`` into the wheel only; its absence means plain Python.

A compiled install can still be older than the checkout it is run from: :func:`describe` with
``src`` compares the digest of the package's sources at build time with the checkout's.
"""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path
from typing import Any

#: what ``make compiled`` compiles: the simulator's event loop, engine model and the scheduler
#: core it calls per turn (policies, workload and everything else stay interpreted)
COMPILED_MODULES = (
    "turnstile.core.actions",
    "turnstile.core.scheduler",
    "turnstile.core.state",
    "turnstile.sim.batch_scheduler",
    "turnstile.sim.block_pool",
    "turnstile.sim.cluster",
    "turnstile.sim.engine",
    "turnstile.sim.event_loop",
    "turnstile.sim.kernel",
    "turnstile.sim.kv_retention",
    "turnstile.sim.lanes",
    "turnstile.sim.leap_loop",
    "turnstile.sim.request",
    "turnstile.sim.roofline_perf",
    "turnstile.sim.slot_pool",
    "turnstile.sim.step",
    "turnstile.sim.tp_perf",  # its model derives from RooflinePerf (compiled classes only
    #                           take compiled subclasses)
)


#: not part of the sources: what the build itself writes or leaves behind
_NOT_SOURCES = ("_compiled_build.py", ".pyc", ".so")


def source_digest(src: Path) -> str:
    """SHA-256 over every file of the ``turnstile`` package under ``src`` (the directory that
    holds it): the compiled build installs a copy of the whole package, interpreted modules
    included, so an edit to any of them makes it stale."""
    h = hashlib.sha256()
    for path in sorted((src / "turnstile").rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts or path.name.endswith(_NOT_SOURCES):
            continue
        h.update(path.relative_to(src).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def compiled_build() -> dict[str, Any] | None:
    """What ``make compiled`` recorded (mypy version, commit, source digest, modules), or None
    for a plain Python install."""
    try:
        from turnstile import _compiled_build  # type: ignore[attr-defined]
    except ImportError:
        return None
    return dict(_compiled_build.BUILD)


def extension_modules() -> list[str]:
    """Those of :data:`COMPILED_MODULES` loaded from a C extension in this process."""
    out = []
    for mod in COMPILED_MODULES:
        path = getattr(importlib.import_module(mod), "__file__", "") or ""
        if not path.endswith(".py"):
            out.append(mod)
    return out


def describe(src: Path | None = None) -> str:
    """One line: plain Python, or compiled (with how many modules really are extensions, and,
    given the checkout's ``src``, whether its sources still match the build's)."""
    build = compiled_build()
    if build is None:
        return "plain Python, not compiled"
    ext = extension_modules()
    commit = build["commit"]
    commit = commit[:10] + ("+dirty" if commit.endswith("+dirty") else "")
    line = (f"compiled with mypyc {build['mypy']}: {len(ext)}/{len(COMPILED_MODULES)} modules "
            f"are C extensions, built from commit {commit}")
    if src is not None and (src / "turnstile").is_dir():
        same = source_digest(src) == build["source_digest"]
        line += ("; sources match this checkout" if same else
                 "; STALE: this checkout's sources differ (run `make compiled`)")
    return line
