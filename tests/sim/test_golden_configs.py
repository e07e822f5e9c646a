"""The named release configurations (``auto``, ``cvar-fixed``, ``fcfs-workflow``, and the
aliases ``composite-noshadow``) bit-identical to a stored fixture on the golden run's workload
(:mod:`tests.sim.test_golden_run`, which covers ``eager``, ``cvar`` and ``plas``). The fixture
was written by the code before these configurations became options of shared parts, so a
refactor that changes any result fails here. Regenerate only for a documented change:

    .venv/bin/python tests/sim/test_golden_configs.py --write
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import test_golden_run as golden

FIXTURE = Path(__file__).with_name("fixtures") / "golden_configs.json"
POLICIES = ("auto", "cvar-fixed+composite-noshadow", "fcfs-workflow+least-loaded-shadow",
            "auto+composite+budget-keep")


def results() -> dict[str, Any]:
    golden.POLICIES = POLICIES  # the same run, other specs
    return golden.golden_results()


def test_named_configurations_are_bit_identical_to_the_fixture():
    want = golden._flat(json.loads(FIXTURE.read_text()))
    got = golden._flat(json.loads(json.dumps(results())))
    assert got.keys() == want.keys()
    diff = {k: (want[k], got[k]) for k in want if got[k] != want[k]}
    assert not diff, f"{len(diff)} results changed (fixture, now): {dict(list(diff.items())[:20])}"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: test_golden_configs.py --write   (regenerates the fixture)")
    FIXTURE.write_text(json.dumps(results(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
