"""``scripts/fetch_traces.sh`` against local bare git repositories laid out like the upstream
ones (no network): the pinned commit's files land in the layout the loaders read, and nothing
else does."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

from turnstile.traces import load_trace
from turnstile.traces.fetch import SOURCES

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "fetch_traces.sh"
FIX = ROOT / "tests" / "fixtures" / "traces"
AGENT = FIX / "agentcgroup"

#: upstream path → fixture file, per repository
UPSTREAM: dict[str, dict[str, Path | bytes]] = {
    "yunwei37/agentcgroup": {
        "experiments/all_images_haiku/demo__parser-1/attempt_1/trace.jsonl":
            AGENT / "haiku/demo__parser-1/attempt_1/trace.jsonl",
        "experiments/all_images_haiku/demo__parser-1/attempt_1/tool_calls.json":
            AGENT / "haiku/demo__parser-1/attempt_1/tool_calls.json",
        "experiments/all_images_haiku/demo__parser-1/attempt_1/resource_plot.png": b"\x89PNG",
        "experiments/all_images_local/demo__cli-2/attempt_1/trace.jsonl":
            AGENT / "glm47flash_local/demo__cli-2/attempt_1/trace.jsonl",
        "experiments/all_images_local/demo__cli-2/attempt_1/claude_output.txt": b"stdout\n",
        "experiments/all_images_local/demo__cli-3/attempt_1/results.json":
            AGENT / "glm47flash_local/demo__cli-3/attempt_1/results.json",
        "experiments/all_images_local/mwouts__jupytext-372/attempt_1/trace.jsonl":
            AGENT / "glm47flash_local/demo__cli-2/attempt_1/trace.jsonl",
        "experiments/all_images_local/mwouts__jupytext-372/attempt_1/results.json":
            AGENT / "glm47flash_local/demo__cli-3/attempt_1/results.json",
        "experiments/all_images_local/summary.json": b'{"tasks": 3}\n',
        "experiments/valid_common_tasks.json": b'["demo__cli-2"]\n',
        "scripts/analyse.py": b"print(1)\n",
    },
    "kvcache-ai/Mooncake": {
        "FAST25-release/traces/conversation_trace.jsonl": FIX / "mooncake_tiny.jsonl",
        "FAST25-release/traces/synthetic_trace.jsonl": FIX / "mooncake_tiny.jsonl",
        "README.md": b"# Mooncake\n",
    },
    "Azure/AzurePublicDataset": {
        "data/AzureLLMInferenceTrace_conv.csv": FIX / "azure_tiny.csv",
        "data/AzureLLMInferenceTrace_code.csv": FIX / "azure_tiny.csv",
    },
    "uw-syfi/TraceLab": {
        "example_sessions/sanitized/round_trace.jsonl": FIX / "tracelab_tiny.jsonl",
    },
}

#: what the fetch must write (relative to the traces folder), besides each SOURCE.md
EXPECTED = {
    "agentcgroup_swerebench_claude_code/haiku/demo__parser-1/attempt_1/trace.jsonl.gz",
    "agentcgroup_swerebench_claude_code/haiku/demo__parser-1/attempt_1/tool_calls.json.gz",
    "agentcgroup_swerebench_claude_code/glm47flash_local/demo__cli-2/attempt_1/trace.jsonl.gz",
    "agentcgroup_swerebench_claude_code/glm47flash_local/demo__cli-3/attempt_1/results.json.gz",
    "agentcgroup_swerebench_claude_code/glm47flash_local/"
    "mwouts__jupytext-372/attempt_1/results.json.gz",
    "agentcgroup_swerebench_claude_code/glm47flash_local/summary.json.gz",
    "agentcgroup_swerebench_claude_code/valid_common_tasks.json",
    "mooncake_fast25/conversation_trace.jsonl",
    "mooncake_fast25/synthetic_trace.jsonl",
    "azure_llm_2023_conv/AzureLLMInferenceTrace_conv.csv",
    "tracelab_example/round_trace.jsonl",
}


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def _content(src: Path | bytes) -> bytes:
    return src if isinstance(src, bytes) else src.read_bytes()


@pytest.fixture(scope="module")
def mirror(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """Bare repositories ``<base>/<owner>/<repo>.git``; the pinned commit holds the files above,
    a later commit (the branch tip) changes every one of them."""
    base = tmp_path_factory.mktemp("mirror")
    pins: dict[str, str] = {}
    for repo, files in UPSTREAM.items():
        work = base / "work" / repo
        work.mkdir(parents=True)
        _git(work, "init", "-q")
        for path, src in files.items():
            (work / path).parent.mkdir(parents=True, exist_ok=True)
            (work / path).write_bytes(_content(src))
        _git(work, "add", ".")
        _git(work, "commit", "-q", "-m", "pinned")
        pins[repo] = _git(work, "rev-parse", "HEAD")
        for path in files:
            (work / path).write_bytes(b"changed after the pinned commit\n")
        _git(work, "commit", "-q", "-am", "later")
        _git(base, "clone", "-q", "--bare", str(work), str(base / f"{repo}.git"))
    return base, pins


def _fetch(dest: Path, base: Path, pins: dict[str, str], *extra: str
           ) -> subprocess.CompletedProcess[str]:
    args = [str(dest), "--git-base", f"file://{base}", *extra]
    for s in SOURCES:
        args += ["--pin", f"{s.name}={pins[s.repo]}"]
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def test_fetch_writes_the_pinned_files_in_the_loaders_layout(
        mirror: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    base, pins = mirror
    done = _fetch(tmp_path / "traces", base, pins)
    assert done.returncode == 0, done.stderr
    root = tmp_path / "traces"
    written = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    sources = {f"{s.name}/SOURCE.md" for s in SOURCES}
    assert written == EXPECTED | sources
    for s in SOURCES:
        assert pins[s.repo] in (root / s.name / "SOURCE.md").read_text()
    # the pinned commit's bytes, not the branch tip's; gzipped files decompress to them
    files = UPSTREAM["yunwei37/agentcgroup"]
    got = gzip.decompress((root / "agentcgroup_swerebench_claude_code/haiku/demo__parser-1/"
                           "attempt_1/trace.jsonl.gz").read_bytes())
    assert got == _content(files["experiments/all_images_haiku/demo__parser-1/attempt_1/"
                                 "trace.jsonl"])
    assert (root / "tracelab_example/round_trace.jsonl").read_bytes() == \
        (FIX / "tracelab_tiny.jsonl").read_bytes()
    # and the loaders read what was written
    agent = load_trace(root / "agentcgroup_swerebench_claude_code" / "glm47flash_local")
    assert len(agent) >= 1
    assert len(load_trace(root / "agentcgroup_swerebench_claude_code" / "haiku")) == 1
    for rel in ("mooncake_fast25/conversation_trace.jsonl", "azure_llm_2023_conv",
                "tracelab_example/round_trace.jsonl"):
        assert len(load_trace(root / rel)) >= 1, rel


def test_an_existing_folder_is_kept_unless_forced(
        mirror: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    base, pins = mirror
    dest = tmp_path / "traces"
    assert _fetch(dest, base, pins, "--only", "tracelab_example").returncode == 0
    target = dest / "tracelab_example" / "round_trace.jsonl"
    target.write_text("edited\n")
    again = _fetch(dest, base, pins, "--only", "tracelab_example")
    assert again.returncode == 0 and "already present" in again.stdout
    assert target.read_text() == "edited\n"
    assert _fetch(dest, base, pins, "--only", "tracelab_example", "--force").returncode == 0
    assert target.read_bytes() == (FIX / "tracelab_tiny.jsonl").read_bytes()
    assert sorted(p.name for p in dest.iterdir()) == ["tracelab_example"]


def test_a_commit_without_the_files_fails_and_leaves_no_folder(
        mirror: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    base, pins = mirror
    wrong = dict(pins, **{"Azure/AzurePublicDataset": pins["uw-syfi/TraceLab"]})
    # the TraceLab commit is not in the Azure repository: git cannot fetch it
    done = _fetch(tmp_path / "t", base, wrong, "--only", "azure_llm_2023_conv")
    assert done.returncode == 1
    assert "azure_llm_2023_conv" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "t" / "azure_llm_2023_conv").exists()


def test_user_mistakes_exit_2_with_one_line(
        mirror: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    base, pins = mirror
    done = _fetch(tmp_path / "t", base, pins, "--only", "no-such-trace")
    assert done.returncode == 2 and "unknown trace" in done.stderr
    done = _fetch(tmp_path / "t", base, pins, "--pin", "tracelab_example=zz")
    assert done.returncode == 2 and "NAME=COMMIT" in done.stderr


def test_the_docs_name_every_pinned_commit() -> None:
    """docs/traces.md cites each trace's repository and pinned commit (docs match the code)."""
    text = (ROOT / "docs" / "traces.md").read_text(encoding="utf-8")
    for s in SOURCES:
        assert len(s.commit) == 40
        assert f"`{s.name}/`" in text and s.repo in text and s.commit[:12] in text, s.name


def test_a_required_file_missing_from_the_commit_is_an_error() -> None:
    from turnstile.traces.fetch import FetchError, plan

    azure = next(s for s in SOURCES if s.name == "azure_llm_2023_conv")
    with pytest.raises(FetchError, match="no file matches"):
        plan(azure, ["data/AzureLLMInferenceTrace_code.csv", "README.md"])
    agent = next(s for s in SOURCES if s.repo == "yunwei37/agentcgroup")
    chosen = plan(agent, list(UPSTREAM["yunwei37/agentcgroup"]))
    assert not any("mwouts__jupytext-372/attempt_1/trace" in p for p in chosen)
