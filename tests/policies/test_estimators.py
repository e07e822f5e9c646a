"""The shared online estimators: windows, prefix trees, level bounds, the two tool keys."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnstile.policies.estimators import (
    LevelBounds,
    PrefixTree,
    QuantileTracker,
    RecentWindow,
    return_code,
)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=60), st.integers(1, 40),
       st.floats(0.0, 1.0))
def test_window_matches_numpy_on_the_last_values(xs: list[float], size: int, q: float) -> None:
    w = RecentWindow(size)
    for x in xs:
        w.add(x)
    tail = np.asarray(xs[-size:])
    assert len(w) == tail.size
    assert w.mean == pytest.approx(float(tail.mean()), rel=1e-9, abs=1e-6)
    assert w.quantile(q) == pytest.approx(float(np.quantile(tail, q)), rel=1e-9, abs=1e-6)
    assert w.rank_quantile(q) in set(tail.tolist())


def test_quantile_tracker_waits_for_samples() -> None:
    t = QuantileTracker(0.5, window=8, every=1, min_samples=3)
    t.add(1.0)
    t.add(2.0)
    assert t.q == float("inf")
    t.add(3.0)
    assert t.q == 2.0


def test_return_code_format() -> None:
    assert return_code("Bash", 10, "error") == "Bash:small:failure"
    assert return_code("Read", 300, "ok") == "Read:medium:success"
    assert return_code("Read", 5000, "timeout") == "Read:large:timeout"
    assert return_code("Edit", None, "ok") == "Edit:unknown:success"


def test_prefix_tree_deepest_trusted_node() -> None:
    tree = PrefixTree(window=10)
    for _ in range(3):
        tree.observe(["a", "b"], [100.0, 60.0, 10.0])
    tree.observe(["a", "c"], [50.0, 40.0, 5.0])
    depth, obs = tree.lookup(["a", "b", "z"], min_obs=3)  # type: ignore[misc]
    assert depth == 2 and obs.mean == 10.0
    depth, obs = tree.lookup(["a", "c"], min_obs=3)  # type: ignore[misc]
    assert depth == 1 and obs.mean == pytest.approx((60 * 3 + 40) / 4)
    assert tree.lookup(["x"], min_obs=5) is None


def test_level_bounds_split_the_token_mass_by_gpu_share() -> None:
    b = LevelBounds(min_obs=4)
    assert b.level(5_000, (8, 8)) == 0 and b.level(7_000, (8, 8)) == 1  # default bound 6,000
    for x in [100.0] * 90 + [10_000.0] * 10:
        b.observe(x)
    # the 10 long trajectories hold 91.7% of the tokens; half the GPUs → bound at 10,000
    assert b.current((8, 8)) == (10_000.0,)
    assert b.level(100, (8, 8)) == 0
