"""Warm and cold steps: how long llama.cpp takes for the same append right after a turn's
decodes, after a pause, and right after a large prefill.

An agent's next turn appends a few tokens to its previous prompt and output. On a CPU engine
that append is much faster when it follows the previous turn's decodes at once than when the
engine has idled or just computed a large prompt: the weights stay in the last-level cache
while the engine steps on small batches (the simulator's ``cold_step_s``,
:data:`turnstile.sim.profiles.llamacpp.WARM`). This script measures it.

One ``llama-server`` (the fidelity benchmark's 768×8 random-weight model, ``-np 4``, one thread)
is pinned to a core and this script to another. Each cell: a fresh 800-token prompt generates
``gen`` tokens (1: only its prefill), then after ``pause`` seconds its prompt, its output and
``k`` new tokens are sent; the time is the engine's ``timings.prompt_ms`` for those ``k`` (and
the one sampled token never fed back: ``prompt_n = k + 1`` after a generation). Prints the
median per cell over ``--repeats`` and writes ``warm_steps.json``.

    .venv/bin/python benchmarks/warm_steps.py --out /tmp/warm     # about 7 minutes
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from pathlib import Path
from statistics import median

from rich.console import Console
from rich.progress import Progress

from turnstile.calibrate.client import stream_completion
from turnstile.engines.llama_server import pinned_test_engine, require_llama_server

GENS = (1, 2, 3, 8, 40)
PAUSES = (0.0, 0.05, 0.15, 0.3, 1.0)
APPENDS = (1, 16, 100)


def measure(url: str, repeats: int, context: int, progress: Progress) -> list[dict]:
    rng = random.Random(3)
    cells = [(g, p, k) for g in GENS for p in PAUSES for k in APPENDS
             if g > 1 or p == 0.0]  # after a bare prefill: no pause (it would only cool more)
    task = progress.add_task("cells", total=repeats * len(cells))

    def fresh(n: int) -> list[int]:
        return [rng.randrange(33, 127) for _ in range(n)]

    stream_completion(url, fresh(32), 4, api="llamacpp")  # one-off costs
    rows = []
    for rep in range(repeats):
        for gen, pause, k in rng.sample(cells, len(cells)):
            prompt = fresh(context)
            turn = stream_completion(url, prompt, gen, api="llamacpp", return_ids=True)
            out = list(turn.output_ids or [])
            time.sleep(pause)
            res = stream_completion(url, prompt + out + fresh(k), 1, api="llamacpp")
            t = res.timings or {}
            rows.append({"repeat": rep, "gen": gen, "pause_s": pause, "new": k,
                         "prompt_n": t.get("prompt_n"), "prompt_ms": t.get("prompt_ms")})
            progress.update(task, advance=1)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--context", type=int, default=800)
    args = ap.parse_args(argv)
    console = Console(stderr=True)
    require_llama_server()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with pinned_test_engine() as (server, pinned), Progress(console=console,
                                                             transient=True) as progress:
        rows = measure(server.base_url, args.repeats, args.context, progress)
    cells: dict[tuple[int, float, int], list[float]] = defaultdict(list)
    for r in rows:
        if r["prompt_ms"] is not None:
            cells[(r["gen"], r["pause_s"], r["new"])].append(r["prompt_ms"])
    table = {f"gen {g}, pause {p:g} s, +{k}": round(median(v), 2)
             for (g, p, k), v in sorted(cells.items())}
    report = {"median_prompt_ms": table, "rows": rows,
              "setup": {"context": args.context, "repeats": args.repeats, "pinned_cpus": pinned,
                        "wall_s": round(time.time() - t0, 1),
                        "model": "tiny-768x8, -np 4 -c 8192 -t 1"}}
    (args.out / "warm_steps.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"append to a {args.context}-token prompt after its turn: engine prompt_ms, median of "
          f"{args.repeats}")
    print("| turn generated | pause | " + " | ".join(f"+{k} tokens" for k in APPENDS) + " |")
    print("|---|---:|" + "---:|" * len(APPENDS))
    for g in GENS:
        for p in PAUSES:
            got = [cells.get((g, p, k)) for k in APPENDS]
            if all(got):
                print(f"| {g} | {p:g} s | " + " | ".join(f"{median(v):.1f} ms" for v in got
                                                        if v) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
