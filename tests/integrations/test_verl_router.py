"""The verl router and hook without verl: the router's protocol methods called as verl's client
calls them (one acquire/release per turn, one request id per trajectory), on a virtual clock.
The same router through verl's own ``get_router_handle`` and client is in test_verl_e2e.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from turnstile.core.clock import VirtualClock
from turnstile.integrations.verl_hook import RouterReporter, TurnstileHookMixin, classify_tool_text
from turnstile.integrations.verl_router import NO_SERVERS, TurnstileRouter, tool_return


def make(servers: list[str], clock: VirtualClock | None = None, **cfg: Any) -> TurnstileRouter:
    return TurnstileRouter({s: f"handle-{s}" for s in servers},
                           {"router_class": "x.Y", **cfg}, clock=clock or VirtualClock())


def turn(r: TurnstileRouter, rid: str, prompt: list[int], out: int | None = None) -> str:
    """One turn as verl runs it, plus the hook's output report when ``out`` is given."""
    sid, handle = r.acquire_server(rid, prompt_ids=prompt)
    assert handle == f"handle-{sid}"
    r.release_server(sid, request_id=rid)
    if out is not None:
        r.report_turn(rid, out)
    return sid


def test_least_open_spreads_trajectories_and_keeps_each_on_its_server():
    r = make(["a:1", "b:1", "c:1"], policy="least-open")
    assert r.require_acquire_fields() == ["prompt_ids"]
    assert r.require_release_fields() == ["request_id"]
    first = {f"t{i}": r.acquire_server(f"t{i}", prompt_ids=[i, 2, 3])[0] for i in range(6)}
    # open trajectories per server, tool time included: two each
    assert sorted(first.values()) == ["a:1", "a:1", "b:1", "b:1", "c:1", "c:1"]
    assert r.get_total_inflight() == 6
    for rid, sid in first.items():
        r.release_server(sid, request_id=rid)
    assert r.get_total_inflight() == 0
    # later turns stay where their KV is, even though every server is now idle
    for rid, sid in first.items():
        assert turn(r, rid, [0] * 40, 5) == sid
    st = r.get_status()
    assert st["open_trajectories"] == 6 and st["acquires"] == 12
    assert st["open_per_server"] == {"a:1": 2, "b:1": 2, "c:1": 2}


def test_a_paused_trajectory_counts_as_load_unlike_verls_inflight_count():
    """verl's default balancer counts in-flight requests only: a trajectory in a tool call is
    invisible. Here it still holds its server."""
    r = make(["a:1", "b:1"], policy="least-open")
    assert turn(r, "t0", [1, 2, 3], 4) == "a:1"  # released: now in a tool call on a:1
    assert r.get_total_inflight() == 0
    assert r.acquire_server("t1", prompt_ids=[9, 9])[0] == "b:1"


def test_ended_trajectories_free_their_server_and_are_forgotten():
    r = make(["a:1", "b:1"], policy="least-open")
    turn(r, "t0", [1, 2], 3)
    turn(r, "t1", [3, 4], 3)
    r.end_trajectory("t0")
    assert r.get_status()["open_per_server"] == {"a:1": 0, "b:1": 1}
    assert r.acquire_server("t2", prompt_ids=[5])[0] == "a:1"
    assert r.get_status()["trajectories_ended"] == 1
    # the same request id again later is a new trajectory (verl uses fresh uuids)
    r.release_server("a:1", request_id="t2")
    assert turn(r, "t0", [1, 2], 2) in ("a:1", "b:1")


def test_without_the_hook_idle_trajectories_close_and_phase_switch_clears():
    clock = VirtualClock()
    r = make(["a:1", "b:1"], clock=clock, policy="least-open", session_idle_s=10.0)
    turn(r, "t0", [1])  # no output report: finished in the core at the next event
    turn(r, "t1", [2])
    sid, _ = r.acquire_server("t2", prompt_ids=[3])  # in flight
    clock.t = 20.0
    r.acquire_server("t3", prompt_ids=[4])  # the sweep runs first: t0, t1 idle past 10 s
    st = r.get_status()
    assert st["closed_idle"] == 2 and st["open_trajectories"] == 2
    r.release_server(sid, request_id="t2")
    out = r.clear_sticky_cache()
    assert out["cleared_entries"] == 1  # t2 (t3 is still in flight)
    assert r.get_status()["open_trajectories"] == 1


def test_empty_pool_raises_verls_retry_message_and_servers_come_and_go():
    r = TurnstileRouter({}, {"policy": "least-open"}, clock=VirtualClock())
    with pytest.raises(RuntimeError, match=NO_SERVERS):
        r.acquire_server("t0", prompt_ids=[1])
    r.add_servers({"a:1": "handle-a:1", "b:1": "handle-b:1"})
    assert r.get_all_servers() == ["a:1", "b:1"]
    assert turn(r, "t0", [1], 2) == "a:1"
    r.remove_servers(["a:1"])
    assert r.get_all_servers() == ["b:1"]
    assert turn(r, "t0", [1, 5], 2) == "b:1"  # its server left: it moves
    r.remove_servers(["b:1"])
    with pytest.raises(RuntimeError, match=NO_SERVERS):
        r.acquire_server("t9", prompt_ids=[1])
    r.add_servers({"a:1": "handle-a:1"})  # re-added after removal
    assert turn(r, "t9", [1], 1) == "a:1"
    # a release for a removed server is ignored, never negative
    r.release_server("zz", request_id="nobody")
    assert r.get_total_inflight() == 0


def test_prompt_ids_as_a_numpy_array_name_the_prompt_group():
    np = pytest.importorskip("numpy")
    r = make(["a:1", "b:1"], policy="least-open")
    sid, _ = r.acquire_server("t0", prompt_ids=np.array([1, 2, 3]))
    r.release_server(sid, request_id="t0")
    assert r._sched is not None and r._sched.workflows["t0"].tenant.startswith("p")


def test_overlapping_turns_of_one_trajectory_stay_on_its_server():
    r = make(["a:1", "b:1"], policy="least-open")
    s1, _ = r.acquire_server("t0", prompt_ids=[1])
    s2, _ = r.acquire_server("t0", prompt_ids=[1])
    assert s1 == s2 and r.get_inflight_count(s1) == 2
    r.release_server(s1, request_id="t0")
    r.release_server(s2, request_id="t0")
    assert r.get_total_inflight() == 0 and r.get_status()["overlapping_acquires"] == 1


def test_bad_config_is_refused_with_the_valid_names():
    with pytest.raises(ValueError, match="unknown turnstile router keys"):
        make(["a:1"], polcy="cmlfq")
    with pytest.raises(ValueError, match="cmlfq"):
        make(["a:1"], policy="nope")


def run_trajectory(r: TurnstileRouter, rid: str, prompt: list[int], tool: str,
                   outs: list[int]) -> list[str]:
    """Turns with the given output lengths; ``tool`` returns after the first."""
    served = []
    ctx = list(prompt)
    for j, out in enumerate(outs):
        served.append(turn(r, rid, ctx, out))
        ctx = ctx + [7] * (out + 3)
        if j == 0:
            r.report_tool_returns(rid, [tool_return(tool, 10, "ok")])
    r.end_trajectory(rid)
    return served


def test_cmlfq_moves_a_trajectory_to_the_large_tp_server_after_a_telling_tool_return():
    """Two TP-1 replicas and one TP-2 (``server_tp``: verl cannot deploy this; see docs/verl.md).
    After a few trajectories, the return of ``deep_search`` predicts a long remainder (> 40
    tokens): the next turn moves to the TP-2 level. ``lookup`` predicts a short one: it stays."""
    r = make(["a:1", "b:1", "big:1"], policy="cmlfq", server_tp={"big:1": 2},
             policy_params={"bounds": [40], "rebuild_every_done": 4, "min_obs": 2})
    assert r.get_status()["tp"] == {"a:1": 1, "b:1": 1, "big:1": 2}
    for i in range(4):  # history: long after deep_search, short after lookup
        run_trajectory(r, f"h{i}-long", [i, 1], "deep_search", [5, 30, 30, 30])
        run_trajectory(r, f"h{i}-short", [i, 2], "lookup", [5, 3])
    assert r.get_status()["routing_stats"]["rebuilds"] >= 1
    long_path = run_trajectory(r, "new-long", [99, 1], "deep_search", [5, 30, 30])
    short_path = run_trajectory(r, "new-short", [99, 2], "lookup", [5, 3])
    assert long_path[0] in ("a:1", "b:1") and long_path[1:] == ["big:1", "big:1"]
    assert "big:1" not in short_path
    assert r.get_status()["routing_stats"]["moves"] >= 1
    assert r.get_status()["tool_returns_seen"] == 10


def test_cmlfq_with_one_tp_is_sticky_least_open():
    r = make(["a:1", "b:1"], policy="cmlfq", policy_params={"bounds": [40]})
    paths = [run_trajectory(r, f"t{i}", [i], "deep_search", [5, 30, 30]) for i in range(3)]
    assert all(len(set(p)) == 1 for p in paths)


# ---------------------------------------------------------------- the hook, on a stand-in loop
class FakeToolLoop:
    """The four methods of verl's ToolAgentLoop the hook wraps, with verl's shapes: AgentData
    with ``request_id``/``response_ids``, ``_call_tool`` returning ``(ToolResponse, reward,
    extra)``; ``generate`` on a server manager that acquires/releases on the router."""

    def __init__(self, router: TurnstileRouter, tools: list[tuple[str, str]]) -> None:
        self.server_manager = SimpleNamespace(_load_balancer=router, router=router)
        self.tools = list(tools)
        self.results = dict(tools)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> str:
        data = SimpleNamespace(request_id=kwargs["rid"], response_ids=[], prompt_ids=[1, 2])
        await self._handle_pending_state(data, sampling_params)
        for _ in range(len(self.tools) + 1):
            await self._handle_generating_state(data, sampling_params)
            if not self.tools:
                break
            await self._handle_processing_tools_state(data)
        return "done"

    async def _handle_pending_state(self, data: Any, sampling_params: Any) -> str:
        return "generating"

    async def _handle_generating_state(self, data: Any, sampling_params: Any) -> str:
        r = self.server_manager.router
        sid, _ = r.acquire_server(data.request_id, prompt_ids=data.prompt_ids)
        data.response_ids = [5] * 12
        r.release_server(sid, request_id=data.request_id)
        data.prompt_ids = data.prompt_ids + data.response_ids
        return "tools"

    async def _handle_processing_tools_state(self, data: Any) -> str:
        name, _ = self.tools.pop(0)
        await self._call_tool(SimpleNamespace(name=name), {}, data)
        return "generating"

    async def _call_tool(self, call: Any, kwargs: Any, data: Any) -> tuple[Any, float, dict]:
        return SimpleNamespace(text=self.results[call.name]), 0.0, {}


class HookedLoop(TurnstileHookMixin, FakeToolLoop):
    pass


class RecordingRouter(TurnstileRouter):
    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.log: list[tuple[str, Any]] = []

    def report_turn(self, request_id: str, output_tokens: int) -> None:
        self.log.append(("turn", output_tokens))
        super().report_turn(request_id, output_tokens)

    def report_tool_returns(self, request_id: str, returns: Any) -> None:
        self.log.append(("tools", [(x["name"], x["status"], x["result_tokens"]) for x in returns]))
        super().report_tool_returns(request_id, returns)

    def end_trajectory(self, request_id: str) -> None:
        self.log.append(("end", request_id))
        super().end_trajectory(request_id)


def test_the_hook_reports_outputs_tool_returns_and_the_end():
    r = RecordingRouter({"a:1": "h", "b:1": "h"}, {"policy": "cmlfq"}, clock=VirtualClock())
    loop = HookedLoop(r, [("search", "x" * 400), ("python", "Error executing tool 'python': boom")])
    assert asyncio.run(loop.run({}, rid="t0")) == "done"
    assert r.log == [("turn", 12), ("tools", [("search", "ok", 100)]), ("turn", 12),
                     ("tools", [("python", "error", 9)]), ("turn", 12), ("end", "t0")]
    st = r.get_status()
    assert st["tool_returns_seen"] == 2
    assert st["trajectories_ended"] == 1 and st["open_trajectories"] == 0
    assert st["total_inflight"] == 0


def test_the_hook_stops_quietly_against_verls_default_balancer():
    class Default:  # verl's GlobalRequestLoadBalancer has none of the report methods
        pass

    rep = RouterReporter(Default())
    asyncio.run(rep.turn_done("t0", 3))
    assert rep.enabled is False
    asyncio.run(rep.trajectory_end("t0"))  # no error once off


def test_tool_text_status():
    assert classify_tool_text("Error executing tool 'x': boom") == "error"
    assert classify_tool_text("Unknown function 'y'. Available tools: []") == "error"
    assert classify_tool_text("Invalid JSON in arguments for 'x'") == "error"
    assert classify_tool_text("the request timed out after 30 s") == "timeout"
    assert classify_tool_text("42") == "ok"
