"""The robustness suite (simulated): every policy side by side on every workload family, on
1/4/16-engine clusters, two model sizes, paged-KV and llama.cpp-style slot engines, at loads
placed by measured saturation and by the capacity estimate.

    python benchmarks/robustness.py --suite quick            # ≤ 3 min on 2 cores
    python benchmarks/robustness.py --suite full --out benchmarks/results/robustness
    python benchmarks/robustness.py --suite quick --ray auto # cells as tasks on a Ray cluster

Same as ``turnstile bench --suite quick|full``. The suite itself lives in
``turnstile.bench.suite``; docs/robustness.md explains the families and the report.
"""

from __future__ import annotations

import argparse

from turnstile.bench.suite import run_with_progress
from turnstile.policies.spec import split_specs


def _split(s: str | None) -> list[str] | None:
    return [x.strip() for x in s.split(",") if x.strip()] if s else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", choices=("quick", "full"), default="quick")
    ap.add_argument("--out", default="robustness-out", help="folder for results.json, "
                    "robustness.md and heatmap.png")
    ap.add_argument("--policies", default=None, help="comma-separated policy specs (eager is "
                    "always first); default: plas, cvar and the default policy")
    ap.add_argument("--families", default=None, help="comma-separated family names")
    ap.add_argument("--ray", default=None, help="run cells on Ray: auto, local or an ADDRESS")
    ap.add_argument("--workers", type=int, default=None, help="local processes (default: cores)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    pols = split_specs(a.policies) if a.policies else None
    run_with_progress(a.suite, a.out, policies=pols, families=_split(a.families),
                      seed=a.seed, ray=a.ray, workers=a.workers)


if __name__ == "__main__":
    main()
