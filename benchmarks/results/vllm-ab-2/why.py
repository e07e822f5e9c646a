"""Why cvar's prefix hit is 80% simulated but 34% real at load 2 (2026-12-07, h-why).

Re-predicts the stored run (``real_ab.json``, ``profile.json`` here; the same sessions, rates,
seeds and profile as ``real_ab.py --from``) with one thing changed at a time, and counts, per
variant, the retention decisions that were not ``lru`` (hypothesis a) and the new sessions
that cvar's idle override admitted past its KV gate. No engine runs; all figures **simulated**.

    PYTHONPATH=src python benchmarks/results/vllm-ab-2/why.py \
        --trace $TURNSTILE_TRACES/agentcgroup_swerebench_claude_code [--load 2] \
        [--overhead S] [--slowdown X] [--override count|off] [--pool-blocks N]

``--overhead`` / ``--slowdown``: :class:`ServingTerms` (the run was predicted with none: no
serving probe on vLLM). ``--override off``: cvar's idle override no longer admits a new session
past its KV gate; ``pool``: only where its prompt fits in the whole pool beside the released
and paused KV (``kv_fill`` 1; diagnostics only). ``max_live_sessions``: the most sessions cvar
had started and not finished at once (both engines).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from real_ab import _sessions  # noqa: E402

from turnstile.calibrate.ab import (  # noqa: E402
    AbEngines,
    ServingTerms,
    cell_workload,
    predict,
    with_profile_slots,
)
from turnstile.calibrate.fidelity import TraceScale  # noqa: E402
from turnstile.policies import cvar as cvar_mod  # noqa: E402
from turnstile.policies import retention as ret_mod  # noqa: E402
from turnstile.sim.fitted_perf import FittedPerf  # noqa: E402

COUNTS = {"retain_not_lru": 0, "idle_override_new": 0, "max_live_sessions": 0}
_PAST_GATE: set[str] = set()


def _count_retention() -> None:
    orig = ret_mod.LruRetention.on_tool_start

    def on_tool_start(self, turn, engine, now):  # type: ignore[no-untyped-def]
        d = orig(self, turn, engine, now)
        if d.action != "lru":
            COUNTS["retain_not_lru"] += 1
        return d
    ret_mod.LruRetention.on_tool_start = on_tool_start  # type: ignore[method-assign]


def _idle_override(mode: str) -> None:
    """``count``: count the new sessions the idle override lets past the KV gate; ``off``: the
    override no longer admits a new session past the gate; ``pool``: only where it fits in the
    whole pool (``kv_fill`` 1)."""
    orig = cvar_mod.CvarRelease.idle_with_free_slot

    def idle_with_free_slot(self, view, now):  # type: ignore[no-untyped-def]
        ok = orig(self, view, now)
        COUNTS["max_live_sessions"] = max(COUNTS["max_live_sessions"], len(self._active))
        if ok and self._gate:
            _seq, turn = self._gate[0]
            over = turn.prompt_tokens > self.kv_room(view)
            if over and mode == "off":
                return False
            if over and mode == "pool":  # fits beside the KV counted, in the whole pool
                fill, self.kv_fill = self.kv_fill, 1.0
                fits = turn.prompt_tokens <= self.kv_room(view)
                self.kv_fill = fill
                if not fits:
                    return False
            if over:
                _PAST_GATE.add(turn.workflow.id)
                COUNTS["idle_override_new"] = len(_PAST_GATE)
        return ok
    cvar_mod.CvarRelease.idle_with_free_slot = idle_with_free_slot  # type: ignore[method-assign]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--overhead", type=float, default=0.0, help="turn_overhead_s")
    ap.add_argument("--slowdown", type=float, default=1.0, help="engine_slowdown")
    ap.add_argument("--override", choices=("count", "off", "pool"), default="count")
    ap.add_argument("--pool-blocks", type=int, default=None,
                    help="the simulator's pool (blocks of 128); default the gate's kv_tokens")
    ap.add_argument("--load", type=float, default=2.0)
    args = ap.parse_args()
    doc = json.loads((HERE / "real_ab.json").read_text())
    setup, run = doc["setup"], doc["run"]
    sessions = _sessions(args.trace, setup["subset"], setup["trace_sessions"],
                         setup["synth_sessions"], TraceScale(**setup["scale"]), setup["seed"])
    perf = FittedPerf.from_profile(HERE / "profile.json")
    eng = with_profile_slots(AbEngines(**run["engines"]), perf)
    if args.pool_blocks:
        eng = AbEngines(**{**run["engines"], "kv_tokens": args.pool_blocks * eng.block_size})
    _count_retention()
    _idle_override(args.override)
    serving = ServingTerms(args.overhead, args.slowdown)
    rate = {float(k): v for k, v in doc["rates"].items()}[args.load]
    out = {}
    for seed in (0, 1):
        p = predict(cell_workload(sessions, rate, seed), ["eager", "cvar"], eng, perf,
                    run["session_idle_s"], serving)
        out[seed] = {k: (round(v["flow_time_s"]["p95"], 2), round(v["flow_time_s"]["mean"], 2),
                         round(v["prefix_hit_rate"], 3),
                         v["engine_totals"]["recomputed_prefill_tokens"]) for k, v in p.items()}
    ratio = [out[s]["eager"][0] / out[s]["cvar"][0] for s in (0, 1)]
    variant = {k: v for k, v in vars(args).items() if k != "trace"}
    # cells: seed -> policy -> [P95 s, mean s, prefix hit, recomputed prompt tokens]
    print(json.dumps({"variant": variant, "cells": out,
                      "eager/cvar": [round(r, 2) for r in ratio], **COUNTS}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
