"""``turnstile serve --log-level info`` is readable: health checks (the gateway's own of its
engines every ``health_interval_s``, and a balancer's probes of ``/health`` and ``/ready``) and
ordinary requests write nothing; start-up and engine state changes do."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(90)
def test_info_log_is_not_flooded_by_health_checks(fake_engines: Any) -> None:
    eng = fake_engines()
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-c", "from turnstile.cli import main; main()", "serve", "--engine",
         f"{eng.url},openai", "--port", str(port), "--log-level", "info"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        for _ in range(10):  # a balancer's probes, and a client's requests
            httpx.get(url + "/health", timeout=5)
            httpx.get(url + "/ready", timeout=5)
            httpx.get(url + "/v1/models", timeout=5)
        time.sleep(4.5)  # the gateway's own health checks: one a second by default
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    err = out + err  # uvicorn's access log goes to stdout
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err
    assert not [ln for ln in lines if "/health" in ln or "/ready" in ln or "GET " in ln], err
    # start-up (the gateway's line, uvicorn's four), "engine ... is up", shutdown: a dozen lines
    assert len(lines) <= 14, err
