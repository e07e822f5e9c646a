"""Profile a real engine through its HTTP API and fit the simulator's performance model to it.

:func:`profile_engine` sweeps batch composition (a :class:`ProfilePlan`: cold prefills, cache
hits, the same appends right after a generation, ``k = 1..N`` decoding streams, decoders plus a
newcomer) with the probes of :mod:`turnstile.calibrate.probes`, which send token-id prompts
(exact lengths, exact prefixes) and time the streamed tokens.

Each measurement becomes a ``(features, step_time)`` sample (:mod:`turnstile.calibrate.features`)
and :func:`turnstile.sim.profile_fit.fit_profile` fits ``b0..b4`` to them (relative least
squares by default: step times span three orders of magnitude), the small-chunk attention term
``b5`` with its knee where it fits better, and the extra cost of a step whose caches are cold
(``cold_step_s``: the cache hits against the warm appends). On llama.cpp ``b0`` is fitted per
forward pass (its server cuts a step into micro-batches of ``-ub`` tokens, per slot unless
``--kv-unified``) and a one-token pass gets its own fixed cost ``b0_one`` (see
:class:`~turnstile.sim.fitted_perf.FittedPerf`). :func:`write_profile` stores the result as a
``turnstile-profile`` file with its provenance: engine kind, model, slots, when, the samples and
the fit's residuals.

Only OpenAI-compatible streaming is required (``POST /v1/completions`` with a token-id prompt),
so the same sweep runs against vLLM; llama.cpp's extra fields are used when present.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

from turnstile.calibrate.client import EngineInfo, EngineRequestError, discover
from turnstile.calibrate.contention import measure_host_contention
from turnstile.calibrate.probes import EngineProber, Measurement, cold_flags
from turnstile.sim.engine_profile import profile_for
from turnstile.sim.fitted_perf import FittedPerf
from turnstile.sim.perf import FEATURES
from turnstile.sim.profile_fit import fit_profile
from turnstile.sim.profiles import llamacpp, vllm

__all__ = [
    "ProfilePlan",
    "ProfileResult",
    "plan_for",
    "profile_engine",
    "write_profile",
]

#: llama.cpp's default logical batch (``-b``): the most tokens one step computes
LLAMACPP_BATCH = llamacpp.BATCH_TOKENS
#: llama.cpp's default physical batch (``-ub``): the most tokens one forward pass computes
LLAMACPP_UBATCH = llamacpp.UBATCH_TOKENS
#: vLLM V1's default ``max_num_batched_tokens`` for online serving (pass the real one)
VLLM_BATCH = vllm.BATCH_TOKENS
#: knees tried for the small-chunk attention term
#: (see :class:`~turnstile.sim.fitted_perf.FittedPerf`)
SMALL_CHUNK_KNEES = (4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
#: the query tokens from which llama.cpp's CPU flash attention runs its tiled kernel
#: (``GGML_FA_TILE_Q`` in ggml-cpu, its tiles 64 × 64): the threshold and the tile tried for the
#: small-chunk term on llama.cpp (each engine's comes from its profile)
LLAMACPP_FA_TILE_Q = llamacpp.FA_TILE_Q


@dataclass
class ProfilePlan:
    """What to measure. :func:`plan_for` builds one from the engine's limits."""

    #: prompt lengths for cold prefills
    prefill_lengths: list[int]
    #: (cached prefix, new suffix) pairs
    cache_hits: list[tuple[int, int]]
    #: concurrent decoding streams
    decode_batches: list[int]
    #: contexts (prompt tokens) of the decoding streams
    decode_contexts: list[int]
    #: (decoders, newcomer prompt) pairs
    mixed: list[tuple[int, int]]
    #: context of the decoders in the mixed measurements
    mixed_context: int = 64
    #: tokens each decoding stream generates
    decode_tokens: int = 32
    #: tokens the prefill and cache-hit probes generate (>= 1)
    probe_tokens: int = 2
    #: each measurement this many times
    repeats: int = 1
    #: (cached prefix, new suffix) pairs sent right after a generation: the cache hits' work
    #: with the caches warm (:meth:`~turnstile.calibrate.probes.EngineProber.warm_append`)
    warm_appends: list[tuple[int, int]] = field(default_factory=list)

    def count(self) -> int:
        per = (
            len(self.prefill_lengths)
            + len(self.cache_hits)
            + len(self.warm_appends)
            + len(self.decode_batches) * len(self.decode_contexts)
            + len(self.mixed)
        )
        return per * self.repeats


def _geometric(lo: int, hi: int, n: int) -> list[int]:
    if hi <= lo:
        return [max(1, hi)]
    vals = np.unique(np.round(np.geomspace(lo, hi, n)).astype(int))
    return [int(v) for v in vals]


def plan_for(
    *,
    max_context: int,
    max_seqs: int,
    chunk: int,
    quick: bool = False,
    decode_tokens: int | None = None,
    repeats: int = 1,
) -> ProfilePlan:
    """A sweep that covers an engine with ``max_seqs`` sequences of up to ``max_context``
    tokens and a per-step budget of ``chunk`` tokens. ``quick`` trims it (tests, smoke runs)."""
    gen = decode_tokens if decode_tokens is not None else (16 if quick else 32)
    ctx = max(64, max_context - gen - 8)  # room for the generated tokens
    n_pre = 4 if quick else 6
    top = min(ctx, chunk)
    prefill = _geometric(16, top, n_pre)
    # suffix lengths off multiples of 64: llama.cpp's CPU kernels run an exact multiple of 64
    # new tokens up to a third faster than one token fewer or more (docs/calibration.md §1),
    # and real turns are almost never such a multiple
    if quick:
        hits = [(ctx // 2, 4), (ctx // 2, 60)]
        warm = [(ctx // 2, 4)]
        contexts = [64, min(ctx, ctx // 2 + 8)]
    else:
        # agent turns mostly append a few tokens to a cached context: sample small suffixes
        hits = [
            (p, s) for p in (ctx // 4, ctx // 2, (ctx * 4) // 5)
            for s in (4, 16, 40, 100, 250, 500)
        ]
        hits = [(p, s) for p, s in hits if p + s <= ctx]
        # the small appends again right after a generation, as agents send them: their caches
        # warm (the prefix, 4 new tokens and 16 generated, then the suffix)
        warm = [(p, s) for p in (ctx // 4, ctx // 2, (ctx * 4) // 5) for s in (1, 4, 16)
                if p + s + 24 <= ctx]
        # decode prompts are a cached prefix + 8 tokens: reuse the cache-hit prefixes
        contexts = [64, min(ctx, ctx // 2 + 8), min(ctx, (ctx * 4) // 5 + 8)]
    if max_seqs <= 8:
        batches = list(range(1, max_seqs + 1))
    else:
        batches = sorted({*(2**i for i in range(0, 12) if 2**i <= max_seqs), max_seqs})
    if quick:
        batches = sorted({1, max_seqs})
    decoders = sorted({1, max(1, max_seqs - 1)}) if max_seqs > 1 else []
    news = [64, 256] if quick else [16, 64, 256, 512]
    mixed = [(k, p) for k in decoders for p in news if p + k <= chunk and p + 8 <= ctx]
    return ProfilePlan(
        prefill_lengths=prefill,
        cache_hits=hits,
        decode_batches=batches,
        decode_contexts=sorted(set(contexts)),
        mixed=mixed,
        decode_tokens=gen,
        repeats=repeats,
        warm_appends=warm,
    )


@dataclass
class ProfileResult:
    perf: FittedPerf
    info: EngineInfo
    measurements: list[Measurement]
    wall_s: float


def profile_engine(
    url: str | Sequence[str],
    *,
    out: str | Path | None = None,
    chunk: int | None = None,
    max_seqs: int | None = None,
    max_context: int | None = None,
    quick: bool = False,
    repeats: int = 1,
    decode_tokens: int | None = None,
    relative: bool = True,
    small_chunk: bool = True,
    ubatch: int | None = None,
    kv_unified: bool = False,
    kv_bytes_per_token: float = 0.0,
    seed: int = 0,
    token_range: tuple[int, int] = (33, 127),
    timeout: float = 600.0,
    plan: ProfilePlan | None = None,
    on_progress: Callable[[str], None] | None = None,
    on_total: Callable[[int], None] | None = None,
    neighbours: Sequence[str] = (),
    contention_rounds: int = 5,
) -> ProfileResult:
    """Measure the engine at ``url`` and fit a :class:`FittedPerf` to it.

    ``url`` may be a list of identical engines (replicas): they are swept at the same time, each
    by its own thread, and one profile is fitted to all their measurements (a configuration's
    step time is the median over engines and repeats). Measuring replicas together also measures
    them under the contention they see when they all serve (shared CPU cores or host links).

    ``chunk`` is the engine's per-step token budget (llama.cpp ``-b``, default 2048; vLLM
    ``max_num_batched_tokens``); ``max_seqs`` its concurrent sequences (llama.cpp slots are
    discovered); ``max_context`` caps prompt lengths (default: the per-sequence context the
    engine reports, at most 4096). ``small_chunk`` also fits the small-chunk attention term
    (kept only where it fits better). ``ubatch`` is llama.cpp's ``-ub`` (default 512; 0: a step
    is one pass, which is how other engines are fitted) and ``kv_unified`` whether it was
    started with ``--kv-unified`` (one KV buffer: a step is cut in batch order, not per slot).
    ``neighbours`` are other engines on the same host (not profiled): after the sweep a few
    probes are timed again while they serve a steady load, and the slowdown per co-running
    engine is the profile's ``host_contention`` (:mod:`turnstile.calibrate.contention`,
    ``contention_rounds`` rounds). ``seed`` draws the random prompts: profiling the same
    engine again needs another seed, or the engine's prompt cache serves the earlier prompts.
    ``on_progress`` is called once per finished measurement with a label, ``on_total`` once with
    the number planned.
    """
    t0 = time.perf_counter()
    urls = [url] if isinstance(url, str) else list(url)
    if not urls:
        raise ValueError("no engine to profile")
    infos = [discover(u) for u in urls]
    info = infos[0]
    if chunk is None:
        chunk = profile_for(info.kind).max_batched_tokens
    seqs = max_seqs or info.n_parallel or 8
    ctx = max_context or min(info.ctx_per_seq or 4096, 4096)
    if info.ctx_per_seq:
        ctx = min(ctx, info.ctx_per_seq)
    if plan is None:
        plan = plan_for(
            max_context=ctx,
            max_seqs=seqs,
            chunk=chunk,
            quick=quick,
            decode_tokens=decode_tokens,
            repeats=repeats,
        )
    if neighbours and len(urls) > 1:
        raise ValueError("neighbours measure one engine's host contention: profile one target")
    if on_total is not None:
        on_total(plan.count() * len(urls) + (6 * contention_rounds if neighbours else 0))
    tick = on_progress or (lambda _label: None)
    raw: dict[str, list[Measurement]] = {}
    skipped: list[str] = []
    lock = threading.Lock()
    probers: list[EngineProber] = []

    def sweep(i: int) -> None:
        prober = EngineProber(infos[i], chunk, seed + 1000 * i, token_range, timeout)
        probers.append(prober)

        def keep(measure: Callable[[], Measurement | None], label: str) -> None:
            try:
                m = measure()
            except EngineRequestError as e:  # one failed probe does not end the sweep
                m = None
                label = f"{label} ({e})"
            with lock:
                if m is None:
                    skipped.append(label)
                else:
                    raw.setdefault(label, []).append(m)
            tick(label)

        prober.warm_up()
        for _ in range(plan.repeats):
            for n in plan.prefill_lengths:
                keep(partial(prober.prefill, n, plan.probe_tokens), f"prefill {n}")
            for p, s in plan.cache_hits:
                keep(partial(prober.cache_hit, p, s, plan.probe_tokens), f"cache hit {p}+{s}")
            for p, s in plan.warm_appends:
                keep(partial(prober.warm_append, p, s, plan.probe_tokens),
                     f"warm append {p}+{s}")
            for c in plan.decode_contexts:
                for k in plan.decode_batches:
                    keep(partial(prober.decode, k, c, plan.decode_tokens), f"decode {k}x{c}")
            for k, p in plan.mixed:
                keep(partial(prober.mixed, k, p, plan.mixed_context), f"mixed {k}+{p}")

    if len(urls) == 1:
        sweep(0)
    else:
        with ThreadPoolExecutor(max_workers=len(urls)) as pool:
            for f in [pool.submit(sweep, i) for i in range(len(urls))]:
                f.result()
    # the sweep's own request overheads: the contention probes under load would inflate them
    overheads = [o for p in probers for o in p.overheads]
    contention = None
    if neighbours:
        contention = measure_host_contention(
            probers[0], [discover(u) for u in neighbours], rounds=contention_rounds,
            seed=seed, token_range=token_range, timeout=timeout, on_progress=tick,
            prefill_tokens=min(256, ctx // 2), cache_hit=(min(768, ctx // 2), 48),
            decode=(min(2, seqs), min(512, ctx // 2), 24))
    # repeats of one configuration: the median step time (robust to a noisy neighbour)
    ms = [_combine(group) for group in raw.values()]
    if len(ms) < 2:
        raise RuntimeError(f"only {len(ms)} usable measurements (skipped: {skipped})")
    samples = [m.sample() for m in ms]
    measured_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    wall = time.perf_counter() - t0
    meta: dict[str, Any] = {
        "target": info.url if len(urls) == 1 else [i.url for i in infos],
        "engines_profiled": len(urls),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "engine_kind": info.kind,
        "n_parallel": info.n_parallel if info.n_parallel else seqs,
        "ctx_per_seq": info.ctx_per_seq,
        "kv_tokens": info.kv_tokens,
        "chunk_tokens": chunk,
        "max_seqs": seqs,
        "sample_count": len(samples),
        "skipped": skipped,
        "plan": asdict(plan),
        "profile_wall_s": round(wall, 3),
        "host": platform.node(),
        "machine": platform.machine(),
        "engine_extra": {k: v for k, v in info.extra.items() if v is not None},
    }
    if overheads:
        meta["request_overhead_s"] = float(median(overheads))
    prof = profile_for(info.kind)  # what this engine does differently
    ub = prof.ubatch_tokens if ubatch is None else ubatch
    tile = (prof.attention_tile_tokens,) if small_chunk and prof.attention_tile_tokens else ()
    meta["kv_unified"] = kv_unified  # the split it implies is in the file's forward_passes
    perf = fit_profile(
        samples,
        relative=relative,
        ubatch_tokens=ub,
        ubatch_split="simple" if kv_unified else prof.ubatch_split,
        one_token_pass=prof.one_token_pass,
        small_chunk_knees=SMALL_CHUNK_KNEES if small_chunk else (),
        small_chunk_thresholds=tile,
        small_chunk_tiles=tile,
        # a cold-step cost only where the profile says which steps are cold
        cold=cold_flags([m.kind for m in ms]) if prof.warm is not None else None,
        kv_bytes_per_token=kv_bytes_per_token,
        engine=info.kind,
        model=info.model,
        measured_at=measured_at,
        meta=meta,
    )
    if contention is not None:
        perf.host_contention = contention.per_engine
        perf.meta["host_contention"] = contention.to_meta()
    perf.meta["fit"]["by_kind"] = _residuals_by_kind(perf, ms)
    perf.meta["samples"] = [
        {
            "kind": m.kind,
            **{f: round(v, 3) for f, v in zip(FEATURES, m.features, strict=True)},
            "step_s": m.step_s,
            "pred_s": _predicted(perf, m),
            "cold": m.cold,
            "steps": m.steps,
            **m.note,
        }
        for m in ms
    ]
    result = ProfileResult(perf, info, ms, time.perf_counter() - t0)
    if out is not None:
        write_profile(result, out)
    return result


def _combine(group: Sequence[Measurement]) -> Measurement:
    """One measurement from repeats of the same configuration: mean features, median time."""
    if len(group) == 1:
        return group[0]
    feats = tuple(float(np.mean([m.features[i] for m in group])) for i in range(4))
    times = [m.step_s for m in group]
    note = {**group[0].note, "repeats": len(group), "spread": float(max(times) / min(times))}
    return Measurement(
        group[0].kind,
        feats,  # type: ignore[arg-type]
        float(median(times)),
        group[0].steps,
        note,
    )


def _predicted(perf: FittedPerf, m: Measurement) -> float:
    """The model's time for the step a measurement timed, cold or warm as it ran."""
    t = perf.step_time(*m.features)  # type: ignore[arg-type]
    return t + perf.cold_step_s if m.cold else t


def _residuals_by_kind(perf: FittedPerf, ms: Sequence[Measurement]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in sorted({m.kind for m in ms}):
        errs = [
            abs(_predicted(perf, m) - m.step_s) / m.step_s
            for m in ms
            if m.kind == kind and m.step_s > 0
        ]
        if errs:
            out[kind] = {
                "samples": len(errs),
                "median_abs_rel_err": float(np.median(errs)),
                "p90_abs_rel_err": float(np.percentile(errs, 90)),
            }
    return out


def write_profile(result: ProfileResult, path: str | Path) -> Path:
    """Write the fitted profile (a ``turnstile-profile`` JSON file) to ``path``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    result.perf.to_profile(out)
    return out
