"""Fitting on synthetic measurements with a known ground truth.

Two paths:

* straight through :func:`fit_profile`: ``(features, step_time)`` samples drawn from a known
  :class:`FittedPerf`, with and without noise;
* through the measurement path this package writes (:mod:`turnstile.calibrate.features`): an
  *emulated engine* — the simulator's own :class:`EngineModel` running the known model — is
  "profiled" the way :mod:`turnstile.calibrate.profile` profiles a real one (prompt times, token
  arrival times of concurrent streams, a newcomer's first token among decoders), the timings are
  turned into samples, and the fit must give the model back.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest

from turnstile.calibrate.features import (
    DecodeStream,
    Sample,
    decode_window_sample,
    mixed_sample,
    prefill_sample,
)
from turnstile.sim.engine import EngineConfig, EngineModel, SimRequest
from turnstile.sim.fitted_perf import FittedPerf
from turnstile.sim.profile_fit import fit_profile

TRUTH = FittedPerf(b0=0.004, b1=2.0e-4, b2=1.5e-3, b3=4.0e-6, b4=3.0e-8, engine="truth")
CHUNK = 512


def _close(fit: FittedPerf, truth: FittedPerf, rel: float) -> None:
    for name, got, want in zip(["b0", "b1", "b2", "b3", "b4"], fit.coefficients, truth.coefficients,
                               strict=True):
        assert got == pytest.approx(want, rel=rel), (name, got, want)


# --- straight through fit_profile -------------------------------------------------------------


def _random_samples(n: int, noise: float, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out: list[Sample] = []
    for _ in range(n):
        kind = rng.choice(["prefill", "decode", "mixed"])
        p = rng.randint(1, 2048) if kind != "decode" else 0
        c = rng.randint(0, 4096) if kind != "decode" else 0
        k = rng.randint(1, 64) if kind != "prefill" else 0
        kv = c + k * rng.randint(16, 4096)
        a2 = p * c + p * (p + 1) / 2
        f = (float(p), float(k), float(kv), a2)
        y = TRUTH.step_time(*f) * (1.0 + rng.uniform(-noise, noise))  # type: ignore[arg-type]
        out.append((f, y))
    return out


@pytest.mark.parametrize("relative", [False, True])
def test_fit_profile_recovers_exact_parameters(relative: bool) -> None:
    fit = fit_profile(_random_samples(60, 0.0, 1), relative=relative)
    _close(fit, TRUTH, 1e-6)
    assert fit.meta["fit"]["r2"] == pytest.approx(1.0)


def test_fit_profile_recovers_parameters_under_noise() -> None:
    fit = fit_profile(_random_samples(400, 0.05, 2), relative=True)
    _close(fit, TRUTH, 0.10)
    assert fit.meta["fit"]["median_abs_rel_err"] < 0.05


# --- through the measurement path: profile an emulated engine ---------------------------------


class EmulatedEngine:
    """The simulator's engine model running ``perf``, observed like an HTTP client observes a
    real engine: when each request's tokens "arrive" (step end times), with optional timing
    noise on every step (multiplicative, uniform in ±noise)."""

    def __init__(self, perf: FittedPerf, chunk: int, noise: float = 0.0, seed: int = 0) -> None:
        cfg = EngineConfig(num_gpu_blocks=4096, block_size=16, max_num_seqs=16,
                           max_batched_tokens=chunk)
        self.perf = perf
        self.engine = EngineModel("emu", cfg, _Noisy(perf, noise, seed))
        self.now = 0.0
        self.tokens: dict[SimRequest, list[float]] = {}
        self._decoding: set[SimRequest] = set()
        self._ids = itertools.count()

    def submit(self, prompt: int, out: int, session: str | None = None) -> SimRequest:
        rid = next(self._ids)
        req = SimRequest(rid, session or f"s{rid}", prompt, out, arrival_s=self.now)
        self.engine.submit(req, self.now)
        self.tokens[req] = []
        return req

    def step(self) -> bool:
        out = self.engine.step(self.now)
        if out is None:
            return False
        self.now += out.duration_s
        for r in self._decoding:
            self.tokens[r].append(self.now)
        for r in out.first_token:
            self.tokens[r].append(self.now)
            self._decoding.add(r)
        for r in out.finished:
            self._decoding.discard(r)
        return True

    def drain(self) -> None:
        while self.step():
            pass

    def idle(self, gap: float = 0.01) -> None:
        self.now += gap


class _Noisy:
    def __init__(self, perf: FittedPerf, noise: float, seed: int) -> None:
        self.perf, self.noise = perf, noise
        self.rng = random.Random(seed)
        self.name = "noisy"
        self.kv_bytes_per_token = 0.0

    def step_time(self, p: int, d: int, kv: int, a2: float = 0.0) -> float:
        t = self.perf.step_time(p, d, kv, a2)
        return t * (1.0 + self.rng.uniform(-self.noise, self.noise)) if self.noise else t


def profile_emulated(emu: EmulatedEngine, chunk: int) -> list[Sample]:
    """The profile sweep's measurements, taken on the emulated engine."""
    samples: list[Sample] = []
    # prefill (cold): TTFT of a lone prompt, some longer than one chunk
    for p in (16, 64, 200, 511, 900, 1500):
        r = emu.submit(p, 2)
        t0 = emu.now
        emu.drain()
        samples.append(prefill_sample(p, r.cached_tokens, chunk, emu.tokens[r][0] - t0))
        emu.idle()
    # cache hits: a session's second turn extends its first
    for i, (p0, suffix) in enumerate(((256, 16), (640, 128), (1200, 300))):
        a = emu.submit(p0, 1, session=f"hit{i}")
        emu.drain()
        b = emu.submit(p0 + suffix, 2, session=f"hit{i}")
        t0 = emu.now
        emu.drain()
        assert b.cached_tokens > 0
        samples.append(prefill_sample(b.prompt_tokens, b.cached_tokens, chunk,
                                      emu.tokens[b][0] - t0))
        del a
        emu.idle()
    # decode: k streams together
    for k, ctx in itertools.product((1, 2, 4, 8), (32, 700)):
        reqs = [emu.submit(ctx, 24) for _ in range(k)]
        emu.drain()
        got = decode_window_sample([DecodeStream(r.prompt_tokens, emu.tokens[r]) for r in reqs])
        assert got is not None
        samples.append(got)
        emu.idle()
    # mixed: a newcomer arrives while k streams decode
    for k, p in itertools.product((1, 3, 7), (40, 300)):
        decs = [emu.submit(64, 40) for _ in range(k)]
        for _ in range(5):
            emu.step()
        new = emu.submit(p, 2)
        emu.drain()
        streams = [DecodeStream(r.prompt_tokens, emu.tokens[r]) for r in decs]
        got = mixed_sample(streams, new.prompt_tokens, new.cached_tokens, emu.tokens[new][0],
                           chunk)
        assert got is not None, (k, p)
        samples.append(got)
        emu.idle()
    return samples


def test_emulated_profile_recovers_exact_parameters() -> None:
    emu = EmulatedEngine(TRUTH, CHUNK)
    samples = profile_emulated(emu, CHUNK)
    # each sample's step time is exactly the model's prediction of its features
    for feats, y in samples:
        assert TRUTH.step_time(*feats) == pytest.approx(y, rel=1e-9)  # type: ignore[arg-type]
    _close(fit_profile(samples, relative=True), TRUTH, 1e-6)


def test_emulated_profile_recovers_parameters_under_timing_noise() -> None:
    emu = EmulatedEngine(TRUTH, CHUNK, noise=0.05, seed=3)
    samples: list[Sample] = []
    for _ in range(3):
        samples += profile_emulated(emu, CHUNK)
    fit = fit_profile(samples, relative=True)
    # the attention-pair term is the smallest share of any step: the loosest tolerance
    for got, want, tol in zip(fit.coefficients, TRUTH.coefficients,
                              (0.15, 0.15, 0.15, 0.25, 0.25), strict=True):
        assert got == pytest.approx(want, rel=tol)


def _sum_steps(samples: Sequence[Sample]) -> float:
    return sum(y for _, y in samples)


def test_emulated_profile_through_profile_records_the_truth_in_a_file(tmp_path) -> None:
    """The fitted model round-trips through a profile file and predicts the emulated steps."""
    emu = EmulatedEngine(TRUTH, CHUNK)
    samples = profile_emulated(emu, CHUNK)
    fit = fit_profile(samples, engine="emulated", model="truth", relative=True)
    path = tmp_path / "profile.json"
    fit.to_profile(path)
    back = FittedPerf.from_profile(path)
    assert back.coefficients == pytest.approx(TRUTH.coefficients, rel=1e-6)
    pred = sum(back.step_time(*f) for f, _ in samples)  # type: ignore[arg-type, misc]
    assert pred == pytest.approx(_sum_steps(samples), rel=1e-9)


# --- forward passes: llama.cpp's micro-batches and its one-token pass ---------------------------

#: a llama.cpp-like truth: b0 paid per forward pass of <= 512 tokens, cut per slot, and a lone
#: token's pass a third of the cost
TRUTH_PASSES = FittedPerf(b0=0.006, b1=2.0e-4, b2=1.5e-3, b3=4.0e-6, b4=3.0e-8, b0_one=0.002,
                          ubatch_tokens=512, ubatch_split="equal", engine="truth")


def test_emulated_profile_recovers_the_per_pass_and_one_token_costs() -> None:
    emu = EmulatedEngine(TRUTH_PASSES, CHUNK)
    samples = profile_emulated(emu, CHUNK)
    fit = fit_profile(samples, relative=True, ubatch_tokens=512, ubatch_split="equal",
                      one_token_pass=True)
    _close(fit, TRUTH_PASSES, 1e-6)
    assert fit.b0_one == pytest.approx(0.002, rel=1e-6)
    # the one-pass model cannot: a mixed step (decoders + newcomer) costs two passes' b0
    plain = fit_profile(samples, relative=True)
    mixed = [(f, y) for f, y in samples if f[0] and f[1]]
    assert mixed
    err = [abs(plain.step_time(*f) - y) / y for f, y in mixed]  # type: ignore[arg-type, misc]
    assert max(err) > 0.05
    err = [abs(fit.step_time(*f) - y) / y for f, y in mixed]  # type: ignore[arg-type, misc]
    assert max(err) < 1e-6


def test_one_token_pass_cost_is_left_unset_without_one_token_samples() -> None:
    samples = [(f, y) for f, y in profile_emulated(EmulatedEngine(TRUTH_PASSES, CHUNK), CHUNK)
               if f[0] + f[1] > 1.5]
    fit = fit_profile(samples, relative=True, ubatch_tokens=512, ubatch_split="equal",
                      one_token_pass=True)
    assert fit.b0_one is None and fit.meta["fit"]["one_token_pass_samples"] == 0
    assert fit.step_time(0, 1, 100) == pytest.approx(fit.b0 + fit.b2 + 100 * fit.b3)
