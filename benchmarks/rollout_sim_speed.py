"""Side-by-side speed of ``turnstile rollout sim`` builds (all figures simulated workloads).

Runs the same rollout command with several builds, alternated, ``--rounds`` times each, and
prints per build the results' ``wall_s`` per policy, the command's wall and CPU time, and the
event counts. A build is ``NAME=PYTHON[:SRC]``: the interpreter to run, and optionally a source
tree put first on ``PYTHONPATH`` (e.g. a ``git archive`` of another commit)::

    git archive b8d4467^ | tar -x -C /tmp/oldcopy   # the rollout's old private engine copy
    .venv/bin/python benchmarks/rollout_sim_speed.py \\
        --build old=.venv/bin/python:/tmp/oldcopy/src --old-policies load-balance,cmlfq \\
        --build plain=.venv/bin/python --build compiled=.venv-compiled/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import tempfile
import time
from pathlib import Path

COMMAND = ["rollout", "sim", "--steps", "3", "--gpus", "16", "--mix", "tp1x8,tp4x2",
           "--train-gpus", "0"]


def run_once(python: str, src: str | None, policies: str) -> dict[str, object]:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src
    with tempfile.TemporaryDirectory() as out:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([python, "-c", "from turnstile.cli import app; app()", *COMMAND,
                        "--policy", policies, "--out", out], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        doc = json.loads((Path(out) / "results.json").read_text())
    pols = doc["policies"]
    return {
        "wall_s": {p: v["wall_s"] for p, v in pols.items()},
        "events": {p: v["sim"]["events"] for p, v in pols.items()},
        "iterations": {p: v["sim"]["iterations"] for p, v in pols.items()},
        "command_wall_s": round(wall, 2),
        "command_cpu_s": round((after.ru_utime - before.ru_utime)
                               + (after.ru_stime - before.ru_stime), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", action="append", required=True, help="NAME=PYTHON[:SRC]")
    ap.add_argument("--policies", default="least-open,cmlfq")
    ap.add_argument("--old-policies", default=None,
                    help="policies for the build named 'old' (the old copy's router names)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the runs here (JSON)")
    a = ap.parse_args()
    builds = []
    for spec in a.build:
        name, _, rest = spec.partition("=")
        python, _, src = rest.partition(":")
        builds.append((name, python, src or None))
    runs: dict[str, list[dict[str, object]]] = {name: [] for name, _, _ in builds}
    loads = [os.getloadavg()[0]]
    for _ in range(a.rounds):
        for name, python, src in builds:
            pols = a.old_policies if name == "old" and a.old_policies else a.policies
            runs[name].append(run_once(python, src, pols))
            loads.append(os.getloadavg()[0])
    print(f"load average (1 min) during the runs: {min(loads):.2f}-{max(loads):.2f}")
    print("| build | wall_s per policy (each run) | command wall s | command CPU s | events |")
    print("|---|---|---:|---:|---|")
    for name, rs in runs.items():
        walls = "; ".join(", ".join(f"{w:.2f}" for w in r["wall_s"].values())  # type: ignore[attr-defined]
                          for r in rs)
        cmd = ", ".join(f"{r['command_wall_s']:.1f}" for r in rs)
        cpu = ", ".join(f"{r['command_cpu_s']:.1f}" for r in rs)
        ev = ", ".join(f"{e / 1e6:.3f} M" for e in rs[0]["events"].values())  # type: ignore[attr-defined]
        print(f"| {name} | {walls} | {cmd} | {cpu} | {ev} |")
    if a.out is not None:
        a.out.write_text(json.dumps({"loads": loads, "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
