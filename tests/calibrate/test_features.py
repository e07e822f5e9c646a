"""Feature building by hand: chunked prefills, decode windows, mixed steps."""

from __future__ import annotations

import pytest

from turnstile.calibrate.features import (
    DecodeStream,
    StepFeatures,
    attn_pairs,
    decode_step,
    decode_window_sample,
    mean_features,
    mixed_sample,
    prefill_sample,
    prefill_steps,
)


def test_attn_pairs_is_causal() -> None:
    assert attn_pairs(1, 0) == 1
    assert attn_pairs(4, 0) == 10  # 1 + 2 + 3 + 4
    assert attn_pairs(2, 10) == 2 * 10 + 3


def test_prefill_steps_chunk_a_long_prompt() -> None:
    steps = prefill_steps(1000, 0, 512)
    assert [s.prefill_tokens for s in steps] == [512, 488]
    assert [s.kv_read_tokens for s in steps] == [0, 512]
    assert steps[1].prefill_attn_tokens2 == attn_pairs(488, 512)


def test_prefill_steps_start_after_the_cached_prefix_and_leave_room_for_decoders() -> None:
    steps = prefill_steps(600, 300, 256, decode_seqs=6, decode_kv=1000)
    assert [s.prefill_tokens for s in steps] == [250, 50]
    assert steps[0].kv_read_tokens == 300 + 1000
    assert steps[0].decode_seqs == 6
    # a fully cached prompt still computes its last token
    (only,) = prefill_steps(100, 100, 256)
    assert only.prefill_tokens == 1 and only.kv_read_tokens == 99
    with pytest.raises(ValueError):
        prefill_steps(0, 0, 16)
    with pytest.raises(ValueError):
        prefill_steps(10, 0, 4, decode_seqs=4)


def test_prefill_sample_is_the_mean_step() -> None:
    feats, step = prefill_sample(1000, 0, 512, 3.0)
    assert step == 1.5
    assert feats == mean_features(prefill_steps(1000, 0, 512)).as_tuple()
    assert feats[0] == 500.0


def test_decode_step_and_mean_features() -> None:
    s = decode_step([10, 20, 30])
    assert s == StepFeatures(0, 3, 60, 0)
    m = mean_features([s, StepFeatures(4, 1, 0, 10)])
    assert m.as_tuple() == (2.0, 2.0, 30.0, 5.0)


def test_decode_window_uses_the_span_where_all_streams_decode() -> None:
    # stream a starts at t=0 and emits every 10 ms; b's first token comes 2 steps later; both run
    # in lockstep afterwards; a finishes first
    a = DecodeStream(100, [0.00 + 0.01 * i for i in range(12)])
    b = DecodeStream(50, [0.02 + 0.01 * i for i in range(14)])
    feats, step = decode_window_sample([a, b])  # type: ignore[misc]
    assert step == pytest.approx(0.01)
    # window [0.02, 0.11]: a's tokens 2..11, b's 0..9 -> steps make a's 3..11 and b's 1..9
    assert feats[1] == 2
    assert feats[2] == pytest.approx((100 + 7) + (50 + 5))
    assert decode_window_sample([DecodeStream(10, [0.0, 0.01])]) is None  # too short
    assert decode_window_sample([a, DecodeStream(5, [0.2, 0.21, 0.22, 0.23, 0.3])]) is None


def test_mixed_sample_reads_the_gap_that_ends_with_the_newcomer() -> None:
    # decoders tick every 10 ms; the step ending at 0.13 took 60 ms (it held the newcomer)
    times = [0.01 * i for i in range(8)] + [0.13 + 0.01 * i for i in range(5)]
    d1, d2 = DecodeStream(64, times), DecodeStream(64, [t + 0.0005 for t in times])
    feats, step = mixed_sample([d1, d2], 200, 0, 0.1302, chunk=512)  # type: ignore[misc]
    assert step == pytest.approx(0.06)
    assert feats == (200.0, 2.0, 2 * (64 + 8), attn_pairs(200, 0))
    # a newcomer too long for one step, or one that does not line up, gives nothing
    assert mixed_sample([d1, d2], 600, 0, 0.1302, chunk=512) is None
    assert mixed_sample([d1, d2], 200, 0, 0.105, chunk=512) is None
