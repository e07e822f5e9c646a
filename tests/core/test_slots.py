"""The engine's slot pick for an unbound request (:func:`session_else_lru`, the rule of the slot
engines profiled so far), shared by the simulator's slot models."""

from __future__ import annotations

from dataclasses import dataclass

from turnstile.core.slots import session_else_lru as server_slot


@dataclass
class Slot:
    id: int
    busy: bool = False
    session: str | None = None
    last_used: int = 0


def test_a_fresh_engine_fills_its_slots_from_the_highest_id():
    slots = [Slot(i) for i in range(4)]
    picked = []
    for k in range(4):
        s = server_slot(slots, f"s{k}")
        assert s is not None
        s.busy, s.session = True, f"s{k}"
        picked.append(s.id)
    assert picked == [3, 2, 1, 0]
    assert server_slot(slots, "s9") is None  # every slot busy


def test_the_sessions_own_idle_slot_comes_before_the_least_recently_used():
    slots = [Slot(0, session="a", last_used=5), Slot(1, session="b", last_used=2),
             Slot(2, session="c", last_used=2), Slot(3, busy=True, session="d")]
    assert server_slot(slots, "a").id == 0
    # "b" and "c" were used as long ago: the later slot, as the rule's `<=` keeps it
    assert server_slot(slots, "x").id == 2
    slots[2].last_used = 3
    assert server_slot(slots, "x").id == 1
    assert server_slot(slots, "d").id == 1  # its own slot is busy: the least recently used
