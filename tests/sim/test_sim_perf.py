"""Performance models: data files, roofline arithmetic by hand, fitted profiles and NNLS."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnstile.core.registry import UnknownNameError
from turnstile.sim.engine_profile import WarmRule, profile_for
from turnstile.sim.fitted_perf import (
    FittedPerf,
    chunk_tile_pairs,
    forward_passes,
    tile_pairs,
)
from turnstile.sim.perf import PerfModel
from turnstile.sim.profile_fit import fit_profile, nnls
from turnstile.sim.roofline_perf import (
    RooflinePerf,
    gpu_names,
    kv_capacity_tokens,
    load_gpu,
    load_model,
    model_names,
)

# --- data files -------------------------------------------------------------------------------


def test_gpu_table_matches_the_design_constants() -> None:
    expect = {
        "A100-80G": (312, 2.039, 80),
        "H100-SXM": (989, 3.35, 80),
        "H200": (989, 4.8, 141),
        "L40S": (362, 0.864, 48),
    }
    assert set(expect) <= set(gpu_names())
    for name, (tflops, tbps, gb) in expect.items():
        g = load_gpu(name)
        assert (g.peak_tflops, g.hbm_tbps, g.memory_gb) == (tflops, tbps, gb)
        assert g.price_per_hour > 0 and g.power_w > 0 and g.interconnect_gbps > 0
        assert "datasheet" in g.source and "http" in g.source


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [("H100", "H100-SXM"), ("h100-sxm", "H100-SXM"), ("a100", "A100-80G"), ("l40s", "L40S")],
)
def test_gpu_aliases_are_case_insensitive(alias: str, canonical: str) -> None:
    assert load_gpu(alias).name == canonical


def test_unknown_names_list_the_valid_ones() -> None:
    with pytest.raises(UnknownNameError, match=r"valid names: A100-80G, H100-SXM, H200, L40S"):
        load_gpu("B200")
    with pytest.raises(KeyError, match=r"llama-3\.1-8b"):
        load_model("gpt-5")


def test_models_have_sources_and_consistent_shapes() -> None:
    assert set(model_names()) == {
        "llama-3.1-8b",
        "llama-3.1-70b",
        "qwen3-8b",
        "qwen3-32b",
        "qwen3-30b-a3b",
    }
    for name in model_names():
        m = load_model(name)
        assert "huggingface.co" in m.source and "config.json" in m.source
        total, active = m.shape_params()
        assert total == pytest.approx(m.params, rel=0.02), name
        assert active == pytest.approx(m.active_params, rel=0.02), name
    assert load_model("Qwen/Qwen3-30B-A3B").is_moe
    assert load_model("QWEN3-32B").attention_width == 64 * 128  # wider than hidden (5120)


def test_kv_bytes_per_token_by_hand() -> None:
    m = load_model("llama-3.1-8b")
    assert m.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 131072
    assert m.kv_bytes_per_token(tp=2) == 2 * 32 * 4 * 128 * 2
    # more GPUs than KV heads: each keeps a replica of one head
    assert m.kv_bytes_per_token(tp=16) == 2 * 32 * 1 * 128 * 2
    moe = load_model("qwen3-30b-a3b")
    assert moe.kv_bytes_per_token() == 2 * 48 * 4 * 128 * 2


def test_kv_capacity_tokens_by_hand() -> None:
    # H100 80 GB at 0.9 minus 16.06 GB of llama-3.1-8b weights minus 1 GB reserve
    free = 80e9 * 0.9 - 8.03e9 * 2 - 1e9
    assert kv_capacity_tokens("H100", "llama-3.1-8b") == int(free // 131072)
    # 70B on 4x H100: weights split four ways, KV heads 8/4 = 2 per GPU
    free = 80e9 * 0.9 - 70.6e9 * 2 / 4 - 1e9
    assert kv_capacity_tokens("H100", "llama-3.1-70b", tp=4) == int(free // (2 * 80 * 2 * 128 * 2))
    with pytest.raises(ValueError, match="does not fit"):
        kv_capacity_tokens("L40S", "llama-3.1-70b")


# --- roofline ---------------------------------------------------------------------------------


def test_roofline_prefill_is_compute_bound_by_hand() -> None:
    perf = RooflinePerf("H100-SXM", "llama-3.1-8b")
    p = 1000
    attn2 = p * (p + 1) / 2
    flops = 2 * 8.03e9 * p + 4 * 32 * 4096 * attn2
    compute = flops / (989e12 * 0.65)
    memory = 8.03e9 * 2 / (3.35e12 * 0.85)
    assert compute > memory
    assert perf.step_time(p, 0, 0, attn2) == pytest.approx(compute + 0.002, rel=1e-12)


def test_roofline_decode_is_memory_bound_by_hand() -> None:
    perf = RooflinePerf("H100-SXM", "llama-3.1-8b")
    seqs, ctx = 8, 8 * 2000
    compute = (2 * 8.03e9 * seqs + 4 * 32 * 4096 * ctx) / (989e12 * 0.65)
    memory = (8.03e9 * 2 + ctx * 131072) / (3.35e12 * 0.85)
    assert memory > compute
    assert perf.step_time(0, seqs, ctx) == pytest.approx(memory + 0.002, rel=1e-12)
    # a wider HBM makes the same decode step faster
    assert RooflinePerf("H200", "llama-3.1-8b").step_time(0, seqs, ctx) < perf.step_time(
        0, seqs, ctx
    )


def test_roofline_tensor_parallel_term_by_hand() -> None:
    perf = RooflinePerf("H100-SXM", "llama-3.1-70b", tp=4, overhead_s=0.0)
    tokens = 64
    compute = (2 * 70.6e9 * tokens + 4 * 80 * 8192 * 0) / (989e12 * 4 * 0.65)
    memory = 70.6e9 * 2 / 4 / (3.35e12 * 0.85)
    allreduce = 2 * 80 * (5e-6 + 2 * 3 / 4 * tokens * 8192 * 2 / 900e9)
    expect = max(compute, memory) + allreduce
    assert perf.step_time(0, tokens, 0) == pytest.approx(expect, rel=1e-12)


def test_roofline_moe_uses_active_flops_and_total_bytes() -> None:
    perf = RooflinePerf("H100-SXM", "qwen3-30b-a3b", overhead_s=0.0)
    big = 8192
    compute = (2 * 3.3e9 * big + 0) / (989e12 * 0.65)
    memory = 30.5e9 * 2 / (3.35e12 * 0.85)
    assert perf.step_time(big, 0, 0) == pytest.approx(max(compute, memory), rel=1e-12)
    assert isinstance(perf, PerfModel)
    assert perf.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2


# --- fitted -----------------------------------------------------------------------------------


def test_fitted_step_time_and_profile_round_trip(tmp_path) -> None:
    f = FittedPerf(
        0.01,
        1e-4,
        2e-5,
        3e-8,
        4e-10,
        kv_bytes_per_token=4096.0,
        engine="llama.cpp",
        model="tiny",
        measured_at="2026-01-01T00:00:00Z",
        meta={"host": "ci"},
    )
    assert isinstance(f, PerfModel)
    assert f.step_time(100, 4, 1000, 5000.0) == pytest.approx(
        0.01 + 1e-4 * 100 + 2e-5 * 4 + 3e-8 * 1000 + 4e-10 * 5000
    )
    path = tmp_path / "p.json"
    f.to_profile(path)
    doc = json.loads(path.read_text())
    assert doc["format"] == "turnstile-profile" and doc["version"] == 3
    assert doc["engine"] == "llama.cpp" and doc["measured_at"].startswith("2026")
    g = FittedPerf.from_profile(path)
    assert g.coefficients == f.coefficients
    assert (g.kv_bytes_per_token, g.engine, g.model, g.meta) == (
        4096.0,
        "llama.cpp",
        "tiny",
        {"host": "ci"},
    )
    assert g.name == "fitted:llama.cpp/tiny"


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"format": "other", "version": 1}, "not a turnstile-profile"),
        ({"format": "turnstile-profile", "version": 4, "coefficients": {"b0_s": 1}}, "version 4"),
        ({"format": "turnstile-profile", "version": 1, "coefficients": {}}, "b0_s"),
        (
            {"format": "turnstile-profile", "version": 1, "coefficients": {"b0_s": -1.0}},
            "non-negative",
        ),
    ],
)
def test_bad_profiles_are_rejected(tmp_path, doc: dict, match: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=match):
        FittedPerf.from_profile(path)


def test_fit_recovers_known_coefficients_from_noisy_samples() -> None:
    rng = random.Random(7)
    true = (0.004, 6e-5, 1.5e-4, 2e-8, 5e-10)
    samples = []
    for _ in range(400):
        p = rng.choice([0, 0, rng.randint(1, 4096)])
        d = rng.randint(0 if p else 1, 64)
        kv = rng.randint(0, 200_000)
        a2 = p * (rng.randint(0, 30_000) + p / 2)
        y = true[0] + true[1] * p + true[2] * d + true[3] * kv + true[4] * a2
        samples.append(((p, d, kv, a2), y * (1 + rng.gauss(0, 0.02))))
    fit = fit_profile(samples, engine="synthetic", relative=True)
    # the attention-pair term is the smallest contribution, so the least well determined
    for got, want, tol in zip(fit.coefficients, true, (0.05,) * 4 + (0.15,), strict=True):
        assert got == pytest.approx(want, rel=tol)
    assert fit.meta["fit"]["samples"] == 400 and fit.meta["fit"]["r2"] > 0.99
    assert fit.meta["fit"]["median_abs_rel_err"] < 0.03


def test_fit_keeps_coefficients_non_negative() -> None:
    # step time does not depend on decode seqs; noise would give it a small negative slope
    rng = random.Random(3)
    samples = []
    for _ in range(200):
        p = rng.randint(0, 2000)
        d = rng.randint(0, 32)
        samples.append(((p, d, 0), 0.01 + 1e-4 * p - 1e-6 * d + rng.gauss(0, 1e-4)))
    fit = fit_profile(samples)
    assert all(c >= 0 for c in fit.coefficients)
    assert fit.b2 == pytest.approx(0.0, abs=1e-6)
    assert fit.b1 == pytest.approx(1e-4, rel=0.02)
    with pytest.raises(ValueError, match="at least 2"):
        fit_profile([((1, 1, 1), 1.0)])


def test_nnls_matches_unconstrained_when_the_optimum_is_positive() -> None:
    rng = np.random.default_rng(0)
    a = rng.random((50, 4))
    x = np.array([1.0, 2.0, 0.5, 3.0])
    got = nnls(a, a @ x)
    assert np.allclose(got, x)
    got = nnls(a, a @ np.array([1.0, -2.0, 0.5, 3.0]))
    assert got.min() >= 0 and math.isclose(got[1], 0.0, abs_tol=1e-12)


@pytest.mark.parametrize(
    ("prefill", "decode", "ubatch", "split", "passes"),
    [
        (0, 1, 512, "equal", (0, 1)),  # a lone decoder: a one-token pass
        (0, 4, 512, "equal", (1, 0)),  # decoders: one pass of one token each
        (8, 3, 512, "equal", (2, 0)),  # a token of each of 4 sequences, then 7 prompt tokens
        (8, 3, 512, "simple", (1, 0)),  # one KV buffer: 11 tokens in one pass
        (2, 3, 512, "equal", (1, 1)),  # 4 tokens, then the prompt's last one alone
        (1500, 0, 512, "equal", (3, 0)),  # 512 + 512 + 476
        (1025, 0, 512, "simple", (2, 1)),  # 512 + 512 + 1
        (1500, 0, 0, "equal", (1, 0)),  # uncut
        (0, 1, 0, "simple", (0, 1)),
        (0, 0, 512, "equal", (0, 0)),
    ],
)
def test_forward_passes_by_hand(prefill, decode, ubatch, split, passes) -> None:
    assert forward_passes(prefill, decode, ubatch, split) == passes


def test_fitted_step_time_pays_b0_per_pass_and_b0_one_for_a_lone_token(tmp_path) -> None:
    perf = FittedPerf(0.008, 1e-3, 2e-3, 1e-6, 0.0, b0_one=0.003, ubatch_tokens=512,
                      ubatch_split="equal")
    assert perf.step_time(0, 1, 100) == pytest.approx(0.003 + 2e-3 + 1e-4)
    assert perf.step_time(0, 2, 100) == pytest.approx(0.008 + 4e-3 + 1e-4)
    # a newcomer's 8 tokens beside 3 decoders: two passes, each paying b0
    assert perf.step_time(8, 3, 1000) == pytest.approx(2 * 0.008 + 8e-3 + 6e-3 + 1e-3)
    path = tmp_path / "p.json"
    perf.to_profile(path)
    back = FittedPerf.from_profile(path)
    assert (back.b0_one, back.ubatch_tokens, back.ubatch_split) == (0.003, 512, "equal")
    assert back.step_time(8, 3, 1000) == perf.step_time(8, 3, 1000)
    # older profiles (no such fields) keep the one-pass model
    doc = json.loads(path.read_text())
    del doc["forward_passes"], doc["coefficients"]["b0_one_token_pass_s"]
    path.write_text(json.dumps(doc))
    old = FittedPerf.from_profile(path)
    assert old.step_time(8, 3, 1000) == pytest.approx(0.008 + 8e-3 + 6e-3 + 1e-3)
    doc["forward_passes"] = {"ubatch_tokens": 512, "split": "per-slot"}
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="ubatch_split"):
        FittedPerf.from_profile(path)


def test_fitted_profile_keeps_its_host_contention(tmp_path):
    perf = FittedPerf(0.01, 1e-4, host_contention=0.07)
    perf.to_profile(tmp_path / "p.json")
    back = FittedPerf.from_profile(tmp_path / "p.json")
    assert back.host_contention == 0.07
    assert back.scaled(2.0).host_contention == 0.07  # a factor per co-runner, not a time
    with pytest.raises(ValueError, match="host_contention"):
        FittedPerf(0.01, host_contention=-0.1)


def test_fitted_profile_keeps_its_cold_step_and_scales_it(tmp_path):
    perf = FittedPerf(0.01, 1e-4, cold_step_s=0.005, engine="llama.cpp")
    assert perf.warm == profile_for("llama.cpp").warm  # the engine profile's rule
    perf.to_profile(tmp_path / "p.json")
    back = FittedPerf.from_profile(tmp_path / "p.json")
    assert back.cold_step_s == 0.005 and back.warm == perf.warm
    assert back.scaled(2.0).cold_step_s == pytest.approx(0.01)  # a time, unlike contention
    with pytest.raises(ValueError, match="cold_step_s"):
        FittedPerf(0.01, cold_step_s=-0.001)
    # a rule of its own is stored with the cost, and wins over the engine profile's
    own = FittedPerf(0.01, cold_step_s=0.005, engine="llama.cpp", warm=WarmRule(0.5, 2, 16))
    own.to_profile(tmp_path / "q.json")
    assert FittedPerf.from_profile(tmp_path / "q.json").warm == WarmRule(0.5, 2, 16)
    # an engine nobody profiled has no rule: a cold-step cost needs one given
    with pytest.raises(ValueError, match="warm rule"):
        FittedPerf(0.01, cold_step_s=0.005, engine="some-engine")


def test_fit_recovers_the_cold_step_from_warm_and_cold_appends() -> None:
    """The same appends timed cold (right after a prefill) and warm (right after decodes): the
    fit puts their difference in ``cold_step_s``, not in ``b0``; without warm samples the
    term stays out."""
    rule = WarmRule(0.1, 3, 64)
    truth = FittedPerf(0.002, 1.5e-3, 2e-3, 2e-6, 5e-7, cold_step_s=0.006, warm=rule)
    samples, cold = [], []
    rng = np.random.default_rng(3)
    for n in (1, 2, 4, 16, 40, 100, 400):
        for c in (0, 300, 800, 1500):
            feats = (n, 0, c + n, n * c + n * (n + 1) / 2)
            for is_cold in (True, False):
                t = truth.step_time(*feats) + (truth.cold_step_s if is_cold else 0.0)
                samples.append((feats, t * (1 + 0.01 * rng.standard_normal())))
                cold.append(is_cold)
    for k in (1, 2, 4):
        samples.append(((0, k, 600 * k, 0.0), truth.step_time(0, k, 600 * k)))
        cold.append(False)
    fit = fit_profile(samples, relative=True, cold=cold, warm=rule)
    assert fit.warm == rule
    assert fit.cold_step_s == pytest.approx(0.006, rel=0.1)
    assert fit.b0 == pytest.approx(0.002, rel=0.2)
    assert fit.meta["fit"]["cold_samples"] == sum(cold)
    # every sample cold: nothing tells the term from b0
    assert fit_profile(samples, relative=True, cold=[True] * len(samples)).cold_step_s == 0.0
    with pytest.raises(ValueError, match="flags"):
        fit_profile(samples, cold=[True])


def _tiles_by_hand(p: int, c: int, tile: int) -> int:
    """Pairs a tiled kernel computes, tile by tile: every query tile padded to ``tile`` rows,
    every KV tile that one of its rows may see (causal: position ``c + i`` sees ``0..c + i``)."""
    pairs = 0
    for q0 in range(0, p, tile):
        rows = range(c + q0, c + min(q0 + tile, p))
        for k0 in range(0, c + p, tile):
            if any(k0 <= r for r in rows):  # some row sees a key of this tile
                pairs += tile * tile
    return pairs


@pytest.mark.parametrize(("p", "c"), [(1, 0), (64, 0), (65, 0), (64, 800), (65, 800), (128, 768),
                                       (100, 1), (500, 1023), (2048, 64), (63, 5)])
def test_tile_pairs_count_the_tiles_a_tiled_kernel_computes(p: int, c: int) -> None:
    causal = p * c + p * (p + 1) / 2
    assert tile_pairs(p, causal, 64) == _tiles_by_hand(p, c, 64)
    assert tile_pairs(p, causal, 16) == _tiles_by_hand(p, c, 16)


def test_the_tiles_rule_prices_65_query_tokens_as_two_tiles(tmp_path) -> None:
    """From 64 query tokens on, attention costs ``b4`` per pair of the tiles computed: 65 new
    tokens over 800 cached cost a whole tile more than 64; under 64 it is ``b4 + b5`` per causal
    pair, as with the threshold."""
    f = FittedPerf(0.007, 1.2e-3, 1.4e-3, 3e-6, 5e-7, b5=7e-7, small_chunk_tokens=64.0,
                   small_chunk_rule="tiles")
    base = 0.007 + 3e-6 * 800

    def pairs(p: int) -> float:
        return p * 800 + p * (p + 1) / 2

    assert f.step_time(64, 0, 800, pairs(64)) == pytest.approx(
        base + 1.2e-3 * 64 + 5e-7 * 14 * 4096)
    assert f.step_time(65, 0, 800, pairs(65)) == pytest.approx(
        base + 1.2e-3 * 65 + 5e-7 * 2 * 14 * 4096)  # twice the tiles of 64
    assert f.step_time(63, 0, 800, pairs(63)) == pytest.approx(
        base + 1.2e-3 * 63 + (5e-7 + 7e-7) * pairs(63))
    f.to_profile(tmp_path / "p.json")
    back = FittedPerf.from_profile(tmp_path / "p.json")
    assert back.small_chunk_rule == "tiles"
    assert back.step_time(65, 2, 900, pairs(65)) == f.step_time(65, 2, 900, pairs(65))
    with pytest.raises(ValueError, match="tile"):
        FittedPerf(0.007, small_chunk_rule="tiles", small_chunk_tokens=0.0)


def test_fit_finds_the_tiles_of_an_engine_that_computes_them() -> None:
    """Samples from an engine with a tiled kernel from 64 query tokens on: the tiles candidate
    fits them to their noise, which neither a knee nor the threshold does."""
    truth = FittedPerf(0.007, 1.2e-3, 1.4e-3, 3e-6, 5e-7, b5=7e-7, small_chunk_tokens=64.0,
                       small_chunk_rule="tiles")
    rng = random.Random(3)
    samples = []
    for c in (0, 256, 500, 800, 1100, 1400):
        for p in (1, 2, 4, 8, 16, 40, 63, 64, 65, 80, 100, 128, 200, 256, 500):
            feats = (p, 0, c, p * c + p * (p + 1) / 2)
            samples.append((feats, truth.step_time(*feats) * (1 + rng.gauss(0, 0.005))))
    fit = fit_profile(samples, relative=True, small_chunk_knees=(4, 16, 64),
                      small_chunk_thresholds=(64,), small_chunk_tiles=(64,))
    assert (fit.small_chunk_rule, fit.small_chunk_tokens) == ("tiles", 64.0)
    assert fit.b4 == pytest.approx(5e-7, rel=0.05) and fit.b5 == pytest.approx(7e-7, rel=0.05)
    assert fit.meta["fit"]["median_abs_rel_err"] < 0.01
    below = fit_profile(samples, relative=True, small_chunk_knees=(4, 16, 64),
                        small_chunk_thresholds=(64,))
    assert below.meta["fit"]["median_abs_rel_err"] > 2 * fit.meta["fit"]["median_abs_rel_err"]


@pytest.mark.parametrize("rule", ["below", "tiles"])
def test_a_threshold_prices_each_prompt_chunk_by_its_own_kernel(rule: str) -> None:
    """Two 40-token appends in one step: each runs the small-chunk kernel (40 query tokens),
    though the step computes 80 prompt tokens. Priced from the sums, the step would count no
    ``b5`` (80 >= 64) and, with ``tiles``, the tiles of one 80-token chunk."""
    f = FittedPerf(0.007, 1.2e-3, 1.4e-3, 3e-6, 5e-7, b5=7e-7, small_chunk_tokens=64.0,
                   small_chunk_rule=rule)

    def pairs(n: int, c: int) -> float:
        return n * c + n * (n + 1) / 2

    two = [(40, 1000), (40, 600)]
    attn = pairs(40, 1000) + pairs(40, 600)
    rest = 0.007 + 1.2e-3 * 80 + 3e-6 * 1600
    assert f.step_time(80, 0, 1600, attn, None, two) == pytest.approx(
        rest + (5e-7 + 7e-7) * attn, rel=1e-12)
    assert f.step_time(80, 0, 1600, attn) < f.step_time(80, 0, 1600, attn, None, two) - 0.01
    # a chunk from the threshold on runs the large kernel: tiles or causal pairs, without b5
    big = [(100, 1000), (10, 0)]
    large = chunk_tile_pairs(100, 1000, 64) if rule == "tiles" else pairs(100, 1000)
    assert f.step_time(110, 0, 1000, pairs(100, 1000) + pairs(10, 0), None, big) == (
        pytest.approx(0.007 + 1.2e-3 * 110 + 3e-6 * 1000 + 5e-7 * large
                      + (5e-7 + 7e-7) * pairs(10, 0), rel=1e-12))


@given(n=st.integers(1, 700), c=st.integers(0, 3000),
       rule=st.sampled_from(["below", "tiles"]))
def test_one_chunk_is_priced_alike_from_the_sums_and_chunk_by_chunk(n: int, c: int,
                                                                     rule: str) -> None:
    f = FittedPerf(0.007, 1.2e-3, 1.4e-3, 3e-6, 5e-7, b5=7e-7, small_chunk_tokens=64.0,
                   small_chunk_rule=rule)
    attn = n * c + n * (n + 1) / 2
    assert f.step_time(n, 2, c + 900, attn, None, [(n, c)]) == pytest.approx(
        f.step_time(n, 2, c + 900, attn), rel=1e-12)
