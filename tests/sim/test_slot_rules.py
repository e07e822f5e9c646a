"""The engine's pick of an idle slot for a request no gateway bound (a ``SlotRule``):
llama-server's (:func:`turnstile.sim.profiles.llamacpp.session_else_lru`, in its profile) and the
neutral one an engine profiled without a rule gets (:func:`generic_server_slot`)."""

from __future__ import annotations

from dataclasses import dataclass

from turnstile.sim.engine_profile import GENERIC, generic_server_slot, profile_for
from turnstile.sim.profiles.llamacpp import session_else_lru as server_slot


@dataclass
class Slot:
    id: int
    busy: bool = False
    session: str | None = None
    last_used: int = 0


def _fill(rule, n: int) -> list[int]:
    slots = [Slot(i) for i in range(n)]
    picked = []
    for k in range(n):
        s = rule(slots, f"s{k}")
        assert s is not None
        s.busy, s.session = True, f"s{k}"
        picked.append(s.id)
    assert rule(slots, "s9") is None  # every slot busy
    return picked


def test_a_fresh_engine_fills_its_slots_from_the_highest_id():
    assert _fill(server_slot, 4) == [3, 2, 1, 0]


def test_the_sessions_own_idle_slot_comes_before_the_least_recently_used():
    slots = [Slot(0, session="a", last_used=5), Slot(1, session="b", last_used=2),
             Slot(2, session="c", last_used=2), Slot(3, busy=True, session="d")]
    assert server_slot(slots, "a").id == 0
    # "b" and "c" were used as long ago: the later slot, as the rule's `<=` keeps it
    assert server_slot(slots, "x").id == 2
    slots[2].last_used = 3
    assert server_slot(slots, "x").id == 1
    assert server_slot(slots, "d").id == 1  # its own slot is busy: the least recently used


def test_the_profiles_name_their_rules():
    assert profile_for("llama.cpp").server_slot is server_slot
    assert GENERIC.server_slot is generic_server_slot
    assert profile_for("vllm").server_slot is generic_server_slot  # paged: no slots to pick


def test_the_neutral_rule_breaks_ties_by_the_lowest_id():
    assert _fill(generic_server_slot, 4) == [0, 1, 2, 3]
    slots = [Slot(0, session="a", last_used=5), Slot(1, session="b", last_used=2),
             Slot(2, session="c", last_used=2), Slot(3, busy=True, session="d")]
    assert generic_server_slot(slots, "c").id == 2  # the session's own idle slot
    assert generic_server_slot(slots, "x").id == 1  # a tie of "b" and "c": the first
    slots[1].last_used = 4
    assert generic_server_slot(slots, "x").id == 2  # the least recently used
    assert generic_server_slot(slots, "d").id == 2  # its own slot is busy
