"""Azure conversation stream and TraceLab rounds: fixtures (exact) and the real files (counts)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from turnstile.traces import arrival_times, load_azure_conv, load_tracelab
from turnstile.traces.azure import parse_timestamp
from turnstile.workload.model import validate_workflow


def test_azure_fixture(fixtures_dir: Path) -> None:
    lt = load_azure_conv(fixtures_dir / "azure_tiny.csv")
    assert [len(w.turns) for w in lt.workflows] == [1, 1, 1, 1]
    assert [w.turns[0].input_tokens for w in lt.workflows] == [374, 396, 879, 1020]
    # GeneratedTokens 0 cannot be a turn: clamped to 1 and said so
    assert [w.turns[0].output_tokens for w in lt.workflows] == [44, 109, 55, 1]
    assert any("zero outputs set to 1" in n for n in lt.notes)
    assert any("arrival stream" in n for n in lt.notes)
    # 7 fractional digits, relative to the first row, without float drift
    assert [w.arrival_s for w in lt.workflows] == pytest.approx(
        [0.0, 4.314579, 4.541877, 14.31941], abs=1e-9
    )
    t = arrival_times(fixtures_dir / "azure_tiny.csv")
    assert isinstance(t, np.ndarray) and t.shape == (4,)
    assert t[1] == pytest.approx(4.314579, abs=1e-9)
    assert parse_timestamp("1970-01-01 00:00:01.5000000") == 1.5


def test_azure_rejects_other_csv(tmp_path: Path) -> None:
    p = tmp_path / "x.csv"
    p.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="missing columns"):
        load_azure_conv(p)
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n")
    with pytest.raises(ValueError, match=r":2: bad TIMESTAMP"):
        load_azure_conv(p)


def test_tracelab_fixture(fixtures_dir: Path) -> None:
    lt = load_tracelab(fixtures_dir / "tracelab_tiny.jsonl")
    s1, s2 = lt.workflows
    assert (s1.id, s2.id) == ("s1", "s2")
    # rounds are ordered by round_index, not file order
    r0, r1 = s1.turns
    assert (r0.context_tokens, r0.input_tokens, r0.output_tokens) == (0, 1000, 80)
    assert (r1.context_tokens, r1.input_tokens, r1.output_tokens) == (1000, 300, 40)
    # tools in tool_index order; null latency → timestamps; null is_error → unknown
    assert [(t.name, t.duration_s, t.status, t.result_tokens) for t in r0.tools] == [
        ("Bash", 2.0, "error", 100),
        ("Read", 0.5, "unknown", None),
    ]
    # think time: the user message of round 1 − the last event of round 0
    assert r1.think_s == pytest.approx(23.0)
    # null prefix/append → the total is new input; null output → 1; no latency → 0, unknown
    (only,) = s2.turns
    assert (only.context_tokens, only.input_tokens, only.output_tokens) == (0, 500, 1)
    assert [(t.duration_s, t.status) for t in only.tools] == [(0.0, "unknown")]
    assert s2.arrival_s == 60.0 and s1.arrival_s == 0.0
    for key in ("prefix_or_append_null", "output_clamped", "latency_missing", "status_null",
                "latency_from_timestamps"):
        assert lt.counts[key] == 1, key
    assert len(lt.notes) >= 7


@pytest.mark.traces
def test_azure_real(traces_dir: Path) -> None:
    path = traces_dir / "azure_llm_2023_conv" / "AzureLLMInferenceTrace_conv.csv"
    lt = load_azure_conv(path)
    assert lt.counts["requests"] == len(lt.workflows) == 19_366
    t = arrival_times(path)
    assert t.size == 19_366 and t[0] == 0.0
    assert 3_501 < t[-1] < 3_503  # SOURCE.md: 3,502 s
    assert np.all(np.diff(t) >= 0)
    ctx = np.array([w.turns[0].input_tokens for w in lt.workflows])
    assert np.percentile(ctx, 50) == pytest.approx(1_020, abs=1)


@pytest.mark.traces
def test_tracelab_real(traces_dir: Path) -> None:
    lt = load_tracelab(traces_dir / "tracelab_example" / "round_trace.jsonl")
    assert lt.counts["llm_calls"] == 19
    assert sorted(len(w.turns) for w in lt.workflows) == [9, 10]
    claude = next(w for w in lt.workflows if w.meta["provider"] == "claude")
    first = claude.turns[0]
    # SOURCE.md sample: round 0 prefix 27217 + append 5055, out 931, Bash 860 ms + WebSearch
    assert (first.context_tokens, first.input_tokens, first.output_tokens) == (27_217, 5_055, 931)
    assert [(t.name, t.duration_s) for t in first.tools] == [("Bash", 0.86), ("WebSearch", 19.291)]
    for wf in lt.workflows:
        assert validate_workflow(wf) == []


def test_azure_folder_and_code_trace_label(fixtures_dir: Path, tmp_path: Path) -> None:
    from turnstile.traces import load_trace

    text = (fixtures_dir / "azure_tiny.csv").read_text()
    conv = tmp_path / "conv"
    conv.mkdir()
    (conv / "AzureLLMInferenceTrace_conv.csv").write_text(text)
    (conv / "SOURCE.md").write_text("about the trace\n")
    by_dir = load_trace(conv)
    by_file = load_azure_conv(fixtures_dir / "azure_tiny.csv")
    assert by_dir.name == "azure:conv"
    assert [w.turns for w in by_dir.workflows] == [w.turns for w in by_file.workflows]
    code = tmp_path / "code"
    code.mkdir()
    (code / "AzureLLMInferenceTrace_code.csv").write_text(text)
    for lt in (load_trace(code), load_trace(code / "AzureLLMInferenceTrace_code.csv")):
        assert lt.name == "azure:code"
        assert all(w.id.startswith("azure-code-") for w in lt.workflows)
        assert lt.workflows[0].meta["source"] == "azure_llm_2023_code"
    # both services in one folder: the conversation trace; two unrelated CSVs: ask for the file
    (code / "AzureLLMInferenceTrace_conv.csv").write_text(text)
    assert load_trace(code).name == "azure:conv"
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.csv").write_text(text)
    (other / "b.csv").write_text(text)
    with pytest.raises(ValueError, match="one Azure trace CSV"):
        load_azure_conv(other)
