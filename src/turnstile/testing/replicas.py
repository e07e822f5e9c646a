"""Gateway replicas as separate processes (``python -m turnstile.gateway serve``), so a test or
a benchmark can kill one the hard way (SIGKILL) and restart it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from turnstile.gateway.process import GatewayProcess as _Process
from turnstile.gateway.process import config_toml

__all__ = ["GatewayProcess", "write_config"]


def write_config(path: Path, engines: list[tuple[str, str]], policy: str,
                 policy_params: dict[str, dict[str, Any]] | None = None,
                 **gateway: Any) -> Path:
    """A gateway TOML file: ``engines`` as (url, kind), ``gateway``: [gateway] keys,
    ``policy_params``: constructor arguments per policy kind."""
    path.write_text(config_toml({**gateway, "policy": policy},
                                [{"url": url, "kind": kind} for url, kind in engines],
                                policy_params=policy_params))
    return path


class GatewayProcess(_Process):
    """One replica: ``start()`` waits for ``/health``; ``kill()`` is SIGKILL (no clean-up)."""

    def __init__(self, config: Path, *, replica_id: str, port: int | None = None,
                 log_level: str = "warning") -> None:
        super().__init__(config, port=port, name=replica_id,
                         args=["--replica-id", replica_id, "--log-level", log_level])
        self.replica_id = replica_id
        self.log_level = log_level
