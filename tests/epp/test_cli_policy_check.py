"""``turnstile epp`` checks its policy before serving (it once failed there with an ImportError)."""

from __future__ import annotations

from typer.testing import CliRunner

from turnstile.cli import app


def test_unknown_policy_is_a_one_line_error() -> None:
    r = CliRunner().invoke(app, ["epp", "--endpoint", "127.0.0.1:1", "--policy", "no-such"])
    assert r.exit_code == 2, r.output
    assert "error:" in r.output and "no-such" in r.output
    assert not isinstance(r.exception, ImportError)
