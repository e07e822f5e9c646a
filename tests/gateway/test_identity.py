"""Session identity and hints from the headers and bodies other stacks send (Dynamo, SGLang's
model gateway, OpenAI), read the same way by ``serve`` and ``epp``."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from turnstile.gateway.embedded import start_gateway
from turnstile.gateway.estimate import TokenEstimator, output_hint
from turnstile.gateway.identity import request_identity
from turnstile.testing.fake_engine import chat_body, start_fake


def _h(**kv: str) -> list[tuple[bytes, bytes]]:
    return [(k.replace("_", "-").encode(), v.encode()) for k, v in kv.items()]


@pytest.mark.parametrize(("headers", "body", "sid", "source"), [
    (_h(x_session_id="a", x_dynamo_session_id="b"), {}, "a", "x-session-id"),
    (_h(x_dynamo_session_id="b", x_smg_routing_key="c"), {}, "b", "x-dynamo-session-id"),
    (_h(x_smg_routing_key="c"), {"prompt_cache_key": "d"}, "c", "x-smg-routing-key"),
    ([], {"prompt_cache_key": "d", "user": "e"}, "d", "prompt_cache_key"),
    ([], {"user": "e"}, "e", "user"),
    ([], {"user": "  "}, None, None),
])
def test_session_id_precedence(headers: list[tuple[bytes, bytes]], body: dict[str, str],
                               sid: str | None, source: str | None) -> None:
    ident = request_identity(headers, body)
    assert (ident.session_id, ident.session_source) == (sid, source)


def test_parent_and_hints() -> None:
    ident = request_identity(
        _h(x_dynamo_session_id="child", x_dynamo_parent_session_id="root", x_tenant_id="t1"),
        {"nvext": {"agent_hints": {"osl": 512, "priority": 5, "latency_sensitivity": 1.2}}})
    assert ident.parent_session == "root" and ident.tenant == "t1"
    assert ident.output_tokens_hint == 512 and ident.priority_hint == 5.0
    assert ident.latency_sensitivity_s == 1.2
    bad = request_identity([], {"nvext": {"agent_hints": {"osl": True, "priority": "high"}}})
    assert bad.output_tokens_hint is None and bad.priority_hint is None


def test_expected_output_length_becomes_the_turn_estimate() -> None:
    est = TokenEstimator(default_output_tokens=256)

    def out(body: dict) -> int:
        turn, _ = asyncio.run(est.estimate("/v1/chat/completions",
                                           {"messages": [{"role": "user", "content": "x"}],
                                            **body}, 0))
        return turn.output_tokens

    assert out({}) == 256
    assert out({"max_tokens": 1000}) == 1000
    assert out({"nvext": {"agent_hints": {"osl": 80}}}) == 80
    assert out({"max_tokens": 1000, "nvext": {"agent_hints": {"osl": 80}}}) == 80
    assert out({"max_tokens": 50, "nvext": {"agent_hints": {"osl": 80}}}) == 50  # the cap holds
    assert output_hint({"nvext": {"agent_hints": {"osl": 0}}}) is None


def test_serve_understands_other_stacks_session_keys() -> None:
    eng = start_fake()
    gw = start_gateway([eng.url])
    try:
        url = gw.url + "/v1/chat/completions"
        cases = [({"x-dynamo-session-id": "dyn-1"}, {}, "dyn-1"),
                 ({"x-smg-routing-key": "smg-1"}, {}, "smg-1"),
                 ({}, {"prompt_cache_key": "pck-1"}, "pck-1"),
                 ({}, {"user": "user-1"}, "user-1")]
        for headers, extra, sid in cases:
            for _ in range(2):
                r = httpx.post(url, json=chat_body(**extra), headers=headers, timeout=10)
                assert r.status_code == 200 and r.headers["x-session-id"] == sid
            assert gw.gateway.sessions[sid].turns == 2
    finally:
        gw.stop()
        eng.stop()
