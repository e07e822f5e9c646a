"""The ``x-turnstile-engine`` request header: honoured by the ``hinted`` routing policy only."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from turnstile.testing.fake_engine import chat_body

pytestmark = pytest.mark.timeout(60)


def _post(url: str, session: str, engine: str | None) -> httpx.Response:
    headers = {"x-session-id": session}
    if engine is not None:
        headers["x-turnstile-engine"] = engine
    r = httpx.post(url + "/v1/chat/completions", json=chat_body(), headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return r


def test_hinted_policy_routes_each_turn_to_the_named_engine(fake_engines: Any,
                                                            gateways: Any) -> None:
    a, b = fake_engines(), fake_engines()
    gw = gateways([a.url, b.url], policy="eager+hinted")
    ids = list(gw.gateway.adapters)
    # one session hopping between engines, turn by turn, as the header says
    plan = [ids[1], ids[0], ids[1], ids[1], ids[0]]
    served = [_post(gw.url, "s1", e).headers["x-turnstile-engine"] for e in plan]
    assert served == plan
    assert len(a.engine.requests) == 2 and len(b.engine.requests) == 3
    # no hint, or a name the gateway does not know: the fallback (kv-affinity) routes
    assert _post(gw.url, "s1", None).headers["x-turnstile-engine"] in ids
    assert _post(gw.url, "s1", "no-such-engine").headers["x-turnstile-engine"] in ids
    routing = gw.gateway.policies.routing
    assert (routing.hinted, routing.fell_back) == (5, 2)


def test_other_routing_policies_ignore_the_header(fake_engines: Any, gateways: Any) -> None:
    a, b = fake_engines(), fake_engines()
    gw = gateways([a.url, b.url], policy="eager+kv-affinity")
    ids = list(gw.gateway.adapters)
    first = _post(gw.url, "s2", None).headers["x-turnstile-engine"]
    other = ids[1] if first == ids[0] else ids[0]
    # kv-affinity keeps the session on its engine whatever the client asks for
    assert all(_post(gw.url, "s2", other).headers["x-turnstile-engine"] == first
               for _ in range(3))
