"""Test helpers: the endpoint picker served on its own event loop in a thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

from turnstile.epp.server import EppConfig, EppServer
from turnstile.gateway.config import GatewayConfig

__all__ = ["PickerThread", "start_picker"]


class PickerThread:
    """An :class:`EppServer` running in a background thread until :meth:`stop`."""

    def __init__(self, cfg: EppConfig) -> None:
        self.cfg = cfg
        self.loop = asyncio.new_event_loop()
        self.server: EppServer | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="turnstile-epp")

    def start(self, timeout_s: float = 20.0) -> PickerThread:
        self._thread.start()

        async def boot() -> EppServer:
            srv = EppServer(self.cfg)
            await srv.start()
            return srv

        self.server = self.call(boot(), timeout_s)
        return self

    def call(self, coro: Any, timeout_s: float = 30.0) -> Any:
        fut: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout_s)

    @property
    def picker(self) -> Any:
        assert self.server is not None
        return self.server.picker

    @property
    def grpc_port(self) -> int:
        assert self.server is not None
        return self.server.grpc_port

    @property
    def metrics_url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.metrics_port}"

    def stop(self, grace_s: float = 0.5) -> None:
        if self.server is not None:
            try:
                self.call(self.server.stop(grace_s), 30)
            finally:
                self.server = None
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        self.loop.close()


def start_picker(endpoints: list[str], *, policy: str = "eager", grpc_port: int = 0,
                 metrics_port: int | None = 0, endpoints_file: str | None = None,
                 engine_kind: str = "llama.cpp", fallbacks: int = 0,
                 **gateway: Any) -> PickerThread:
    """A picker over ``endpoints`` (``ip:port``); ``gateway``: GatewayConfig fields."""
    gateway.setdefault("stats_interval_s", 0.0)
    gcfg = GatewayConfig(policy=policy, **gateway)
    cfg = EppConfig(gateway=gcfg, grpc_port=grpc_port, metrics_port=metrics_port,
                    endpoints=endpoints, endpoints_file=endpoints_file, engine_kind=engine_kind,
                    fallbacks=fallbacks)
    return PickerThread(cfg).start()
