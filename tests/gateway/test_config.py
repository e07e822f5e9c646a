"""Gateway configuration (TOML, flags, policy parameters), the serve command's checks, and a
vLLM engine behind the gateway through recorded fixtures."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import typer
from typer.testing import CliRunner

from turnstile.gateway.adapters import VllmAdapter
from turnstile.gateway.cli import register
from turnstile.gateway.config import (
    GatewayConfig,
    load_config,
    parse_engine_flag,
)
from turnstile.policies import PolicySet

pytestmark = pytest.mark.timeout(30)
FIXTURES = Path(__file__).parent / "fixtures"


def test_load_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GW_TOKEN", "from-env")
    path = tmp_path / "gw.toml"
    path.write_text("""
[gateway]
port = 9001
policy = "cvar+kv-affinity+ttl"
max_held = 64
auth_token_env = "GW_TOKEN"
db = "state.sqlite3"

[policy.release]
budget_per_engine = 16384.0

[[engines]]
url = "http://127.0.0.1:8081"
kind = "llama.cpp"
name = "a"
offload = false

[[engines]]
url = "http://127.0.0.1:8082"
kind = "vllm"
weight = 2.0
priority = false
""")
    cfg = load_config(path)
    assert (cfg.port, cfg.policy, cfg.max_held, cfg.auth_token, cfg.db) == (
        9001, "cvar+kv-affinity+ttl", 64, "from-env", "state.sqlite3")
    assert cfg.host == "127.0.0.1"  # loopback unless told otherwise
    assert cfg.policy_params == {"release": {"budget_per_engine": 16384.0}}
    a, b = cfg.engines
    assert (a.name, a.kind, a.options) == ("a", "llama.cpp", {"offload": False})
    assert (b.kind, b.weight, b.options) == ("vllm", 2.0, {"priority": False})
    cfg.validate()
    assert PolicySet.from_spec(cfg.policy, cfg.policy_params).release.budget_per_engine == 16384.0

    path.write_text("[gateway]\nbogus = 1\n")
    with pytest.raises(ValueError, match="unknown \\[gateway\\] key 'bogus'"):
        load_config(path)
    path.write_text("[gateway\n")
    with pytest.raises(ValueError, match=r"gw\.toml"):
        load_config(path)


def test_engine_flags() -> None:
    e = parse_engine_flag("http://127.0.0.1:8081")
    assert (e.url, e.kind, e.name) == ("http://127.0.0.1:8081", "llama.cpp", None)
    e = parse_engine_flag("http://h:1,vllm,big")
    assert (e.kind, e.name) == ("vllm", "big")
    for bad in ("127.0.0.1:8081", "http://h:1,a,b,c"):
        with pytest.raises(ValueError, match=r"URL\[,kind"):
            parse_engine_flag(bad)


def test_policy_parameters_and_validation() -> None:
    ps = PolicySet.from_spec("fcfs-workflow", {"release": {"max_inflight_per_engine": 2}})
    assert ps.release.max_inflight_per_engine == 2  # type: ignore[attr-defined]
    assert ps.admission is ps.release  # fcfs-workflow still orders its own engine queues
    with pytest.raises(ValueError, match="eager: unknown option 'nope'"):
        PolicySet.from_spec("eager", {"release": {"nope": 1}})
    with pytest.raises(ValueError, match="unknown policy kind"):
        PolicySet.from_spec("eager", {"planner": {}})
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        GatewayConfig(engines=[parse_engine_flag("http://h:1")], policy="fifo").validate()
    with pytest.raises(ValueError, match="at least one engine"):
        GatewayConfig().validate()


def test_serve_command_rejects_bad_setups() -> None:
    app = typer.Typer()
    register(app)

    @app.command("noop")
    def noop() -> None:  # a second command keeps typer from flattening the app
        pass

    runner = CliRunner()
    r = runner.invoke(app, ["serve"])
    assert r.exit_code == 2 and "at least one engine" in r.output
    r = runner.invoke(app, ["serve", "--engine", "http://h:1", "--policy", "nope"])
    assert r.exit_code == 2 and "unknown policy" in r.output
    r = runner.invoke(app, ["replay", "--target", "http://h:1", "--rate", "0"])
    assert r.exit_code == 2


# ----------------------------------------------------------------------------- vLLM behind
def vllm_handler(sent: list[dict[str, Any]]) -> Any:
    def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/models":
            return httpx.Response(200, content=(FIXTURES / "vllm/models.json").read_bytes())
        if path == "/metrics":
            return httpx.Response(200, content=(FIXTURES / "vllm/metrics.txt").read_bytes())
        body = json.loads(request.content)
        sent.append(body)
        if body.get("stream"):
            return httpx.Response(200, content=(FIXTURES / "vllm/chat_stream.sse").read_bytes(),
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(200, content=(FIXTURES / "vllm/chat_completion.json").read_bytes(),
                              headers={"content-type": "application/json"})

    return handle


def test_vllm_engine_behind_the_gateway(gateways: Any) -> None:
    sent: list[dict[str, Any]] = []
    client = httpx.AsyncClient(transport=httpx.MockTransport(vllm_handler(sent)))
    engine = VllmAdapter("http://vllm:8000", client=client, engine_id="vllm-0")
    gw = gateways([engine], policy="cvar+least-loaded+tiered-aging", stats_interval_s=0.05)
    model = "meta-llama/Llama-3.1-8B-Instruct"
    oai = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=10)
    r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=16, extra_headers={"x-session-id": "v1"})
    assert r.usage is not None and r.usage.completion_tokens == 10
    chunks = list(oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], stream=True,
        extra_headers={"x-session-id": "v1"}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        "Hello there!"
    assert all(c.usage is None for c in chunks)  # our include_usage chunk stays with us
    # the configuration check's one-token probe at start, then the two turns
    assert sent[0] == {"model": model, "prompt": "turnstile probe", "max_tokens": 1}
    sent = sent[1:]
    assert len(sent) == 2
    assert all(isinstance(b["priority"], int) for b in sent)
    assert sent[1]["stream_options"] == {"include_usage": True}
    g = gw.gateway
    deadline = time.monotonic() + 5
    while g.sessions["v1"].turns != 2:  # the stream's end reaches the client first
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert g.scheduler.workflows["v1"].turns[1].output_tokens == 3  # the engine's usage
    deadline = time.monotonic() + 5
    while g.scheduler.view["vllm-0"].queue_len != 5:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert g.scheduler.view["vllm-0"].kv_used_frac == 0.4375
    assert model in httpx.get(gw.url + "/v1/models").text


def test_public_names() -> None:
    import turnstile.gateway as gw

    for name in gw.__all__:
        assert getattr(gw, name) is not None
    assert sorted(gw.__all__) == gw.__all__
