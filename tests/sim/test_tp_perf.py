"""TP performance model: all-reduce arithmetic by hand, the two TP laws, and the check against
published TP scaling figures (docs/rollout-tp-model.md states the tolerance)."""

from __future__ import annotations

import pytest

from turnstile.core.registry import UnknownNameError
from turnstile.sim.perf import PerfModel
from turnstile.sim.roofline_perf import RooflinePerf, load_gpu, load_model
from turnstile.sim.tp_perf import (
    TpRooflinePerf,
    check_tp_reference,
    decode_latency_s,
    interconnect_names,
    load_interconnect,
    max_decode_batch,
    per_gpu_throughput,
    tp_gpu,
    tp_perf_factory,
    tp_perf_model,
    tp_scaling_table,
)

GPUS = ("H100-SXM", "A800-80G", "A100-80G", "H200")
MODELS = ("llama-3.1-8b", "qwen3-8b")

#: the largest |error| docs/rollout-tp-model.md states for the published figures: batch 1 (the
#: TP speedup a straggler gets), and large batch (the roofline is optimistic there)
REFERENCE_TOLERANCE = 0.30
LARGE_BATCH_TOLERANCE = 0.40


def test_every_interconnect_entry_has_a_source_and_a_loadable_gpu() -> None:
    for name in interconnect_names():
        ic = load_interconnect(name)
        assert ic.source and ic.link
        # NCCL's bus bandwidth is below the one-way line rate (half the bidirectional figure)
        assert 0 < ic.busbw_gbps <= ic.nvlink_bidir_gbps / 2
        assert ic.small_gbps < ic.busbw_gbps
        assert tp_gpu(name).name == name


def test_a800_is_an_a100_with_400_gbps_nvlink() -> None:
    a800, a100 = tp_gpu("A800"), load_gpu("A100")
    assert (a800.peak_tflops, a800.hbm_tbps, a800.memory_gb) == (
        a100.peak_tflops, a100.hbm_tbps, a100.memory_gb)
    assert a800.interconnect_gbps == 400.0 and a100.interconnect_gbps == 600.0
    assert load_interconnect("a800").busbw_gbps < load_interconnect("A100").busbw_gbps


def test_unknown_gpu_lists_the_valid_names() -> None:
    with pytest.raises(UnknownNameError, match="H100-SXM"):
        load_interconnect("B200-imaginary")


def test_allreduce_by_hand_picks_the_faster_line() -> None:
    ic = load_interconnect("H100")
    # 1 KB over 8 GPUs: the custom kernel's intercept dominates
    ring = 2 * 7 / 8 * 1024
    assert ic.allreduce_s(1024, 8) == pytest.approx(9e-6 + ring / 50e9)
    # 128 MB: NCCL's ring at 370 GB/s is faster than the custom kernel's 50 GB/s slope
    big = 128e6
    assert ic.allreduce_s(big, 8) == pytest.approx(25e-6 + 2 * 7 / 8 * big / 370e9)
    assert ic.allreduce_s(big, 1) == 0.0


def test_step_time_by_hand() -> None:
    m = load_model("llama-3.1-8b")
    p = tp_perf_model("H100", m, 4, layer_overhead_s=0.0)
    base = RooflinePerf("H100", m, 4, allreduce_latency_s=0.0)
    busy_and_overhead = base.step_time(0, 16, 16 * 1000) - base._ar_tok_s * 16
    want = busy_and_overhead + 2 * m.num_layers * p.interconnect.allreduce_s(16 * 4096 * 2, 4)
    assert p.step_time(0, 16, 16 * 1000) == pytest.approx(want)
    # tp=1 pays no all-reduce; the per-layer overhead is charged once per layer
    p1 = tp_perf_model("H100", m, 1, layer_overhead_s=1e-5)
    r1 = RooflinePerf("H100", m, 1)
    assert p1.step_time(0, 1, 500) == pytest.approx(r1.step_time(0, 1, 500) + 32 * 1e-5)


def test_it_is_a_perf_model_the_simulators_take() -> None:
    p = tp_perf_model("H100", "llama-3.1-8b", 2)
    assert isinstance(p, PerfModel) and isinstance(p, TpRooflinePerf)
    assert p.kv_bytes_per_token == load_model("llama-3.1-8b").kv_bytes_per_token(2)
    make = tp_perf_factory("A800", "qwen3-8b")
    assert make(4) is make(4) and make(4).tp == 4 and make(4).gpu.name == "A800-80G"


@pytest.mark.parametrize("gpu", GPUS)
@pytest.mark.parametrize("model", MODELS)
def test_batch1_decode_latency_falls_with_tp_but_less_than_linearly(gpu: str, model: str) -> None:
    lat = [decode_latency_s(tp_perf_model(gpu, model, tp), 1, 2048) for tp in (1, 2, 4, 8)]
    assert lat[0] > lat[1] > lat[2] > lat[3]
    assert lat[3] > lat[0] / 8  # all-reduces and per-layer costs do not shrink


@pytest.mark.parametrize("gpu", GPUS)
@pytest.mark.parametrize("model", MODELS)
def test_per_gpu_throughput_at_large_batch_falls_with_tp(gpu: str, model: str) -> None:
    batch, ctx = 256, 1024
    assert max_decode_batch(gpu, model, 1, ctx) >= batch  # the same batch fits at every tp
    thr = [per_gpu_throughput(tp_perf_model(gpu, model, tp), tp, batch, ctx)
           for tp in (1, 2, 4, 8)]
    assert thr[0] > thr[1] > thr[2] > thr[3]


def test_the_slower_link_loses_more_to_tp() -> None:
    # A800 and A100 differ only in NVLink: TP8 decode at batch 64 is slower on the A800
    a800 = decode_latency_s(tp_perf_model("A800", "llama-3.1-8b", 8), 64, 1024)
    a100 = decode_latency_s(tp_perf_model("A100", "llama-3.1-8b", 8), 64, 1024)
    assert a800 > a100
    one = decode_latency_s(tp_perf_model("A800", "llama-3.1-8b", 1), 64, 1024)
    assert one == pytest.approx(decode_latency_s(tp_perf_model("A100", "llama-3.1-8b", 1), 64,
                                                 1024))


def test_published_tp_scaling_figures_within_the_stated_tolerance() -> None:
    checks = check_tp_reference()
    assert len(checks) == 10 and {c.reference for c in checks} == {"gpt-fast", "sglang-1008"}
    for c in checks:
        tol = REFERENCE_TOLERANCE if c.batch == 1 else LARGE_BATCH_TOLERANCE
        assert abs(c.rel_err) <= tol, c
    # the speedup shape, not just the level: TP8 over TP1/TP2 within the same tolerance
    by = {(c.reference, c.model, c.tp, c.batch): c for c in checks}
    for ref, model, lo in (("gpt-fast", "llama-2-7b", 1), ("gpt-fast", "llama-2-70b", 2),
                           ("sglang-1008", "llama-3.1-8b", 1)):
        pub = by[ref, model, 8, 1].published / by[ref, model, lo, 1].published
        pred = by[ref, model, 8, 1].predicted / by[ref, model, lo, 1].predicted
        assert abs(pred / pub - 1) <= REFERENCE_TOLERANCE


def test_the_per_layer_overhead_is_what_narrows_the_error() -> None:
    # on gpt-fast (little per-step overhead) the model without it is optimistic at every TP
    with_it = [c for c in check_tp_reference() if c.reference == "gpt-fast"]
    without = [c for c in check_tp_reference(layer_overhead_s=0.0) if c.reference == "gpt-fast"]
    for a, b in zip(with_it, without, strict=True):
        assert 0 < a.rel_err < b.rel_err


def test_scaling_table_skips_layouts_the_weights_do_not_fit() -> None:
    rows = tp_scaling_table("H100", "llama-3.1-70b", context_tokens=4096)
    assert [r["tp"] for r in rows] == [2, 4, 8]  # 141 GB of weights do not fit one GPU
    assert rows[0]["batch"] == 0 and rows[-1]["batch"] > rows[1]["batch"]
