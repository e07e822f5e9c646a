"""Fitting :class:`~turnstile.sim.fitted_perf.FittedPerf` to measured step times.

:func:`fit_profile` takes ``(features, step_time)`` samples (what ``turnstile profile``
measures, :mod:`turnstile.calibrate.profile`) and solves for the coefficients by non-negative
least squares (:func:`nnls`), trying the small-chunk attention term's knees, thresholds and
tiles, and keeps whichever fits best.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from turnstile.sim.engine_profile import WarmRule
from turnstile.sim.fitted_perf import FittedPerf, forward_passes, tile_pairs
from turnstile.sim.perf import FEATURES

__all__ = ["Sample", "fit_profile", "nnls"]

Sample = tuple[Sequence[float], float]


def nnls(a: np.ndarray, b: np.ndarray, tol: float | None = None) -> np.ndarray:
    """Non-negative least squares ``min ||a x − b||, x ≥ 0`` (Lawson–Hanson active set)."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    m, n = a.shape
    if tol is None:
        tol = 10.0 * np.finfo(float).eps * np.linalg.norm(a, 1) * max(m, n)
    passive = np.zeros(n, dtype=bool)
    x = np.zeros(n)
    w = a.T @ (b - a @ x)
    for _ in range(3 * n + 10):
        if passive.all() or w[~passive].max() <= tol:
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            s = np.zeros(n)
            s[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if s[passive].min() > 0:
                break
            neg = passive & (s <= 0)
            alpha = np.min(x[neg] / (x[neg] - s[neg]))
            x = x + alpha * (s - x)
            passive &= x > tol
            x[~passive] = 0.0
        x = s
        w = a.T @ (b - a @ x)
    return x


def _nnls_scaled(x: np.ndarray, y: np.ndarray, wgt: np.ndarray) -> np.ndarray:
    """Weighted NNLS with columns scaled to unit norm (features span ten orders of magnitude)."""
    a = x * wgt[:, None]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    return nnls(a / scale, y * wgt) / scale


def _with_small_chunk(x: np.ndarray, k: float, rule: str) -> np.ndarray:
    """The fit's rows ``x`` (the prefill tokens in column 1, the attention pairs in column 4)
    with the small-chunk term's column for knee, threshold or tile ``k`` added; with the
    ``tiles`` rule the attention column of the rows from ``k`` prefill tokens on counts tiles
    (:func:`tile_pairs`)."""
    p, attn = x[:, 1], x[:, 4]
    if rule == "knee":
        return np.column_stack([x, attn * k / (k + p)])
    small = np.where(p < k, attn, 0.0)
    if rule == "tiles":
        x = x.copy()
        x[:, 4] = [a if n < k else tile_pairs(n, a, int(k)) for n, a in zip(p, attn, strict=True)]
    return np.column_stack([x, small])


def fit_profile(
    samples: Iterable[Sample],
    *,
    relative: bool = False,
    kv_bytes_per_token: float = 0.0,
    engine: str = "",
    model: str = "",
    measured_at: str = "",
    meta: dict[str, Any] | None = None,
    small_chunk_knees: Sequence[float] = (),
    small_chunk_thresholds: Sequence[float] = (),
    small_chunk_tiles: Sequence[float] = (),
    ubatch_tokens: int = 0,
    ubatch_split: str = "simple",
    one_token_pass: bool = False,
    cold: Sequence[bool] | None = None,
    warm: WarmRule | None = None,
) -> FittedPerf:
    """Fit :class:`FittedPerf` to measured ``(features, step_time_s)`` samples.

    ``small_chunk_knees``: candidate knees ``k`` of the small-chunk attention term; each is
    fitted (its column ``attn2·k/(k + prefill)`` beside the linear ones) and the knee with
    the smallest weighted error is kept, or none when no knee beats the model without it by 2%
    (empty: no such term). ``small_chunk_thresholds`` are candidates for the same term with the
    ``below`` rule (column ``attn2`` where ``prefill < k``), tried after the knees in the same
    way (each kept only if it beats the best so far by 2%), whichever their rule;
    ``small_chunk_tiles`` for the ``tiles`` rule (the same column, and the attention from ``k``
    prefill tokens on counted in ``k × k`` tiles), tried last, kept on the same terms.

    ``ubatch_tokens`` and ``ubatch_split`` say how the engine cuts a step into forward passes
    (:func:`forward_passes`): ``b0`` is then fitted per pass. With ``one_token_pass`` a pass of
    one token gets its own fixed cost ``b0_one`` (kept only when some sample has such a pass).

    ``cold`` says, sample by sample, whether the step ran with the engine's caches cold
    (the engine profile's :class:`~turnstile.sim.engine_profile.WarmRule`): with both kinds
    among the samples the extra cost of a cold step, ``cold_step_s``, is fitted too (else it
    stays 0); the result then needs a warm rule, ``warm`` or the profile of ``engine``.

    ``features`` is ``(prefill_tokens, decode_seqs, kv_read_tokens[, prefill_attn_tokens2])``.
    Coefficients are constrained non-negative (a negative per-token cost would make bigger
    batches faster). Columns are scaled before solving, so features of very different
    magnitudes (attention pairs ~1e8 vs decode seqs ~10) are fitted equally well. With
    ``relative`` each sample is weighted by ``1 / step_time`` (minimises relative error, which
    is what TTFT fidelity cares about when step times span orders of magnitude).
    """
    passes = bool(ubatch_tokens) or one_token_pass
    rows: list[list[float]] = []
    ones: list[float] = []
    ys: list[float] = []
    for feats, step_s in samples:
        f = [float(v) for v in feats]
        if len(f) == 3:
            f.append(0.0)
        if len(f) != 4:
            raise ValueError(f"a sample needs 3 or 4 features {FEATURES}, got {len(f)}")
        if passes:
            multi, one = forward_passes(f[0], f[1], ubatch_tokens, ubatch_split)
            if not one_token_pass:
                multi, one = multi + one, 0
        else:
            multi, one = 1, 0
        rows.append([float(multi), *f])
        ones.append(float(one))
        ys.append(float(step_s))
    if len(rows) < 2:
        raise ValueError(f"need at least 2 samples to fit, got {len(rows)}")
    x = np.asarray(rows)
    y = np.asarray(ys)
    # the one-token pass column only where some sample has such a pass (else b0_one is b0)
    with_one = one_token_pass and any(ones)
    if with_one:
        x = np.column_stack([x, np.asarray(ones)])
    if cold is not None and len(cold) != len(ys):
        raise ValueError(f"cold has {len(cold)} flags for {len(ys)} samples")
    with_cold = cold is not None and any(cold) and not all(cold)
    if with_cold:
        assert cold is not None
        x = np.column_stack([x, np.asarray(cold, dtype=float)])
    if relative:
        if (y <= 0).any():
            raise ValueError("relative=True needs positive step times")
        wgt = 1.0 / y
    else:
        wgt = np.ones_like(y)
    coef = _nnls_scaled(x, y, wgt)
    sse = float((((x @ coef) - y) * wgt) ** 2 @ np.ones_like(y))
    knee = 0.0
    rule = "knee"
    candidates = [(k, "knee") for k in small_chunk_knees]
    candidates += [(k, "below") for k in small_chunk_thresholds]
    candidates += [(k, "tiles") for k in small_chunk_tiles]
    for k, r in candidates:
        if k <= 0 or (r == "tiles" and k < 1):
            raise ValueError(f"small-chunk knees, thresholds and tiles must be > 0, got {k}")
        xk = _with_small_chunk(x, k, r)
        ck = _nnls_scaled(xk, y, wgt)
        sse_k = float((((xk @ ck) - y) * wgt) ** 2 @ np.ones_like(y))
        if ck[-1] > 0 and sse_k < 0.98**2 * sse:
            coef, sse, knee, rule = ck, sse_k, float(k), r
    if knee:
        x = _with_small_chunk(x, knee, rule)
    pred = x @ coef
    resid = y - pred
    ss_tot = float(((y - y.mean()) ** 2).sum())
    stats = {
        "samples": len(ys),
        "rmse_s": float(np.sqrt((resid**2).mean())),
        "median_abs_rel_err": float(np.median(np.abs(resid) / np.maximum(np.abs(y), 1e-12))),
        "r2": 1.0 - float((resid**2).sum()) / ss_tot if ss_tot > 0 else 1.0,
        "relative": relative,
        "small_chunk_tokens": knee,
        "small_chunk_rule": rule,
        "one_token_pass_samples": int(sum(1 for o in ones if o)),
        "cold_samples": int(sum(map(bool, cold))) if with_cold and cold is not None else 0,
    }
    b0, b1, b2, b3, b4 = (float(c) for c in coef[:5])
    return FittedPerf(
        b0=b0, b1=b1, b2=b2, b3=b3, b4=b4,
        b5=float(coef[-1]) if knee else 0.0,
        small_chunk_tokens=knee,
        small_chunk_rule=rule,
        b0_one=float(coef[5]) if with_one else None,
        cold_step_s=float(coef[6 if with_one else 5]) if with_cold else 0.0,
        warm=warm,
        ubatch_tokens=ubatch_tokens,
        ubatch_split=ubatch_split,
        kv_bytes_per_token=kv_bytes_per_token,
        engine=engine,
        model=model,
        measured_at=measured_at,
        meta={**(meta or {}), "fit": stats},
    )
