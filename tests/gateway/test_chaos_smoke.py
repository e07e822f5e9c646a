"""The chaos suite's CI-sized run (``benchmarks/chaos.py --smoke``) on real llama.cpp engines:
every fault is injected under retrying agents; no turn is lost or generated twice, hostile bodies
never get a 5xx, and every stream hit by a fault hears from the gateway within the bound. Each
fault comes with a stream under way: the suite freezes the engines (SIGSTOP) until there is one."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_chaos_smoke(llama_server_binary: Path, request: pytest.FixtureRequest) -> None:
    try:  # a missing redis-server fails under CI; elsewhere its two rows are left out
        request.getfixturevalue("redis_server_binary")
        redis = True
    except pytest.skip.Exception:
        redis = False
    sys.path.insert(0, str(BENCH))
    try:
        import chaos
    finally:
        sys.path.remove(str(BENCH))
    argv = ["--smoke"] + ([] if redis else ["--no-redis"])
    rows = {r.fault: r for r in chaos.main(argv)}
    expected = {"no fault (baseline)", "engine SIGKILL", "engine SIGTERM", "engine 5xx",
                "slow engine", "stalled engine", "gateway SIGKILL+restart", "hostile bodies",
                "100 concurrent streams"}
    if redis:
        expected |= {"replica SIGKILL", "Redis restart"}
    assert set(rows) == expected
    for r in rows.values():
        # a duplicate is allowed only right at a gateway/replica kill (the answer was complete
        # at the engine but not yet out of the killed process: docs/reliability.md)
        assert r.sent > 0 and r.lost == 0 and r.duplicated == r.dup_at_fault, r
        if "engine" in r.fault or "streams" in r.fault or "hostile" in r.fault:
            assert r.duplicated == 0, r
        assert r.completed == r.sent, r
        # each fault came with a stream under way (the engines frozen until then: on a host 4x
        # faster the agents' turns were over before the faults, which hit nothing); the
        # baseline injects nothing (a fresh-clone run on a host stalled by memory reclaim
        # found no stream under way for it, at 1.8 turns/s)
        if r.fault != "no fault (baseline)":
            assert r.hit is not False, r
        if math.isnan(r.answered_s):
            continue
        if r.fault in ("engine SIGTERM", "stalled engine"):
            # calling a hung engine dead is the engine-death work (docs/reliability.md, "Not
            # done"): a SIGTERMed llama-server closes its port but may keep its streams open
            # for seconds; bounded here by the suite's 10 s kill
            assert r.answered_s <= 12.0, r
        elif r.fault == "replica SIGKILL":
            # the retry waits for the survivors to see the dead replica's heartbeat lapse:
            # 1.2-1.3 s in the full suite, 2.6 s once in a fresh-clone CI run on a loaded host
            assert r.answered_s <= 4.0, r
        else:
            assert r.answered_s <= 2.5, r  # goal 2 s; slack for a shared 2-core machine
    assert rows["hostile bodies"].note.startswith("0 of 40 bodies got a 5xx")
