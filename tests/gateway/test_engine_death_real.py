"""An engine killed (SIGKILL, SIGTERM) with turns in flight: llama.cpp's ``llama-server``
(the vLLM runs are in test_vllm_real.py). The scenario and its contract: ``death.py``.

The victim is frozen (SIGSTOP, the whole server) once its first turns stream: here 1,500 tokens
take 3 s with four running, and at a quarter of that (375, a host 4x faster) every turn was
over before the kill without the hold (3 set-ups of 3)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from turnstile.engines.llama_server import LlamaServerProcess
from turnstile.engines.tiny_model import write_tiny_gguf

from .death import Frozen, killed_with_turns_in_flight

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_llama_cpp_engine_killed_with_turns_in_flight(
        sig: int, llama_server_binary: Path, tmp_path: Path) -> None:
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    # 4 slots: the fifth and sixth turns wait in the server's queue
    with LlamaServerProcess(model, n_parallel=4, ctx=8192, threads=1,
                            binary=llama_server_binary) as victim, \
            LlamaServerProcess(model, n_parallel=4, ctx=8192, threads=1,
                               binary=llama_server_binary) as other:
        assert victim.process is not None
        proc = victim.process
        timings = killed_with_turns_in_flight("llama.cpp", victim.base_url, other.base_url,
                                              lambda: proc.send_signal(sig), max_tokens=1500,
                                              hold=Frozen(proc.pid))
    print(f"\n{signal.Signals(sig).name}: {timings}")
