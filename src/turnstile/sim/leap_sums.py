"""A long decode leap's step times and end times, summed by numpy with the same float
operations, in the same order, as the leap loop of :mod:`turnstile.sim.leap_loop` (so the same
results, bit for bit).

Why it is exact: every iteration's duration is a fixed chain of IEEE-754 double operations on
the decoders' KV tokens (``base + per_kv * kv + overhead + ar_tok + comm``, or the larger of the
two roofline terms first); numpy's element-wise ``multiply``/``add``/``maximum`` on float64
compute each element with exactly those operations (no fused multiply-add, no wider
intermediates), and ``cumsum`` adds left to right, one element after the other, as the loop's
``end += dur`` does (it is not the pairwise summation of ``np.sum``). The KV token counts are
integers below 2**53, converted to doubles exactly either way.

Only worth it for long leaps (a numpy call costs about a microsecond, a loop iteration about a
tenth of one in CPython); the compiled build keeps its C loop (see
``leap_loop._NUMPY_MIN``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: what :func:`leap_durations` returns: (ends: the end after 0..cap iterations, durations)
LeapSums = tuple[Any, Any]


def leap_durations(end: float, kv: int, n_dec: int, cap: int,
                   roof: tuple[float, float, float, float, float, float, float],
                   linear: bool, base: float, per_kv: float) -> LeapSums:
    """The durations of ``cap`` decode iterations from KV ``kv`` on (``n_dec`` more each) and
    the ends after 0, 1, ..., ``cap`` of them from ``end``: what the leap loop computes."""
    c_tok, attn_s, weights_s, kv_s, overhead_s, ar_tok, comm = roof
    kvs = np.arange(kv, kv + n_dec * cap, n_dec)  # int64: exact below 2**53
    if linear:
        durs = kvs * per_kv
        durs += base  # base + x: addition is commutative in IEEE-754, bit for bit
    else:
        durs = kvs * attn_s
        durs += c_tok
        memory = kvs * kv_s
        memory += weights_s
        np.maximum(durs, memory, out=durs)  # equal values are equal bits (all positive)
    durs += overhead_s
    if ar_tok:  # x + 0.0 is x for every positive x: the loop's addition changes nothing
        durs += ar_tok
    if comm:
        durs += comm
    ends = np.empty(cap + 1)
    ends[0] = end
    ends[1:] = durs
    ends.cumsum(out=ends)
    return ends, durs


def first_at_or_after(ends: Any, k: int, until: float) -> int:
    """The first of the first ``k`` iterations that would start at or after ``until`` (``k``
    when none would): where the loop's ``if end >= until: break`` stops."""
    return int(ends[:k].searchsorted(until))


def running_sums(start: float, durs: Any, k: int) -> tuple[float, float]:
    """``start`` plus the first ``k`` durations, and 0.0 plus them, each added one at a time
    (the loop's ``busy_s += dur`` and ``total += dur``): both rows summed in one call."""
    acc = np.empty((2, k + 1))
    acc[0, 0] = start
    acc[1, 0] = 0.0
    acc[:, 1:] = durs[:k]
    acc.cumsum(axis=1, out=acc)
    return float(acc[0, k]), float(acc[1, k])
