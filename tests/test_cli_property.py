"""Random argument vectors on every ``turnstile`` command (issue 41): exit code 0 or 2, never a
traceback, never a hang.

The command tree is walked from the Typer app, so a new command or option is covered without
editing this file. Each command's *work* entry point (the simulation, the server, the engine
measurement) is replaced by a stub that raises :class:`ReachedWork`: reaching it means every
flag passed validation, and the property checks the parsing and validation paths only. A fake
engine on loopback answers ``/v1/models`` and ``/props`` so the flags that name an engine can
pass their checks too.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import signal
import threading
import traceback
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import typer.main
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnstile.cli import app, main

#: seconds one argument vector may take before it counts as a hang
EXAMPLE_TIMEOUT_S = 20.0


class ReachedWork(Exception):
    """Raised by a stubbed work entry point: validation passed."""


class Hang(Exception):
    """Raised by the alarm when an argument vector runs past :data:`EXAMPLE_TIMEOUT_S`."""


#: (module, attribute) of each command's work, called once its flags are validated
WORK = {
    "bench": [("turnstile.bench.runner", "run_bench"),
              ("turnstile.bench.suite", "run_with_progress")],
    "tune": [("turnstile.bench.tune_cli", "tune_main")],
    "serve": [("uvicorn", "run")],
    "replay": [("turnstile.bench.replay", "run_replay")],
    "profile": [("turnstile.calibrate.profile", "profile_engine")],
    "fidelity": [("turnstile.calibrate.fidelity", "run_fidelity")],
    "epp": [("turnstile.epp.server", "serve_forever")],
    "rollout sim": [("turnstile.rollout.experiment", "run_rollout_sim")],
    "rollout live": [("turnstile.rollout.live", "run_live")],
}


def _commands() -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []

    def walk(cmd: Any, path: list[str]) -> None:
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, [*path, name])
        else:
            found.append((" ".join(path), cmd))

    walk(typer.main.get_command(app), [])
    return found


COMMANDS = _commands()


class _Engine(BaseHTTPRequestHandler):
    """Answers like a one-slot llama.cpp server, enough for the engine checks."""

    def do_GET(self) -> None:
        body: dict[str, Any] = {"error": "not found"}
        if self.path.startswith("/v1/models"):
            body = {"object": "list", "data": [{"id": "tiny", "owned_by": "llamacpp",
                                                "meta": {"n_vocab": 256}}]}
        elif self.path.startswith("/props"):
            body = {"total_slots": 1, "default_generation_settings": {"n_ctx": 2048}}
        raw = json.dumps(body).encode()
        self.send_response(200 if "error" not in body else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def pools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[str]]]:
    """Values to draw from, by the option's type: valid ones, edge ones and nonsense."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine = f"http://127.0.0.1:{server.server_address[1]}"
    d = tmp_path_factory.mktemp("property")
    (d / "folder").mkdir()
    (d / "binary.bin").write_bytes(b"\xff\xfe\x00\x81\x00binary")
    (d / "empty.jsonl").write_text("")
    (d / "header.jsonl").write_text(json.dumps({"format": "turnstile-workload",
                                                "version": 1}) + "\n")
    (d / "text.txt").write_text("not json\n")
    paths = [str(d / n) for n in ("missing/x", "folder", "binary.bin", "empty.jsonl",
                                  "header.jsonl", "text.txt", "out")] + [""]
    words = ["", "abc", "-", "x" * 300, "ünï", "1e9", "eager,auto", "cvar:budget=fixed",
             "medium", "poisson", "tool-heavy", "H100", "llama-3.1-8b", "debug", "inline",
             "auto", engine, f"{engine}/v1", f"{engine},llama.cpp", "127.0.0.1:1",
             "http://127.0.0.1:9", "quick", "default", "a=b"]
    yield {
        "int": ["0", "1", "2", "3", "-1", "7", "1000000000000", "9" * 30, "abc", "", "nan",
                "1.5"],
        "float": ["0", "0.5", "1", "-1", "nan", "inf", "-inf", "1e308", "1e-300", "abc", ""],
        "path": paths,
        "str": words + paths,
        "valid_int": ["1", "2", "3"],
        "valid_float": ["0.5", "1"],
        "valid_path": [str(d / "out" / "x"), str(d / "header.jsonl")],
        "valid_str": [engine, f"{engine},llama.cpp", "127.0.0.1:1", "eager"],
        "workdir": [str(d)],
    }
    server.shutdown()


def _kind(param: Any) -> str:
    desc = getattr(param, "type_descriptor", None)
    annotation = getattr(desc, "annotation", None)
    if annotation is int:
        return "int"
    if annotation is float:
        return "float"
    if annotation is Path:
        return "path"
    return "str"


def _valid(param: Any, kind: str, pools: dict[str, list[str]]) -> list[str]:
    """Values the option is likely to accept: its default, else one of its kind's."""
    default = param.default
    if default is not None and not isinstance(default, bool) and str(default) and \
            not callable(default):
        return [str(default[0] if isinstance(default, list | tuple) else default)]
    return pools["valid_" + kind]


@st.composite
def argvs(draw: st.DrawFn, name: str, cmd: Any, pools: dict[str, list[str]]) -> list[str]:
    """An argument vector for ``cmd``: some of its options, each with a drawn value."""
    argv = name.split()
    token = st.one_of(st.sampled_from(pools["str"]),
                      st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)),
                              max_size=12))
    options = [p for p in cmd.params if p.param_type_name == "option"]
    for p in cmd.params:
        if p.param_type_name == "argument":
            if draw(st.integers(0, 9)):
                argv.append(draw(st.sampled_from(pools["path"])))
            continue
        # about three options a vector (and most required ones), so that many get past the
        # first check and reach the later ones
        if not (p.required and draw(st.integers(0, 4))) and \
                draw(st.integers(0, max(len(options) // 3, 1))):
            continue
        flag = draw(st.sampled_from(p.opts))
        if getattr(p, "is_flag", False):
            argv.append(flag)
            continue
        kind = _kind(p)
        if draw(st.integers(0, 2)):  # mostly a valid value, so that later checks run too
            value = draw(st.sampled_from(_valid(p, kind, pools)))
        else:
            value = draw(token if kind == "str" else st.sampled_from(pools[kind]))
        glued = flag.startswith("--") and not draw(st.integers(0, 3))
        argv += [f"{flag}={value}"] if glued else [flag, value]
    if not draw(st.integers(0, 5)):
        argv.insert(draw(st.integers(len(name.split()), len(argv))), draw(token))
    return argv


def _stub(*args: object, **kwargs: object) -> None:
    raise ReachedWork


def _alarm(signum: int, frame: object) -> None:
    raise Hang


def run_argv(argv: list[str], workdir: str) -> tuple[int | str, str]:
    """``main(argv)`` with the work stubbed out: (exit code or ``"work"``, all output)."""
    buf = io.StringIO()
    code: int | str
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(buf), \
            contextlib.redirect_stderr(buf):
        mp.chdir(workdir)
        mp.setattr(logging, "basicConfig", lambda **kw: None)
        mp.setenv("COLUMNS", "100")
        for targets in WORK.values():
            for module, attr in targets:
                mp.setattr(f"{module}.{attr}", _stub)
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, EXAMPLE_TIMEOUT_S)
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except ReachedWork:
            code = "work"
        except Hang:
            pytest.fail(f"turnstile {argv} ran past {EXAMPLE_TIMEOUT_S:g} s")
        except BaseException:
            pytest.fail(f"turnstile {argv} raised:\n{traceback.format_exc()}\n{buf.getvalue()}")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    return code, buf.getvalue()


def test_the_walk_finds_every_command() -> None:
    """The property below covers what the walk finds; each long command's work is stubbed."""
    names = {n for n, _ in COMMANDS}
    assert set(WORK) <= names
    assert {"policies", "version", "traces info", "traces synth"} <= names


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "cmd"), COMMANDS, ids=[n for n, _ in COMMANDS])
def test_random_argv_exits_0_or_2_without_traceback(name: str, cmd: Any,
                                                     pools: dict[str, list[str]]) -> None:
    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(argv=argvs(name, cmd, pools))
    def check(argv: list[str]) -> None:
        code, output = run_argv(argv, pools["workdir"][0])
        assert "Traceback" not in output, (argv, output)
        assert code in (0, 2, "work"), (argv, code, output)
        if code == 2:
            assert "error" in output.lower() or "usage" in output.lower(), (argv, output)

    check()
