"""Every ``turnstile`` command the README shows uses options that exist (a renamed flag fails
here, not in a newcomer's first five minutes). Each is parsed with ``--help`` appended: the
option names are checked, nothing runs."""

from __future__ import annotations

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
