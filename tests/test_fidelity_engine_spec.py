"""The fidelity benchmark's simulated engine follows the real engine's profile (no engine runs)."""

from __future__ import annotations

import pytest

from turnstile.calibrate.fidelity import engine_spec_for
from turnstile.sim.engine_profile import profile_for


def test_llamacpp_slots_reuse_any_prefix_and_offload_to_host_ram() -> None:
    spec = engine_spec_for("llama.cpp", kv_tokens=8192, max_num_seqs=4, ctx=8192,
                           block_size=128)
    assert spec.block_size == 1  # slots: any common prefix, whatever a block would be
    assert spec.cpu_offload_tokens == 64 * 8192  # --cache-ram, far larger than the sessions
    assert spec.max_batched_tokens == profile_for("llama.cpp").max_batched_tokens
    assert (spec.kv_tokens, spec.max_num_seqs) == (8192, 4)


@pytest.mark.parametrize(("reported", "expected"), [(128, 128), (None, 16)])
def test_vllm_reuses_whole_blocks_of_the_reported_size(reported: int | None,
                                                       expected: int) -> None:
    spec = engine_spec_for("vllm", kv_tokens=87_000, max_num_seqs=4, ctx=2048,
                           block_size=reported)
    assert spec.block_size == expected
    assert spec.cpu_offload_tokens == 0
    assert spec.max_batched_tokens == 8192
    assert spec.kv_tokens == 87_000
