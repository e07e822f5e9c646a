"""From timed requests to ``(features, step_time)`` samples for ``fit_profile``.

The features are the simulator's (:mod:`turnstile.sim.perf`), computed exactly as
:class:`~turnstile.sim.engine.EngineModel` computes them, so a fitted profile predicts the steps
the simulator will ask about:

* a prefill chunk of ``n`` tokens after ``c`` already-computed ones (cached prefix or earlier
  chunks) adds ``n`` prefill tokens, ``c`` KV-read tokens and ``n·c + n(n+1)/2`` attention pairs;
  a prompt longer than the per-step token budget is split into chunks of the budget;
* a decoding sequence whose prompt was ``p`` tokens, in the step that produces its ``j``-th
  output token (``j ≥ 2``), adds one decode sequence and ``p + j − 1`` KV-read tokens.

A measurement that spans several engine steps (a chunked prefill, a window of decode steps) is
one sample: the *mean* features of its steps against the *mean* step time. The model is linear,
so ``Σ step_time = n·b0 + b·Σ features`` and dividing by ``n`` loses nothing.

Measurements come in three shapes (see :mod:`turnstile.calibrate.profile` for the sweep):

:func:`prefill_sample`
    one request's prompt processing time (llama.cpp's ``timings.prompt_ms`` or the TTFT);
:func:`decode_window_sample`
    ``k`` streams decoding together: the window where all of them decode, step time from the
    token inter-arrival times;
:func:`mixed_sample`
    ``k`` streams decoding while a new prompt is prefilled: the decoders' inter-token gap that
    ends with the newcomer's first token is one mixed step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

__all__ = [
    "DecodeStream",
    "Sample",
    "StepFeatures",
    "attn_pairs",
    "decode_step",
    "decode_window_sample",
    "mean_features",
    "mixed_sample",
    "prefill_sample",
    "prefill_steps",
]


@dataclass(frozen=True, slots=True)
class StepFeatures:
    """One engine step (or the mean of several), in the simulator's four features."""

    prefill_tokens: float = 0.0
    decode_seqs: float = 0.0
    kv_read_tokens: float = 0.0
    prefill_attn_tokens2: float = 0.0

    def as_tuple(self) -> tuple[float, float, float, float]:
        return (
            self.prefill_tokens,
            self.decode_seqs,
            self.kv_read_tokens,
            self.prefill_attn_tokens2,
        )

    def __add__(self, other: StepFeatures) -> StepFeatures:
        return StepFeatures(
            self.prefill_tokens + other.prefill_tokens,
            self.decode_seqs + other.decode_seqs,
            self.kv_read_tokens + other.kv_read_tokens,
            self.prefill_attn_tokens2 + other.prefill_attn_tokens2,
        )


#: ``(features, seconds per step)``, what :func:`turnstile.sim.profile_fit.fit_profile` takes
Sample = tuple[tuple[float, float, float, float], float]


def attn_pairs(n: int, c: int) -> float:
    """Causal attention pairs of a chunk of ``n`` tokens after ``c`` computed ones."""
    return float(n * c + n * (n + 1) / 2)


def decode_step(kv_lengths: Sequence[int]) -> StepFeatures:
    """A decode-only step; ``kv_lengths[i]`` is sequence ``i``'s KV read this step
    (prompt + j − 1 when it produces its ``j``-th output token)."""
    return StepFeatures(0.0, float(len(kv_lengths)), float(sum(kv_lengths)), 0.0)


def prefill_steps(
    prompt_tokens: int,
    cached_tokens: int,
    chunk: int,
    *,
    decode_seqs: int = 0,
    decode_kv: int = 0,
) -> list[StepFeatures]:
    """The steps that prefill one prompt (``cached_tokens`` of it hit the prefix cache) with a
    per-step token budget ``chunk``, next to ``decode_seqs`` decoders reading ``decode_kv`` KV
    tokens per step (the budget left for the prompt is ``chunk − decode_seqs``)."""
    if prompt_tokens < 1:
        raise ValueError("prompt_tokens must be >= 1")
    budget = chunk - decode_seqs
    if budget < 1:
        raise ValueError(f"chunk {chunk} leaves no budget next to {decode_seqs} decoders")
    # at least one token is always computed (the engine needs the last position's logits)
    c = min(max(cached_tokens, 0), prompt_tokens - 1)
    steps: list[StepFeatures] = []
    while c < prompt_tokens:
        n = min(budget, prompt_tokens - c)
        steps.append(
            StepFeatures(
                float(n),
                float(decode_seqs),
                float(c + decode_kv),
                attn_pairs(n, c),
            )
        )
        c += n
    return steps


def mean_features(steps: Sequence[StepFeatures]) -> StepFeatures:
    if not steps:
        raise ValueError("no steps")
    total = StepFeatures()
    for s in steps:
        total = total + s
    k = float(len(steps))
    return StepFeatures(*(v / k for v in total.as_tuple()))


def prefill_sample(prompt_tokens: int, cached_tokens: int, chunk: int, seconds: float) -> Sample:
    """A lone prompt's processing time → one sample (mean over its chunks)."""
    steps = prefill_steps(prompt_tokens, cached_tokens, chunk)
    return mean_features(steps).as_tuple(), seconds / len(steps)


@dataclass(frozen=True, slots=True)
class DecodeStream:
    """One streamed request: prompt length (cached part included) and per-token arrival times
    (``token_times[0]`` is the first token, produced by the prefill)."""

    prompt_tokens: int
    token_times: Sequence[float]


def decode_window_sample(streams: Sequence[DecodeStream], min_steps: int = 3) -> Sample | None:
    """``k`` streams decoding together → one sample, or ``None`` when the window where all of
    them decode is shorter than ``min_steps`` steps.

    The window runs from the last first token (every stream is decoding after it) to the first
    last token (no stream has finished before it). Each stream's tokens inside the window give
    its mean step time; the streams advance in lockstep, so the sample's step time is their
    median and its KV read the sum of each stream's mean ``prompt + j − 1``.
    """
    if not streams or any(len(s.token_times) < 2 for s in streams):
        return None
    lo = max(s.token_times[0] for s in streams)
    hi = min(s.token_times[-1] for s in streams)
    if hi <= lo:
        return None
    per_stream: list[float] = []
    kv = 0.0
    for s in streams:
        idx = [q for q, t in enumerate(s.token_times) if lo <= t <= hi]
        # a chunk may carry several tokens at one time: use the distinct first/last positions
        if len(idx) < 2:
            return None
        a, b = idx[0], idx[-1]
        if b - a < min_steps:
            return None
        per_stream.append((s.token_times[b] - s.token_times[a]) / (b - a))
        # steps produce 0-based tokens a+1..b; token q (0-based) reads prompt + q KV tokens
        kv += s.prompt_tokens + (a + 1 + b) / 2.0
    step = median(per_stream)
    return (0.0, float(len(streams)), kv, 0.0), step


def mixed_sample(
    decoders: Sequence[DecodeStream],
    newcomer_prompt: int,
    newcomer_cached: int,
    newcomer_first_token_s: float,
    chunk: int,
    *,
    tolerance: float = 0.35,
) -> Sample | None:
    """Decoders running while a newcomer's prompt is prefilled in one step → one sample.

    For each decoder, the token arriving nearest the newcomer's first token (within
    ``tolerance`` of the gap before it) was produced by the same step; the gap before it is the
    mixed step's duration. ``None`` when the prompt needs several steps, a decoder was not
    decoding then, or the times do not line up.
    """
    k = len(decoders)
    n = newcomer_prompt - min(max(newcomer_cached, 0), newcomer_prompt - 1)
    if k == 0 or n > chunk - k:
        return None
    gaps: list[float] = []
    kv = 0.0
    for d in decoders:
        tt = d.token_times
        if len(tt) < 3:
            return None
        q = min(range(len(tt)), key=lambda i: abs(tt[i] - newcomer_first_token_s))
        if q < 1 or q >= len(tt):
            return None
        gap = tt[q] - tt[q - 1]
        if gap <= 0 or abs(tt[q] - newcomer_first_token_s) > tolerance * gap:
            return None
        gaps.append(gap)
        kv += d.prompt_tokens + q
    c = newcomer_prompt - n
    feats = StepFeatures(float(n), float(k), kv + c, attn_pairs(n, c))
    return feats.as_tuple(), median(gaps)
