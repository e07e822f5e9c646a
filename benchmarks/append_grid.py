"""How long llama.cpp takes to append ``n`` new tokens to ``c`` cached ones, on a grid, and how
well each step model fits it.

One ``llama-server`` (the fidelity benchmark's 768×8 random-weight model, ``-np 4``, one
thread) is pinned to a core of its own and this script to another (``--pin-cores``, as a CPU
deployment would with ``taskset``). For every ``c`` a prefix of ``c`` tokens is computed in
slot 0, then every ``n`` in turn appends ``n`` fresh tokens to it (the slot's cache keeps the
prefix: the engine reports ``prompt_n = n``), in random order, ``--repeats`` times over fresh
prefixes. The time is the engine's own ``timings.prompt_ms``.

The step models of ``turnstile profile`` are then fitted to the whole grid (medians over the
repeats), so that only their form differs: the threshold at 64 query tokens (where ggml-cpu's
flash attention turns to its tiled kernel), and the same with the attention from 64 tokens on
counted in 64 × 64 tiles (:func:`turnstile.sim.fitted_perf.tile_pairs`). Prints the grid and
each model's median relative error by range of ``n``; writes ``append_grid.json``.

    .venv/bin/python benchmarks/append_grid.py --out /tmp/grid      # about 3 minutes
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress

from turnstile.calibrate.client import stream_completion
from turnstile.calibrate.features import attn_pairs
from turnstile.calibrate.profile import LLAMACPP_FA_TILE_Q, LLAMACPP_UBATCH, SMALL_CHUNK_KNEES
from turnstile.engines.llama_server import pinned_test_engine, require_llama_server
from turnstile.sim.profile_fit import fit_profile

CONTEXTS = (256, 400, 500, 640, 768, 900, 1024, 1100, 1300, 1500)
APPENDS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 36, 40, 48, 56, 63, 64, 65,
           72, 80, 96, 100, 128, 160, 200, 256, 320, 400, 500)
RANGES = ((1, 8), (9, 63), (64, 64), (65, 127), (128, 512))
MODELS = {
    "threshold at 64": {"small_chunk_knees": SMALL_CHUNK_KNEES,
                        "small_chunk_thresholds": (LLAMACPP_FA_TILE_Q,)},
    "threshold + 64x64 tiles": {"small_chunk_knees": SMALL_CHUNK_KNEES,
                                "small_chunk_thresholds": (LLAMACPP_FA_TILE_Q,),
                                "small_chunk_tiles": (LLAMACPP_FA_TILE_Q,)},
}


def measure(url: str, contexts: list[int], appends: list[int], repeats: int,
            progress: Progress) -> list[dict]:
    rng = random.Random(1)
    task = progress.add_task("appends", total=repeats * len(contexts) * len(appends))

    def fresh(n: int) -> list[int]:
        return [rng.randrange(33, 300) for _ in range(n)]

    def send(prompt: list[int]) -> dict:
        res = stream_completion(url, prompt, 1, api="llamacpp", extra={"id_slot": 0})
        return res.timings or {}

    send(fresh(32))  # one-off costs (graph allocation, page faults)
    rows = []
    for rep in range(repeats):
        base = fresh(max(contexts) + 1)
        for c in rng.sample(contexts, len(contexts)):
            send(base[: c + 1])  # the prefix, computed once
            for n in rng.sample(appends, len(appends)):
                new = fresh(n)
                while new[0] == base[c]:  # the append must not extend the cached prefix
                    new[0] = rng.randrange(33, 300)
                t = send(base[:c] + new)
                rows.append({"repeat": rep, "cached": c, "new": n,
                             "prompt_n": t.get("prompt_n"), "prompt_ms": t.get("prompt_ms")})
                progress.update(task, advance=1)
    return rows


def analyse(rows: list[dict]) -> dict:
    cells: dict[tuple[int, int], list[float]] = defaultdict(list)
    for r in rows:
        if r["prompt_n"] == r["new"] and r["prompt_ms"]:  # the prefix was reused as asked
            cells[(r["cached"], r["new"])].append(r["prompt_ms"] / 1e3)
    keys = sorted(cells)
    step = np.array([float(np.median(cells[k])) for k in keys])
    spread = [(max(v) - min(v)) / float(np.median(v)) for v in cells.values() if len(v) > 1]
    samples = [((n, 0, c, attn_pairs(n, c)), s) for (c, n), s in zip(keys, step, strict=True)]
    new = np.array([n for _, n in keys])
    out: dict = {"cells": len(keys), "repeat_spread_median": float(np.median(spread)),
                 "grid_ms": {f"{c},{n}": round(1e3 * s, 3) for (c, n), s in
                             zip(keys, step, strict=True)}, "models": {}}
    for name, kw in MODELS.items():
        perf = fit_profile(samples, relative=True, ubatch_tokens=LLAMACPP_UBATCH,
                           ubatch_split="equal", one_token_pass=True, **kw)
        pred = np.array([perf.step_time(*f) for f, _ in samples])
        err = np.abs(pred / step - 1)
        by = {f"{lo}-{hi}": float(np.median(err[(new >= lo) & (new <= hi)])) for lo, hi in RANGES}
        out["models"][name] = {"all": float(np.median(err)), "by_new_tokens": by,
                               "rule": perf.small_chunk_rule,
                               "coefficients": [*perf.coefficients, perf.b5]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--appends", default=",".join(map(str, APPENDS)))
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="leave the engine and this script where the OS puts them")
    args = ap.parse_args(argv)
    console = Console(stderr=True)
    require_llama_server()
    contexts = [int(x) for x in args.contexts.split(",")]
    appends = [int(x) for x in args.appends.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with pinned_test_engine(args.pin) as (server, pinned), Progress(console=console,
                                                                   transient=True) as progress:
        rows = measure(server.base_url, contexts, appends, args.repeats, progress)
    report = analyse(rows)
    report["setup"] = {"contexts": contexts, "appends": appends, "repeats": args.repeats,
                       "pinned_cpus": pinned, "wall_s": round(time.time() - t0, 1),
                       "model": "tiny-768x8, -np 4 -c 8192 -t 1"}
    report["rows"] = rows
    (args.out / "append_grid.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"{report['cells']} cells, spread over repeats (median) "
          f"{100 * report['repeat_spread_median']:.1f}%")
    print("| step model | all | " + " | ".join(f"n {lo}-{hi}" for lo, hi in RANGES) + " |")
    print("|---|---:|" + "---:|" * len(RANGES))
    for name, m in report["models"].items():
        cells = " | ".join(f"{100 * v:.1f}%" for v in m["by_new_tokens"].values())
        print(f"| {name} ({m['rule']}) | {100 * m['all']:.1f}% | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
