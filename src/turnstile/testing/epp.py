"""Test helpers: the endpoint picker served on its own event loop in a thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

from turnstile.epp.server import EppConfig, EppServer
from turnstile.gateway.config import GatewayConfig

__all__ = ["EnvoyFront", "PickerProcess", "PickerThread", "start_picker"]


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
                 watch: str = "inline", **gateway: Any) -> PickerThread:
    """A picker over ``endpoints`` (``ip:port``); ``gateway``: GatewayConfig fields."""
    gateway.setdefault("stats_interval_s", 0.0)
    gcfg = GatewayConfig(policy=policy, **gateway)
    cfg = EppConfig(gateway=gcfg, grpc_port=grpc_port, metrics_port=metrics_port,
                    endpoints=endpoints, endpoints_file=endpoints_file, engine_kind=engine_kind,
                    fallbacks=fallbacks, watch=watch)
    return PickerThread(cfg).start()


class PickerProcess:
    """``turnstile epp`` as its own process (the CLI end to end), for crash tests and
    benchmarks: :meth:`kill` is a crash (SIGKILL), :meth:`stop` a clean shutdown."""

    def __init__(self, endpoints: list[str], *, policy: str = "eager", grpc_port: int = 0,
                 extra: list[str] | None = None, timeout_s: float = 60.0) -> None:
        import os
        import subprocess
        import sys
        import tempfile
        from pathlib import Path

        from turnstile.epp.envoy import free_port
        from turnstile.transport.blocking import wait_ready

        self.grpc_port = grpc_port or free_port()
        self.metrics_port = free_port()
        fd, self.log = tempfile.mkstemp(prefix="turnstile-epp-", suffix=".log")
        src = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
        args = [sys.executable, "-c", "from turnstile.cli import app; app()", "epp",
                "--grpc-port", str(self.grpc_port), "--metrics-port", str(self.metrics_port),
                "--policy", policy, *(extra or [])]
        for e in endpoints:
            args += ["--endpoint", e]
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env)
        got = wait_ready(f"http://127.0.0.1:{self.metrics_port}/health", timeout_s=timeout_s,
                         process=self.proc, poll_s=0.1)
        if got == "exited":
            raise RuntimeError(Path(self.log).read_text()[-2000:])
        if got == "timeout":
            self.kill()
            raise RuntimeError("the picker did not become ready")

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def cpu_s(self) -> float:
        from turnstile.engines.process import cpu_seconds

        return cpu_seconds(self.proc.pid)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        import os
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if os.path.exists(self.log):
            os.unlink(self.log)


class EnvoyFront:
    """Real Envoy, on a free port, in front of a picker already serving ext_proc on
    ``grpc_port``; ``picker`` (anything with ``stop()``) is stopped where Envoy fails to start,
    and by :meth:`stop`, after Envoy."""

    def __init__(self, picker: Any, grpc_port: int) -> None:
        from turnstile.epp.envoy import EnvoyProcess, envoy_config, free_port

        self.picker = picker
        try:
            self.envoy = EnvoyProcess(envoy_config(listen_port=free_port(),
                                                   picker_port=grpc_port)).start()
        except BaseException:
            picker.stop()
            raise
        self.url = self.envoy.url

    def stop(self) -> None:
        self.envoy.stop()
        self.picker.stop()
