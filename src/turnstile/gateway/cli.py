"""``turnstile serve`` and ``turnstile replay``: :func:`register` adds them to a Typer app.

Also runnable alone: ``python -m turnstile.gateway serve ...``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from turnstile.bench.flags import NON_NEGATIVE, POSITIVE, out_path
from turnstile.bench.progress import QUIET_HELP

if TYPE_CHECKING:
    from turnstile.gateway.config import GatewayConfig

__all__ = ["load_config_flag", "main", "register", "set_given"]


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
#: ``replay --workflows``: each session is one concurrent agent with its own connection
MAX_REPLAY_SESSIONS = 100_000


def set_given(cfg: GatewayConfig, **values: object) -> None:
    """Set each ``cfg`` field whose command-line value was given (is not ``None``)."""
    for key, value in values.items():
        if value is not None:
            setattr(cfg, key, value)


def _fail(message: str) -> typer.Exit:
    from turnstile.bench.usage import fail

    return fail(message)


def _check_serve(cfg: GatewayConfig, log_level: str) -> None:
    """Everything ``serve`` can check before it binds: flags by name, files, Redis, the port.

    Raises ``ValueError`` with one line naming the flag or file.
    """
    from turnstile.bench.usage import check_out_file

    check_log_level(log_level)
    import httpx

    ids = [e.name or httpx.URL(e.url).netloc.decode() for e in cfg.engines]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"--engine: {', '.join(dup)} given twice; name each engine "
                         "(--engine URL,kind,NAME) to serve the same address twice")
    for e in cfg.engines:
        check_engine_kind(e.kind, f"--engine {e.url},{e.kind}")
    if cfg.db:
        check_out_file(Path(cfg.db), "--db")
        check_sqlite(Path(cfg.db))
    if cfg.record:
        check_record(Path(cfg.record))
    if cfg.state:
        _check_redis(cfg.state)
    check_listen(cfg.host, cfg.port, "--port")


def check_sqlite(path: Path) -> None:
    """``--db``: a new or empty file, or an SQLite database (opened read-only to check)."""
    import sqlite3

    if not path.is_file() or not path.stat().st_size:
        return
    try:
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            con.execute("PRAGMA schema_version").fetchone()
        finally:
            con.close()
    except sqlite3.Error as e:
        raise ValueError(f"--db {path}: not an SQLite database ({e}); give a new file or the "
                         "gateway's own database") from None


def load_config_flag(config: Path | None) -> GatewayConfig:
    """``--config``: the gateway TOML file (defaults without one); ``ValueError`` naming the
    flag and the file."""
    from turnstile.gateway.config import GatewayConfig, load_config

    if config is None:
        return GatewayConfig()
    if config.is_dir():
        raise ValueError(f"--config {config}: is a folder; give the gateway TOML file")
    if not config.is_file():
        raise ValueError(f"--config {config}: no such file")
    try:
        return load_config(config)
    except UnicodeDecodeError:
        raise ValueError(f"--config {config}: not a TOML text file (not UTF-8 text)") from None
    except OSError as e:
        raise ValueError(f"--config {config}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise ValueError(f"--config {e}") from None


def check_log_level(log_level: str) -> None:
    if log_level.lower() not in LOG_LEVELS:
        raise ValueError(f"--log-level {log_level!r}: use one of {', '.join(LOG_LEVELS)}")


def check_engine_kind(kind: str, where: str) -> None:
    from turnstile.gateway.adapters import ADAPTERS

    if kind.lower() not in ADAPTERS:
        valid = ", ".join(sorted({c.kind for c in ADAPTERS.values()}))
        raise ValueError(f"{where}: unknown engine kind {kind!r}; use one of {valid}")


def check_record(record_path: Path) -> None:
    """``--record``: a writable file that is new, empty or a whole workload (left as it is
    when it is not one)."""
    from turnstile.bench.usage import check_out_file
    from turnstile.gateway.recorder import SessionRecorder
    from turnstile.workload.jsonl import check_workload_file

    check_out_file(record_path, "--record")
    if record_path.exists() and record_path.stat().st_size:
        try:  # read-only: a file that is not a whole workload is left as it is
            check_workload_file(record_path, allow_torn_tail=True)
        except ValueError as e:
            raise ValueError(f"--record {e} (not a turnstile workload: record to a new "
                             "file)") from None
    SessionRecorder(str(record_path)).close()


def check_listen(host: str, port: int, flag: str) -> None:
    """A port out of range or in use fails here, in one line naming ``flag``, not after the
    server said it is up (port 0: any free port)."""
    import socket

    if not 0 <= port <= 65535:
        raise ValueError(f"{flag} {port}: a port is 0 to 65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            import errno

            bad_host = isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL
            what = f"--host {host}" if bad_host else f"{flag} {port}"
            raise ValueError(f"{what}: cannot listen on {host}:{port} "
                             f"({e.strerror or e})") from None


def _check_redis(url: str) -> None:
    """``--state``: a Redis URL that answers PING within a few seconds."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"--state {url}: expected redis://HOST:PORT/DB")
    import redis
    from redis.exceptions import RedisError

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
        try:
            client.ping()
        finally:
            client.close()
    except (RedisError, OSError, ValueError) as e:
        raise ValueError(f"--state {url}: cannot reach Redis ({e})") from None


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
    port: Annotated[int | None, typer.Option(help="Port (default 8000; 0: any free port)")]
    = None,
    max_held: Annotated[int | None, typer.Option(min=1,
        help="Accepted turns not yet released (held, queued, being admitted) before 429")] = None,
    max_inflight: Annotated[int | None, typer.Option(
        min=0, help="Accepted, unanswered requests before 429 (0: no bound)")] = None,
    auth_admin: Annotated[bool | None, typer.Option(
        "--auth-admin/--no-auth-admin",
        help="/metrics (and /health, /ready details) require the bearer token too")] = None,
    max_body_bytes: Annotated[int | None, typer.Option(min=1, help="Request body limit (413)")
                              ] = None,
    max_header_bytes: Annotated[int | None, typer.Option(
        min=1, help="Request line + headers limit (431)")] = None,
    client_header_timeout_s: Annotated[float | None, typer.Option(
        parser=POSITIVE, help="408 when a request's line and headers take longer (default 10)")
    ] = None,
    client_body_timeout_s: Annotated[float | None, typer.Option(
        parser=POSITIVE, help="408 when a request's body takes longer after its headers "
        "(default 30)")] = None,
    ready_max_hold_s: Annotated[float | None, typer.Option(
        parser=POSITIVE, help="/ready is 503 while a turn has been held longer than this")] = None,
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
    log_level: Annotated[
        str, typer.Option(help="uvicorn/gateway log level: " + ", ".join(LOG_LEVELS))
    ] = "warning",
) -> None:
    """Run the OpenAI-compatible scheduling gateway in front of engines."""
    from turnstile.bench.usage import require_extra

    require_extra("serve", "gateway")
    import uvicorn

    from turnstile.gateway.app import create_app
    from turnstile.gateway.config import parse_engine_flag
    from turnstile.gateway.server import uvicorn_options

    try:
        cfg = load_config_flag(config)
        if engine:
            cfg.engines = [parse_engine_flag(e) for e in engine]
        set_given(cfg, policy=policy, host=host, port=port, max_held=max_held,
                  auth_token=auth_token or None, max_inflight=max_inflight,
                  auth_admin=auth_admin, max_body_bytes=max_body_bytes,
                  max_header_bytes=max_header_bytes, ready_max_hold_s=ready_max_hold_s,
                  client_header_timeout_s=client_header_timeout_s,
                  client_body_timeout_s=client_body_timeout_s,
                  db=None if db is None else str(db), state=state, replica_id=replica_id,
                  record=None if record is None else str(record), log_level=log_level)
        if cfg.auth_admin and not cfg.auth_token:
            raise ValueError("--auth-admin needs --auth-token")
        cfg.validate()
        _check_serve(cfg, log_level)
    except (ValueError, OSError) as e:
        raise _fail(str(e)) from None
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and not cfg.auth_token:
        typer.echo(f"warning: binding {cfg.host} without --auth-token", err=True)
    typer.echo(f"turnstile gateway on http://{cfg.host}:{cfg.port} policy={cfg.policy} "
               f"engines={', '.join(e.url for e in cfg.engines)}"
               + (f" state={cfg.state}" if cfg.state else ""), err=True)
    # loop="asyncio": the same loop whether or not uvloop (the epp extra) is installed, which
    # uvicorn's "auto" would pick up (serve was measured on asyncio)
    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_level=log_level, loop="asyncio",
                access_log=False, lifespan="on", timeout_graceful_shutdown=5,
                **uvicorn_options(cfg))


def replay(
    target: Annotated[str, typer.Option(help="Gateway or engine base URL: http://host:port "
                                        "(a trailing /v1, an OpenAI client's base_url, is "
                                        "accepted)")],
    trace: Annotated[
        str | None, typer.Option(help="Trace dir/file or workload .jsonl; omit: synthetic")
    ] = None,
    rate: Annotated[float, typer.Option(parser=POSITIVE,
                                        help="Poisson session arrival rate (sessions/s)")] = 1.0,
    workflows: Annotated[int, typer.Option(min=1, max=MAX_REPLAY_SESSIONS,
                                           help="Sessions to play")] = 20,
    out: Annotated[Path, typer.Option("-o", "--out", parser=out_path,
                                      help="Directory for results.json")] = Path("replay-out"),
    time_scale: Annotated[float, typer.Option(parser=NON_NEGATIVE,
                                              help="Multiply tool durations by this")] = 1.0,
    max_context: Annotated[
        int, typer.Option(min=2, max=10_000_000, help="Engine context per request (tokens): "
                          "prompts are scaled to fit")
    ] = 2048,
    max_tokens: Annotated[int, typer.Option(min=1, max=10_000_000,
                                            help="Cap on output tokens per turn")] = 64,
    max_turns: Annotated[int | None, typer.Option(min=1, help="Play at most this many turns "
                                                  "each")] = None,
    model: Annotated[str, typer.Option(help="Model name sent in requests")] = "tiny",
    stream: Annotated[bool, typer.Option(help="Stream responses (measures TTFT)")] = True,
    arrivals: Annotated[str, typer.Option(help="poisson or trace")] = "poisson",
    label: Annotated[
        str | None, typer.Option(help="Result label (default: the gateway's policy)")
    ] = None,
    auth_token: Annotated[
        str | None, typer.Option(help="Send 'Authorization: Bearer TOKEN' (serve --auth-token)",
                                 envvar="TURNSTILE_AUTH_TOKEN")
    ] = None,
    subset: Annotated[str | None, typer.Option(help="agentcgroup subset")] = None,
    seed: Annotated[int, typer.Option(min=0)] = 0,
    timeout_s: Annotated[float, typer.Option(parser=POSITIVE,
                                             help="Per-request timeout (s)")] = 300.0,
    save_detailed: Annotated[
        bool, typer.Option("--save-detailed", help="Also write every workflow's and turn's "
                           "samples into results.json")
    ] = False,
    api_key: Annotated[str | None, typer.Option(hidden=True, help="Deprecated: --auth-token")]
    = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help=QUIET_HELP)] = False,
) -> None:
    """Play a trace's workflows as closed-loop agents against a gateway or an engine.

    Exits 1, with the target's first error, when no turn was answered."""
    from turnstile.bench.usage import require_extra

    require_extra("replay", "gateway")
    if api_key is not None:
        typer.echo("warning: --api-key is deprecated: use --auth-token", err=True)
        auth_token = auth_token or api_key
    import asyncio

    import httpx

    from turnstile.bench.replay import ReplaySpec, load_workflows, run_replay
    from turnstile.bench.usage import check_out_dir

    if not target.startswith(("http://", "https://")):
        raise _fail(f"--target {target}: expected an http(s) URL")
    base = target.rstrip("/")
    base = base.removesuffix("/v1")  # requests go to {base}/v1/chat/completions
    spec = ReplaySpec(target=base, trace=trace, rate=rate, workflows=workflows,
                      time_scale=time_scale, max_context=max_context, max_tokens=max_tokens,
                      max_turns=max_turns, model=model, stream=stream, arrivals=arrivals,
                      label=label, api_key=auth_token, subset=subset, seed=seed,
                      timeout_s=timeout_s, save_detailed=save_detailed)
    try:
        if out.exists() and not out.is_dir():
            check_out_dir(out)  # an existing file: said before anything else
        wfs, trace_info = load_workflows(spec)
        _check_target(spec.target)
        check_out_dir(out)
    except (ValueError, OSError) as e:
        raise _fail(str(e)) from None
    typer.echo(f"replaying {len(wfs)} sessions from {trace_info['name']} against {target}",
               err=True)
    from turnstile.bench.progress import progress_bar

    turns = sum(len(w.turns) if max_turns is None else min(len(w.turns), max_turns)
                for w in wfs)
    with progress_bar(quiet=quiet) as bar:
        task = bar.add_task("replay (requests)", total=turns)
        try:
            path, summary = asyncio.run(run_replay(spec, wfs, trace_info, out,
                                                   on_request=lambda: bar.advance(task)))
        except httpx.HTTPError as e:
            raise _fail(f"--target {target}: {type(e).__name__}: {e}") from None
    typer.echo(summary)
    typer.echo(f"wrote {path} and {path.with_name('report.html')}")
    _exit_if_nothing_answered(path)


def _exit_if_nothing_answered(path: Path) -> None:
    """A replay whose turns all failed is a failure (exit 1): say the target's first error."""
    import json

    doc = json.loads(path.read_text(encoding="utf-8"))
    result = (doc.get("policies") or [{}])[0]
    if (result.get("metrics") or {}).get("turns"):
        return
    first = (result.get("replay") or {}).get("first_error") or "no reason given"
    typer.echo(f"error: no turn was answered; the target's first error: {first}", err=True)
    raise typer.Exit(1)


def _check_target(url: str) -> None:
    """``--target`` must answer HTTP (any status) before the replay starts."""
    import urllib.error

    from turnstile.transport import blocking

    try:
        blocking.request(f"{url}/v1/models", timeout=5.0)
    except blocking.NO_ANSWER as e:
        why = e.reason if isinstance(e, urllib.error.URLError) else e
        raise ValueError(f"--target {url}: cannot connect ({why or type(e).__name__})") from None


def register(app: typer.Typer) -> None:
    """Add the ``serve`` and ``replay`` commands to ``app``."""
    app.command("serve")(serve)
    app.command("replay")(replay)


def main() -> None:  # pragma: no cover - thin entry point
    app = typer.Typer(help="turnstile gateway", no_args_is_help=True,
                      pretty_exceptions_show_locals=False)
    register(app)
    app()
