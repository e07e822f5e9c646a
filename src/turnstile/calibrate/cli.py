"""``turnstile profile`` and ``turnstile fidelity``: calibrate the simulator against a real engine.

The lead CLI wires these in with :func:`register`; ``python -m turnstile.calibrate.cli`` runs
them standalone.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from turnstile.bench.flags import NON_NEGATIVE, POSITIVE, out_path
from turnstile.bench.progress import QUIET_HELP, progress_bar

_err = Console(stderr=True, soft_wrap=True)
_out = Console()


def _check_targets(targets: list[str]) -> None:
    """``--target``: each an http(s) URL that answers as an engine; one line naming the flag."""
    from turnstile.calibrate.client import EngineRequestError, discover

    for t in targets:
        if not t.startswith(("http://", "https://")):
            raise ValueError(f"--target {t}: expected an http(s) URL")
        try:
            discover(t)
        except (EngineRequestError, OSError) as e:
            raise ValueError(f"--target {t}: {e}") from None


def _fail(message: str) -> typer.Exit:
    from turnstile.bench.usage import fail

    return fail(message)


def _check_token_range(low: int, high: int) -> None:
    """``--token-low``/``--token-high``: prompts draw token ids from ``[low, high)``."""
    if high <= low:
        raise ValueError(f"--token-high {high} must be above --token-low {low} (prompts use "
                         "token ids from --token-low up to, not including, --token-high)")


def profile_cmd(
    target: Annotated[
        list[str],
        typer.Option(
            "--target",
            help="Engine base URL (http://host:port); repeat for identical replicas, "
            "profiled together into one profile",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", parser=out_path,
                                      help="Profile JSON to write")] = Path("profile.json"),
    chunk: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Per-step token budget: llama.cpp -b (default 2048), vLLM "
            "max_num_batched_tokens (default 8192)"
        ),
    ] = None,
    max_seqs: Annotated[
        int | None,
        typer.Option("--max-num-seqs", "--max-seqs", min=1,
                     help="Concurrent sequences to sweep up to (vLLM's --max-num-seqs; "
                          "llama.cpp: its slots)"),
    ] = None,
    max_context: Annotated[
        int | None, typer.Option(min=1, help="Longest prompt to measure (default: engine "
                                 "limit, ≤4096)")
    ] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Measure each configuration N times")] = 1,
    quick: Annotated[bool, typer.Option(help="A short sweep (smoke tests)")] = False,
    kv_bytes_per_token: Annotated[
        float, typer.Option(parser=NON_NEGATIVE,
                            help="KV bytes per token to record (offload-tier timing)")
    ] = 0.0,
    token_low: Annotated[int, typer.Option(min=0, help="Prompts use random token ids from "
                                           "here ...")] = 33,
    token_high: Annotated[int, typer.Option(min=1, help="... to here (exclusive)")] = 127,
    absolute: Annotated[
        bool, typer.Option(help="Least squares on absolute (not relative) step-time errors")
    ] = False,
    seed: Annotated[int, typer.Option(min=0)] = 0,
    ubatch: Annotated[
        int | None,
        typer.Option(min=0, help="Tokens per forward pass: llama.cpp -ub (default 512); 0: "
                     "one pass per step"),
    ] = None,
    kv_unified: Annotated[
        bool, typer.Option(help="The llama.cpp server runs with --kv-unified (one KV buffer)")
    ] = False,
    neighbour: Annotated[
        list[str] | None,
        typer.Option(help="Another engine on the same host (repeatable): measure how much "
                     "slower the target computes while it serves (host contention)"),
    ] = None,
    contention_rounds: Annotated[
        int, typer.Option(min=1, max=1000,
                          help="Alone / under-load rounds of the host-contention probes")
    ] = 5,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help=QUIET_HELP)] = False,
) -> None:
    """Measure a real engine's step times through its HTTP API and fit the simulator's
    performance model to them (a profile for turnstile bench --profile)."""
    from turnstile.bench.usage import check_out_file
    from turnstile.calibrate.client import EngineRequestError
    from turnstile.calibrate.profile import profile_engine

    try:
        _check_token_range(token_low, token_high)
        check_out_file(out)
        _check_targets(target)
    except ValueError as e:
        raise _fail(str(e)) from None
    with progress_bar(_err, quiet=quiet) as bar:
        task = bar.add_task("profile", total=None)
        try:
            res = profile_engine(
                target,
                out=out,
                chunk=chunk,
                max_seqs=max_seqs,
                max_context=max_context,
                quick=quick,
                repeats=repeats,
                relative=not absolute,
                kv_bytes_per_token=kv_bytes_per_token,
                seed=seed,
                ubatch=ubatch,
                kv_unified=kv_unified,
                neighbours=neighbour or (),
                contention_rounds=contention_rounds,
                token_range=(token_low, token_high),
                on_total=lambda n: bar.update(task, total=n),
                on_progress=lambda label: bar.update(task, advance=1, description=label),
            )
        except (EngineRequestError, RuntimeError, ValueError) as e:
            raise _fail(str(e)) from None
    perf = res.perf
    fit = perf.meta["fit"]
    _out.print(
        f"[bold]{res.info.kind}[/] {res.info.model}: {fit['samples']} samples in "
        f"{res.wall_s:.0f} s, median |rel err| {100 * fit['median_abs_rel_err']:.1f}%, "
        f"R² {fit['r2']:.3f}"
    )
    names = ("b0 s/step", "b1 s/prefill tok", "b2 s/decode seq", "b3 s/kv tok", "b4 s/attn pair")
    _out.print("  ".join(f"{n} {v:.3g}" for n, v in zip(names, perf.coefficients, strict=True)))
    if perf.b0_one is not None or perf.ubatch_tokens:
        one = "b0" if perf.b0_one is None else f"{perf.b0_one:.3g} s"
        _out.print(f"forward passes of ≤{perf.ubatch_tokens or '∞'} tokens "
                   f"({perf.ubatch_split} split), one-token pass {one}")
    if perf.b5:
        k = f"{perf.small_chunk_tokens:g}"
        how = {"knee": f"knee {k} prefill tokens", "below": f"below {k} prefill tokens",
               "tiles": f"below {k} prefill tokens, {k}×{k} attention tiles from {k} on"}
        _out.print(f"b5 s/small-chunk attn pair {perf.b5:.3g} ({how[perf.small_chunk_rule]})")
    if fit.get("cold_samples"):
        _out.print(f"cold step +{1e3 * perf.cold_step_s:.2f} ms (a prompt after an idle spell "
                   "or a large chunk; appends after a generation run warm)")
    hc = perf.meta.get("host_contention")
    if hc:
        probes = ", ".join(f"{k} ×{v['ratio']:.2f}" for k, v in hc["probes"].items())
        _out.print(f"host contention {100 * perf.host_contention:.1f}% per co-running engine "
                   f"({hc['neighbours']} neighbour(s): {probes})")
    _out.print(f"wrote {out}")


def fidelity_cmd(
    target: Annotated[
        list[str], typer.Option("--target", help="Engine base URL; repeat for several engines")
    ],
    profile: Annotated[Path, typer.Option(help="Fitted profile (from turnstile profile)")],
    trace: Annotated[Path, typer.Option(help="AgentCgroup trace directory")],
    out: Annotated[Path, typer.Option("--out", "-o", parser=out_path,
                                      help="Report directory")] = Path("fidelity"),
    subset: Annotated[str | None, typer.Option(help="agentcgroup subset")] = "glm47flash_local",
    sessions: Annotated[int, typer.Option("--workflows", "--sessions", min=1,
                                          help="Sessions replayed per rate (as bench's "
                                               "--workflows)")] = 12,
    rates: Annotated[
        str, typer.Option(help="Session arrival rates per second, comma-separated")
    ] = "0.2,0.5,1.0",
    kv_tokens: Annotated[
        int | None, typer.Option(min=1, help="Simulated KV tokens per engine (default: "
                                 "discovered)")
    ] = None,
    max_num_seqs: Annotated[
        int | None, typer.Option(min=1, help="Simulated max sequences (default: discovered)")
    ] = None,
    chunk: Annotated[
        int | None, typer.Option(min=1, help="Simulated per-step token budget (default: "
                                 "profile's)")
    ] = None,
    cpu_offload_tokens: Annotated[
        int | None,
        typer.Option(min=0, help="Simulated offload tier (default: 64×KV for llama.cpp, 0 "
                     "otherwise)"),
    ] = None,
    token_div: Annotated[float, typer.Option(parser=POSITIVE,
                                             help="Divide prompt tokens by this")] = 32.0,
    output_div: Annotated[float, typer.Option(parser=POSITIVE,
                                              help="Divide output tokens by this")] = 8.0,
    tool_div: Annotated[float, typer.Option(parser=POSITIVE,
                                            help="Divide tool seconds by this")] = 10.0,
    max_context: Annotated[int, typer.Option(min=2, help="Cap on a turn's prompt + output")
                           ] = 1536,
    max_turns: Annotated[int, typer.Option(min=1, help="Turns kept per session")] = 12,
    max_output: Annotated[int, typer.Option(min=1, help="Cap on a turn's output tokens")] = 48,
    max_tool_s: Annotated[float, typer.Option(parser=NON_NEGATIVE,
                                              help="Cap on a turn's (scaled) tool time")] = 3.0,
    roofline_gpu: Annotated[
        str | None, typer.Option(help="Also simulate the roofline model on this GPU")
    ] = None,
    roofline_model: Annotated[
        str | None,
        typer.Option(help="... for this model: a models.json name, or a Hugging Face model "
                     "directory / config.json"),
    ] = None,
    token_low: Annotated[int, typer.Option(min=0, help="Prompts use random token ids from "
                                           "here ...")] = 33,
    token_high: Annotated[int, typer.Option(min=1, help="... to here (exclusive)")] = 127,
    noise_floor: Annotated[
        bool, typer.Option(help="Replay each rate twice and report real-vs-real error too")
    ] = False,
    seed: Annotated[int, typer.Option(min=0)] = 0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help=QUIET_HELP)] = False,
) -> None:
    """Replay a scaled AgentCgroup slice on real engines and in the simulator (same sessions,
    same arrivals, same engine per session) and report the simulator's relative error."""
    from turnstile.bench.usage import check_out_dir
    from turnstile.calibrate.client import discover
    from turnstile.calibrate.fidelity import (
        SimEngineSpec,
        TraceScale,
        model_spec,
        run_fidelity,
        select_sessions,
    )
    from turnstile.calibrate.fidelity_report import write_report
    from turnstile.sim.engine_profile import profile_for
    from turnstile.sim.fitted_perf import FittedPerf
    from turnstile.sim.perf import PerfModel
    from turnstile.sim.roofline_perf import RooflinePerf
    from turnstile.traces import load_trace

    try:
        _check_token_range(token_low, token_high)
        rate_list = _rates(rates)
        check_out_dir(out)
        if not profile.is_file():
            raise ValueError(f"--profile {profile}: no such file")
        if not trace.exists():
            raise ValueError(f"--trace {trace}: no such file or folder")
        _check_targets(target)
        perf = FittedPerf.from_profile(profile)
        info = discover(target[0])
        kw: dict[str, Any] = {"subset": subset} if subset else {}
        loaded = load_trace(trace, **kw)
    except (ValueError, OSError, RuntimeError) as e:
        raise _fail(str(e)) from None
    scale = TraceScale(
        token_div=token_div,
        output_div=output_div,
        tool_div=tool_div,
        max_context=max_context,
        max_turns=max_turns,
        max_output=max_output,
        max_tool_s=max_tool_s,
    )
    kv = kv_tokens or info.kv_tokens or perf.meta.get("kv_tokens")
    seqs = max_num_seqs or info.n_parallel or perf.meta.get("max_seqs")
    if not kv or not seqs:
        raise _fail("the engine does not report its KV size or max sequences: pass "
                    "--kv-tokens and --max-num-seqs")
    step = chunk or int(perf.meta.get("chunk_tokens", 2048))
    offload = cpu_offload_tokens
    if offload is None:
        offload = 64 * int(kv) if info.kind == "llama.cpp" else 0
    prof = profile_for(info.kind)
    block = prof.block_size if prof.slot_limited else int(info.extra.get("block_size",
                                                                          prof.block_size))
    engine = SimEngineSpec(int(kv), int(seqs), step, offload, block_size=block)
    perfs: dict[str, PerfModel] = {"fitted": perf}
    if roofline_gpu and roofline_model:
        try:
            spec = model_spec(roofline_model)
            perfs[f"roofline ({roofline_gpu})"] = RooflinePerf(roofline_gpu, spec)
        except (KeyError, ValueError, OSError) as e:
            raise _fail(f"roofline: {e}") from None
    try:
        wfs = select_sessions(loaded.workflows, sessions, scale, seed=seed)
    except ValueError as e:
        raise _fail(str(e)) from None
    apis = ["llamacpp" if discover(t).kind == "llama.cpp" else "openai" for t in target]
    models = [discover(t).model for t in target]
    with progress_bar(_err, quiet=quiet) as bar:
        total = sum(len(w.turns) for w in wfs) * len(rate_list) * (2 if noise_floor else 1)
        task = bar.add_task("replay", total=total)
        report = run_fidelity(
            wfs,
            target,
            rate_list,
            engine,
            perfs,
            apis=apis,
            models=models,
            seed=seed,
            repeat_real=noise_floor,
            token_range=(token_low, token_high),
            on_turn=lambda _t: bar.update(task, advance=1),
            on_rate=lambda r, run: _err.print(
                f"rate {r:g}/s: {len(run.turns)} turns in {run.wall_s:.0f} s"
                + (f" ({len(run.errors)} errors)" if run.errors else "")
            ),
        )
    report["setup"] = {
        "targets": list(target),
        "engine_kind": info.kind,
        "model": info.model,
        "profile": str(profile),
        "trace": str(trace),
        "subset": subset,
        "scale": asdict(scale),
        "arrivals": "sessions superimposed on Poisson arrivals (seeded)",
    }
    out.mkdir(parents=True, exist_ok=True)
    md = write_report(out, report, f"Simulator vs {info.kind} ({info.model})")
    _out.print(md)
    _out.print(f"wrote {out}/fidelity.md, fidelity.json, fidelity_scatter.png")


def _rates(text: str) -> list[float]:
    """``--rates 0.2,0.5``: finite rates > 0 (sessions/s)."""
    from turnstile.bench.flags import check_finite

    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"--rates {text}: {part!r} is not a number") from None
        why = check_finite(rate, gt=0)
        if why:
            raise ValueError(f"--rates {text}: {part}: {why}")
        out.append(rate)
    if not out:
        raise ValueError(f"--rates {text!r}: give at least one rate (sessions/s)")
    return out


def register(app: typer.Typer) -> None:
    """Add ``profile`` and ``fidelity`` to ``app``."""
    app.command("profile")(profile_cmd)
    app.command("fidelity")(fidelity_cmd)


def main() -> None:  # pragma: no cover
    app = typer.Typer(help="Calibrate the simulator against a real engine.", no_args_is_help=True,
                      pretty_exceptions_show_locals=False)
    register(app)
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
