"""``turnstile epp``: the picker's process — the ext_proc gRPC server with gRPC health, the
endpoint source (a static list or a file re-read when it changes), and an HTTP port with
Prometheus ``/metrics`` and ``/health``.

gRPC health services (``grpc.health.v1``): ``liveness`` (the process answers), ``readiness``
and ``envoy.service.ext_proc.v3.ExternalProcessor`` (at least one endpoint is ready), and the
empty service name (the same as readiness).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client import Counter, Histogram

from turnstile.epp.extproc import ExtProc
from turnstile.epp.picker import Picker
from turnstile.gateway.adapters import make_adapter
from turnstile.gateway.config import EngineConfig, GatewayConfig

__all__ = ["EppConfig", "EppMetrics", "EppServer", "read_endpoints_file"]

log = logging.getLogger("turnstile.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0, 5.0,
                     30.0, 120.0)


@dataclass
class EppConfig:
    """The picker's own settings; the scheduling ones are the gateway's (``gateway``)."""

    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    host: str = "127.0.0.1"
    grpc_port: int = 9002
    #: Prometheus /metrics and /health (0: none)
    metrics_port: int | None = 9090
    #: static endpoints (``ip:port``)
    endpoints: list[str] = field(default_factory=list)
    #: a file of endpoints, one ``ip:port`` a line (or a JSON list), re-read when it changes
    endpoints_file: str | None = None
    engine_kind: str = "llama.cpp"
    #: how often the endpoints file is checked (seconds)
    watch_interval_s: float = 1.0
    #: fallback endpoints after the picked one (0 for Envoy's ORIGINAL_DST cluster, which
    #: reads a single address; >0 for the override_host policy, which retries down the list)
    fallbacks: int = 0
    #: how the response reaches the picker: ``inline`` (the routing filter's own stream) or
    #: ``observe`` (a second ext_proc filter in observability mode: no round trip on the
    #: response path); must match the Envoy config (:func:`turnstile.epp.envoy.envoy_config`)
    watch: str = "inline"
    #: the InferencePool this picker serves (Kubernetes; informational)
    pool_name: str = ""


def read_endpoints_file(path: str | os.PathLike[str]) -> list[str]:
    text = Path(path).read_text(encoding="utf-8")
    s = text.strip()
    if s.startswith("["):
        data = json.loads(s)
        return [str(x).strip() for x in data if str(x).strip()]
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.extend(x.strip() for x in line.split(",") if x.strip())
    return out


class EppMetrics:
    """The picker's own series, on the gateway's registry (one ``/metrics``)."""

    def __init__(self, picker: Picker) -> None:
        r = picker.metrics.registry
        self.decisions = Counter("turnstile_epp_decisions",
                                 "Data plane requests answered, by result (routed, or the status)",
                                 ["result"], registry=r)
        self.decision_s = Histogram("turnstile_epp_decision_seconds",
                                    "Request body received to the picker's answer (hold included)",
                                    buckets=_DECISION_BUCKETS, registry=r)
        self._children: dict[str, Counter] = {}

    def decision(self, seconds: float, answer: object) -> None:
        imm = getattr(answer, "immediate_response", None)
        has_imm = bool(getattr(answer, "HasField", lambda _n: False)("immediate_response"))
        result = str(imm.status.code) if has_imm and imm is not None else "routed"
        c = self._children.get(result)
        if c is None:
            c = self._children[result] = self.decisions.labels(result)
        c.inc()
        self.decision_s.observe(seconds)


class EppServer:
    """The picker, its gRPC server and its metrics port, on the running event loop."""

    def __init__(self, cfg: EppConfig) -> None:
        self.cfg = cfg
        eps = list(cfg.endpoints)
        if cfg.endpoints_file:
            eps = read_endpoints_file(cfg.endpoints_file) or eps
        if not eps:
            raise ValueError("the picker needs endpoints (--endpoint IP:PORT or --endpoints-file)")
        gcfg = cfg.gateway
        # an endpoint the gateway config lists as an engine takes its kind and options from
        # there (``slots``, ``kv_tokens`` for cvar's KV gate, ``weight``, ``tp``/``bucket``)
        known = {httpx.URL(e.url).netloc.decode(): e for e in gcfg.engines}
        engines = [known.get(ep) or EngineConfig(f"http://{ep}", cfg.engine_kind) for ep in eps]
        gcfg.engines = engines
        adapters = [make_adapter(f"http://{ep}", e.kind, api_key=e.api_key, weight=e.weight,
                                 options=e.options, connect_timeout_s=gcfg.connect_timeout_s,
                                 read_timeout_s=gcfg.read_timeout_s)
                    for ep, e in zip(eps, engines, strict=True)]
        self.picker = Picker(gcfg, adapters=adapters, max_fallbacks=cfg.fallbacks)
        self.metrics = EppMetrics(self.picker)
        self.health = HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.grpc_port = 0
        self.metrics_port = 0
        self._http: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._mtime = 0.0

    async def start(self) -> None:
        await self.picker.start()
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_ExternalProcessorServicer_to_server(
            ExtProc(self.picker, self.metrics, observe=self.cfg.watch == "observe"), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.grpc_port = server.add_insecure_port(f"{self.cfg.host}:{self.cfg.grpc_port}")
        if self.grpc_port == 0:
            raise OSError(f"cannot bind gRPC {self.cfg.host}:{self.cfg.grpc_port}")
        await server.start()
        self.server = server
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self._readiness()
        if self.cfg.metrics_port is not None and self.cfg.metrics_port >= 0:
            self._http = await asyncio.start_server(self._serve_http, self.cfg.host,
                                                    self.cfg.metrics_port)
            self.metrics_port = self._http.sockets[0].getsockname()[1]
        self._tasks.append(asyncio.ensure_future(self._readiness_loop()))
        if self.cfg.endpoints_file:
            with contextlib.suppress(OSError):
                self._mtime = os.stat(self.cfg.endpoints_file).st_mtime
            self._tasks.append(asyncio.ensure_future(self._watch()))

    async def stop(self, grace_s: float = 1.0) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            self._http.close()
        if self.server is not None:
            await self.server.stop(grace_s)
        await self.picker.stop()

    @property
    def ready(self) -> bool:
        return self.picker.started and bool(self.picker.ready_endpoints())

    async def _readiness(self) -> None:
        st = (health_pb2.HealthCheckResponse.SERVING if self.ready
              else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("readiness", EXT_PROC_SERVICE, ""):
            await self.health.set(name, st)

    async def _readiness_loop(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            await self._readiness()

    async def _watch(self) -> None:
        path = self.cfg.endpoints_file
        assert path is not None
        while True:
            await asyncio.sleep(self.cfg.watch_interval_s)
            try:
                mtime = os.stat(path).st_mtime
                if mtime == self._mtime:
                    continue
                self._mtime = mtime
                eps = read_endpoints_file(path)
            except (OSError, ValueError) as e:
                log.warning("endpoints file %s: %s", path, e)
                continue
            if eps:
                await self.picker.set_endpoints(eps, self.cfg.engine_kind)
                await self._readiness()

    async def _serve_http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                          ) -> None:
        try:
            line = await reader.readline()
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass
            parts = line.split()
            target = parts[1].decode() if len(parts) > 1 else "/"
            status, ctype, body = self._http_answer(target)
            writer.write(f"HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: "
                         f"{len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def _http_answer(self, target: str) -> tuple[str, str, bytes]:
        if target.startswith("/metrics"):
            return "200 OK", "text/plain; version=0.0.4", self.picker.metrics.render()
        if target.startswith("/health"):
            pk = self.picker
            body = json.dumps({"status": "ok" if self.ready else "unavailable",
                               "policy": pk.policies.spec, "engines": pk.engine_up,
                               "held_turns": pk.scheduler.held_turns,
                               "sessions": len(pk.sessions)}).encode()
            return ("200 OK" if self.ready else "503 Service Unavailable", "application/json",
                    body)
        return "404 Not Found", "text/plain", b"not found\n"


async def serve_forever(cfg: EppConfig, on_ready: Callable[[EppServer], None] | None = None
                        ) -> None:
    srv = EppServer(cfg)
    await srv.start()
    log.warning("turnstile epp: ext_proc on %s:%d, metrics on %d, policy %s, endpoints %s",
                cfg.host, srv.grpc_port, srv.metrics_port, srv.picker.policies.spec,
                ", ".join(srv.picker.by_endpoint))
    if on_ready is not None:
        on_ready(srv)
    try:
        await asyncio.Event().wait()
    finally:
        await srv.stop()
