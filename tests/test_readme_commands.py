"""Every ``turnstile`` command the README shows uses options that exist (a renamed flag fails
here, not in a newcomer's first five minutes). Each is parsed with ``--help`` appended: the
option names are checked, nothing runs."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from turnstile.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_commands() -> list[str]:
    text = README.read_text(encoding="utf-8")
    cmds: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)  # continuation lines
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip().rstrip("&").strip()
            if re.match(r"(\.venv/bin/)?turnstile\s", line):
                cmds.append(line)
    # inline code in the prose: `turnstile replay --target ... -o out/replay`
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`]+)`", prose.replace("\n", " ")):
        if re.match(r"turnstile [a-z]", span) and " --" in span:
            cmds.append(span)
    return cmds


def test_the_readme_shows_commands() -> None:
    cmds = readme_commands()
    assert any(c.split()[1] == "bench" for c in cmds if len(c.split()) > 1)
    assert len(cmds) >= 5


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_parses(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = shlex.split(command)[1:]
    if argv and argv[-1] == "...":
        argv = argv[:-1]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    _, err = capsys.readouterr()
    assert e.value.code == 0, f"{command!r}: {err}"


ROOT = README.parent


def test_readme_is_a_five_minute_read() -> None:
    """Issue 29: a product README of at most 250 lines; run diaries live in docs/results/."""
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 250


def _section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_quickstart_1_table_is_what_its_command_prints(tmp_path: Path) -> None:
    """The table Quickstart 1 shows is what its command prints today (simulated, seeded): every
    cell the README keeps, formatted as the bench table formats it."""
    from turnstile.bench.report import format_count, format_seconds, load_results, p95_ratio

    section = _section("Quickstart 1")
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    command = re.sub(r"\\\n\s*", " ", block).splitlines()[0].split(" #", 1)[0]
    argv = shlex.split(command)[1:]
    argv[argv.index("-o") + 1] = str(tmp_path / "bench")
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    doc = load_results(tmp_path / "bench")
    table = re.search(r"```\npolicy .*?\n(.*?)```", section, re.S).group(1)
    rows = [re.split(r"\s{2,}", ln.strip()) for ln in table.strip().splitlines()]
    first = doc["policies"][0]["metrics"]
    assert [r[0] for r in rows] == [p["policy"] for p in doc["policies"]]
    for row, result in zip(rows, doc["policies"], strict=True):
        m = result["metrics"]
        flow, ttft = m["flow_time_s"], m["ttft_s"]["p95"]
        ratios = [p95_ratio(first["flow_time_s"][k], flow[k]) for k in ("p95", "mean")]
        ratios.append(p95_ratio(first["ttft_s"]["p95"], ttft))
        want = [result["policy"], format_seconds(flow["p95"]), format_seconds(flow["mean"]),
                format_seconds(ttft), f"{100 * m['prefix_hit_rate']:.1f}%",
                format_count(m["recomputed_prefill_tokens"]),
                " / ".join(f"{r:.2f}×" for r in ratios)]
        got = [*row[:6], re.sub(r"\s+", " ", " ".join(row[6:]))]
        assert got == want, f"README row {row} vs a fresh run {want}"


def _relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    return [u.split("#", 1)[0] for u in links
            if not u.startswith(("http://", "https://", "mailto:", "#"))]


@pytest.mark.parametrize("doc", [README, *sorted((ROOT / "docs").rglob("*.md")),
                                 ROOT / "benchmarks" / "results" / "README.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    missing = [u for u in _relative_links(doc) if not (doc.parent / u).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to missing files: {missing}"


def test_every_stored_result_is_indexed() -> None:
    """benchmarks/results/ keeps only what the docs cite, with an index naming every entry."""
    results = ROOT / "benchmarks" / "results"
    index = (results / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`([^`]+)`", index))
    missing = []
    for entry in sorted(results.iterdir()):
        if entry.name == "README.md":
            continue
        label = entry.name + ("/" if entry.is_dir() else "")
        globbed = any("*" in n and Path(label.rstrip("/")).match(n.rstrip("/")) for n in named)
        inside = any(n.startswith(label) for n in named)  # real-ab/run23/ for real-ab/
        if label not in named and not globbed and not inside:
            missing.append(label)
    assert not missing, f"benchmarks/results/README.md does not index {missing}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quickstart_3_comment_is_what_its_command_prints(tmp_path: Path) -> None:
    """Quickstart 3's comment (mean makespans and their ratio, simulated) matches a fresh run."""
    section = _section("Quickstart 3")
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    command, comment = block.strip().splitlines()[:2]
    argv = shlex.split(command)[1:]
    argv[argv.index("-o") + 1] = str(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    doc = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    means = doc["summary"]["mean_makespan_s"]
    names = list(means)
    want = (f"# mean makespan (simulated): {names[0]} {means[names[0]]:,.0f} s, {names[1]} "
            f"{means[names[1]]:,.0f} s ({means[names[0]] / means[names[1]]:.2f}×)")
    assert comment.strip() == want


def test_every_study_write_up_is_indexed() -> None:
    """docs/results/README.md lists every dated write-up in docs/results/."""
    folder = ROOT / "docs" / "results"
    index = (folder / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in sorted(folder.glob("20*.md")) if f"]({p.name})" not in index]
    assert not missing, f"docs/results/README.md does not list {missing}"


def docs_commands() -> list[tuple[str, str]]:
    """``turnstile ...`` lines in the code blocks of docs/ (where the README links)."""
    found: list[tuple[str, str]] = []
    for doc in sorted((ROOT / "docs").rglob("*.md")):
        text = doc.read_text(encoding="utf-8")
        for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                line = line.split(" #", 1)[0].strip().rstrip("&").strip()
                m = re.match(r"(?:\S*/)?turnstile\s+(.*)", line)
                if m and "|" not in line:
                    found.append((str(doc.relative_to(ROOT)), m.group(1)))
    return found


@pytest.mark.parametrize(("doc", "args"), docs_commands())
def test_docs_command_parses(doc: str, args: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a for a in shlex.split(args) if a != "..."]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    _, err = capsys.readouterr()
    assert e.value.code == 0, f"{doc}: turnstile {args!r}: {err}"
