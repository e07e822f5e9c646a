"""The simulation-only search that chose this run's set-up (2026-12-07, issue 28 item 5).

Every candidate set-up of ``benchmarks/real_ab.py --engine vllm`` (sessions, ``--max-context``,
``--max-turns``, ``--tool-div``, ``--n-parallel``, ``--kv-sessions``) is predicted exactly as the
run predicts its cells (:func:`turnstile.calibrate.ab.predict`: ``turnstile bench``'s runner,
paged KV model, 128-token blocks), with the vLLM profile of the earlier run
(``benchmarks/results/vllm-ab/profile.json``); no engine runs. Prints one JSON line per set-up:
eager's and cvar's **simulated** P95 flow time and their ratio per ``load/seed``.

    PYTHONPATH=src .venv/bin/python benchmarks/results/vllm-ab-2/search.py \
        --trace $TURNSTILE_TRACES/agentcgroup_swerebench_claude_code > search.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))

from real_ab import DEFAULT_TRACE, _sessions  # noqa: E402

from turnstile.calibrate.ab import (  # noqa: E402
    AbEngines,
    cell_workload,
    offered_load,
    predict,
    slot_kv_tokens,
)
from turnstile.calibrate.ab_engines import VLLM_CPU_BLOCK, vllm_blocks  # noqa: E402
from turnstile.calibrate.fidelity import TraceScale  # noqa: E402
from turnstile.sim.fitted_perf import FittedPerf  # noqa: E402

PROFILE = REPO / "benchmarks" / "results" / "vllm-ab" / "profile.json"


def evaluate(perf: FittedPerf, *, trace: Path = DEFAULT_TRACE, n_trace: int = 12,
             n_synth: int = 6, n_parallel: int = 4,
             kv_sess: int | None = None, max_context: int = 600, max_turns: int = 8,
             max_output: int = 8, tool_div: float = 20.0, max_tool_s: float = 0.5,
             ctx: int | None = None, loads: tuple[float, ...] = (0.2, 2.0),
             seeds: tuple[int, ...] = (0, 1)) -> dict[str, Any]:
    """One set-up's simulated eager and cvar P95 flow times (as ``real_ab.py`` predicts)."""
    scale = TraceScale(token_div=32.0, output_div=8.0, max_output=max_output, tool_div=tool_div,
                       max_tool_s=max_tool_s, max_context=max_context, max_turns=max_turns)
    need = int(1.1 * max_context) + max_output + 32 + 12 * max_turns  # real_ab.py's check
    per_seq = max(796, need) if ctx is None else ctx // n_parallel
    sessions = _sessions(trace, "glm47flash_local", n_trace, n_synth, scale, 0)
    kv = slot_kv_tokens(sessions, kv_sess or n_parallel)
    eng = AbEngines(count=2, n_parallel=n_parallel, ctx=per_seq * n_parallel, kv_tokens=kv,
                    kv_model="paged", chunk=8192, block_size=VLLM_CPU_BLOCK,
                    slot_tokens=per_seq, turn_template_tokens=17)
    unit = offered_load(1.0, sessions, eng, perf)
    cells = {}
    for ld, sd in itertools.product(loads, seeds):
        p = predict(cell_workload(sessions, ld / unit, sd), ["eager", "cvar"], eng, perf,
                    max_tool_s + 0.3)
        e, c = p["eager"]["flow_time_s"]["p95"], p["cvar"]["flow_time_s"]["p95"]
        cells[f"{ld:g}/{sd}"] = [round(e, 2), round(c, 2), round(e / c, 3)]
    return {"blocks": vllm_blocks(kv, per_seq), "kv": kv, "per_seq": per_seq,
            "n": len(sessions), "cells": cells}


def _grid() -> list[tuple[dict[str, Any], tuple[float, ...]]]:
    """The set-ups searched, in the order run (four sweeps), each with its loads."""
    one = {"n_trace": [6, 24, 30], "n_synth": [0, 12, 18], "n_parallel": [2, 8],
           "kv_sess": [2, 3, 6], "max_context": [400, 900, 1200], "max_turns": [5, 12, 16],
           "max_output": [4, 16, 32], "tool_div": [5.0, 10.0, 40.0],
           "max_tool_s": [0.25, 1.0, 2.0]}
    prod = itertools.product
    return [
        # 1: one knob at a time around the 2026-12-06 set-up (12 + 6 sessions, 4 seqs)
        *(({k: v}, (0.2, 2.0, 4.0)) for k, vs in one.items() for v in vs),
        # 2: more sessions, longer contexts, KV of 2 or 4 sessions
        *((dict(n_trace=nt, n_synth=ns, max_context=mc, kv_sess=kv, tool_div=td), (0.2, 2.0))
          for nt, ns, mc, kv, td in prod([30, 48], [0, 6], [900, 1200, 1600], [2, 4],
                                         [20.0, 40.0])),
        # 3: 30 trace sessions: turns, sequences per engine, KV per engine
        *((dict(n_trace=30, n_synth=0, max_context=mc, max_turns=mt, n_parallel=np_,
                kv_sess=kv, tool_div=40.0), (0.2, 2.0, 4.0))
          for mc, mt, np_, kv in prod([1200, 1600], [8, 12, 16], [4, 2, 8], [4, 3, 5])),
        # 4: around the best of 3 (1200 tokens, 12 turns, 2-3 seqs, KV of 5-7 sessions)
        *((dict(n_trace=nt, n_synth=0, max_context=1200, max_turns=12, n_parallel=np_,
                kv_sess=kv, tool_div=td), (0.05, 0.2, 2.0, 3.0))
          for nt, np_, kv, td in prod([30, 36], [2, 3], [5, 6, 7], [40.0, 20.0])),
        *((dict(n_trace=nt, n_synth=0, max_context=mc, max_turns=mt, n_parallel=2,
                kv_sess=kv, tool_div=40.0), (0.05, 0.2, 2.0, 3.0))
          for nt, mc, mt, kv in prod([24, 30], [1000, 1400], [10, 14], [5, 6])),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="the AgentCgroup trace")
    args = ap.parse_args(argv)
    perf = FittedPerf.from_profile(PROFILE)
    for kw, loads in _grid():
        try:
            got = evaluate(perf, trace=args.trace, **kw, loads=loads)
        except ValueError as e:  # e.g. a turn that needs more KV blocks than the pool has
            got = {"err": repr(e)[:100]}
        print(json.dumps({**kw, **got}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
