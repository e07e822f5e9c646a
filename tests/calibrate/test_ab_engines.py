"""The real-engine A/B's per-engine pieces (no engine runs): the gateway's engine tables, the
engines' prompt counters, vLLM's KV pool size."""

from __future__ import annotations

from pathlib import Path

import pytest

from turnstile.calibrate.ab import AbEngines
from turnstile.calibrate.ab_engines import (
    counters_from_metrics,
    engine_table,
    gateway_kind,
    start_servers,
    vllm_blocks,
)
from turnstile.calibrate.ab_real import gateway_toml
from turnstile.gateway.config import load_config

VLLM_METRICS = """\
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1000.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 640.0
"""
LLAMA_METRICS = """\
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 360
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 640
"""


def test_both_engines_count_computed_and_reused_prompt_tokens_alike() -> None:
    want = {"processed": 360.0, "cached": 640.0}
    assert counters_from_metrics("vllm", VLLM_METRICS) == want
    assert counters_from_metrics("llamacpp", LLAMA_METRICS) == want
    with pytest.raises(ValueError, match="engine must be"):
        counters_from_metrics("sglang", "")


def test_vllm_pool_holds_the_sessions_kv_and_one_whole_sequence() -> None:
    assert vllm_blocks(1400, 796) == 11  # ceil(1400 / 128)
    assert vllm_blocks(300, 796) == 7  # never less than one max_model_len sequence
    with pytest.raises(ValueError):
        vllm_blocks(0, 796)


def test_vllm_engines_have_no_slots_in_the_gateway_config(tmp_path: Path) -> None:
    assert gateway_kind("vllm") == "vllm" and gateway_kind("llamacpp") == "llama.cpp"
    assert "slots" not in engine_table("vllm", 0, "http://x", slots=4, kv_tokens=9)
    assert engine_table("llamacpp", 0, "http://x", slots=4, kv_tokens=9)["slots"] == 4
    engines = AbEngines(count=2, n_parallel=4, ctx=3184, kv_tokens=1400, kv_model="paged")
    toml = gateway_toml("cvar", ["http://127.0.0.1:9", "http://127.0.0.1:10"], engines,
                        port=8123, session_idle_s=0.8, params={}, engine="vllm")
    (tmp_path / "gw.toml").write_text(toml)
    cfg = load_config(tmp_path / "gw.toml")
    assert [e.kind for e in cfg.engines] == ["vllm", "vllm"]
    assert [e.options["kv_tokens"] for e in cfg.engines] == [1400, 1400]
    assert not any("slots" in e.options for e in cfg.engines)


def test_vllm_servers_get_a_small_pool_and_one_session_per_sequence(tmp_path: Path) -> None:
    servers = start_servers("vllm", tmp_path, count=2, hidden=64, layers=1, n_parallel=4,
                            ctx=3184, threads=1, kv_tokens=1400)
    assert len(servers) == 2 and (tmp_path / "model" / "config.json").is_file()
    s = servers[0]
    assert s.max_model_len == 796 and s.max_num_seqs == 4
    assert list(s.extra_args) == ["--num-gpu-blocks-override", "11"]
    assert servers[0].cpus is not None  # vLLM would put both on the first core


def test_the_prediction_reuses_whole_blocks_of_the_engines_size() -> None:
    """vLLM on a CPU reuses 128-token blocks: a prediction with them keeps less of each
    session's prefix than one with 16-token blocks (the tail past the last full block)."""
    from turnstile.calibrate.ab import ServingTerms, build_sessions, cell_workload, predict
    from turnstile.calibrate.fidelity import TraceScale
    from turnstile.sim.fitted_perf import FittedPerf

    scale = TraceScale(max_output=16, tool_div=20.0, max_tool_s=0.5, max_context=600,
                       max_turns=6)
    wfs = cell_workload(build_sessions([], 0, 6, scale, seed=1), 0.5, 0)
    perf = FittedPerf(0.002, 1e-4, 6e-4, 1e-6, 5e-8, engine="test")
    hits = {}
    for block in (16, 128):
        eng = AbEngines(count=1, n_parallel=4, ctx=8192, kv_model="paged", block_size=block)
        got = predict(wfs, ["eager"], eng, perf, None, ServingTerms())
        hits[block] = got["eager"]["prefix_hit_rate"]
    assert hits[128] < hits[16]
