"""Plain Python vs the mypyc build (``make compiled``): which one runs is known and stated.

Under ``make test-compiled`` (``TURNSTILE_EXPECT_COMPILED=1``) every module the build compiles
must come from a C extension built from this checkout's sources; otherwise (``make test``)
none may, so a stray ``.so`` next to the sources cannot silently replace them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from turnstile.build_info import (
    COMPILED_MODULES,
    compiled_build,
    describe,
    extension_modules,
    source_digest,
)

SRC = Path(__file__).resolve().parents[1] / "src"


def test_the_build_that_runs_is_the_one_expected():
    build = compiled_build()
    if os.environ.get("TURNSTILE_EXPECT_COMPILED") == "1":
        assert build is not None, "expected the compiled build (.venv-compiled), got plain Python"
        assert extension_modules() == list(COMPILED_MODULES)
        assert build["source_digest"] == source_digest(SRC), "compiled build is stale"
        assert "sources match this checkout" in describe(SRC)
    else:
        assert build is None
        assert extension_modules() == []
        assert describe(SRC) == "plain Python, not compiled"


def test_source_digest_follows_the_sources(tmp_path):
    copy = tmp_path / "src"
    shutil.copytree(SRC / "turnstile", copy / "turnstile",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    assert source_digest(copy) == source_digest(SRC)
    edited = copy / "turnstile" / "sim" / "step.py"
    edited.write_text(edited.read_text() + "\n# edited\n")
    assert source_digest(copy) != source_digest(SRC)


def test_source_digest_covers_interpreted_modules(tmp_path):
    # the compiled venv holds a copy of the whole package: a policy edited since the build
    # runs stale there too
    copy = tmp_path / "src"
    shutil.copytree(SRC / "turnstile", copy / "turnstile",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    edited = copy / "turnstile" / "policies" / "cvar.py"
    assert "turnstile.policies.cvar" not in COMPILED_MODULES
    edited.write_text(edited.read_text() + "\n# edited\n")
    assert source_digest(copy) != source_digest(SRC)
