"""load_trace picks the right loader from the path, and refuses unknown formats clearly."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from turnstile.traces import SUPPORTED_FORMATS, load_trace
from turnstile.workload import Turn, Workflow, write_workload


@pytest.mark.parametrize(
    ("rel", "prefix", "workflows"),
    [
        ("agentcgroup", "agentcgroup", 2),
        ("agentcgroup/haiku", "agentcgroup:haiku", 1),
        ("agentcgroup/haiku/demo__parser-1/attempt_1", "agentcgroup:haiku", 1),
        ("mooncake_tiny.jsonl", "mooncake:", 5),
        ("azure_tiny.csv", "azure:", 4),
        ("tracelab_tiny.jsonl", "tracelab:", 2),
    ],
)
def test_detects_format(fixtures_dir: Path, rel: str, prefix: str, workflows: int) -> None:
    lt = load_trace(fixtures_dir / rel)
    assert lt.name.startswith(prefix)
    assert len(lt.workflows) == workflows


def test_detects_gzipped_jsonl(fixtures_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "m.jsonl.gz"
    with open(fixtures_dir / "mooncake_tiny.jsonl", "rb") as src, gzip.open(dst, "wb") as out:
        shutil.copyfileobj(src, out)
    assert load_trace(dst).counts["requests"] == 7


def test_detects_workload_file(tmp_path: Path) -> None:
    p = tmp_path / "w.jsonl"
    write_workload(p, [Workflow("a", 0.0, (Turn(10, 2),))])
    lt = load_trace(p)
    assert lt.name == "workload:w" and lt.workflows[0].id == "a"
    assert lt.counts["llm_calls"] == 1


def test_passes_options(fixtures_dir: Path) -> None:
    lt = load_trace(fixtures_dir / "agentcgroup", subset="glm47flash_local")
    assert [w.meta["subset"] for w in lt.workflows] == ["glm47flash_local"]
    lt = load_trace(fixtures_dir / "mooncake_tiny.jsonl", block_size=256)
    assert lt.counts["requests"] == 7


@pytest.mark.parametrize(
    ("name", "content", "why"),
    [
        ("notes.md", "# hi\n", "unknown file type"),
        ("x.jsonl", '{"foo": 1}\n', "unknown keys"),
        ("y.jsonl", "not json\n", "not JSON"),
        ("z.jsonl", "[1, 2]\n", "not a JSON object"),
    ],
)
def test_rejects_unknown(tmp_path: Path, name: str, content: str, why: str) -> None:
    p = tmp_path / name
    p.write_text(content)
    with pytest.raises(ValueError, match=why) as e:
        load_trace(p)
    for fmt in SUPPORTED_FORMATS:
        assert fmt in str(e.value)


def test_rejects_missing_and_empty_dir(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        load_trace(tmp_path / "nope.csv")
    with pytest.raises(ValueError, match="no AgentCgroup sessions"):
        load_trace(tmp_path)


def test_a_registered_format_is_detected_and_listed(tmp_path: Path) -> None:
    from turnstile.traces import TRACE_FORMATS, LoadedTrace, TraceFormat, register_trace_format

    fmt = TraceFormat(
        "test-ext", "test files (*.testtrace)",
        lambda probe: probe.name.endswith(".testtrace"),
        lambda path, progress, **kw: LoadedTrace(name=f"test:{path.stem}", source=str(path),
                                                 workflows=[], notes=[], counts={}),
    )
    register_trace_format(fmt)
    try:
        p = tmp_path / "a.testtrace"
        p.write_text("x")
        assert load_trace(p).name == "test:a"
        with pytest.raises(ValueError, match=r"registered twice"):
            register_trace_format(fmt)
        bad = tmp_path / "b.unknown"
        bad.write_text("x")
        with pytest.raises(ValueError, match=r"test files \(\*\.testtrace\)"):
            load_trace(bad)
    finally:
        del TRACE_FORMATS["test-ext"]


def test_single_file_formats_without_options_refuse_them(fixtures_dir: Path) -> None:
    with pytest.raises(TypeError, match="take no options"):
        load_trace(fixtures_dir / "tracelab_tiny.jsonl", block_size=256)
