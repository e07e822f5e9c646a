"""One ``ClusterSim.run()`` on the request trace, for counting its instructions with valgrind.

The run is called through ``itertools.starmap`` so that callgrind can count only it (workload
building and imports excluded); instruction counts do not depend on the host's load, unlike
the times of ``sim_speed.py``. Works with either build (``.venv`` or ``.venv-compiled``)::

    valgrind --tool=callgrind --collect-atstart=no --toggle-collect=starmap_next \\
        --callgrind-out-file=/tmp/cg.out .venv/bin/python benchmarks/sim_instructions.py 10000

prints the build and the run's iterations and makespan (callgrind prints ``Collected``).
"""

from __future__ import annotations

import itertools
import sys
import tempfile
from pathlib import Path

from sim_speed import REPO, read_vidur_csv, request_rows, trace_groups, write_vidur_csv

from turnstile.build_info import describe
from turnstile.policies import PolicySet
from turnstile.sim.cluster import ClusterSim


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 10_000
    rows, src = request_rows(n)
    with tempfile.TemporaryDirectory() as tmp:
        csv = Path(tmp) / "trace_vidur.csv"
        write_vidur_csv(rows, csv)  # the very workflows sim_speed.py runs (CSV round trip)
        wfs = read_vidur_csv(csv)
    sim = ClusterSim(wfs, PolicySet.from_spec("eager"), trace_groups())
    (res,) = itertools.starmap(ClusterSim.run, [(sim,)])
    print(f"{describe(REPO / 'src')}\n{src}: {res.iterations} iterations, "
          f"makespan {res.makespan_s!r} s (simulated)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
