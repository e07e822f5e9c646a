"""``turnstile serve`` and ``turnstile replay``: :func:`register` adds them to a Typer app.

Also runnable alone: ``python -m turnstile.gateway serve ...``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["main", "register"]


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def serve(
    config: Annotated[Path | None, typer.Option(help="Gateway TOML file (flags override it)")]
    = None,
    engine: Annotated[
        list[str] | None,
        typer.Option("--engine", help="Engine URL[,kind[,name]] (repeat); kind: llama.cpp, "
                     "vllm, sglang, openai"),
    ] = None,
    policy: Annotated[str | None, typer.Option(help="Policy spec, e.g. cvar+kv-affinity+ttl")]
    = None,
    host: Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8000)")] = None,
    max_held: Annotated[int | None, typer.Option(
        help="Accepted turns not yet released (held, queued, being admitted) before 429")] = None,
    max_inflight: Annotated[int | None, typer.Option(
        help="Accepted, unanswered requests before 429 (0: no bound)")] = None,
    auth_admin: Annotated[bool | None, typer.Option(
        "--auth-admin/--no-auth-admin",
        help="/metrics (and /health, /ready details) require the bearer token too")] = None,
    max_body_bytes: Annotated[int | None, typer.Option(help="Request body limit (413)")] = None,
    max_header_bytes: Annotated[int | None, typer.Option(
        help="Request line + headers limit (431)")] = None,
    ready_max_hold_s: Annotated[float | None, typer.Option(
        help="/ready is 503 while a turn has been held longer than this")] = None,
    auth_token: Annotated[
        str | None, typer.Option(help="Require 'Authorization: Bearer TOKEN'",
                                 envvar="TURNSTILE_AUTH_TOKEN")
    ] = None,
    db: Annotated[Path | None, typer.Option(help="SQLite file for sessions and held turns")]
    = None,
    state: Annotated[
        str | None, typer.Option(help="Shared state of several replicas: redis://HOST:PORT/DB")
    ] = None,
    replica_id: Annotated[
        str | None, typer.Option(help="This replica's name in the shared state "
                                 "(default: host-pid-random)")
    ] = None,
    record: Annotated[
        Path | None, typer.Option(help="Append every finished session to this workload .jsonl "
                                  "(counts, times and prefix hashes; never content)")
    ] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn/gateway log level")] = "warning",
) -> None:
    """Run the OpenAI-compatible scheduling gateway in front of engines."""
    import uvicorn

    from turnstile.gateway.app import create_app
    from turnstile.gateway.config import GatewayConfig, load_config, parse_engine_flag

    try:
        cfg = load_config(config) if config is not None else GatewayConfig()
        if engine:
            cfg.engines = [parse_engine_flag(e) for e in engine]
        if policy is not None:
            cfg.policy = policy
        if host is not None:
            cfg.host = host
        if port is not None:
            cfg.port = port
        if max_held is not None:
            cfg.max_held = max_held
        if auth_token:
            cfg.auth_token = auth_token
        for key, value in (("max_inflight", max_inflight), ("auth_admin", auth_admin),
                           ("max_body_bytes", max_body_bytes),
                           ("max_header_bytes", max_header_bytes),
                           ("ready_max_hold_s", ready_max_hold_s)):
            if value is not None:
                setattr(cfg, key, value)
        if cfg.auth_admin and not cfg.auth_token:
            raise ValueError("--auth-admin needs --auth-token")
        if db is not None:
            cfg.db = str(db)
        if state is not None:
            cfg.state = state
        if replica_id is not None:
            cfg.replica_id = replica_id
        if record is not None:
            cfg.record = str(record)
        if cfg.record:
            from turnstile.gateway.recorder import SessionRecorder

            SessionRecorder(cfg.record).close()  # fails now on a file that is not a workload
        cfg.log_level = log_level
        cfg.validate()
    except (ValueError, OSError) as e:
        raise _fail(str(e)) from None
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and not cfg.auth_token:
        typer.echo(f"warning: binding {cfg.host} without --auth-token", err=True)
    typer.echo(f"turnstile gateway on http://{cfg.host}:{cfg.port} policy={cfg.policy} "
               f"engines={', '.join(e.url for e in cfg.engines)}"
               + (f" state={cfg.state}" if cfg.state else ""), err=True)
    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_level=log_level,
                access_log=False, lifespan="on", timeout_graceful_shutdown=5,
                h11_max_incomplete_event_size=cfg.max_header_bytes)


def replay(
    target: Annotated[str, typer.Option(help="Gateway or engine base URL (http://host:port)")],
    trace: Annotated[
        str | None, typer.Option(help="Trace dir/file or workload .jsonl; omit: synthetic")
    ] = None,
    rate: Annotated[float, typer.Option(help="Poisson session arrival rate (sessions/s)")] = 1.0,
    workflows: Annotated[int, typer.Option(help="Sessions to play")] = 20,
    out: Annotated[Path, typer.Option(help="Directory for results.json")] = Path("replay-out"),
    time_scale: Annotated[float, typer.Option(help="Multiply tool durations by this")] = 1.0,
    max_context: Annotated[
        int, typer.Option(help="Engine context per request (tokens): prompts are scaled to fit")
    ] = 2048,
    max_tokens: Annotated[int, typer.Option(help="Cap on output tokens per turn")] = 64,
    max_turns: Annotated[int | None, typer.Option(help="Play at most this many turns each")]
    = None,
    model: Annotated[str, typer.Option(help="Model name sent in requests")] = "tiny",
    stream: Annotated[bool, typer.Option(help="Stream responses (measures TTFT)")] = True,
    arrivals: Annotated[str, typer.Option(help="poisson or trace")] = "poisson",
    label: Annotated[
        str | None, typer.Option(help="Result label (default: the gateway's policy)")
    ] = None,
    api_key: Annotated[str | None, typer.Option(envvar="TURNSTILE_AUTH_TOKEN")] = None,
    subset: Annotated[str | None, typer.Option(help="agentcgroup subset")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    timeout_s: Annotated[float, typer.Option(help="Per-request timeout")] = 300.0,
) -> None:
    """Play a trace's workflows as closed-loop agents against a gateway or an engine."""
    if rate <= 0 or workflows < 1 or time_scale < 0:
        raise _fail("--rate must be > 0, --workflows >= 1, --time-scale >= 0")
    import asyncio

    from turnstile.bench.replay import ReplaySpec, load_workflows, run_replay

    spec = ReplaySpec(target=target.rstrip("/"), trace=trace, rate=rate, workflows=workflows,
                      time_scale=time_scale, max_context=max_context, max_tokens=max_tokens,
                      max_turns=max_turns, model=model, stream=stream, arrivals=arrivals,
                      label=label, api_key=api_key, subset=subset, seed=seed,
                      timeout_s=timeout_s)
    try:
        wfs, trace_info = load_workflows(spec)
    except (ValueError, OSError) as e:
        raise _fail(str(e)) from None
    typer.echo(f"replaying {len(wfs)} sessions from {trace_info['name']} against {target}",
               err=True)
    path, summary = asyncio.run(run_replay(spec, wfs, trace_info, out))
    typer.echo(summary)
    typer.echo(f"wrote {path}")


def register(app: typer.Typer) -> None:
    """Add the ``serve`` and ``replay`` commands to ``app``."""
    app.command("serve")(serve)
    app.command("replay")(replay)


def main() -> None:  # pragma: no cover - thin entry point
    app = typer.Typer(help="turnstile gateway", no_args_is_help=True,
                      pretty_exceptions_show_locals=False)
    register(app)
    app()
