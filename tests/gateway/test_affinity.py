"""Sessions derived from the conversation (no x-session-id): keys, follow-up turns, sub-agents
placed near their parent."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx

from turnstile.gateway.affinity import ConversationKeys, LocalKeyStore, reply_texts


def _resolve(keys: ConversationKeys, messages: list[dict[str, Any]], rid: str) -> Any:
    return asyncio.run(keys.resolve({"messages": messages}, rid))


def test_follow_up_turns_find_their_session_and_equal_replies_do_not_collide() -> None:
    keys = ConversationKeys(LocalKeyStore())
    a = [{"role": "system", "content": "agent"}, {"role": "user", "content": "task A"}]
    b = [{"role": "system", "content": "agent"}, {"role": "user", "content": "task B"}]
    ra, rb = _resolve(keys, a, "req-a"), _resolve(keys, b, "req-b")
    assert ra.new and rb.new and ra.session_id != rb.session_id
    for res in (ra, rb):
        keys.remember(res)
        keys.reply(res.session_id, res.chain, res.root, "same reply", "", None, "e1", 40)
    for msgs, res in ((a, ra), (b, rb)):
        nxt = [*msgs, {"role": "assistant", "content": "same reply"},
               {"role": "user", "content": "tool output"}]
        found = _resolve(keys, nxt, "req-next")
        assert not found.new and found.session_id == res.session_id
        assert (found.engine, found.context_tokens) == ("e1", 40)
    # the same first messages again: a new session, started near the earlier one
    again = _resolve(keys, a, "req-a2")
    assert again.new and again.session_id != ra.session_id and again.near == ra.session_id
    assert again.parent is None and again.engine == "e1"


def test_tool_call_arguments_name_sub_agents() -> None:
    keys = ConversationKeys(LocalKeyStore())
    parent = _resolve(keys, [{"role": "user", "content": "refactor the parser"}], "req-p")
    keys.remember(parent)
    prompt = "Find every caller of parse_header and list them"
    args = json.dumps({"description": "search", "prompt": prompt})
    assert prompt in reply_texts("", args)
    keys.reply(parent.session_id, parent.chain, parent.root, "", args, "refactor the parser",
               "e2", 10)
    child = _resolve(keys, [{"role": "system", "content": "you are a sub-agent"},
                            {"role": "user", "content": prompt}], "req-c")
    assert child.new and child.parent == parent.session_id and child.near == parent.session_id
    assert child.engine == "e2"
    # a client echoing the tool call back finds the parent session
    follow = _resolve(keys, [{"role": "user", "content": "refactor the parser"},
                             {"role": "assistant", "content": None, "tool_calls": [
                                 {"id": "c1", "type": "function",
                                  "function": {"name": "Task", "arguments": args}}]},
                             {"role": "tool", "tool_call_id": "c1", "content": "done"}],
                      "req-f")
    assert not follow.new and follow.session_id == parent.session_id


def test_unmodified_clients_get_sessions_and_sub_agents_start_near_parents(
        fake_engines: Any, gateways: Any) -> None:
    engines = [fake_engines(ttft_s=0.3), fake_engines(ttft_s=0.3)]
    gw = gateways([e.url for e in engines], policy="eager+kv-affinity")
    parents: dict[int, tuple[str, str, str]] = {}

    def parent(i: int) -> None:
        msgs = [{"role": "user", "content": f"parent task {i}"}]
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=10,
                       json={"model": "tiny", "messages": msgs, "max_tokens": 20 + i})
        reply = r.json()["choices"][0]["message"]["content"]
        parents[i] = (r.headers["x-session-id"], r.headers["x-turnstile-engine"], reply)

    threads = [threading.Thread(target=parent, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {p[1] for p in parents.values()} == {e.url.removeprefix("http://")
                                                for e in engines}
    for sid, engine, reply in parents.values():
        # a sub-agent: a new conversation whose task is what the parent turn produced
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=10, json={
            "model": "tiny", "max_tokens": 4, "tools": [{"type": "function", "function": {
                "name": "Read", "parameters": {}}}],  # an agent: its session stays open
            "messages": [{"role": "system", "content": "sub-agent"},
                         {"role": "user", "content": reply}]})
        assert r.status_code == 200
        assert r.headers["x-session-id"] != sid
        assert r.headers["x-turnstile-engine"] == engine
    assert gw.gateway.sessions[r.headers["x-session-id"]].parent == sid
