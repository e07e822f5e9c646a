"""Ordinary command-line mistakes: one ``error:`` line naming the flag or file, exit code 2.

Each row is a mistake a new user makes (issue 29's list). The command runs through the real
entry point (:func:`turnstile.cli.main`, what the ``turnstile`` script calls) and must end
with exit code 2, exactly one line on stderr that names the flag or file, no traceback, and
nothing on stdout: every check runs before any work is printed or started.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from turnstile.cli import main


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    """A loopback port held open (listening) for the module: "port in use" rows."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, busy_port: int) -> dict[str, str]:
    d = tmp_path_factory.mktemp("cli-errors")
    profile = d / "profile.json"
    profile.write_text(json.dumps({"format": "turnstile-profile", "version": 1}) + "\n")
    existing = d / "existing.txt"
    existing.write_text("hello\n")
    bad_json = d / "bad.json"
    bad_json.write_text("{not json\n")
    not_profile = d / "not_profile.json"
    not_profile.write_text('{"hello": 1}\n')
    huge = d / "huge.jsonl"
    turn = {"input_tokens": 100_000_000_000, "context_tokens": 0, "output_tokens": 10}
    huge.write_text(json.dumps({"format": "turnstile-workload", "version": 1}) + "\n"
                    + json.dumps({"id": "w0", "arrival_s": 0.0, "turns": [turn]}) + "\n")
    mooncake = d / "mooncake_huge.jsonl"  # another loader than the workload JSONL's
    mooncake.write_text("".join(json.dumps({"timestamp": i, "input_length": 10 ** 11 if i == 3
                                            else 500, "output_length": 20, "hash_ids": [i]})
                                + "\n" for i in range(8)))
    empty_record = d / "empty_record.jsonl"
    empty_record.write_text(json.dumps({"format": "turnstile-workload", "version": 1}) + "\n")
    bad_record = d / "bad_record.jsonl"
    bad_record.write_text('{"x": 1}\n')
    bad_line_record = d / "bad_line_record.jsonl"
    bad_line_record.write_text('{"format": "turnstile-workload", "version": 1}\n{garbage\n')
    future_record = d / "future_record.jsonl"
    future_record.write_text('{"format": "turnstile-workload", "version": 99}\n')
    return {"dir": str(d), "existing": str(existing), "bad_json": str(bad_json),
            "not_profile": str(not_profile), "huge": str(huge), "mooncake": str(mooncake),
            "bad_record": str(bad_record),
            "bad_line_record": str(bad_line_record), "future_record": str(future_record),
            "under_file": str(existing / "sub"), "profile": str(profile),
            "busy": str(busy_port), "empty_record": str(empty_record)}


ENGINE = "http://127.0.0.1:9"  # never contacted: every row fails before
B = ["bench", "--workflows", "5"]
R = ["rollout", "sim", "--steps", "1"]
S = ["serve", "--engine", f"{ENGINE},llama.cpp", "--port", "0"]

#: (case id, argv with {placeholders} from ``files``, text the one line must contain)
CASES: list[tuple[str, list[str], str]] = [
    ("bench-profile-missing", [*B, "--profile", "/missing/profile.json"], "--profile"),
    ("bench-profile-malformed", [*B, "--profile", "{bad_json}"], "--profile"),
    ("bench-profile-not-a-profile", [*B, "--profile", "{not_profile}"], "--profile"),
    ("bench-kv-tokens-too-small", [*B, "--kv-tokens", "10"], "--kv-tokens"),
    ("bench-trace-turn-1e11-tokens", [*B, "--trace", "{huge}"], "huge.jsonl"),
    ("bench-mooncake-turn-1e11-tokens", [*B, "--trace", "{mooncake}"], "mooncake_huge.jsonl"),
    ("info-mooncake-turn-1e11-tokens", ["traces", "info", "{mooncake}"], "mooncake_huge.jsonl"),
    ("bench-out-existing-file", [*B, "--out", "{existing}"], "--out"),
    ("bench-out-uncreatable", [*B, "--out", "{under_file}"], "--out"),
    ("bench-workflows-0", ["bench", "--workflows", "0"], "--workflows"),
    ("bench-tp-3-8b", [*B, "--tp", "3"], "--tp"),
    ("bench-tp-over-a-node", [*B, "--tp", "16"], "--tp"),
    ("bench-rate-0-no-internal-name", [*B, "--rate", "0"], "--rate"),
    ("bench-load-negative", [*B, "--load", "-1"], "--load"),
    ("bench-unknown-policy", [*B, "--policies", "banana"], "banana"),
    ("bench-unknown-option", [*B, "--policies", "eager,cvar:nope=1"], "valid keys: alpha"),
    ("bench-option-range", [*B, "--policies", "cvar:kv_fill=3"], "kv_fill"),
    ("suite-unknown-option", ["bench", "--suite", "quick", "--policies", "auto:nope=1"],
     "valid keys"),
    ("policies-bad-option", ["policies", "ttl:max_ttl_s=-1"], "max_ttl_s"),
    ("bench-unknown-gpu", [*B, "--gpu", "banana"], "banana"),
    ("bench-70b-on-one-gpu", [*B, "--model", "llama-3.1-70b", "--gpu", "A100-80G"], "--tp 1"),
    ("bench-unknown-option", [*B, "--banana"], "--banana"),
    ("synth-out-missing-dir", ["traces", "synth", "-o", "/missing/dir/x.jsonl"], "--out"),
    ("synth-n-huge", ["traces", "synth", "-o", "{dir}/x.jsonl", "-n", "100000000000"],
     "--workflows"),
    ("synth-rate-0", ["traces", "synth", "-o", "{dir}/x.jsonl", "--rate", "0"], "--rate"),
    ("convert-missing-trace", ["traces", "convert", "/missing/trace", "-o", "{dir}/c.jsonl"],
     "/missing/trace"),
    ("serve-engine-kind-banana", ["serve", "--engine", f"{ENGINE},banana", "--port", "0"],
     "--engine"),
    ("serve-port-99999", [*S[:3], "--port", "99999"], "--port"),
    ("serve-log-level-banana", [*S, "--log-level", "banana"], "--log-level"),
    ("serve-state-unreachable", [*S, "--state", "redis://127.0.0.1:1/0"], "--state"),
    ("serve-record-malformed", [*S, "--record", "{bad_record}"], "--record"),
    ("serve-record-malformed-line", [*S, "--record", "{bad_line_record}"], "--record"),
    ("serve-record-future-version", [*S, "--record", "{future_record}"], "--record"),
    ("serve-record-missing-dir", [*S, "--record", "/missing/dir/s.jsonl"], "--record"),
    ("serve-db-missing-dir", [*S, "--db", "/missing/dir/g.sqlite3"], "--db"),
    ("serve-unknown-policy", [*S, "--policy", "banana"], "banana"),
    ("serve-bad-option", [*S, "--policy", "auto:hold_frac=x"], "hold_frac"),
    ("serve-no-engine", ["serve", "--port", "0"], "--engine"),
    ("serve-same-engine-twice", [*S, "--engine", ENGINE], "--engine"),
    ("serve-max-held-0", [*S, "--max-held", "0"], "--max-held"),
    ("serve-config-missing", ["serve", "--config", "/missing/gateway.toml"], "--config"),
    ("serve-config-malformed", ["serve", "--config", "{bad_json}"], "--config"),
    ("replay-max-turns-0", ["replay", "--target", "http://127.0.0.1:1", "--max-turns", "0"],
     "--max-turns"),
    ("info-group-by-wrong-format", ["traces", "info", "{mooncake}", "--group-by", "user"],
     "--group-by"),
    ("fit-out-missing-dir", ["traces", "fit", "{mooncake}", "-o", "/missing/dir/spec.json"],
     "--out"),
    ("convert-out-missing-dir", ["traces", "convert", "{mooncake}", "-o", "/missing/d/w.jsonl"],
     "--out"),
    ("profile-out-missing-dir", ["profile", "--target", "http://127.0.0.1:1", "-o",
                                 "/missing/dir/p.json"], "--out"),
    ("fidelity-profile-missing", ["fidelity", "--target", "http://127.0.0.1:1", "--profile",
                                  "/missing/p.json", "--trace", "{mooncake}", "-o",
                                  "{dir}/fid"], "--profile"),
    ("replay-target-unreachable", ["replay", "--target", "http://127.0.0.1:1", "--workflows",
                                   "2", "-o", "{dir}/replay"], "--target"),
    ("replay-out-existing-file", ["replay", "--target", "http://127.0.0.1:1", "-o",
                                  "{existing}"], "--out"),
    ("rollout-gpus-1000000", [*R, "--gpus", "1000000"], "--gpus"),
    ("rollout-train-gpus-negative", [*R, "--mix", "tp2x2", "--train-gpus", "-4"],
     "--train-gpus"),
    ("rollout-mix-over-gpus", [*R, "--gpus", "16", "--mix", "tp8x3"], "--mix"),
    ("rollout-mix-tp-3", [*R, "--mix", "tp3x2"], "--mix"),
    ("rollout-mix-malformed", [*R, "--mix", "tp2xq"], "--mix"),
    ("rollout-too-few-gpus", [*R, "--gpus", "4"], "--gpus"),
    ("rollout-tool-time-negative", [*R, "--tool-time-scale", "-1"], "--tool-time-scale"),
    ("rollout-unknown-policy", [*R, "--policies", "banana"], "banana"),
    ("rollout-unknown-workload", [*R, "--workload", "banana"], "banana"),
    ("rollout-out-existing-file", [*R, "--out", "{existing}"], "--out"),
    ("rollout-steps-huge", ["rollout", "sim", "--steps", "100000000"], "--steps"),
    # rollout live: every flag checked before two llama.cpp engines start
    ("live-unknown-policy", ["rollout", "live", "--policy", "banana"], "--policy banana"),
    ("live-model-missing", ["rollout", "live", "--model", "/missing/m.gguf"], "--model"),
    ("live-out-existing-file", ["rollout", "live", "--out", "{existing}"], "--out"),
    ("bench-engines-huge", [*B, "--engines", "100000"], "--engines"),
    ("bench-seed-negative", [*B, "--seed", "-1"], "--seed"),
    ("synth-seed-negative", ["traces", "synth", "-o", "{dir}/x.jsonl", "--seed", "-1"],
     "--seed"),
    ("profile-target-not-a-url", ["profile", "--target", "banana", "-o", "{dir}/p.json"],
     "--target banana"),
    ("profile-target-unreachable", ["profile", "--target", "http://127.0.0.1:1", "-o",
                                    "{dir}/p.json"], "--target http://127.0.0.1:1"),
    ("fidelity-target-not-a-url", ["fidelity", "--target", "banana", "--profile",
                                   "{profile}", "--trace", "{mooncake}", "-o", "{dir}/fid"],
     "--target banana"),
    # epp: the endpoint picker checks its endpoints and ports before it listens
    ("epp-endpoint-not-ip-port", ["epp", "--endpoint", "banana"], "--endpoint banana"),
    ("epp-endpoint-port-huge", ["epp", "--endpoint", "127.0.0.1:99999"], "--endpoint"),
    ("epp-grpc-port-99999", ["epp", "--endpoint", "127.0.0.1:1", "--grpc-port", "99999"],
     "--grpc-port"),
    ("epp-grpc-port-in-use", ["epp", "--endpoint", "127.0.0.1:1", "--grpc-port", "{busy}"],
     "--grpc-port"),
    ("epp-metrics-port-in-use", ["epp", "--endpoint", "127.0.0.1:1", "--grpc-port", "0",
                                 "--metrics-port", "{busy}"], "--metrics-port"),
    ("epp-endpoints-file-missing", ["epp", "--endpoints-file", "/missing/eps.txt"],
     "--endpoints-file"),
    ("epp-endpoints-file-malformed", ["epp", "--endpoints-file", "{bad_json}"],
     "--endpoints-file"),
    ("serve-port-in-use", [*S[:3], "--port", "{busy}"], "--port"),
    # a recording before any session finished: the header and no workflow
    ("bench-trace-no-workflows", [*B, "--trace", "{empty_record}"], "empty_record.jsonl"),
    ("fit-trace-no-workflows", ["traces", "fit", "{empty_record}", "-o", "{dir}/s.json"],
     "empty_record.jsonl"),
    ("bench-subset-not-agentcgroup", [*B, "--trace", "{mooncake}", "--subset", "haiku"],
     "--subset"),
    ("bench-subset-without-trace", [*B, "--subset", "haiku"], "--subset"),
    ("epp-log-level-banana", ["epp", "--endpoint", "127.0.0.1:1", "--log-level", "banana"],
     "--log-level"),
    ("epp-engine-kind-banana", ["epp", "--endpoint", "127.0.0.1:1", "--engine-kind",
                                "banana"], "--engine-kind"),
    ("epp-record-missing-dir", ["epp", "--endpoint", "127.0.0.1:1", "--record",
                                "/missing/d/r.jsonl"], "--record"),
    ("epp-record-malformed", ["epp", "--endpoint", "127.0.0.1:1", "--record",
                              "{bad_record}"], "--record"),
    ("epp-config-missing", ["epp", "--endpoint", "127.0.0.1:1", "--config", "/missing.toml"],
     "--config"),
    ("epp-config-malformed", ["epp", "--endpoint", "127.0.0.1:1", "--config", "{bad_json}"],
     "--config"),
    ("epp-max-held-0", ["epp", "--endpoint", "127.0.0.1:1", "--max-held", "0"], "--max-held"),
    ("serve-max-body-bytes-0", [*S, "--max-body-bytes", "0"], "--max-body-bytes"),
    ("serve-max-inflight-negative", [*S, "--max-inflight", "-1"], "--max-inflight"),
    ("serve-host-unresolvable", [*S, "--host", "no-such-host.invalid"], "--host"),
    # the robustness suite: minutes of work, so every flag is checked first
    ("suite-out-existing-file", ["bench", "--suite", "quick", "--out", "{existing}"], "--out"),
    ("suite-out-uncreatable", ["bench", "--suite", "quick", "--out", "{under_file}"], "--out"),
    ("suite-unknown-policy", ["bench", "--suite", "quick", "--policies", "eager,banana"],
     "banana"),
    ("suite-ray-not-an-address", ["bench", "--suite", "quick", "--ray", "banana"], "--ray"),
    ("suite-unknown", ["bench", "--suite", "banana"], "--suite"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("argv", "names"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_mistake_is_one_line_and_exit_2(argv: list[str], names: str, files: dict[str, str],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    args = [a.format(**files) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and names in lines[0], err
    assert "Traceback" not in err + out
    assert "rate_per_s" not in err  # the flag's name, not an internal one
    assert out == "", out  # checked before any work is printed


def test_bench_out_checked_before_the_run(tmp_path: Path, capsys) -> None:
    """An unwritable --out fails before the simulation, not after it (results lost)."""
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(SystemExit) as e:
        main(["bench", "--workflows", "200", "--out", str(target)])
    assert e.value.code == 2
    out, _ = capsys.readouterr()
    assert "simulated" not in out


def test_good_commands_still_exit_0(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["traces", "synth", "-o", str(tmp_path / "s.jsonl"), "-n", "3"])
    assert e.value.code == 0
    with pytest.raises(SystemExit) as e:
        main(["bench", "--workflows", "3", "-o", str(tmp_path / "b")])
    assert e.value.code == 0
    assert (tmp_path / "b" / "results.json").is_file()


def test_deprecated_policy_alias_still_works(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["rollout", "sim", "--steps", "1", "--gpus", "8", "--prompts", "2", "--samples",
              "2", "--mix", "tp2x2", "--policy", "least-open", "-o", str(tmp_path)])
    assert e.value.code == 0
    _, err = capsys.readouterr()
    assert "--policy is deprecated" in err
    doc = json.loads((tmp_path / "results.json").read_text())
    assert list(doc["policies"]) == ["least-open"]


def test_version_flag(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out, _ = capsys.readouterr()
    from turnstile import __version__

    assert out.startswith(__version__)


def test_entry_point_is_main() -> None:
    """The installed ``turnstile`` script calls :func:`main` (one-line usage errors)."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    doc = tomllib.loads((root / "pyproject.toml").read_text())
    assert doc["project"]["scripts"]["turnstile"] == "turnstile.cli:main"


def test_a_malformed_record_file_is_left_untouched(tmp_path: Path, capsys) -> None:
    """serve --record on a file that is not a whole workload fails and does not modify it (the
    recorder would otherwise cut what looks like a torn last line)."""
    f = tmp_path / "binary.jsonl"
    f.write_bytes(b"\x00\x01 not a workload")
    with pytest.raises(SystemExit) as e:
        main(["serve", "--engine", f"{ENGINE},openai", "--port", "0", "--record", str(f)])
    assert e.value.code == 2
    assert f.read_bytes() == b"\x00\x01 not a workload"


def test_replay_target_check_takes_an_error_status_as_an_answer() -> None:
    """``replay --target`` needs a target that answers HTTP, whatever the status (checked
    through the one blocking transport): a 404 on ``/v1/models`` passes, no listener fails."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from turnstile.engines.process import free_port
    from turnstile.gateway.cli import _check_target

    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_error(404)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        _check_target(f"http://127.0.0.1:{httpd.server_address[1]}")
    finally:
        httpd.shutdown()
        httpd.server_close()
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=f"--target {url}: cannot connect"):
        _check_target(url)
