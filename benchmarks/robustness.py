"""The robustness suite (simulated): every policy side by side on every workload family, on
1/4/16-engine clusters, two model sizes, paged-KV and llama.cpp-style slot engines, at loads
placed by measured saturation and by the capacity estimate.

    python benchmarks/robustness.py --suite quick            # ≤ 3 min on 2 cores
    python benchmarks/robustness.py --suite full --out benchmarks/results/robustness
    python benchmarks/robustness.py --suite quick --ray auto # cells as tasks on a Ray cluster
    python benchmarks/robustness.py --suite quick --announced-ends  # the policies told of ends

Same as ``turnstile bench --suite quick|full``. The suite itself lives in
``turnstile.bench.suite``; docs/robustness.md explains the families and the report.
"""

from __future__ import annotations

import argparse

from turnstile.bench.suite import run_with_progress
from turnstile.core.session_idle import SESSION_IDLE_S
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
    ap.add_argument("--announced-ends", action="store_true", help="tell the policies when a "
                    "workflow ends in every cell (default: the gateway-facing cells' ends are "
                    "unannounced and sessions close by the gateway's idle rule)")
    ap.add_argument("--session-idle-s", type=float, default=SESSION_IDLE_S,
                    help="seconds idle after which an unannounced session closes")
    a = ap.parse_args()
    if a.session_idle_s <= 0:
        ap.error("--session-idle-s must be > 0")
    pols = split_specs(a.policies) if a.policies else None
    run_with_progress(a.suite, a.out, policies=pols, families=_split(a.families),
                      seed=a.seed, ray=a.ray, workers=a.workers,
                      unannounced_ends=not a.announced_ends, session_idle_s=a.session_idle_s)


if __name__ == "__main__":
    main()
