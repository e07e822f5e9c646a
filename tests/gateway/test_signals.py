"""Tool returns and engine metadata the gateway passes to the scheduler core."""

from __future__ import annotations

from types import SimpleNamespace

from turnstile.gateway.signals import engine_loads, tool_returns
from turnstile.workload import ToolCall


def test_tool_returns_after_the_last_assistant_turn() -> None:
    body = {"messages": [
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": "x", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "old", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "stale"},
        {"role": "assistant", "content": "y", "tool_calls": [
            {"id": "c2", "type": "function", "function": {"name": "calculator",
                                                          "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "x" * 400},
        {"role": "tool", "name": "sleep", "status": "timeout", "content": "timed out"},
        {"role": "tool", "name": "read_file", "content": "Error: no such file"},
    ]}
    assert tool_returns(body) == (
        ToolCall("calculator", 0.0, "ok", 100),
        ToolCall("sleep", 0.0, "timeout", 3),
        ToolCall("read_file", 0.0, "error", 5),
    )


def test_no_tool_returns() -> None:
    assert tool_returns({"messages": [{"role": "user", "content": "hi"}]}) == ()
    assert tool_returns({"prompt": "hi"}) == ()
    assert tool_returns({"messages": [{"role": "assistant", "content": "a"},
                                      {"role": "user", "content": "b"}]}) == ()


def test_engine_loads_carry_tp_bucket_and_kv_capacity() -> None:
    adapters = [SimpleNamespace(id="a", weight=1.0, options={"slots": 4}, kind="vllm"),
                SimpleNamespace(id="b", weight=4.0, options={"kv_tokens": 8192, "slots": 4},
                                kind="llama.cpp")]
    configs = [SimpleNamespace(tp=1, bucket="short"), SimpleNamespace(tp=4, bucket="long")]
    loads = engine_loads(adapters, configs)
    assert [(e.id, e.tp, e.bucket, e.weight) for e in loads] == [
        ("a", 1, "short", 1.0), ("b", 4, "long", 4.0)]
    # the engine's KV capacity (its ``kv_tokens`` option) reaches the release policy's KV gate
    assert [e.capacity_tokens for e in loads] == [0, 8192]
    # a llama.cpp engine's ``slots`` option: the sessions it keeps at once (other kinds: none)
    assert [e.kv_slots for e in loads] == [0, 4]
    assert [e.tp for e in engine_loads(adapters, [])] == [1, 1]
