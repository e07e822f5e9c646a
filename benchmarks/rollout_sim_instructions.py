"""One policy's rollout simulation (pre-drawn batches) inside ``itertools.starmap``, so that
callgrind can count the instructions of the simulation alone, independent of the host's load
(all figures simulated workloads)::

    valgrind --tool=callgrind --collect-atstart=no --toggle-collect=starmap_next \\
        .venv/bin/python benchmarks/rollout_sim_instructions.py least-open 1

The setup is the fixed-mix command of ``benchmarks/rollout_sim_speed.py``
(``--gpus 16 --mix tp1x8,tp4x2 --train-gpus 0``) with ``STEPS`` steps; it prints the
makespans (seconds, simulated) so that two builds' runs can be checked to agree.
"""

from __future__ import annotations

import argparse
import itertools

from turnstile.rollout.experiment import RolloutSimRequest, make_router
from turnstile.rollout.planner import RLLoop


class _Drawn:
    """The workload with its batches drawn beforehand (outside the counted call)."""

    def __init__(self, workload: object, steps: int) -> None:
        self.workload = workload
        self.spec = workload.spec  # type: ignore[attr-defined]
        self.batches = [workload.batch(k) for k in range(steps)]  # type: ignore[attr-defined]

    def batch(self, step: int) -> list:
        return self.batches[step]

    def forecast(self, step: int) -> list:
        return self.workload.forecast(step)  # type: ignore[attr-defined]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("policy")
    ap.add_argument("steps", type=int)
    a = ap.parse_args()
    req = RolloutSimRequest(steps=a.steps, gpus=16, policies=(a.policy,), mix="tp1x8,tp4x2",
                            train_gpus=0)
    drawn = _Drawn(req.make_workload(), a.steps)

    def simulate() -> object:
        loop = RLLoop(drawn, lambda: make_router(a.policy),  # type: ignore[arg-type]
                      sim_config=req.sim_config(), planner=req.planner_config())
        return loop.run(a.steps)

    res = next(itertools.starmap(simulate, [()]))
    print([round(r.rollout_s, 3) for r in res.steps])  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
