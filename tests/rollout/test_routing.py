"""C-MLFQ demotion, hysteresis and aging on hand-made trajectories; the baselines' contracts."""

from __future__ import annotations

import itertools

import pytest

from turnstile.core.registry import UnknownNameError
from turnstile.rollout.routing import (
    ROLLOUT_ROUTING,
    CMLFQRouter,
    LevelBounds,
    LoadBalanceRouter,
    PrefixTree,
    RolloutRouter,
    create_router,
)
from turnstile.rollout.state import PoolView, ToolResult, TrajectoryState, tool_key
from turnstile.workload.model import ToolStatus

from .conftest import two_level_pool


class Manual:
    """A minimal driver: the same calls, in the same order, as the simulator makes."""

    def __init__(self, router: RolloutRouter, pool: PoolView) -> None:
        self.router = router
        self.pool = pool
        self.now = 0.0

    def place(self, st: TrajectoryState) -> str:
        eid = self.router.place(st, self.pool, self.now)
        assert self.pool[eid].accepting
        if st.engine != eid:
            if st.engine is not None:
                old = self.pool[st.engine]
                old.open_trajectories -= 1
                old.open_tokens -= st.context_tokens
                old.open_attained_tokens -= st.attained_output_tokens
                st.migrations += 1
            new = self.pool[eid]
            new.open_trajectories += 1
            new.open_tokens += st.context_tokens
            new.open_attained_tokens += st.attained_output_tokens
            st.engine = eid
        return eid

    def finish_turn(self, st: TrajectoryState, out: int) -> None:
        self.now += 1.0
        st.turns_done += 1
        st.attained_output_tokens += out
        st.context_tokens += out + 20
        if st.engine is not None:
            self.pool[st.engine].open_attained_tokens += out
            self.pool[st.engine].open_tokens += out + 20
        self.router.on_turn_finished(st, out, self.now)

    def tool(self, st: TrajectoryState, status: ToolStatus, name: str = "Bash") -> None:
        res = ToolResult(name, status, 10, 0.1)
        st.tool_keys.append(res.key)
        self.router.on_tool_result(st, res, self.now)

    def done(self, st: TrajectoryState) -> None:
        st.done_s = self.now
        e = self.pool[st.engine] if st.engine else None
        if e is not None:
            e.open_trajectories -= 1
            e.open_tokens -= st.context_tokens
            e.open_attained_tokens -= st.attained_output_tokens
        self.router.on_trajectory_done(st, self.now)


def traj(tid: str, step: int = 1, prompt: str = "new") -> TrajectoryState:
    return TrajectoryState(tid, prompt, step=step, prompt_tokens=100)


def history(m: Manual, n: int, status: ToolStatus, remaining: int, prompt: str = "hist") -> None:
    """``n`` step-0 trajectories: one 50-token turn, one tool return, then ``remaining``."""
    for i in range(n):
        st = traj(f"h-{status}-{remaining}-{i}", step=0, prompt=f"{prompt}{i}")
        m.place(st)
        m.finish_turn(st, 50)
        m.tool(st, status)
        m.place(st)
        m.finish_turn(st, remaining)
        m.done(st)


def test_tool_key_format() -> None:
    assert tool_key("Bash", 10, "error") == "Bash:small:failure"
    assert tool_key("Read", 300, "ok") == "Read:medium:success"
    assert tool_key("Read", 5000, "timeout") == "Read:large:timeout"
    assert tool_key("Edit", None, "ok") == "Edit:unknown:success"


def test_every_trajectory_starts_at_the_top_level(pool: PoolView) -> None:
    m = Manual(CMLFQRouter(bounds=LevelBounds(bounds=(1000,))), pool)
    for i in range(6):
        assert pool[m.place(traj(f"t{i}"))].level == 0


def test_demotion_by_attained_tokens(pool: PoolView) -> None:
    r = CMLFQRouter(bounds=LevelBounds(bounds=(1000,)), min_dwell_turns=1, fill_idle=False)
    m = Manual(r, pool)
    st = traj("t")
    assert pool[m.place(st)].level == 0
    m.finish_turn(st, 400)
    m.tool(st, "ok")
    assert pool[m.place(st)].level == 0  # 400 attained: still short
    m.finish_turn(st, 700)
    m.tool(st, "ok")
    eid = m.place(st)  # 1,100 attained > 1,000: demoted to the fast bucket
    assert pool[eid].level == 1 and eid == "b0"
    assert r.moves_by_reason == {"attained": 1}
    assert r.level_of("t") == 1


def test_demotion_by_tool_failure_history(pool: PoolView) -> None:
    r = CMLFQRouter(bounds=LevelBounds(bounds=(1000,)), min_obs=8, use_attained=False,
                    fill_idle=False)
    m = Manual(r, pool)
    history(m, 10, "error", 5000)
    history(m, 10, "ok", 100)
    assert r.moves == 0  # step 0's observations are not used within step 0
    failing, fine = traj("f"), traj("s")
    for st, status in ((failing, "error"), (fine, "ok")):
        assert pool[m.place(st)].level == 0
        m.finish_turn(st, 50)
        m.tool(st, status)
    assert pool[m.place(failing)].level == 1  # a failure predicts ~5,000 more tokens
    assert pool[m.place(fine)].level == 0  # success predicts ~100
    assert r.moves_by_reason == {"tool": 1}


def test_no_move_when_mean_and_p90_disagree(pool: PoolView) -> None:
    r = CMLFQRouter(bounds=LevelBounds(bounds=(1000,)), min_obs=8, use_attained=False,
                    fill_idle=False)
    m = Manual(r, pool)
    # after a failure: usually 100 more tokens, sometimes 5,000: mean 835 (short), p90 long
    history(m, 17, "error", 100)
    history(m, 3, "error", 5000)
    st = traj("x")
    m.place(st)
    m.finish_turn(st, 50)
    m.tool(st, "error")
    assert pool[m.place(st)].level == 0
    assert r.moves == 0


def _alternating(r: CMLFQRouter, pool: PoolView, turns: int) -> list[int]:
    """A trajectory whose tool returns alternate between 'long' and 'short' predictions."""
    m = Manual(r, pool)
    history(m, 10, "error", 5000)
    history(m, 10, "ok", 100)
    st = traj("bouncy")
    levels = [pool[m.place(st)].level]
    for k in range(turns):
        m.finish_turn(st, 10)
        # the tree looks at the whole key path: reset it so each return is a fresh signal
        st.tool_keys.clear()
        m.tool(st, "error" if k % 2 == 0 else "ok")
        levels.append(pool[m.place(st)].level)
    return levels


def test_hysteresis_levels_only_go_down_by_default(pool: PoolView) -> None:
    r = CMLFQRouter(bounds=LevelBounds(bounds=(1000,)), use_attained=False, min_dwell_turns=1,
                    fill_idle=False)
    levels = _alternating(r, pool, 12)
    assert levels == sorted(levels)  # monotone: no bouncing
    assert r.moves == 1


def test_hysteresis_with_promotion_respects_the_dwell(pool: PoolView) -> None:
    r = CMLFQRouter(bounds=LevelBounds(bounds=(1000,)), use_attained=False, min_dwell_turns=4,
                    allow_promote=True, cost_aware=False)
    levels = _alternating(r, pool, 12)
    changes = [i for i in range(1, len(levels)) if levels[i] != levels[i - 1]]
    assert changes, "the signals should move it at least once"
    assert all(b - a >= 4 for a, b in itertools.pairwise(changes))
    # without the dwell the same signals flip the level every turn
    r2 = CMLFQRouter(bounds=LevelBounds(bounds=(1000,)), use_attained=False, min_dwell_turns=1,
                     allow_promote=True, cost_aware=False)
    flips = _alternating(r2, two_level_pool(), 12)
    assert sum(flips[i] != flips[i - 1] for i in range(1, len(flips))) > len(changes)


def test_aging_moves_a_waiting_trajectory(pool: PoolView) -> None:
    r = CMLFQRouter(bounds=LevelBounds(bounds=(10**9,)), aging_wait_s=30.0, fill_idle=False)
    m = Manual(r, pool)
    st = traj("old")
    m.place(st)
    pool[st.engine].open_tokens += 50_000  # its engine is busier than the fast one
    m.finish_turn(st, 10)
    m.tool(st, "ok")
    st.wait_s = 10.0
    assert pool[m.place(st)].level == 0
    m.finish_turn(st, 10)
    m.tool(st, "ok")
    st.wait_s = 45.0  # waited 45 s in queues since it was placed: promote its service
    assert pool[m.place(st)].level == 1
    assert r.moves_by_reason == {"aging": 1}


def test_idle_fast_level_takes_the_longest_trajectories(pool: PoolView) -> None:
    r = CMLFQRouter(bounds=LevelBounds(bounds=(10**9,)))  # no token signal at all
    m = Manual(r, pool)
    sts = [traj(f"t{i}") for i in range(6)]
    for st in sts:
        m.place(st)
    pool["b0"].open_trajectories = 0  # nobody on the fast engine (the batch's tail)
    assert all(pool[st.engine].level == 0 for st in sts)
    for i, st in enumerate(sts):
        m.finish_turn(st, 100 * (i + 1))
        m.tool(st, "ok")
    # the longest on its engine moves (while the fast engine stays underloaded)
    assert pool[m.place(sts[-1])].level == 1
    assert pool[m.place(sts[0])].level == 0
    assert r.moves_by_reason == {"idle": 1}


def test_move_must_pay_for_the_reprefill() -> None:
    pool = two_level_pool(tpot0=0.006, tpot1=0.005)  # hardly faster
    pool["b0"].prefill_s_per_token = 1e-3  # and an expensive re-prefill
    r = CMLFQRouter(bounds=LevelBounds(bounds=(1000,)), min_dwell_turns=1)
    m = Manual(r, pool)
    st = traj("t")
    m.place(st)
    m.finish_turn(st, 2000)
    m.tool(st, "ok")
    assert pool[m.place(st)].level == 0
    assert r.blocked_by_cost == 1
    r_free = CMLFQRouter(bounds=LevelBounds(bounds=(1000,)), cost_aware=False)
    m2 = Manual(r_free, two_level_pool(tpot0=0.006, tpot1=0.005))
    st2 = traj("t2")
    m2.place(st2)
    m2.finish_turn(st2, 2000)
    m2.tool(st2, "ok")
    assert m2.pool[m2.place(st2)].level == 1


def test_draining_engines_are_never_chosen(pool: PoolView) -> None:
    pool["b0"].accepting = False
    pool["a0"].accepting = False
    for router in (CMLFQRouter(bounds=LevelBounds(bounds=(10,))), LoadBalanceRouter(),
                   create_router("length-predict"), create_router("round-robin")):
        m = Manual(router, pool)
        st = traj(f"d-{router.name}")
        for _ in range(3):
            assert m.place(st) == "a1"
            m.finish_turn(st, 500)
            m.tool(st, "error")


def test_load_balance_stickiness(pool: PoolView) -> None:
    sticky = Manual(LoadBalanceRouter(), pool)
    st = traj("s")
    first = sticky.place(st)
    for _ in range(3):
        pool[first].open_trajectories += 5  # its engine gets busy: it stays anyway
        assert sticky.place(st) == first
    loose = Manual(LoadBalanceRouter(sticky=False), two_level_pool())
    st2 = traj("l")
    e1 = loose.place(st2)
    loose.pool[e1].open_trajectories += 5
    assert loose.place(st2) != e1


def test_load_balance_counts_per_gpu(pool: PoolView) -> None:
    m = Manual(LoadBalanceRouter(), pool)
    placed = [m.place(traj(f"t{i}")) for i in range(12)]
    # the TP4 engine takes four times the trajectories of a TP1 engine
    assert placed.count("b0") == 8 and placed.count("a0") == 2 and placed.count("a1") == 2


def test_prefix_tree_deepest_trusted_node() -> None:
    t = PrefixTree(window=200)
    for _ in range(8):
        t.observe(["a", "b"], [100.0, 80.0, 10.0])
    t.observe(["a", "c"], [100.0, 80.0, 70.0])
    depth, obs = t.lookup(["a", "b"], min_obs=8)  # type: ignore[misc]
    assert depth == 2 and obs.mean == pytest.approx(10.0)
    depth, obs = t.lookup(["a", "c"], min_obs=8)  # type: ignore[misc]
    assert depth == 1 and obs.mean == pytest.approx(80.0)  # "c" has one observation only
    assert t.lookup(["z"], min_obs=8) == (0, t.root.obs)


def test_registry_names_and_errors() -> None:
    assert {"load-balance", "length-predict", "cmlfq"} <= set(ROLLOUT_ROUTING.names())
    with pytest.raises(UnknownNameError, match=r"valid names: .*cmlfq"):
        create_router("nope")
