"""The adapters' configuration check and the gateway's warnings, on mocked engines (the real
vLLM check is in test_vllm_real.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from turnstile.gateway.adapters import FEATURES, EngineAdapter, make_adapter
from turnstile.gateway.embedded import GatewayServer
from turnstile.gateway.engine_check import check_engines, policy_needs
from turnstile.policies import PolicySet
from turnstile.testing.fake_engine import FakeServer

_METRICS = ('vllm:cache_config_info{block_size="128",enable_prefix_caching="%s",engine="0"} 1.0\n'
            'vllm:num_requests_running{engine="0"} 0.0\n')


def _vllm(*, policy: str | None, details: bool, prefix: bool = True,
          options: dict[str, Any] | None = None) -> EngineAdapter:
    """A vLLM adapter over a mocked server: ``policy`` None = no /server_info (no dev mode)."""

    def handler(req: httpx.Request) -> httpx.Response:
        path = req.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny", "max_model_len": 2048}]})
        if path == "/metrics":
            return httpx.Response(200, text=_METRICS % prefix)
        if path == "/server_info" and policy is not None:
            return httpx.Response(200, json={"vllm_config": {
                "scheduler_config": {"policy": policy}}})
        if path == "/v1/completions":
            assert json.loads(req.content)["max_tokens"] == 1
            usage: dict[str, Any] = {"prompt_tokens": 3, "completion_tokens": 1}
            if details:
                usage["prompt_tokens_details"] = {"cached_tokens": 0}
            return httpx.Response(200, json={"choices": [{"text": "x"}], "usage": usage})
        return httpx.Response(404)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return make_adapter("http://vllm:8000", "vllm", engine_id="v", client=client,
                        options=options)


def _check(a: EngineAdapter) -> EngineAdapter:
    asyncio.run(a.check_config())
    return a


def test_vllm_check_reads_the_engine() -> None:
    good = _check(_vllm(policy="priority", details=True))
    assert good.features == {"priority": True, "cached_tokens": True, "prefix_caching": True,
                             "slot_pinning": False}
    assert good.max_model_len == 2048
    bad = _check(_vllm(policy="fcfs", details=False, prefix=False))
    assert bad.features == {"priority": False, "cached_tokens": False, "prefix_caching": False,
                            "slot_pinning": False}
    assert "fcfs" in bad.config_notes["priority"]
    unknown = _check(_vllm(policy=None, details=True))
    assert unknown.features["priority"] is None
    stated = _check(_vllm(policy=None, details=True, options={"priority": True}))
    assert stated.features["priority"] is True


def test_policy_needs() -> None:
    assert set(policy_needs(PolicySet.from_spec("eager+round-robin"))) == {"cached_tokens"}
    needs = policy_needs(PolicySet.from_spec("cvar+kv-affinity+ttl+tiered-aging"))
    assert set(needs) == set(FEATURES)
    assert "ttl" in needs["slot_pinning"] and "tiered-aging" in needs["priority"]


def test_warnings_name_what_the_engine_ignores(caplog: pytest.LogCaptureFixture) -> None:
    policies = PolicySet.from_spec("cvar+kv-affinity+ttl+tiered-aging")
    adapters = {"good": _check(_vllm(policy="priority", details=True)),
                "bad": _check(_vllm(policy="fcfs", details=False)),
                "unsure": _check(_vllm(policy=None, details=True))}
    with caplog.at_level(logging.WARNING, logger="turnstile.gateway"):
        verdicts = check_engines(policies, adapters)
    # retention degrades to a no-op on every vLLM, with its reason
    assert all("no-ops" in str(v["slot_pinning"]) for v in verdicts.values())
    assert verdicts["good"]["priority"] is None and verdicts["good"]["cached_tokens"] is None
    assert "--scheduling-policy priority" in str(verdicts["bad"]["priority"])
    assert "--enable-prompt-tokens-details" in str(verdicts["bad"]["cached_tokens"])
    assert "cannot confirm priority" in str(verdicts["unsure"]["priority"])
    assert verdicts["unsure"]["cached_tokens"] is None
    assert sum("engine bad" in r.getMessage() for r in caplog.records) == 3


def test_gateway_exposes_the_warnings_on_metrics(
        fake_engines: Callable[..., FakeServer], gateways: Callable[..., GatewayServer],
        caplog: pytest.LogCaptureFixture) -> None:
    eng = fake_engines()  # a llama.cpp-like engine: no request priority
    with caplog.at_level(logging.WARNING, logger="turnstile.gateway"):
        gw = gateways([eng.url], policy="eager+tiered-aging")
    text = httpx.get(gw.url + "/metrics").text
    engine = gw.gateway.scheduler.view.ids[0]
    assert (f'turnstile_engine_config_warning{{engine="{engine}",feature="priority"}} 1.0'
            in text)
    assert (f'turnstile_engine_config_warning{{engine="{engine}",feature="cached_tokens"}} 0.0'
            in text)
    assert any("ignores priority" in r.getMessage() for r in caplog.records)
