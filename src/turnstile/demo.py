"""``make demo``: the main job, a side-by-side simulated bench on a real trace.

Runs on the AgentCgroup Claude Code sessions when the real traces are present (``--traces``,
default ``$TURNSTILE_TRACES`` or ``traces/`` in the checkout: ``scripts/fetch_traces.sh`` fetches
them), else on the built-in synthetic generator (fitted to the same trace), so it works on any
fresh machine.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from turnstile.cli import app
from turnstile.traces import default_traces_dir

# the release policies compared (the first is the baseline), all with the same routing
RELEASE = ["eager", "plas", "cvar", "auto"]
ROUTING = "least-loaded-shadow"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--traces", default=None,
                   help="the real traces folder (default: $TURNSTILE_TRACES, else traces/)")
    p.add_argument("--out", default="out/demo")
    args = p.parse_args(argv)
    traces = Path(args.traces) if args.traces else default_traces_dir() or Path("traces")
    trace = traces / "agentcgroup_swerebench_claude_code" / "glm47flash_local"
    specs = [f"{r}+{ROUTING}" for r in RELEASE]
    cmd = ["bench", "--policies", ",".join(specs), "--engines", "4", "--gpu", "H100",
           "--model", "llama-3.1-8b", "--load", "0.7", "--workflows", "300", "--seed", "0",
           "--out", args.out]
    if trace.exists():
        cmd += ["--trace", str(trace)]
    else:
        print(f"{trace} not found: using the built-in synthetic workload")
    print("turnstile " + " ".join(cmd))
    app(cmd, standalone_mode=True)


if __name__ == "__main__":
    main()
