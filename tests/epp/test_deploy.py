"""``deploy/``: the Envoy configs are what :func:`envoy_config` writes, and the Kubernetes
manifests agree with each other and with ``turnstile epp``'s flags (no Envoy run here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
import yaml

from turnstile.epp.cli import epp
from turnstile.epp.envoy import DEST_HEADER, envoy_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
EPS = ["10.0.0.5:8080", "10.0.0.6:8080"]


def _without_admin(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if k != "admin"}


def _ext_proc(cfg: dict[str, Any]) -> dict[str, Any]:
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = hcm["typed_config"]["http_filters"]
    assert filters[-1]["name"] == "envoy.filters.http.router"  # the router comes last
    (ext,) = [f["typed_config"] for f in filters if f["name"] == "envoy.filters.http.ext_proc"]
    return ext


def _cluster(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in cfg["static_resources"]["clusters"] if c["name"] == name]
    return c


def test_envoy_configs_are_the_generated_ones() -> None:
    a = yaml.safe_load((DEPLOY / "envoy.yaml").read_text())
    assert _without_admin(a) == _without_admin(envoy_config(
        listen_port=8081, host="0.0.0.0", picker_port=9002, mode="original_dst"))
    b = yaml.safe_load((DEPLOY / "envoy-fallback.yaml").read_text())
    assert _without_admin(b) == _without_admin(envoy_config(
        listen_port=8081, host="0.0.0.0", picker_port=9002, mode="override_host",
        endpoints=EPS, failure_mode_allow=True))


def test_envoy_config_speaks_the_picker_protocol() -> None:
    for name in ("envoy.yaml", "envoy-fallback.yaml"):
        cfg = yaml.safe_load((DEPLOY / name).read_text())
        ext = _ext_proc(cfg)
        mode = ext["processing_mode"]
        # the picker decides on the whole body and follows the streamed response: fail-closed
        # in full-duplex mode (headers and body in one round trip; the picker answers the
        # headers once the body is in), fail-open buffered (Envoy 1.40 answers 500 in
        # full-duplex mode when the picker is gone, failure_mode_allow or not)
        if ext["failure_mode_allow"]:
            assert mode["request_body_mode"] == "BUFFERED"
        else:
            assert mode["request_body_mode"] == "FULL_DUPLEX_STREAMED"
            assert mode["request_trailer_mode"] == "SEND"  # Envoy wants it in this mode
        assert mode["response_body_mode"] == "STREAMED"
        assert mode["request_header_mode"] == mode["response_header_mode"] == "SEND"
        # long enough for the picker to hold a turn (release control)
        assert float(ext["message_timeout"].rstrip("s")) >= 60
        epp_cluster = _cluster(cfg, ext["grpc_service"]["envoy_grpc"]["cluster_name"])
        assert "http2_protocol_options" in str(epp_cluster)  # gRPC needs HTTP/2
        port = epp_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"][
            "address"]["socket_address"]["port_value"]
        assert port == 9002
        pool = _cluster(cfg, "pool")
        if pool["type"] == "ORIGINAL_DST":
            assert pool["original_dst_lb_config"] == {"use_http_header": True,
                                                      "http_header_name": DEST_HEADER}
            # one address only: no fallback to fail open to
            assert ext["failure_mode_allow"] is False
        else:
            policy = str(pool["load_balancing_policy"])
            assert "override_host" in policy and DEST_HEADER in policy
            eps = [e["endpoint"]["address"]["socket_address"]
                   for e in pool["load_assignment"]["endpoints"][0]["lb_endpoints"]]
            assert [f"{e['address']}:{e['port_value']}" for e in eps] == EPS


def _docs() -> dict[str, dict[str, Any]]:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "turnstile-epp.yaml").read_text()))
    return {d["kind"]: d for d in docs}


def _args() -> dict[str, Any]:
    """The Deployment's picker flags, parsed by the ``turnstile epp`` command itself (an unknown
    flag or a bad value fails here)."""
    dep = _docs()["Deployment"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["turnstile", "epp"]
    app = typer.Typer()
    app.command()(epp)
    ctx = typer.main.get_command(app).make_context("epp", list(c["args"]))
    return dict(ctx.params)


def test_kubernetes_manifests_agree_with_the_picker_flags() -> None:
    docs = _docs()
    args = _args()
    pool, svc, dep, cm = (docs["InferencePool"], docs["Service"], docs["Deployment"],
                          docs["ConfigMap"])
    grpc_port = args["grpc_port"]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == svc["metadata"]["name"] == dep["metadata"]["name"]
    assert ref["port"]["number"] == grpc_port
    (svc_grpc,) = [p for p in svc["spec"]["ports"] if p["name"].startswith("grpc")]
    assert svc_grpc["port"] == svc_grpc["targetPort"] == grpc_port
    assert svc["spec"]["selector"] == dep["spec"]["template"]["metadata"]["labels"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["grpc"] == grpc_port and ports["metrics"] == args["metrics_port"]
    # the probes ask the picker's gRPC health services by name
    assert c["livenessProbe"]["grpc"] == {"port": grpc_port, "service": "liveness"}
    assert c["readinessProbe"]["grpc"] == {"port": grpc_port, "service": "readiness"}
    assert args["host"] == "0.0.0.0"  # reachable from the gateway's pods
    assert args["engine_kind"] == "llama.cpp" and "+" in args["policy"]
    assert args["pool_name"] == pool["metadata"]["name"]
    # the endpoints file is the mounted ConfigMap, listing pods on the pool's target port
    (mount,) = c["volumeMounts"]
    assert str(args["endpoints_file"]).startswith(mount["mountPath"] + "/")
    key = str(args["endpoints_file"]).rsplit("/", 1)[1]
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert vol["configMap"]["name"] == cm["metadata"]["name"]
    target = pool["spec"]["targetPorts"][0]["number"]
    lines = [ln.strip() for ln in cm["data"][key].splitlines()
             if ln.strip() and not ln.strip().startswith("#")]
    assert lines and all(ln.endswith(f":{target}") for ln in lines)
    # a gateway built from the pool uses one destination address (fail-closed, no fallbacks)
    assert ref["failureMode"] == "FailClose" and args["fallbacks"] == 0


def test_envoy_accepts_the_deploy_configs(envoy_binary: Path) -> None:
    import subprocess

    for name in ("envoy.yaml", "envoy-fallback.yaml"):
        r = subprocess.run([str(envoy_binary), "--mode", "validate", "-c", str(DEPLOY / name),
                            "--disable-hot-restart", "-l", "error"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (name, r.stdout[-2000:], r.stderr[-2000:])
