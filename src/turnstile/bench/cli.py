"""``turnstile bench``: every policy on the same simulated workload, side by side, or the
robustness suite (:func:`register` adds it to a Typer app)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from turnstile.bench.flags import POSITIVE, out_path
from turnstile.bench.progress import QUIET_HELP, err_console, out_console, progress_bar
from turnstile.bench.traces_cli import MAX_SYNTH_WORKFLOWS
from turnstile.core.session_idle import SESSION_IDLE_S

if TYPE_CHECKING:
    from turnstile.sim.cluster import EngineGroup

__all__ = ["bench", "engine_groups", "register", "tune"]

console = out_console()
_err = err_console()


def register(app: typer.Typer) -> None:
    """Add ``bench`` and ``tune`` to ``app``."""
    app.command("bench")(bench)
    app.command("tune")(tune)


# the simulated cluster's flags, shared by ``bench`` and ``tune`` (:func:`engine_groups`)
EnginesOpt = Annotated[int, typer.Option(min=1, max=4096, help="Number of simulated engines")]
GpuOpt = Annotated[str, typer.Option(help="GPU name (A100-80G, H100-SXM, H200, L40S)")]
ModelOpt = Annotated[str, typer.Option(help="Model name, e.g. llama-3.1-8b")]
TpOpt = Annotated[int, typer.Option(min=1, help="Tensor parallelism per engine")]
KvTokensOpt = Annotated[int | None, typer.Option(
    min=1, help="KV capacity per engine in tokens (default: from GPU)")]
ProfileOpt = Annotated[Path | None, typer.Option(
    help="Fitted performance profile (default: roofline); a llama.cpp profile also simulates "
    "the engine's slots")]


def _fail(message: str) -> typer.Exit:
    from turnstile.bench.usage import fail

    return fail(message)


def bench(
    ctx: typer.Context,
    trace: Annotated[
        str | None, typer.Option(help="Trace dir/file; omit for the built-in synthetic generator")
    ] = None,
    policies: Annotated[
        str, typer.Option(help="Comma-separated policy specs, e.g. eager,cvar+kv-affinity+ttl "
                          "(default: eager beside the default policy, auto)")
    ] = "eager,auto",
    engines: EnginesOpt = 2,
    gpu: GpuOpt = "H100",
    model: ModelOpt = "llama-3.1-8b",
    tp: TpOpt = 1,
    load: Annotated[
        str, typer.Option(help="Offered load as a fraction of the estimated capacity: a number "
                          "or light (0.3), medium (0.7), high (1.2), overload (2.0); an "
                          "estimate, not a measured saturation point (see --suite)")
    ] = "medium",
    rate: Annotated[
        float | None, typer.Option(parser=POSITIVE, help="Arrival rate in workflows/s "
                                   "(overrides --load)")
    ] = None,
    workflows: Annotated[int, typer.Option(min=1, max=MAX_SYNTH_WORKFLOWS,
                                           help="Workflows to simulate")] = 200,
    arrivals: Annotated[str, typer.Option(help="poisson or trace")] = "poisson",
    kv_tokens: KvTokensOpt = None,
    profile: ProfileOpt = None,
    subset: Annotated[str | None, typer.Option(help="agentcgroup subset")] = None,
    seed: Annotated[int, typer.Option(min=0)] = 0,
    out: Annotated[Path | None, typer.Option("-o", "--out", parser=out_path,
                                             help="Write results.json and plots here")] = None,
    suite: Annotated[
        str | None, typer.Option(help="Run the robustness suite instead: quick (≤ 3 min) or "
                                 "full (every family, cluster and load; docs/robustness.md)")
    ] = None,
    ray: Annotated[
        str | None, typer.Option(help="--suite: run cells on Ray (auto, local or an ADDRESS)")
    ] = None,
    save_detailed: Annotated[
        bool, typer.Option("--save-detailed", help="Also write every workflow's and turn's "
                           "samples into results.json (to re-plot or recompute later)")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help=QUIET_HELP)] = False,
    unannounced_ends: Annotated[
        bool | None, typer.Option("--unannounced-ends/--announced-ends",
                                  help="Tell the policies nothing when a workflow ends: "
                                  "sessions close by the gateway's idle rule "
                                  "(--session-idle-s), as in production (default: announced "
                                  "for a bench run; unannounced in the suite's gateway-facing "
                                  "cells)")
    ] = None,
    session_idle_s: Annotated[
        float, typer.Option(parser=POSITIVE, help="With --unannounced-ends: seconds idle after "
                            "which a session closes (the gateway's session_idle_s)")
    ] = SESSION_IDLE_S,
) -> None:
    """Simulate every policy on the same workload and compare them side by side (simulated)."""
    if suite is not None:
        source = ctx.get_parameter_source("policies")  # compared by name: typer ships its click
        given = getattr(source, "name", "DEFAULT") != "DEFAULT"
        _run_suite(suite, policies if given else None, out, seed, ray, quiet,
                   unannounced_ends is not False, session_idle_s)
        return
    from turnstile.bench import runner
    from turnstile.bench.usage import check_out_dir
    from turnstile.policies import parse_policy_list

    try:
        if ray is not None:
            raise ValueError(f"--ray {ray} runs the robustness suite's cells: it needs --suite")
        specs = parse_policy_list(policies)
        load_frac = runner.parse_load(load)
        if subset and trace is None:
            raise ValueError(f"--subset {subset} needs --trace (an AgentCgroup trace)")
    except (ValueError, KeyError) as e:
        raise _fail(str(e)) from None
    groups = engine_groups(gpu, model, tp, engines, kv_tokens, profile)
    wspec = runner.WorkloadSpec(trace=trace, workflows=workflows, rate=rate, load=load_frac,
                                arrivals=arrivals, seed=seed, subset=subset)
    try:
        wfs, trace_info = runner.build_workload(wspec, groups)
        runner.check_kv_fits(wfs, groups)
        if out is not None:
            check_out_dir(out)  # before the run (created last): a bad --out must not cost results
    except (ValueError, OSError) as e:
        raise _fail(str(e)) from None
    from turnstile.bench.report import workload_line

    idle = session_idle_s if unannounced_ends else None

    console.print(f"[bold]simulated[/] {workload_line(len(wfs), trace_info)} on {engines}x "
                  f"{gpu} {model} TP{tp}")
    if trace_info.get("used"):
        console.print(f"[dim]{trace_info['used']}[/]")
    for warning in trace_info.get("warnings", []):
        console.print(f"[bold yellow]warning:[/] {warning}")
    with progress_bar(_err, quiet=quiet) as bar:
        task = bar.add_task("", total=len(wfs))

        def start(spec: str) -> None:
            bar.update(task, description=spec, completed=0)

        results = runner.run_bench(
            wfs, specs, groups, on_policy_start=start,
            on_progress=lambda n: bar.update(task, completed=n),
            hash_block_tokens=trace_info.get("hash_block_tokens", 0),
            detailed=save_detailed, session_idle_s=idle,
        )
    from turnstile.bench.report import render_table

    render_table(results, console)
    if out is not None:
        config = runner.bench_config(
            wspec, groups, specs, workload_sha256=runner.workload_digest(wfs),
            session_ends="announced" if idle is None else f"idle {idle:g} s",
        )
        _write_outputs(out, results, config, trace_info)


def _run_suite(suite: str, policies: str | None, out: Path | None, seed: int, ray: str | None,
               quiet: bool, unannounced_ends: bool = True,
               session_idle_s: float = SESSION_IDLE_S) -> None:
    """``bench --suite``: every flag is checked before the suite's minutes of work."""
    from turnstile.bench.suite import run_with_progress
    from turnstile.bench.usage import check_out_dir
    from turnstile.policies import parse_policy_list
    from turnstile.policies.spec import split_specs

    names = split_specs(policies) if policies is not None else None
    where = out or Path(f"robustness-{suite}")
    try:
        if suite not in ("quick", "full"):
            raise ValueError(f"--suite must be quick or full; got {suite!r}")
        if names is not None:
            parse_policy_list(policies)
        if ray is not None and ray not in ("auto", "local") and ":" not in ray:
            raise ValueError(f"--ray {ray}: expected auto, local or a Ray cluster's "
                             "ADDRESS (host:port)")
        check_out_dir(where)
    except (ValueError, KeyError) as e:
        raise _fail(str(e)) from None
    try:
        run_with_progress(suite, where, policies=names, seed=seed, ray=ray, console=console,
                          quiet=quiet, unannounced_ends=unannounced_ends,
                          session_idle_s=session_idle_s)
    except (RuntimeError, ValueError) as e:
        raise _fail(str(e)) from None


def engine_groups(gpu: str, model: str, tp: int, engines: int, kv_tokens: int | None,
                  profile: Path | None) -> list[EngineGroup]:
    """The simulated cluster of ``bench``'s and ``tune``'s flags; a usage error exits 2."""
    from turnstile.bench import runner
    from turnstile.sim.cluster import EngineGroup

    try:
        runner.model_check(gpu, model, tp)
        perf, slots = _load_profile(profile)
    except (ValueError, KeyError) as e:
        raise _fail(str(e)) from None
    return [EngineGroup(gpu=gpu, model=model, tp=tp, count=engines, kv_tokens=kv_tokens,
                        perf=perf, **slots)]  # type: ignore[arg-type]


def tune(
    trace: Annotated[str | None, typer.Option(
        help="The workload to tune on: a serve --record recording, agent logs or a trace")]
    = None,
    engines: EnginesOpt = 2,
    gpu: GpuOpt = "H100",
    model: ModelOpt = "llama-3.1-8b",
    tp: TpOpt = 1,
    workflows: Annotated[int, typer.Option(min=1, max=MAX_SYNTH_WORKFLOWS,
                                           help="Workflows (sessions) to use")] = 300,
    kv_tokens: KvTokensOpt = None,
    profile: ProfileOpt = None,
    out: Annotated[Path | None, typer.Option("-o", "--out", parser=out_path,
                                             help="Write results.json and report.html here "
                                             "(default: tune-out)")] = None,
    ray: Annotated[
        str | None, typer.Option(help="Run cells on Ray (auto, local or an ADDRESS)")
    ] = None,
    space: Annotated[str, typer.Option(help="Candidate space: default or wide (see --list)")]
    = "default",
    candidates: Annotated[str | None, typer.Option(
        help="Comma-separated specs to search instead of --space (eager is always added)")]
    = None,
    seed: Annotated[int, typer.Option(min=0)] = 0,
    list_: Annotated[bool, typer.Option("--list", help="List the candidate space and exit")]
    = False,
) -> None:
    """Choose the policy for a workload by simulation: every candidate on the workload's
    saturation ladder, no harm against eager in every cell, chosen on one half of the
    sessions and reported on the other (simulated)."""
    from turnstile.bench.tune_cli import list_space, tune_main

    if list_:
        list_space(space, candidates, console)
        return
    if trace is None:
        raise _fail("tune needs --trace (a serve --record recording, agent logs or a trace)")
    tune_main(trace=trace, groups=engine_groups(gpu, model, tp, engines, kv_tokens, profile),
              workflows=workflows, out=out, ray=ray, space=space, candidates=candidates,
              seed=seed, console=console, err_console=_err)


def _load_profile(profile: Path | None) -> tuple[object, dict[str, int]]:
    """``--profile``: the fitted performance model, and the engine's slots when it keeps one
    sequence per slot (llama.cpp). Raises ``ValueError`` naming the flag."""
    if profile is None:
        return None, {}
    from turnstile.sim.engine_profile import profile_for
    from turnstile.sim.fitted_perf import FittedPerf

    if profile.is_dir():
        raise ValueError(f"--profile {profile}: is a folder; give the profile .json file "
                         "(turnstile profile -o FILE wrote it)")
    if not profile.is_file():
        raise ValueError(f"--profile {profile}: no such file")
    try:
        perf = FittedPerf.from_profile(profile)
    except (ValueError, KeyError, TypeError, OSError) as e:
        why = str(e).replace(f"{profile}: ", "")
        raise ValueError(f"--profile {profile}: not a turnstile profile ({why})") from None
    meta = perf.meta
    n, per_slot = int(meta.get("n_parallel") or 0), int(meta.get("ctx_per_seq") or 0)
    if profile_for(meta.get("engine_kind") or perf.engine).slot_limited and n and per_slot:
        # the engine keeps one sequence per slot: simulate its slots, not paged KV
        return perf, {"kv_slots": n, "slot_tokens": per_slot, "max_num_seqs": n}
    return perf, {}


def _write_outputs(out: Path, results: dict, config: dict, trace_info: dict) -> None:
    """results.json, report.html and (with the plots extra) flow_cdf.png in ``out``."""
    from turnstile.bench.html_report import write_html_report
    from turnstile.bench.plots import plot_flow_cdf
    from turnstile.bench.report import load_results, write_results

    path = write_results(out, results, config, trace_info)
    html = write_html_report(out, load_results(path), policies=results,
                             title=f"turnstile bench: {trace_info['name']}")
    wrote = [path, html]
    try:
        wrote.append(plot_flow_cdf(results, out / "flow_cdf.png",
                                   title=f"Workflow flow time (simulated), "
                                   f"{trace_info['name']}"))
    except ImportError as e:
        from rich.markup import escape

        _err.print(f"[dim]{escape(str(e))}; flow_cdf.png skipped[/]")
    console.print("wrote " + ", ".join(str(p) for p in wrote))
