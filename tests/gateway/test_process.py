"""The gateway as a process (turnstile.gateway.process): the config it writes is the config the
gateway reads, and a gateway that cannot start says why."""

from __future__ import annotations

from pathlib import Path

import pytest

from turnstile.gateway.config import load_config
from turnstile.gateway.process import GatewayProcess, config_toml, toml_value


def test_toml_values() -> None:
    assert [toml_value(v) for v in (True, 3, 0.5, [1, 2.5], ("a", 'b"c'))] == [
        "true", "3", "0.5", "[1, 2.5]", '["a", "b\\"c"]']
    assert toml_value("C:\\x") == '"C:\\\\x"'


def test_the_written_config_is_the_one_the_gateway_reads(tmp_path: Path) -> None:
    text = config_toml(
        {"host": "127.0.0.1", "port": 8123, "policy": "eager+cmlfq", "session_idle_s": 1.5,
         "tokenize": True},
        [{"url": "http://127.0.0.1:9", "kind": "llama.cpp", "name": "e0", "slots": 4,
          "kv_tokens": 1536},
         {"url": "http://127.0.0.1:10", "kind": "vllm", "name": 'odd "name"', "tp": 2}],
        policy_params={"routing": {"bounds": [12.0, 40.0], "min_obs": 2}})
    (tmp_path / "gw.toml").write_text(text)
    cfg = load_config(tmp_path / "gw.toml")
    assert (cfg.host, cfg.port, cfg.policy, cfg.session_idle_s) == (
        "127.0.0.1", 8123, "eager+cmlfq", 1.5)
    assert cfg.policy_params == {"routing": {"bounds": [12.0, 40.0], "min_obs": 2}}
    assert [(e.url, e.kind, e.name, e.tp) for e in cfg.engines] == [
        ("http://127.0.0.1:9", "llama.cpp", "e0", 1),
        ("http://127.0.0.1:10", "vllm", 'odd "name"', 2)]
    assert cfg.engines[0].options["slots"] == 4 and cfg.engines[0].options["kv_tokens"] == 1536
    cfg.validate()


def test_a_gateway_that_exits_at_start_says_why(tmp_path: Path) -> None:
    conf = tmp_path / "gw.toml"
    conf.write_text(config_toml({"policy": "no-such-policy"},
                                [{"url": "http://127.0.0.1:9", "kind": "openai"}]))
    gw = GatewayProcess(conf, log=tmp_path / "gw.log", name="probe")
    with pytest.raises(RuntimeError,
                       match=r"(?s)probe exited with 2 .*unknown policy .no-such-policy."):
        gw.start(timeout_s=60)
    gw.close()
    assert (tmp_path / "gw.log").exists()  # a given log is kept
