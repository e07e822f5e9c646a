"""The registries make mypy check every registration against its Protocol: a policy class that
breaks its interface is a type error where it is registered (``make typecheck`` runs mypy over
``policies/``; test_contract.py checks the same on the built objects at run time).

Here mypy runs, with the project's configuration, on a scratch module that registers one
conforming policy and one of each kind of breach, and must flag the breaches only."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

api = pytest.importorskip("mypy.api")

ROOT = Path(__file__).resolve().parents[2]

SCRATCH = textwrap.dedent('''
    from typing import ClassVar

    from turnstile.core.state import EngineLoad, TurnRecord
    from turnstile.policies.base import ADMISSION, ROUTING


    @ADMISSION.register("scratch-good")
    class Good:
        name: ClassVar[str] = "scratch-good"

        def priority(self, turn: TurnRecord, engine: EngineLoad, now: float) -> float:
            return now


    @ADMISSION.register("scratch-missing-parameter")
    class MissingParameter:
        name: ClassVar[str] = "scratch-missing-parameter"

        def priority(self, turn: TurnRecord, now: float) -> float:
            return now


    @ADMISSION.register("scratch-wrong-return")
    class WrongReturn:
        name: ClassVar[str] = "scratch-wrong-return"

        def priority(self, turn: TurnRecord, engine: EngineLoad, now: float) -> str:
            return "first"


    @ROUTING.register("scratch-missing-hook")
    class MissingHook:  # no on_workflow_done
        name: ClassVar[str] = "scratch-missing-hook"

        def route(self, turn: TurnRecord, view: object, now: float) -> str:
            return "e0"
''')


def test_mypy_rejects_a_registration_that_breaks_its_protocol(tmp_path, monkeypatch):
    scratch = tmp_path / "scratch_policies.py"
    scratch.write_text(SCRATCH)
    monkeypatch.chdir(ROOT)  # pyproject's mypy_path ("src") is relative to the repository
    out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml"),
                                "--cache-dir", str(tmp_path / "cache"), "--no-error-summary",
                                str(scratch)])
    assert status == 1, out + err
    flagged = {int(line.split(":")[1]) for line in out.splitlines() if ": error:" in line}
    lines = SCRATCH.splitlines()

    def line_of(name: str) -> int:  # the decorator line above ``class name``
        return next(i for i, text in enumerate(lines, 1) if f"class {name}" in text) - 1

    assert flagged == {line_of("MissingParameter"), line_of("WrongReturn"),
                       line_of("MissingHook")}, out
    assert '"Callable[..., AdmissionPolicy]"' in out and '"Callable[..., RoutingPolicy]"' in out
