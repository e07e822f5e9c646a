"""``turnstile epp`` checks its policy before serving (it once failed there with an ImportError)."""

from __future__ import annotations

from typer.testing import CliRunner

from turnstile.cli import app


def test_unknown_policy_is_a_one_line_error() -> None:
    r = CliRunner().invoke(app, ["epp", "--endpoint", "127.0.0.1:1", "--policy", "no-such"])
    assert r.exit_code == 2, r.output
    assert "error:" in r.output and "no-such" in r.output
    assert not isinstance(r.exception, ImportError)


def test_event_loop_choice() -> None:
    """``--loop``: uvloop where installed (auto), asyncio on request, a bad name an error."""
    import asyncio
    import importlib.util

    from turnstile.epp.cli import _runner

    assert _runner("asyncio") is asyncio.run
    if importlib.util.find_spec("uvloop") is not None:
        import uvloop

        assert _runner("auto") is uvloop.run and _runner("uvloop") is uvloop.run
    else:
        assert _runner("auto") is asyncio.run
    r = CliRunner().invoke(app, ["epp", "--endpoint", "127.0.0.1:1", "--loop", "tokio"])
    assert r.exit_code == 2 and "error:" in r.output and "tokio" in r.output, r.output
