"""``turnstile epp``: run the endpoint picker (:func:`register` adds it to a Typer app)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Annotated, Any

import typer

__all__ = ["epp", "register"]


def epp(
    endpoint: Annotated[
        list[str] | None,
        typer.Option("--endpoint", help="Engine endpoint IP:PORT (repeat): the InferencePool's "
                     "pods"),
    ] = None,
    endpoints_file: Annotated[
        Path | None, typer.Option(help="File of endpoints (one IP:PORT a line, or a JSON list), "
                                  "re-read when it changes")
    ] = None,
    engine_kind: Annotated[str, typer.Option(help="llama.cpp, vllm, sglang or openai")]
    = "llama.cpp",
    config: Annotated[Path | None, typer.Option(help="Gateway TOML file for the scheduling "
                                                "settings: its gateway and policy tables, and "
                                                "for an endpoint one of its engines names, "
                                                "that engine's kind and options (slots, "
                                                "kv_tokens); the endpoints come from the "
                                                "flags")] = None,
    policy: Annotated[str | None, typer.Option(help="Policy spec, e.g. cvar+kv-affinity+ttl")]
    = None,
    host: Annotated[str, typer.Option(help="Bind address")] = "127.0.0.1",
    grpc_port: Annotated[int, typer.Option(help="ext_proc + gRPC health port")] = 9002,
    metrics_port: Annotated[int, typer.Option(min=-1, help="Prometheus /metrics and /health "
                                              "port (-1: none)")] = 9090,
    max_held: Annotated[int | None, typer.Option(min=1, help="Held + queued turns before 429")
                        ] = None,
    fallbacks: Annotated[int, typer.Option(min=0, max=1024, help="Fallback endpoints listed "
                                           "after the picked one (0 for an ORIGINAL_DST "
                                           "cluster)")] = 0,
    watch: Annotated[str, typer.Option(help="How responses reach the picker: inline (the "
                                       "routing filter) or observe (a second, observability-"
                                       "mode ext_proc filter); as the Envoy config says")]
    = "inline",
    pool_name: Annotated[str, typer.Option(help="The InferencePool this picker serves")] = "",
    record: Annotated[Path | None, typer.Option(help="Append every finished session to this "
                                                "workload .jsonl")] = None,
    loop: Annotated[str, typer.Option(help="Event loop: auto (uvloop when installed), uvloop or "
                                      "asyncio")] = "auto",
    log_level: Annotated[str, typer.Option()] = "warning",
) -> None:
    """Run the scheduler as an Envoy ext_proc endpoint picker (Gateway API Inference Extension)."""
    from turnstile.bench.usage import require_extra

    require_extra("epp", "epp")
    from turnstile.epp.server import EppConfig, serve_forever
    from turnstile.gateway.cli import (
        check_engine_kind,
        check_log_level,
        check_record,
        load_config_flag,
        set_given,
    )

    try:
        check_log_level(log_level)
        check_engine_kind(engine_kind, f"--engine-kind {engine_kind}")
        if record is not None:
            check_record(record)
        gcfg = load_config_flag(config)
        set_given(gcfg, policy=policy, max_held=max_held,
                  record=None if record is None else str(record), log_level=log_level)
        cfg = EppConfig(gateway=gcfg, host=host, grpc_port=grpc_port,
                        metrics_port=None if metrics_port < 0 else metrics_port,
                        endpoints=list(endpoint or []),
                        endpoints_file=str(endpoints_file) if endpoints_file else None,
                        engine_kind=engine_kind, pool_name=pool_name,
                        fallbacks=fallbacks, watch=watch)
        if watch not in ("inline", "observe"):
            raise ValueError(f"--watch {watch!r}: expected inline or observe")
        run = _runner(loop)
        if not cfg.endpoints and not cfg.endpoints_file:
            raise ValueError("give --endpoint IP:PORT (repeat) or --endpoints-file")
        for ep in cfg.endpoints:
            _check_endpoint(ep)
        if endpoints_file is not None:
            from turnstile.epp.server import read_endpoints_file

            if not endpoints_file.is_file():
                raise ValueError(f"--endpoints-file {endpoints_file}: no such file")
            try:
                listed = read_endpoints_file(endpoints_file)
            except (ValueError, UnicodeDecodeError) as e:
                raise ValueError(f"--endpoints-file {endpoints_file}: not one IP:PORT a line "
                                 f"nor a JSON list ({e})") from None
            for ep in listed:
                _check_endpoint(ep, f"--endpoints-file {endpoints_file}: endpoint")
        from turnstile.gateway.cli import check_listen

        check_listen(host, grpc_port, "--grpc-port")
        if metrics_port >= 0:
            check_listen(host, metrics_port, "--metrics-port")
        from turnstile.policies import PolicySet

        PolicySet.from_spec(gcfg.policy, gcfg.policy_params)
    except (ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        run(serve_forever(cfg))


def _check_endpoint(ep: str, flag: str = "--endpoint") -> None:
    """``--endpoint``: HOST:PORT (an IPv6 address in brackets), the port 1 to 65535."""
    host, sep, port = ep.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{flag} {ep}: expected IP:PORT (a pod's address and port)")


def _runner(loop: str) -> Callable[[Coroutine[Any, Any, None]], None]:
    """``asyncio.run`` or ``uvloop.run``: uvloop's loop takes 0.2–0.3 ms off each request's
    ext_proc stream in grpc.aio here (``benchmarks/epp_overhead.py``, null picker)."""
    import asyncio

    if loop not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"--loop {loop!r}: expected auto, uvloop or asyncio")
    if loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                raise ValueError("--loop uvloop: uvloop is not installed") from None
        else:
            return uvloop.run
    return asyncio.run


def register(app: typer.Typer) -> None:
    app.command("epp")(epp)
