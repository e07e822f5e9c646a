"""Locate the shared real traces (skip cleanly where absent) and the tiny hand-made fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "traces"


def shared_traces_dir() -> Path | None:
    env = os.environ.get("TURNSTILE_TRACES")
    p = Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared" / "traces"
    return p if p.is_dir() else None


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    p = shared_traces_dir()
    if p is None:
        pytest.skip("shared/traces not present (set TURNSTILE_TRACES to run)")
    return p


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES
