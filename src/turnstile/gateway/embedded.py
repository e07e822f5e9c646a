"""A gateway (or any ASGI app) served by uvicorn in a daemon thread of this process.

For programs that drive a gateway in-process (the rollout manager's live mode, tests,
benchmarks): :func:`start_gateway` over engine URLs or adapters.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import uvicorn

__all__ = ["GatewayServer", "ServerThread", "start_gateway"]


class ServerThread:
    """Serve an ASGI app with uvicorn on a loopback port, in a daemon thread.

    The socket is bound before the thread starts, so ``port`` is known at once.
    """

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0,
                 lifespan: Literal["auto", "on", "off"] = "auto",
                 log_level: str = "warning", options: dict[str, Any] | None = None) -> None:
        self.app = app
        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets (else Nagle and
        # delayed ACKs add ~40 ms to every response written in two parts)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host = host
        self.port = int(self.sock.getsockname()[1])
        kw: dict[str, Any] = {"http": "h11", **(options or {})}
        config = uvicorn.Config(app, host=host, port=self.port, loop="asyncio",
                                lifespan=lifespan, access_log=False, log_level=log_level,
                                timeout_graceful_shutdown=2, **kw)
        self.server = uvicorn.Server(config)
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 20.0) -> ServerThread:
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True, name=f"uvicorn-{self.port}")
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"server on port {self.port} failed to start")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server on port {self.port} did not start in {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout_s)
            if self.thread.is_alive():
                self.server.force_exit = True
                self.thread.join(timeout_s)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class GatewayServer:
    """A gateway app served in a thread (``gateway`` is its :class:`Gateway`)."""

    app: Any
    server: ServerThread

    @property
    def gateway(self) -> Any:
        return self.app.gateway

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()


def start_gateway(engines: list[Any], *, policy: str = "eager", policies: Any = None,
                  kind: str = "llama.cpp", port: int = 0, **cfg: Any) -> GatewayServer:
    """Serve a gateway over ``engines`` (URLs or adapters); ``cfg``: GatewayConfig fields, and
    ``backend``: a state backend object (else ``cfg['db']`` or none)."""
    from turnstile.gateway.adapters import EngineAdapter, make_adapter
    from turnstile.gateway.app import GatewayApp
    from turnstile.gateway.config import EngineConfig, GatewayConfig
    from turnstile.gateway.service import Gateway
    from turnstile.policies import PolicySet

    backend = cfg.pop("backend", None)
    cfg.setdefault("stats_interval_s", 0.0)
    config = GatewayConfig(policy=policy, **cfg)
    adapters = [e if isinstance(e, EngineAdapter) else make_adapter(e, kind) for e in engines]
    config.engines = [EngineConfig(a.base_url, a.kind) for a in adapters]
    gw = Gateway(config, adapters=adapters, backend=backend,
                 policies=policies or PolicySet.from_spec(policy, config.policy_params))
    app = GatewayApp(gw)
    from turnstile.gateway.server import uvicorn_options

    return GatewayServer(app, ServerThread(app, port=port, options=uvicorn_options(config))
                         .start())
