"""``turnstile traces info|convert|synth|fit``: load, inspect, convert and synthesize workloads
(:func:`register` adds the ``traces`` group to a Typer app)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from turnstile.bench.flags import POSITIVE, out_path
from turnstile.bench.progress import out_console

__all__ = ["MAX_SYNTH_WORKFLOWS", "load_or_fail", "register", "traces_app"]

traces_app = typer.Typer(
    help="Load, inspect, convert and synthesize workloads.", no_args_is_help=True
)
console = out_console()


def register(app: typer.Typer) -> None:
    """Add the ``traces`` group to ``app``."""
    app.add_typer(traces_app, name="traces")


def _fail(message: str) -> typer.Exit:
    from turnstile.bench.usage import fail

    return fail(message)


def load_or_fail(path: Path, subset: str | None, progress: bool,
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

    loaded = load_or_fail(path, subset, progress=not json_out, group_by=group_by)
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
    out: Annotated[Path, typer.Option("-o", "--out", parser=out_path,
                                      help="Output workload .jsonl")],
    subset: Annotated[str | None, typer.Option(help="agentcgroup subset (haiku, ...)")] = None,
    group_by: Annotated[str | None, typer.Option(help=_GROUP_BY_HELP)] = None,
    to: Annotated[str, typer.Option(help="Output format: turnstile (workload JSONL) or mooncake "
                                    "(Mooncake-JSONL sessions, as AIPerf and Dynamo replay "
                                    "agents)")] = "turnstile",
) -> None:
    """Convert a real trace (or agent logs, or a serve --record recording) to turnstile's
    JSONL workload format or to Mooncake-JSONL sessions."""
    from turnstile.bench.usage import check_out_file
    from turnstile.workload.jsonl import write_workload

    if to not in ("turnstile", "mooncake"):
        raise _fail(f"--to {to!r}: expected turnstile or mooncake")
    try:
        check_out_file(out)
    except ValueError as e:
        raise _fail(str(e)) from None
    loaded = load_or_fail(path, subset, progress=True, group_by=group_by)
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
    out: Annotated[Path, typer.Option("-o", "--out", parser=out_path,
                                      help="Output workload .jsonl")],
    workflows: Annotated[int, typer.Option("-n", "--workflows", min=1, max=MAX_SYNTH_WORKFLOWS)]
    = 100,
    rate: Annotated[float, typer.Option(parser=POSITIVE, help="Poisson arrival rate, "
                                        "workflows/s")] = 0.5,
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

    try:
        check_out_file(out)
    except ValueError as e:
        raise _fail(str(e)) from None
    spec = synth.DEFAULT_SPEC
    if fit is not None:
        try:
            spec = fit_spec(load_or_fail(fit, None, True).workflows)
        except ValueError as e:
            raise _fail(f"--fit {fit}: {e}") from None
    arrivals = synth.poisson_arrivals(rate, workflows, seed)
    wfs = synth.generate(spec, workflows, seed, arrivals=arrivals)
    write_workload(out, wfs, meta={"generator": "turnstile.synth", "seed": seed, "rate": rate,
                                   "fit": str(fit) if fit else "default"})
    console.print(f"wrote {len(wfs):,} synthetic workflows to {out}")


@traces_app.command("fit")
def traces_fit(
    path: Annotated[Path, typer.Argument(help="A trace directory or file")],
    out: Annotated[Path, typer.Option("-o", "--out", parser=out_path, help="Output spec .json")],
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
    loaded = load_or_fail(path, subset, progress=True)
    try:
        spec = fit_spec(loaded.workflows, name=name or loaded.name)
    except ValueError as e:
        raise _fail(f"{path}: {e}") from None
    spec.info["source"] = f"{loaded.name}: {loaded.counts.get('sessions', len(loaded))} sessions"
    cmd = f"turnstile traces fit {path}" + (f" --subset {subset}" if subset else "")
    cmd += (f" --name {name}" if name else "") + f" -o {out} (run from the repository root)"
    save_spec(spec, out, note=f"generated by: {cmd}")
    console.print(f"wrote {out}: {spec.info}")
