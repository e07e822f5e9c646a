"""Gateway configuration: a TOML file (``turnstile serve --config gateway.toml``) or flags.

```toml
[gateway]
host = "127.0.0.1"          # loopback by default
port = 8000
policy = "cvar+kv-affinity+ttl"
max_held = 1024             # accepted turns not yet released (held, being admitted) before 429
max_inflight = 0            # accepted, unanswered requests before 429 (0: no bound)
auth_token = ""             # or auth_token_env = "TURNSTILE_TOKEN"
auth_admin = false          # /metrics and admin endpoints need the token too
max_body_bytes = 8388608    # 413 past it
max_header_bytes = 65536    # 431 past it (request line and headers)
client_header_timeout_s = 10.0  # 408 when a request's line and headers take longer
client_body_timeout_s = 30.0    # 408 when its body takes longer (from its headers' end)
ready_max_hold_s = 60.0     # /ready is 503 while a turn has been held longer
db = "gateway.sqlite3"      # persist sessions and held turns (omit: in memory only)
record = "sessions.jsonl"   # append every finished session as a workload (omit: no recording)
models = []                 # accepted model names (empty: discovered from the engines)

[policy.release]            # optional constructor arguments, per policy kind
budget_per_engine = 32768

[[engines]]
url = "http://127.0.0.1:8081"
kind = "llama.cpp"          # llama.cpp | vllm | sglang | openai
name = "llama-0"            # engine id (default: host:port)
weight = 1.0
tp = 1                      # tensor parallelism and bucket (for the rollout routers: cmlfq)
bucket = "tp1"
# api_key, priority (vllm/sglang), offload (llama.cpp), slots (llama.cpp),
# kv_tokens (KV capacity in tokens, e.g. llama.cpp -c: enables cvar's KV gate)
```
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from turnstile.core.session_idle import SESSION_IDLE_S
from turnstile.policies import PolicySet

__all__ = ["EngineConfig", "GatewayConfig", "load_config", "parse_engine_flag"]


@dataclass
class EngineConfig:
    url: str
    kind: str = "llama.cpp"
    name: str | None = None
    weight: float = 1.0
    api_key: str | None = None
    #: tensor-parallel degree and bucket name (rollout routers group engines by them)
    tp: int = 1
    bucket: str = ""
    #: adapter options (``priority``, ``offload``, ``slots``, ``low_priority_first``) and
    #: ``kv_tokens``, the engine's KV capacity in tokens (the release policy's KV gate)
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class GatewayConfig:
    engines: list[EngineConfig] = field(default_factory=list)
    policy: str = "auto"
    #: constructor arguments per policy kind: {"release": {"budget_per_engine": 32768}}
    policy_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 8000
    #: turns accepted and not released to an engine yet — held by the release policy, queued
    #: behind their session's running turn, or still being admitted (resolved, tokenized) —
    #: before new requests get 429
    max_held: int = 1024
    #: accepted requests not answered yet (those plus turns on engines) before 429; 0: no bound
    max_inflight: int = 0
    auth_token: str | None = None
    #: ``/metrics`` (and admin endpoints) require the bearer token too; ``/health`` and
    #: ``/ready`` then answer only their status to a caller without it
    auth_admin: bool = False
    db: str | None = None
    #: append each finished session to this workload file (:mod:`.recorder`)
    record: str | None = None
    models: list[str] = field(default_factory=list)
    max_body_bytes: int = 8 * 1024 * 1024
    #: request line and headers, in bytes (431 past it)
    max_header_bytes: int = 64 * 1024
    #: a request's line and headers must arrive within this (from the connection's opening, or
    #: a kept-alive connection's first byte of it), else 408 and the connection is closed
    client_header_timeout_s: float = 10.0
    #: its whole body must arrive within this of its headers, else 408 and the connection is
    #: closed
    client_body_timeout_s: float = 30.0
    #: ``/ready`` answers 503 while the oldest held turn has waited longer than this
    ready_max_hold_s: float = 60.0
    #: ... or while the state backend does not answer a ping within this
    ready_state_timeout_s: float = 1.0
    #: an idle session (no turn for this long) is closed: its flow time is recorded
    session_idle_s: float = SESSION_IDLE_S
    #: forwarding attempts per turn (re-routes after an engine failure)
    max_attempts: int = 3
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0
    #: an engine that is up is health-checked this often (a dead one's turns move at the next
    #: check: keep it well under the 2 s a turn may wait for that)
    health_interval_s: float = 1.0
    #: a failed engine is re-checked this often
    recheck_interval_s: float = 0.5
    #: stall probe (0: off): an engine with requests in flight that has sent no reply byte for
    #: this long is health-checked at once, with half this as the timeout; unanswered (and
    #: still no byte), it is hung: dead at once (its requests dropped: re-routed, or streams
    #: ended with an error event) instead of after three failed health checks (several
    #: seconds). Off by default: a CPU engine starved by a long prefill may miss the short check
    stall_probe_s: float = 0.0
    #: scrape engines' /metrics for queue lengths this often (0: never)
    stats_interval_s: float = 2.0
    #: results of turns served after a restart (no client attached) are kept this long
    result_ttl_s: float = 600.0
    #: prompt tokens estimated from characters (chars / 4, self-calibrated) or asked of the
    #: engine (``/tokenize``, one extra round trip per request)
    tokenize: bool = False
    default_output_tokens: int = 256
    #: shared state for several replicas (``redis://HOST:PORT/DB``); None: one process, with
    #: ``db`` (SQLite) for restarts
    state: str | None = None
    #: this replica's name in the shared state (default: host-pid-random)
    replica_id: str | None = None
    #: a replica whose heartbeat is older than this is dead: its accepted turns are taken over
    replica_ttl_s: float = 3.0
    #: how often replicas exchange their load on the engines (seconds)
    peer_sync_s: float = 0.1
    #: derive a session from the conversation when a request names none (see affinity.py)
    derive_sessions: bool = True
    log_level: str = "warning"

    def validate(self) -> None:
        if not self.engines:
            raise ValueError("the gateway needs at least one engine (--engine URL[,kind])")
        names = [e.name for e in self.engines if e.name]
        if len(names) != len(set(names)):
            raise ValueError(f"engine names must be unique, got {names}")
        if self.max_held < 1:
            raise ValueError("max_held must be >= 1")
        if self.stall_probe_s < 0:
            raise ValueError("stall_probe_s must be >= 0 (0: off)")
        if self.max_inflight < 0:
            raise ValueError("max_inflight must be >= 0 (0: no bound)")
        if self.max_body_bytes < 1 or self.max_header_bytes < 1:
            raise ValueError("max_body_bytes and max_header_bytes must be >= 1")
        for key in ("client_header_timeout_s", "client_body_timeout_s"):
            v = getattr(self, key)
            if not isinstance(v, int | float) or not 0 < v < math.inf:
                raise ValueError(f"{key} must be a number of seconds > 0, got {v!r}")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        PolicySet.from_spec(self.policy, self.policy_params)


def parse_engine_flag(value: str) -> EngineConfig:
    """``URL[,kind[,name]]`` (``--engine http://127.0.0.1:8081,llama.cpp``)."""
    parts = [p.strip() for p in value.split(",")]
    if not parts[0].startswith(("http://", "https://")):
        raise ValueError(f"--engine {value!r}: expected URL[,kind[,name]] with an http(s) URL")
    cfg = EngineConfig(url=parts[0])
    if len(parts) > 1 and parts[1]:
        cfg.kind = parts[1]
    if len(parts) > 2 and parts[2]:
        cfg.name = parts[2]
    if len(parts) > 3:
        raise ValueError(f"--engine {value!r}: expected URL[,kind[,name]]")
    return cfg


_ENGINE_KEYS = {f.name for f in fields(EngineConfig)} - {"options"}
_GATEWAY_KEYS = {f.name for f in fields(GatewayConfig)} - {"engines", "policy_params"}


def load_config(path: str | os.PathLike[str]) -> GatewayConfig:
    """Read a gateway TOML file (see the module docstring); raises ValueError with the key."""
    p = Path(path)
    try:
        doc = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{p}: {e}") from None
    cfg = GatewayConfig()
    section = dict(doc.get("gateway", {}))
    token_env = section.pop("auth_token_env", None)
    for key, value in section.items():
        if key not in _GATEWAY_KEYS:
            raise ValueError(f"{p}: unknown [gateway] key {key!r}; valid: "
                             f"{', '.join(sorted(_GATEWAY_KEYS))}")
        setattr(cfg, key, value)
    if token_env:
        cfg.auth_token = os.environ.get(token_env) or cfg.auth_token
    policy = doc.get("policy", {})
    if not isinstance(policy, dict):
        raise ValueError(f"{p}: [policy] must be a table")
    if "spec" in policy:
        cfg.policy = str(policy["spec"])
    cfg.policy_params = {k: dict(v) for k, v in policy.items() if isinstance(v, dict)}
    for i, raw in enumerate(doc.get("engines", [])):
        if "url" not in raw:
            raise ValueError(f"{p}: engines[{i}] needs a url")
        known = {k: v for k, v in raw.items() if k in _ENGINE_KEYS}
        options = {k: v for k, v in raw.items() if k not in _ENGINE_KEYS}
        cfg.engines.append(EngineConfig(**known, options=options))
    return cfg
