"""Smoke test of the real-engine A/B (``benchmarks/real_ab.py``): one load, two policies and the
baseline's rerun, one seed, a few synthetic sessions, two real llama.cpp engines behind a real
``turnstile serve`` process.
It asserts that the protocol runs end to end and writes its table, JSON and plot; the figures
themselves are the benchmark's business (too small and noisy here to mean anything)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "real_ab.py"


def _load_benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("real_ab", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_real_ab_smoke(tmp_path: Path, llama_server_binary: Path,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNSTILE_LLAMA_SERVER", str(llama_server_binary))
    out = tmp_path / "ab"
    rc = _load_benchmark().main([
        "--out", str(out), "--policies", "eager,cvar", "--loads", "1.5", "--seeds", "0",
        "--trace-sessions", "0", "--synth-sessions", "4", "--max-turns", "4",
        "--max-context", "500", "--ctx", "2048", "--n-parallel", "2", "--quick-profile",
        "--measure-attempts", "1",  # a smoke run: whatever the CI host's load, measure once
        "--pin-cores",
    ])
    assert rc == 0
    doc = json.loads((out / "real_ab.json").read_text())
    cells = doc["cells"]
    # the two policies and eager again after them (the host's noise)
    assert [c["policy"] for c in cells] == ["eager", "cvar", "eager@rerun"]
    assert "noise_floor_max" in doc["goals"]
    for c in cells:
        assert not c["errors"], c["errors"]
        assert c["real"]["workflows"] == 4 and c["real"]["unfinished"] == 0
        assert c["pred"]["workflows"] == 4
        assert c["real"]["flow_p95_s"] > 0 and c["pred"]["flow_p95_s"] > 0
        # the engines' own counters saw the prompts, and some of them hit the slot cache
        assert c["engine_processed_tokens"] > 0 and 0 < c["engine_hit_rate"] < 1
        assert c["loadavg"][0] >= 0
    assert doc["profile"]["fit"]["samples"] >= 5
    # each engine pinned to a CPU of its own among those this process may use
    pinned = doc["setup"]["pinned_cpus"]
    assert len(set(pinned["engines"])) == 2 and pinned["driver"]
    assert set(pinned["engines"]) <= set(doc["setup"]["cpus_allowed"])
    # the serving probe served a cell of its own before the table's and measured the terms
    # the predictions carry: every probe turn came with the engine's timings
    probe = doc["serving_probe"]
    assert probe["turns"] >= 8 and probe["full_prefills"] >= 1
    assert doc["setup"]["serving_source"] == "probe"
    assert doc["serving"]["turn_overhead_s"] > 0 and doc["serving"]["engine_slowdown"] > 0
    assert "measured by the serving probe" in (out / "real_ab.md").read_text()
    # the chat template around a later turn's messages, measured on the engine (the tiny
    # model's template adds more than the 6 tokens per message assumed before measuring)
    assert doc["run"]["engines"]["turn_template_tokens"] > 6
    rows = doc["rows"]
    cvar = next(r for r in rows if r["policy"] == "cvar")
    assert cvar["real_ratio"]["n"] == 1 and cvar["pred_ratio"]["n"] == 1
    table = (out / "real_ab.md").read_text()
    assert "| 1.5 (" in table and "| eager |" in table and "| cvar |" in table
    assert "Host load average" in table
    assert (out / "real_ab.png").stat().st_size > 1000
    assert (out / "profile.json").is_file()
    # --from: the same cells predicted again without engines (here with paged KV)
    again = tmp_path / "again"
    assert _load_benchmark().main(["--from", str(out), "--kv-model", "paged",
                                   "--out", str(again)]) == 0
    redo = json.loads((again / "real_ab.json").read_text())
    assert redo["setup"]["kv_model"] == "paged" and (again / "profile.json").is_file()
    assert redo["setup"]["serving"] == doc["serving"]  # the run's own terms, unless given
    for old, new in zip(cells, redo["cells"], strict=True):
        assert new["real"] == old["real"] and new["pred_before"] == old["pred"]
        assert new["pred"]["workflows"] == 4


@pytest.mark.parametrize("engine, n_parallel, kv_sessions, ok", [
    ("vllm", 2, "5", True), ("vllm", 4, None, True),
    ("llamacpp", 2, "2", True), ("llamacpp", 2, "5", False),
])
def test_kv_sessions_flag(engine: str, n_parallel: int, kv_sessions: str | None,
                          ok: bool) -> None:
    """``--kv-sessions`` sizes vLLM's KV pool apart from its ``--max-num-seqs``; llama.cpp keeps
    one session per slot, so there it must equal ``--n-parallel``."""
    argv = ["--engine", engine, "--n-parallel", str(n_parallel)]
    argv += ["--kv-sessions", kv_sessions] if kv_sessions else []
    mod = _load_benchmark()
    if not ok:
        with pytest.raises(SystemExit):
            mod.parse_args(argv)
        return
    args = mod.parse_args(argv)
    assert (args.kv_sessions or args.n_parallel) == int(kv_sessions or n_parallel)


@pytest.mark.parametrize("argv, ok", [
    (["--engine", "vllm", "--kv-sessions", "7", "--pool-sessions", "14"], True),
    (["--engine", "vllm", "--kv-sessions", "7", "--pool-sessions", "5"], False),
    (["--engine", "llamacpp", "--pool-sessions", "8"], False),
])
def test_pool_sessions_flag(argv: list[str], ok: bool) -> None:
    """``--pool-sessions``: a vLLM pool larger than what the gate is told, never smaller."""
    mod = _load_benchmark()
    if ok:
        assert mod.parse_args(argv).pool_sessions == 14
    else:
        with pytest.raises(SystemExit):
            mod.parse_args(argv)


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_serving_probe_is_on_by_default_on_both_engines(engine: str) -> None:
    """vLLM's probe reads its /metrics histograms, llama.cpp's its replies' timings: both probe
    unless told not to."""
    mod = _load_benchmark()
    assert mod.parse_args(["--engine", engine]).serving_probe is True
    assert mod.parse_args(["--engine", engine, "--no-serving-probe"]).serving_probe is False
    assert mod.parse_args(["--engine", engine]).probe_each_policy is False
    assert mod.parse_args(["--engine", engine, "--probe-each-policy"]).probe_each_policy is True
