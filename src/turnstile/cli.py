"""The ``turnstile`` command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from turnstile.core.session_idle import SESSION_IDLE_S

app = typer.Typer(
    help="turnstile: a workflow-aware scheduler for agentic LLM workloads.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
traces_app = typer.Typer(
    help="Load, inspect, convert and synthesize workloads.", no_args_is_help=True
)
app.add_typer(traces_app, name="traces")


def _version_text() -> str:
    from turnstile import __version__
    from turnstile.build_info import describe

    # a checkout's src/ (when run from one) tells whether a compiled install is stale
    return f"{__version__} ({describe(Path.cwd() / 'src')})"


def _print_version(value: bool) -> None:
    if value:
        print(_version_text())
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True,
                           help="Print the version and exit")
    ] = False,
) -> None:
    pass

# wide enough for the bench table when output is not a terminal (CI logs, pipes)
console = Console(width=None if Console().is_terminal else 160)
err_console = Console(stderr=True, soft_wrap=True)


def _fail(message: str) -> typer.Exit:
    from turnstile.bench.usage import fail

    return fail(message)


def _load(path: Path, subset: str | None, progress: bool,
          group_by: str | None = None):  # -> LoadedTrace
    from turnstile.traces import load_trace

    if not path.exists():
        raise _fail(f"{path} does not exist")
    kw: dict[str, object] = {"progress": progress}
    if subset:
        kw["subset"] = subset
    if group_by:
        kw["group_by"] = group_by
    try:
        loaded = load_trace(path, **kw)
    except TypeError:  # the format's loader takes no such option
        flags = " and ".join(f for f, v in (("--subset", subset), ("--group-by", group_by)) if v)
        raise _fail(f"{path}: {flags or 'an option'} does not apply to this trace format "
                    "(--subset: AgentCgroup; --group-by: request logs)") from None
    except (ValueError, OSError) as e:
        raise _fail(str(e)) from None
    from turnstile.workload.model import check_turn_sizes

    try:  # every loader, not only the JSONL one, gets the same bound
        check_turn_sizes(loaded.workflows, path)
    except ValueError as e:
        raise _fail(str(e)) from None
    return loaded


#: ``traces synth -n``, ``bench --workflows``: 10k synthetic workflows take ~250 MB and ~30 s, so
#: more than this would not fit in a laptop's memory
MAX_SYNTH_WORKFLOWS = 100_000

# the workload and cluster flags bench and tune share (one definition each)
EnginesOpt = Annotated[int, typer.Option(min=1, max=4096, help="Number of simulated engines")]
GpuOpt = Annotated[str, typer.Option(help="GPU name (A100-80G, H100-SXM, H200, L40S)")]
ModelOpt = Annotated[str, typer.Option(help="Model name, e.g. llama-3.1-8b")]
TpOpt = Annotated[int, typer.Option(min=1, help="Tensor parallelism per engine")]
WorkflowsOpt = Annotated[int, typer.Option(min=1, max=MAX_SYNTH_WORKFLOWS,
                                           help="Workflows to simulate")]
KvTokensOpt = Annotated[int | None, typer.Option(
    min=1, help="KV capacity per engine in tokens (default: from GPU)")]
ProfileOpt = Annotated[Path | None, typer.Option(
    help="Fitted performance profile (default: roofline); a llama.cpp profile also "
    "simulates the engine's slots")]
OutOpt = Annotated[Path | None, typer.Option("-o", "--out",
                                             help="Write results.json, report.html and plots "
                                             "here (tune: default tune-out)")]
RayOpt = Annotated[str | None, typer.Option(
    help="--suite, tune: run cells on Ray (auto, local or an ADDRESS)")]

_GROUP_BY_HELP = ("request logs: session field (dotted path), 'prefix' (shared message "
                  "prefixes) or 'auto'")


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}"


@traces_app.command("info")
def traces_info(
    path: Annotated[Path, typer.Argument(help="A trace directory or file, or a workload .jsonl")],
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table")] = False,
    subset: Annotated[str | None, typer.Option(help="agentcgroup subset (haiku, ...)")] = None,
    group_by: Annotated[str | None, typer.Option(help=_GROUP_BY_HELP)] = None,
) -> None:
    """Summarize a trace: workflows, turns, token and tool-latency percentiles."""
    from turnstile.workload.stats import summarize

    loaded = _load(path, subset, progress=not json_out, group_by=group_by)
    summary = summarize(loaded.workflows)
    out = {"trace": loaded.name, "source": str(path), **summary,
           "counts": loaded.counts, "notes": loaded.notes, "warnings": loaded.warnings}
    if json_out:
        print(json.dumps(out, indent=2, default=float))
        return
    console.print(f"[bold]{loaded.name}[/]  ({path})")
    console.print(
        f"workflows {summary['workflows']:,}   turns {summary['turns']:,}   "
        f"tool calls {summary['tool_calls']:,}"
    )
    table = Table("quantity", "mean", "p50", "p90", "p95", "p99", "max")
    for key in ("turns_per_workflow", "prompt_tokens", "input_tokens", "context_tokens",
                "output_tokens", "tool_latency_s"):
        d = summary.get(key) or {}
        table.add_row(key, *(_fmt(d.get(k)) for k in ("mean", "p50", "p90", "p95", "p99", "max")))
    console.print(table)
    for note in loaded.notes:
        console.print(f"[dim]note:[/] {note}")
    for warning in loaded.warnings:
        console.print(f"[bold yellow]warning:[/] {warning}")


@traces_app.command("convert")
def traces_convert(
    path: Annotated[Path, typer.Argument(help="A trace directory or file")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Output workload .jsonl")],
    subset: Annotated[str | None, typer.Option(help="agentcgroup subset (haiku, ...)")] = None,
    group_by: Annotated[str | None, typer.Option(help=_GROUP_BY_HELP)] = None,
    to: Annotated[str, typer.Option(help="Output format: turnstile (workload JSONL) or mooncake "
                                    "(Mooncake-JSONL sessions, as AIPerf and Dynamo replay "
                                    "agents)")] = "turnstile",
) -> None:
    """Convert a real trace (or agent logs, or a ``serve --record`` recording) to turnstile's
    JSONL workload format or to Mooncake-JSONL sessions."""
    from turnstile.bench.usage import check_out_file
    from turnstile.workload.jsonl import write_workload

    if to not in ("turnstile", "mooncake"):
        raise _fail(f"--to {to!r}: expected turnstile or mooncake")
    try:
        check_out_file(out)
    except ValueError as e:
        raise _fail(str(e)) from None
    loaded = _load(path, subset, progress=True, group_by=group_by)
    if to == "mooncake":
        from turnstile.traces.mooncake_sessions import write_mooncake_sessions

        tmp = out.with_name(f".{out.name}.tmp")
        try:
            n = write_mooncake_sessions(tmp, loaded.workflows)
            tmp.replace(out)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise _fail(f"could not write {out}: {e}") from None
        console.print(f"wrote {n:,} calls of {len(loaded.workflows):,} workflows to {out} "
                      "(Mooncake-JSONL sessions)")
        return
    meta: dict[str, object] = {"source": str(path), "trace": loaded.name, "notes": loaded.notes}
    if loaded.warnings:  # carried into the file: bench on it says them too
        meta["warnings"] = loaded.warnings
    if loaded.hash_block_tokens:
        meta["hash_block_tokens"] = loaded.hash_block_tokens
    # write beside the target and rename: a failure never leaves a partial workload behind
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        n = write_workload(tmp, loaded.workflows, meta=meta)
        tmp.replace(out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _fail(f"could not write {out}: {e}") from None
    console.print(f"wrote {n:,} workflows to {out}")


@traces_app.command("synth")
def traces_synth(
    out: Annotated[Path, typer.Option("-o", "--out", help="Output workload .jsonl")],
    workflows: Annotated[int, typer.Option("-n", "--workflows", min=1, max=MAX_SYNTH_WORKFLOWS)]
    = 100,
    rate: Annotated[float, typer.Option(help="Poisson arrival rate, workflows/s")] = 0.5,
    seed: Annotated[int, typer.Option(min=0)] = 0,
    fit: Annotated[
        Path | None, typer.Option(help="Fit the generator to this trace instead of the default")
    ] = None,
) -> None:
    """Generate a synthetic agentic workload (seeded, reproducible)."""
    from turnstile.bench.usage import check_out_file
    from turnstile.workload import synth
    from turnstile.workload.jsonl import write_workload
    from turnstile.workload.synth_fit import fit_spec

    if rate <= 0:
        raise _fail("--rate must be > 0")
    try:
        check_out_file(out)
    except ValueError as e:
        raise _fail(str(e)) from None
    spec = synth.DEFAULT_SPEC if fit is None else fit_spec(_load(fit, None, True).workflows)
    arrivals = synth.poisson_arrivals(rate, workflows, seed)
    wfs = synth.generate(spec, workflows, seed, arrivals=arrivals)
    write_workload(out, wfs, meta={"generator": "turnstile.synth", "seed": seed, "rate": rate,
                                   "fit": str(fit) if fit else "default"})
    console.print(f"wrote {len(wfs):,} synthetic workflows to {out}")


@traces_app.command("fit")
def traces_fit(
    path: Annotated[Path, typer.Argument(help="A trace directory or file")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Output spec .json")],
    subset: Annotated[str | None, typer.Option(help="agentcgroup subset (haiku, ...)")] = None,
    name: Annotated[str | None, typer.Option(help="Spec name (default: the trace's)")] = None,
) -> None:
    """Fit the synthetic generator's spec to a trace and write it as JSON (refits the default)."""
    from turnstile.bench.usage import check_out_file
    from turnstile.workload.synth_fit import fit_spec
    from turnstile.workload.synth_spec import save_spec

    try:
        check_out_file(out)
    except ValueError as e:
        raise _fail(str(e)) from None
    loaded = _load(path, subset, progress=True)
    try:
        spec = fit_spec(loaded.workflows, name=name or loaded.name)
    except ValueError as e:
        raise _fail(f"{path}: {e}") from None
    spec.info["source"] = f"{loaded.name}: {loaded.counts.get('sessions', len(loaded))} sessions"
    cmd = f"turnstile traces fit {path}" + (f" --subset {subset}" if subset else "")
    cmd += (f" --name {name}" if name else "") + f" -o {out} (run from the repository root)"
    save_spec(spec, out, note=f"generated by: {cmd}")
    console.print(f"wrote {out}: {spec.info}")


def _engine_groups(gpu: str, model: str, tp: int, engines: int, kv_tokens: int | None,
                   profile: Path | None):  # -> list[EngineGroup]
    """The simulated cluster of ``bench``'s and ``tune``'s flags; a usage error exits 2."""
    from turnstile.sim.cluster import EngineGroup

    perf = None
    slots: dict[str, int] = {}
    if profile is not None:
        from turnstile.sim.engine_profile import profile_for
        from turnstile.sim.fitted_perf import FittedPerf

        if not profile.is_file():
            raise _fail(f"--profile {profile}: no such file")
        try:
            perf = FittedPerf.from_profile(profile)
        except (ValueError, KeyError, TypeError, OSError) as e:
            why = str(e).replace(f"{profile}: ", "")
            raise _fail(f"--profile {profile}: not a turnstile profile ({why})") from None
        meta = perf.meta
        n, per_slot = int(meta.get("n_parallel") or 0), int(meta.get("ctx_per_seq") or 0)
        if profile_for(meta.get("engine_kind") or perf.engine).slot_limited and n and per_slot:
            # the engine keeps one sequence per slot: simulate its slots, not paged KV
            slots = {"kv_slots": n, "slot_tokens": per_slot, "max_num_seqs": n}
    return [EngineGroup(gpu=gpu, model=model, tp=tp, count=engines, kv_tokens=kv_tokens,
                        perf=perf, **slots)]


@app.command("bench")
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
        float | None, typer.Option(help="Arrival rate in workflows/s (overrides --load)")
    ] = None,
    workflows: WorkflowsOpt = 200,
    arrivals: Annotated[str, typer.Option(help="poisson or trace")] = "poisson",
    kv_tokens: KvTokensOpt = None,
    profile: ProfileOpt = None,
    subset: Annotated[str | None, typer.Option(help="agentcgroup subset")] = None,
    seed: Annotated[int, typer.Option(min=0)] = 0,
    out: OutOpt = None,
    suite: Annotated[
        str | None, typer.Option(help="Run the robustness suite instead: quick (≤ 3 min) or "
                                 "full (every family, cluster and load; docs/robustness.md)")
    ] = None,
    ray: RayOpt = None,
    save_detailed: Annotated[
        bool, typer.Option("--save-detailed", help="Also write every workflow's and turn's "
                           "samples into results.json (to re-plot or recompute later)")
    ] = False,
    unannounced_ends: Annotated[
        bool | None, typer.Option("--unannounced-ends/--announced-ends",
                                  help="Tell the policies nothing when a workflow ends: "
                                  "sessions close by the gateway's idle rule "
                                  "(--session-idle-s), as in production (default: announced "
                                  "for a bench run; unannounced in the suite's gateway-facing "
                                  "cells)")
    ] = None,
    session_idle_s: Annotated[
        float, typer.Option(help="With --unannounced-ends: seconds idle after which a session "
                            "closes (the gateway's session_idle_s)")
    ] = SESSION_IDLE_S,
) -> None:
    """Simulate every policy on the same workload and compare them side by side (simulated)."""
    if session_idle_s <= 0:
        raise _fail(f"--session-idle-s must be > 0; got {session_idle_s:g}")
    if suite is not None:
        from turnstile.bench.suite import run_with_progress

        if suite not in ("quick", "full"):
            raise _fail(f"--suite must be quick or full; got {suite!r}")
        # --policies as given; its default means the suite's own set (plas, cvar, the default)
        # (compared by name: typer may ship its own click)
        source = ctx.get_parameter_source("policies")
        given = getattr(source, "name", "DEFAULT") != "DEFAULT"
        from turnstile.policies.spec import split_specs

        names = split_specs(policies) if given else None
        try:  # every flag before the suite's minutes of work
            from turnstile.bench.usage import check_out_dir
            from turnstile.policies import parse_policy_list

            if names is not None:
                parse_policy_list(policies)
            if ray is not None and ray not in ("auto", "local") and ":" not in ray:
                raise ValueError(f"--ray {ray}: expected auto, local or a Ray cluster's "
                                 "ADDRESS (host:port)")
            check_out_dir(out or Path(f"robustness-{suite}"))
        except (ValueError, KeyError) as e:
            raise _fail(str(e)) from None
        try:
            run_with_progress(suite, out or Path(f"robustness-{suite}"), policies=names,
                              seed=seed, ray=ray, console=console,
                              unannounced_ends=unannounced_ends is not False,
                              session_idle_s=session_idle_s)
        except (RuntimeError, ValueError) as e:
            raise _fail(str(e)) from None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from turnstile.bench import runner
    from turnstile.bench.report import render_table, write_results
    from turnstile.bench.usage import check_out_dir
    from turnstile.policies import parse_policy_list

    try:
        specs = parse_policy_list(policies)
        load_frac = runner.parse_load(load)
        runner.model_check(gpu, model, tp)
        if rate is not None and rate <= 0:
            raise ValueError("--rate must be > 0")
        if subset and trace is None:
            raise ValueError(f"--subset {subset} needs --trace (an AgentCgroup trace)")
    except (ValueError, KeyError) as e:
        raise _fail(str(e)) from None
    groups = _engine_groups(gpu, model, tp, engines, kv_tokens, profile)
    wspec = runner.WorkloadSpec(trace=trace, workflows=workflows, rate=rate, load=load_frac,
                                arrivals=arrivals, seed=seed, subset=subset)
    try:
        wfs, trace_info = runner.build_workload(wspec, groups)
        runner.check_kv_fits(wfs, groups)
        if out is not None:
            check_out_dir(out)  # before the run (created last): a bad --out must not cost results
    except (ValueError, OSError) as e:
        raise _fail(str(e)) from None
    idle = session_idle_s if unannounced_ends else None
    rate_txt = f"{trace_info['rate']:.3g}/s" if trace_info.get("rate") else "trace times"
    console.print(
        f"[bold]simulated[/] {len(wfs)} workflows from {trace_info['name']} "
        f"({rate_txt}, {trace_info['arrivals']}) on {engines}x {gpu} {model} TP{tp}"
    )
    if trace_info.get("used"):
        console.print(f"[dim]{trace_info['used']}[/]")
    for warning in trace_info.get("warnings", []):
        console.print(f"[bold yellow]warning:[/] {warning}")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console, transient=True) as bar:
        task = bar.add_task("", total=len(wfs))

        def start(spec: str) -> None:
            bar.update(task, description=spec, completed=0)

        results = runner.run_bench(
            wfs, specs, groups, on_policy_start=start,
            on_progress=lambda n: bar.update(task, completed=n),
            hash_block_tokens=trace_info.get("hash_block_tokens", 0),
            detailed=save_detailed, session_idle_s=idle,
        )
    render_table(results, console)
    if out is not None:
        config = runner.bench_config(
            wspec, groups, specs, workload_sha256=runner.workload_digest(wfs),
            session_ends="announced" if idle is None else f"idle {idle:g} s",
        )
        path = write_results(out, results, config, trace_info)
        from turnstile.bench.html_report import write_html_report
        from turnstile.bench.plots import plot_flow_cdf
        from turnstile.bench.report import load_results

        html = write_html_report(out, load_results(path), policies=results,
                                 title=f"turnstile bench: {trace_info['name']}")
        wrote = [path, html]
        try:
            wrote.append(plot_flow_cdf(results, out / "flow_cdf.png",
                                       title=f"Workflow flow time (simulated), "
                                       f"{trace_info['name']}"))
        except ImportError as e:
            from rich.markup import escape

            err_console.print(f"[dim]{escape(str(e))}; flow_cdf.png skipped[/]")
        console.print("wrote " + ", ".join(str(p) for p in wrote))


@app.command("tune")
def tune(
    trace: Annotated[str | None, typer.Option(
        help="The workload to tune on: a serve --record recording, agent logs or a trace")]
    = None,
    engines: EnginesOpt = 2,
    gpu: GpuOpt = "H100",
    model: ModelOpt = "llama-3.1-8b",
    tp: TpOpt = 1,
    workflows: WorkflowsOpt = 300,
    kv_tokens: KvTokensOpt = None,
    profile: ProfileOpt = None,
    out: OutOpt = None,
    ray: RayOpt = None,
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
    tune_main(trace=trace, groups=_engine_groups(gpu, model, tp, engines, kv_tokens, profile),
              workflows=workflows, out=out, ray=ray, space=space, candidates=candidates,
              seed=seed, console=console, err_console=err_console)


@app.command("policies")
def list_policies(
    spec: Annotated[str | None, typer.Argument(
        help="A policy spec (e.g. cvar:budget=fixed+ttl): show it resolved, every option")] = None,
) -> None:
    """List the registered policies by kind, or show one spec resolved: every policy with
    every option's value (defaults included) and its declared type and range."""
    from turnstile.policies import DEFAULTS, all_policy_names, resolved_spec
    from turnstile.policies.spec import options_of

    if spec is None:
        for kind, names in all_policy_names().items():
            console.print(f"[bold]{kind}[/] (default {DEFAULTS[kind]}): {', '.join(names)}")
        return
    try:
        doc = resolved_spec(spec)
    except ValueError as e:
        raise _fail(str(e)) from None
    console.print(f"[bold]{spec}[/] = {doc['canonical']}", highlight=False)
    for kind, pol in doc["policies"].items():
        console.print(f"[bold]{kind}[/]: {pol['name']}", highlight=False)
        for opt in options_of(kind, pol["name"]):
            value = pol["options"][opt.name]
            console.print(f"  {opt.name} = {value!r}    [dim]{opt.describe()}[/]", highlight=False)


@app.command("version")
def version() -> None:
    """Print the version, and whether the simulator runs compiled (``make compiled``)."""
    console.print(_version_text())


def main(argv: list[str] | None = None) -> None:
    """The ``turnstile`` entry point: a usage mistake is one ``error:`` line and exit code 2.

    Typer's own usage errors (a bad value for a typed flag, a missing option) come out as one
    line too, instead of a boxed usage panel; ``--help`` and the commands' output are unchanged.
    """
    import sys

    from turnstile.bench.usage import one_line

    try:
        rc = app(args=argv, prog_name="turnstile", standalone_mode=False)
    except typer.TyperException as e:  # typer's (vendored click's) ClickException family
        if type(e).__name__ == "NoArgsIsHelpError":
            e.show()  # type: ignore[attr-defined]
            sys.exit(0)
        ctx = getattr(e, "ctx", None)
        where = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        print(f"error: {one_line(e.format_message())}{where}", file=sys.stderr)
        sys.exit(getattr(e, "exit_code", 2))
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(1)
    sys.exit(rc if isinstance(rc, int) else 0)


def _register_subcommands() -> None:
    """The drivers' commands live in their rooms; each registers itself here."""
    from turnstile.calibrate.cli import register as register_calibrate
    from turnstile.epp.cli import register as register_epp
    from turnstile.gateway.cli import register as register_gateway
    from turnstile.rollout.cli import register as register_rollout

    register_gateway(app)
    register_rollout(app)
    register_calibrate(app)
    register_epp(app)


_register_subcommands()
