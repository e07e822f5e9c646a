"""C-MLFQ through the real scheduler core: Libra's rules (``cmlfq``) and turnstile's variant
(``cmlfq-adaptive``), plus the load-balance control and the length predictor."""

from __future__ import annotations

import pytest

from turnstile.core.state import EngineLoad
from turnstile.policies import ROUTING
from turnstile.policies.buckets import LeastOpenRouting, LengthPredictRouting
from turnstile.policies.cmlfq import AdaptiveCmlfqRouting, CmlfqRouting
from turnstile.policies.estimators import LevelBounds
from turnstile.workload.model import ToolStatus

from .rollout_driver import Driver, trajectory, two_level

LEVEL0 = {"a0", "a1"}


def history(d: Driver, n: int, status: ToolStatus, remaining: int, *, step: int = 0,
            tag: str = "") -> None:
    """``n`` finished trajectories: a 50-token turn, one ``Bash`` return, then ``remaining``."""
    for i in range(n):
        d.run(trajectory(f"h{tag}-{status}-{remaining}-{i}", [50, remaining],
                         [("Bash", status)], prompt=f"hist{i}", step=step))


def libra(**kw: object) -> CmlfqRouting:
    """Libra's rules: every trajectory starts in the first bucket (``start="level0"``)."""
    kw.setdefault("start", "level0")
    return CmlfqRouting(bounds=LevelBounds(bounds=(5000,)), min_obs=4, rebuild_every=1, **kw)


def test_registered_by_name() -> None:
    for name in ("cmlfq", "cmlfq-adaptive", "least-open", "length-predict"):
        assert name in ROUTING
        assert ROUTING.create(name).name == name


def test_every_trajectory_starts_in_the_shortest_bucket() -> None:
    d = Driver(libra(balance=False))  # Libra's rule, whatever the load
    engines = {d.start(trajectory(f"t{i}", [100, 100], [("Bash", "ok")])) for i in range(6)}
    assert engines == LEVEL0  # least connections spreads them over level 0's engines


def test_balance_starts_in_the_shortest_bucket_until_it_is_oversubscribed() -> None:
    d = Driver(libra())
    first = [d.start(trajectory(f"t{i}", [100, 100], [("Bash", "ok")])) for i in range(2)]
    assert set(first) == LEVEL0  # the shortest bucket while it is not queued deeper
    more = [d.start(trajectory(f"u{i}", [100, 100], [("Bash", "ok")])) for i in range(6)]
    # past one open trajectory per GPU above the pool's mean, starts go to the idle bucket
    # instead of piling onto level 0 (0.26x least-open at the README's rollout command)
    assert more.count("b0") == 2  # Libra's rule: all 8 on a0/a1, 4 each
    assert more.count("a0") == more.count("a1") == 2


def test_moves_only_when_a_tool_returns_and_the_tree_agrees() -> None:
    d = Driver(libra())
    history(d, 8, "error", 20_000)  # a failure predicts a long remainder
    history(d, 8, "ok", 10)  # a success predicts a short one
    # step 1: the trees are rebuilt from step 0's trajectories
    fail = trajectory("f", [50, 100, 100], [("Bash", "error"), ("Bash", "ok")])
    ok = trajectory("s", [50, 100], [("Bash", "ok")])
    assert d.start(fail) in LEVEL0 and d.start(ok) in LEVEL0
    assert d.step(fail) == "b0"  # the failure's code maps mean and p90 to level 1
    assert d.step(ok) in LEVEL0
    assert d.routing.moves == 1


def test_no_move_when_mean_and_p90_disagree() -> None:
    d = Driver(libra())
    # 85% of the trajectories after a failure are short, 15% very long: mean < 5,000 < p90
    history(d, 17, "error", 10, tag="s")
    history(d, 3, "error", 30_000, tag="l")
    t = trajectory("t", [50, 100], [("Bash", "error")])
    d.start(t)
    assert d.step(t) in LEVEL0
    assert d.routing.moves == 0


def test_trees_are_rebuilt_every_few_steps() -> None:
    d = Driver(CmlfqRouting(bounds=LevelBounds(bounds=(5000,)), min_obs=4, rebuild_every=2,
                            start="level0"))
    d.run(trajectory("t2", [50], [], step=2))  # step 2: a rebuild (from nothing)
    history(d, 8, "error", 20_000, step=2)
    t3 = trajectory("t3", [50, 100], [("Bash", "error")], step=3)
    d.start(t3)
    assert d.step(t3) in LEVEL0  # step 3: the trees still date from step 2's start
    t4 = trajectory("t4", [50, 100], [("Bash", "error")], step=4)
    d.start(t4)
    assert d.step(t4) == "b0"  # step 4: rebuilt with step 2's trajectories
    assert d.routing.rebuilds == 2


def test_least_connections_with_a_cap() -> None:
    d = Driver(libra(cap=1))
    first = [d.start(trajectory(f"t{i}", [100, 100], [("Bash", "ok")])) for i in range(2)]
    assert sorted(first) == ["a0", "a1"]
    # both level-0 engines hold one open trajectory: the cap lets least connections pick
    # either (nothing below the cap), but never leaves level 0
    assert d.start(trajectory("t2", [100], [])) in LEVEL0


def test_adaptive_demotes_by_attained_tokens() -> None:
    # idle_load=0: an empty fast level does not pull trajectories (work conservation off)
    d = Driver(AdaptiveCmlfqRouting(bounds=LevelBounds(bounds=(1000,)), min_dwell_turns=1,
                                    cost_aware=False, idle_load=0.0))
    t = trajectory("t", [600, 600, 100], [("Bash", "ok"), ("Bash", "ok")])
    assert d.start(t) in LEVEL0
    assert d.step(t) in LEVEL0  # 600 attained: still level 0
    assert d.step(t) == "b0"  # 1,200 attained: past the bound
    assert d.routing.moves_by_reason == {"attained": 1}


def test_adaptive_move_must_pay_for_the_reprefill() -> None:
    engines = two_level()
    engines[2] = EngineLoad("b0", 400_000, tp=4, tpot_s=0.005,
                            prefill_s_per_token=1e-4)  # re-prefilling on b0 is slow
    d = Driver(AdaptiveCmlfqRouting(bounds=LevelBounds(bounds=(1000,)), min_dwell_turns=1,
                                    idle_load=0.0, same_step=True), engines)
    for i in range(6):  # trajectories that passed 1,200 tokens ended right after
        d.run(trajectory(f"h{i}", [1200, 2], [("Bash", "ok")], prompt=f"h{i}"))
    t = trajectory("t", [1200, 2], [("Bash", "ok")])
    d.start(t)
    # 1,200 attained asks for level 1, but ~2 tokens are left: the move does not pay
    assert d.step(t) in LEVEL0
    assert d.routing.blocked_by_cost >= 1


@pytest.mark.parametrize("router", ["cmlfq", "cmlfq-adaptive", "least-open", "length-predict"])
def test_draining_engines_get_no_new_work(router: str) -> None:
    d = Driver(ROUTING.create(router))
    t = trajectory("t", [100, 100, 100], [("Bash", "ok"), ("Bash", "ok")])
    home = d.start(t)
    d.sched.drain_engine(d.now, home)
    for i in range(4):
        assert d.start(trajectory(f"n{i}", [10], [])) != home
    nxt = d.step(t)
    assert nxt is not None and nxt != home  # the paused trajectory moves at its next turn


def test_least_open_is_sticky_and_counts_paused_sessions() -> None:
    d = Driver(LeastOpenRouting())
    a = trajectory("a", [100, 100], [("Bash", "ok")])
    first = d.start(a)
    d.now += 1.0
    d.sched.turn_finished(d.now, "a", 0)  # now paused in its tool call: still open there
    second = d.start(trajectory("b", [10], []))
    assert second != first
    d.sched.tool_finished(d.now, "a", 0)
    assert d.path["a"][-1] == first  # sticky: its KV is there


def test_length_predict_routes_long_prompts_to_the_fast_level() -> None:
    d = Driver(LengthPredictRouting(same_step=True))
    for i in range(24):  # prompt "long*" trajectories are long, "short*" ones short
        d.run(trajectory(f"l{i}", [20_000], [], prompt=f"long{i % 3}"))
        d.run(trajectory(f"s{i}", [50], [], prompt=f"short{i % 3}"))
    assert d.start(trajectory("L", [10], [], prompt="long0")) == "b0"
    assert d.start(trajectory("S", [10], [], prompt="short0")) in LEVEL0
