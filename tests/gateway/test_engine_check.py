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
          options: dict[str, Any] | None = None, max_model_len: int = 2048) -> EngineAdapter:
    """A vLLM adapter over a mocked server: ``policy`` None = no /server_info (no dev mode)."""

    def handler(req: httpx.Request) -> httpx.Response:
        path = req.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny",
                                                       "max_model_len": max_model_len}]})
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


def test_engines_with_different_context_limits_are_warned_of(
        caplog: pytest.LogCaptureFixture) -> None:
    """No routing policy reads an engine's context limit: where the engines' limits differ,
    the smaller ones are named (a session placed there is refused once its context passes
    it); where they agree, nothing is said."""
    policies = PolicySet.from_spec("eager+kv-affinity")
    small = _check(_vllm(policy="priority", details=True, max_model_len=2048))
    large = _check(_vllm(policy="priority", details=True, max_model_len=8192))
    with caplog.at_level(logging.WARNING, logger="turnstile.gateway"):
        verdicts = check_engines(policies, {"small": small, "large": large})
    assert verdicts["large"]["max_model_len"] is None
    msg = str(verdicts["small"]["max_model_len"])
    assert "up to 2048 tokens" in msg and "large up to 8192" in msg and "--max-model-len" in msg
    assert sum("engine small" in r.getMessage() for r in caplog.records) == 1
    same = {"a": _check(_vllm(policy="priority", details=True)),
            "b": _check(_vllm(policy="priority", details=True))}
    assert all(v["max_model_len"] is None for v in check_engines(policies, same).values())


def test_gateway_exposes_context_limits_on_metrics(
        fake_engines: Callable[..., FakeServer], gateways: Callable[..., GatewayServer],
        caplog: pytest.LogCaptureFixture) -> None:
    """Two llama.cpp-like engines whose slots hold 2,048 and 4,096 tokens (``GET /slots``
    ``n_ctx``): both limits on /metrics, and the smaller one warned of."""
    small, large = fake_engines(slot_ctx=2048), fake_engines(slot_ctx=4096)
    with caplog.at_level(logging.WARNING, logger="turnstile.gateway"):
        gw = gateways([small.url, large.url], policy="eager+kv-affinity")
    text = httpx.get(gw.url + "/metrics").text
    ids = {gw.gateway.adapters[e].base_url: e for e in gw.gateway.adapters}
    e_small, e_large = ids[small.url], ids[large.url]
    assert f'turnstile_engine_max_model_len{{engine="{e_small}"}} 2048.0' in text
    assert f'turnstile_engine_max_model_len{{engine="{e_large}"}} 4096.0' in text
    assert (f'turnstile_engine_config_warning{{engine="{e_small}",feature="max_model_len"}} '
            "1.0") in text
    assert (f'turnstile_engine_config_warning{{engine="{e_large}",feature="max_model_len"}} '
            "0.0") in text
    assert any(f"engine {e_small}" in r.getMessage() and "up to 2048 tokens" in r.getMessage()
               for r in caplog.records)
