"""The host-steadiness verdict: quiet only when every check is steady and all agree."""

from __future__ import annotations

import pytest

from turnstile.calibrate.steadiness import Steadiness, steadiness_verdict


def check(label: str, *times: float) -> Steadiness:
    return Steadiness(label, 400, tuple(times))


def test_statistics_of_one_check() -> None:
    c = check("a", 0.9, 1.0, 1.1)
    assert c.median_s == pytest.approx(1.0)
    assert c.cv == pytest.approx((2 / 3) ** 0.5 * 0.1)
    assert c.to_dict()["times_s"] == [0.9, 1.0, 1.1]


def test_steady_checks_at_one_speed_are_a_quiet_host() -> None:
    quiet, line = steadiness_verdict([check("before", 0.76, 0.77, 0.75),
                                      check("after", 0.78, 0.79, 0.77)])
    assert quiet
    assert "before 760 ms" in line and "after 780 ms" in line and "2.6% apart" in line
    assert "A quiet host" in line


def test_a_noisy_check_or_a_drift_between_checks_is_not_quiet() -> None:
    noisy = check("before", 0.9, 1.4, 1.1)
    assert noisy.cv > 0.05
    quiet, line = steadiness_verdict([noisy])
    assert not quiet and "Not a quiet host" in line
    # each check steady, but the host 30% slower at the second
    quiet, line = steadiness_verdict([check("a", 1.0, 1.0), check("b", 1.3, 1.3)])
    assert not quiet and "30.0% apart" in line
    assert steadiness_verdict([check("a", 1.0, 1.0), check("b", 1.3, 1.3)],
                              drift_max=0.35)[0]


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError):
        check("a")
    with pytest.raises(ValueError):
        check("a", 0.0, 1.0)
    with pytest.raises(ValueError):
        steadiness_verdict([])
