"""Real-engine tests: the tiny random GGUF served by llama.cpp's C++ llama-server.

Skipped only when the binary is missing and ``CI`` is unset; under CI a missing binary fails.
Build it with ``scripts/build_llama_server.sh`` (``make engine``).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from turnstile.engines.llama_server import (
    LlamaServerProcess,
)
from turnstile.engines.tiny_model import write_tiny_gguf

pytestmark = pytest.mark.slow

N_PARALLEL = 4


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, llama_server_binary: Path
) -> Iterator[LlamaServerProcess]:
    binary = llama_server_binary
    tmp = tmp_path_factory.mktemp("llama")
    model = write_tiny_gguf(tmp / "tiny.gguf")
    with LlamaServerProcess(
        model,
        n_parallel=N_PARALLEL,
        ctx=8192,
        threads=2,
        slot_save_dir=tmp / "slots",
        binary=binary,
    ) as proc:
        yield proc


def _chat(base_url: str, content: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    }
    req = urllib.request.Request(
        f"{base_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200
        result: dict[str, Any] = json.loads(resp.read())
    return result


def test_chat_completion_runs_to_max_tokens(server: LlamaServerProcess) -> None:
    result = _chat(server.base_url, "hello there", max_tokens=16)
    assert result["usage"]["completion_tokens"] == 16
    assert result["usage"]["prompt_tokens"] > 0
    choice = result["choices"][0]
    assert choice["finish_reason"] == "length"
    assert isinstance(choice["message"]["content"], str)


def test_concurrent_requests_all_complete(server: LlamaServerProcess) -> None:
    max_tokens = 48
    prompts = [f"request number {i}: tell me a story" for i in range(N_PARALLEL)]
    with ThreadPoolExecutor(max_workers=N_PARALLEL) as pool:
        results = list(pool.map(lambda p: _chat(server.base_url, p, max_tokens), prompts))
    assert len(results) == N_PARALLEL
    for result in results:
        assert result["usage"]["completion_tokens"] == max_tokens
        assert result["choices"][0]["finish_reason"] == "length"
    with urllib.request.urlopen(f"{server.base_url}/slots", timeout=10) as resp:
        slots = json.loads(resp.read())
    assert len(slots) == N_PARALLEL
