"""A newcomer's mistakes (issue 41): each ends in one ``error:`` line naming the flag or file,
exit code 2, before any work; every float flag refuses NaN and infinities; help text is clean.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import typer.main

from turnstile.cli import app, main

TRACES = Path(os.environ.get("TURNSTILE_TRACES", "/nonexistent"))
ENGINE = "http://127.0.0.1:9"  # never contacted: every row fails before
B = ["bench", "--workflows", "3"]
S = ["serve", "--engine", f"{ENGINE},llama.cpp", "--port", "0"]
P = ["profile", "--target", ENGINE]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("newcomer")
    header_only = d / "header_only.jsonl"
    header_only.write_text(json.dumps({"format": "turnstile-workload", "version": 1}) + "\n")
    not_db = d / "not_a_db.sqlite3"
    not_db.write_text("this is a text file, not an SQLite database\n" * 4)
    binary = d / "gateway.toml"
    binary.write_bytes(b"\xff\xfe\x00\x81 binary")
    folder = d / "a_folder"
    folder.mkdir()
    mooncake = d / "mooncake_dir"
    mooncake.mkdir()
    (mooncake / "conversation_trace.jsonl").write_text("".join(
        json.dumps({"timestamp": i, "input_length": 500, "output_length": 20, "hash_ids": [i]})
        + "\n" for i in range(4)))
    (mooncake / "SOURCE.md").write_text("where it came from\n")
    return {"dir": str(d), "header_only": str(header_only), "not_db": str(not_db),
            "binary": str(binary), "folder": str(folder), "mooncake_dir": str(mooncake)}


#: (case id, argv, text the one line must contain)
CASES: list[tuple[str, list[str], str]] = [
    ("bench-rate-nan", [*B, "--rate", "nan"], "--rate"),
    ("bench-rate-inf", [*B, "--rate", "inf"], "--rate"),
    ("bench-load-inf", [*B, "--load", "inf"], "--load"),
    ("bench-load-nan", [*B, "--load", "nan"], "--load"),
    ("synth-rate-nan", ["traces", "synth", "-o", "{dir}/s.jsonl", "--rate", "nan"], "--rate"),
    ("synth-fit-header-only", ["traces", "synth", "-o", "{dir}/s.jsonl", "--fit",
                               "{header_only}"], "header_only.jsonl"),
    ("serve-db-not-sqlite", [*S, "--db", "{not_db}"], "--db"),
    ("rollout-n-times-g-huge", ["rollout", "sim", "--prompts", "100000", "--samples",
                                "100000"], "--samples"),
    ("rollout-prompts-over-max", ["rollout", "sim", "--prompts", "1000000"], "--prompts"),
    ("rollout-partial-nan", ["rollout", "sim", "--partial", "nan"], "--partial"),
    ("rollout-live-trajectories-huge", ["rollout", "live", "--trajectories", "10" * 15],
     "--trajectories"),
    ("rollout-live-steps-huge", ["rollout", "live", "--steps", "1000000"], "--steps"),
    ("rollout-tool-time-inf", ["rollout", "sim", "--tool-time-scale", "inf"],
     "--tool-time-scale"),
    ("profile-token-range-inverted", [*P, "--token-low", "200", "--token-high", "100"],
     "--token-high"),
    ("profile-max-context-0", [*P, "--max-context", "0"], "--max-context"),
    ("profile-max-num-seqs-0", [*P, "--max-num-seqs", "0"], "--max-num-seqs"),
    ("profile-kv-bytes-nan", [*P, "--kv-bytes-per-token", "nan"], "--kv-bytes-per-token"),
    ("fidelity-rates-nan", ["fidelity", "--target", ENGINE, "--profile", "{dir}/p.json",
                            "--trace", "{dir}", "-o", "{dir}/fid", "--rates", "0.2,nan"],
     "--rates"),
    ("epp-fallbacks-negative", ["epp", "--endpoint", "127.0.0.1:1", "--fallbacks", "-2"],
     "--fallbacks"),
    ("serve-config-binary", ["serve", "--config", "{binary}"], "gateway.toml"),
    ("epp-config-binary", ["epp", "--endpoint", "127.0.0.1:1", "--config", "{binary}"],
     "gateway.toml"),
    ("bench-out-empty", [*B, "--out", ""], "--out"),
    ("synth-out-empty", ["traces", "synth", "-o", ""], "--out"),
    ("bench-profile-folder", [*B, "--profile", "{folder}"], "is a folder"),
    ("bench-trace-mooncake-folder", [*B, "--trace", "{mooncake_dir}"],
     "conversation_trace.jsonl"),
    ("bench-ray-without-suite", [*B, "--ray", "auto"], "--suite"),
    ("replay-rate-nan", ["replay", "--target", ENGINE, "--rate", "nan"], "--rate"),
    ("replay-time-scale-inf", ["replay", "--target", ENGINE, "--time-scale", "inf"],
     "--time-scale"),
    ("replay-timeout-nan", ["replay", "--target", ENGINE, "--timeout-s", "nan"],
     "--timeout-s"),
    ("serve-ready-max-hold-nan", [*S, "--ready-max-hold-s", "nan"], "--ready-max-hold-s"),
]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


def _one_error_line(code: int, out: str, err: str, names: str) -> None:
    assert code == 2, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and names in lines[0], err
    assert "Traceback" not in err + out
    assert out == "", out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("argv", "names"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_mistake_is_one_line_and_exit_2(argv: list[str], names: str, files: dict[str, str],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    _one_error_line(*_run([a.format(**files) for a in argv], capsys), names)


@pytest.mark.traces
@pytest.mark.parametrize(("folder", "wanted"), [("mooncake_fast25", "conversation_trace.jsonl"),
                                                ("tracelab_example", "round_trace.jsonl")])
def test_bench_trace_on_the_readmes_folders_names_the_file(
        folder: str, wanted: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = TRACES / folder
    if not path.is_dir():
        pytest.skip(f"{path} not present (set TURNSTILE_TRACES)")
    _one_error_line(*_run([*B, "--trace", str(path)], capsys), str(path / wanted))


def _commands() -> list[tuple[list[str], object]]:
    found: list[tuple[list[str], object]] = []

    def walk(cmd: object, path: list[str]) -> None:
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, [*path, name])
        else:
            found.append((path, cmd))

    walk(typer.main.get_command(app), [])
    return found


def _float_options() -> list[tuple[list[str], str]]:
    out = []
    for path, cmd in _commands():
        for p in getattr(cmd, "params", []):
            desc = getattr(p, "type_descriptor", None)
            if getattr(p, "param_type_name", "") == "option" and desc is not None and \
                    desc.annotation is float:
                out.append((path, max(p.opts, key=len)))
    return out


FLOAT_OPTIONS = _float_options()


def test_the_commands_have_float_flags() -> None:
    """The walk below finds the float flags (a walk that finds none would check nothing)."""
    flags = {f"{' '.join(p)} {o}" for p, o in FLOAT_OPTIONS}
    assert {"bench --rate", "traces synth --rate", "replay --rate", "rollout sim --partial",
            "fidelity --token-div", "serve --ready-max-hold-s"} <= flags


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize(("path", "flag"), FLOAT_OPTIONS,
                         ids=[f"{'-'.join(p)}{o}" for p, o in FLOAT_OPTIONS])
def test_every_float_flag_refuses_non_finite(path: list[str], flag: str, value: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Given first, the bad value is refused while parsing: before any required flag is
    missed and before any work."""
    _one_error_line(*_run([*path, f"{flag}={value}"], capsys), flag)


def _help(argv: list[str], capsys: pytest.CaptureFixture[str], width: int = 80) -> str:
    os.environ["COLUMNS"] = str(width)
    try:
        code, out, err = _run([*argv, "--help"], capsys)
    finally:
        del os.environ["COLUMNS"]
    assert code == 0, err
    return out


def test_help_shows_no_bool_type_nor_rest_markup(capsys: pytest.CaptureFixture[str]) -> None:
    """``<bool>`` after a flag and reStructuredText's double backticks are noise in --help."""
    for path in [[], *(p for p, _ in _commands())]:
        text = _help(path, capsys)
        assert "<bool>" not in text, (path, text)
        assert "``" not in text, (path, text)


def test_gitignore_has_the_quickstart_recording() -> None:
    root = Path(__file__).resolve().parents[1]
    lines = (root / ".gitignore").read_text().splitlines()
    assert "sessions.jsonl" in lines
