"""``turnstile tune``'s driver: check the flags, load the workload, run with a progress bar,
print the table and the deploy line, write ``results.json`` and ``report.html``.

A usage mistake (a missing file, an unknown spec, a cluster whose KV cannot hold a session)
is one ``error:`` line and exit code 2, before any simulation runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from turnstile.bench.tune_space import Candidate, custom_space, get_space
from turnstile.bench.usage import fail
from turnstile.sim.engine_group import EngineGroup

__all__ = ["list_space", "resolve_space", "tune_main"]


def resolve_space(space: str, candidates: str | None) -> list[Candidate]:
    """``--candidates`` when given, else the named ``--space``; every spec checked with the
    policies' own parser. ValueError names the bad one."""
    from turnstile.policies import parse_policy_list
    from turnstile.policies.spec import split_specs

    cands = (custom_space(split_specs(candidates)) if candidates is not None
             else get_space(space))
    parse_policy_list(",".join(c.spec for c in cands))
    return cands


def list_space(space: str, candidates: str | None, console: Any) -> None:
    """``tune --list``: the space's candidates, one a line (spec, then what it tries)."""
    from rich.markup import escape

    try:
        cands = resolve_space(space, candidates)
    except (ValueError, KeyError) as e:
        raise fail(str(e)) from None
    label = "--candidates" if candidates is not None else f"space '{space}'"
    console.print(f"[bold]{label}[/]: {len(cands)} candidates (the first is the baseline)")
    width = max(len(c.spec) for c in cands)
    for c in cands:
        console.print(f"  {escape(c.spec.ljust(width))}  [dim]{escape(c.note)}[/]",
                      soft_wrap=True)


def _cluster_label(groups: Sequence[EngineGroup]) -> str:
    g = groups[0]
    return f"{g.count}x{g.gpu}-{g.model}-TP{g.tp}"


def _prepare(trace: str, groups: list[EngineGroup], workflows: int, out: Path | None,
             ray: str | None, space: str, candidates: str | None, seed: int
             ) -> tuple[list[Any], dict[str, Any], list[Candidate], Path]:
    from turnstile.bench import runner
    from turnstile.bench.usage import check_out_dir

    out_dir = out or Path("tune-out")
    try:
        cands = resolve_space(space, candidates)
        g = groups[0]
        runner.model_check(g.gpu, g.model, g.tp)
        if ray is not None and ray not in ("auto", "local") and ":" not in ray:
            raise ValueError(f"--ray {ray}: expected auto, local or a Ray cluster's ADDRESS "
                             "(host:port)")
        if not Path(trace).exists():
            raise ValueError(f"--trace {trace}: no such file or directory")
        check_out_dir(out_dir)
        wfs, info = runner.load_base_workflows(runner.WorkloadSpec(trace=trace, seed=seed))
        if len(wfs) > workflows:  # a seeded sample, as bench takes one
            import random

            wfs = random.Random(seed).sample(list(wfs), workflows)
        runner.check_kv_fits(wfs, groups)
    except (ValueError, KeyError, OSError) as e:
        raise fail(str(e)) from None
    if len(wfs) < 2:
        raise fail(f"--trace {trace}: tune needs at least 2 sessions; it has {len(wfs)}")
    return wfs, info, cands, out_dir


def tune_main(*, trace: str, groups: list[EngineGroup], workflows: int, out: Path | None,
              ray: str | None, space: str, candidates: str | None, seed: int,
              console: Any, err_console: Any) -> dict[str, Any]:
    """``turnstile tune``: returns the results document it wrote."""
    from rich.markup import escape

    from turnstile.bench.progress import progress_bar
    from turnstile.bench.tune import TuneConfig, run_tune
    from turnstile.bench.tune_report import render_tune, write_tune

    wfs, info, cands, out_dir = _prepare(trace, groups, workflows, out, ray, space,
                                         candidates, seed)
    config = TuneConfig(groups=groups, cluster=_cluster_label(groups), candidates=cands,
                        seed=seed, hash_block_tokens=int(info.get("hash_block_tokens") or 0),
                        extra={"space": "--candidates" if candidates else space})
    console.print(f"[bold]simulated[/] tune on {len(wfs)} sessions of {escape(info['name'])}: "
                  f"{len(cands)} candidates × {len(config.loads)} loads × 2 halves on "
                  f"{config.cluster} (sessions superimposed on Poisson arrivals at multiples "
                  "of eager's measured saturation rate)")
    for w in info.get("warnings", []):
        console.print(f"[bold yellow]warning:[/] {escape(w)}")
    with progress_bar(err_console) as bar:
        task = bar.add_task("saturation search", total=None)

        def step(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what[:60])

        try:
            doc = run_tune(wfs, config, ray=ray, on_progress=step)
        except (RuntimeError, ValueError) as e:
            raise fail(str(e)) from None
    doc["trace"] = {k: info.get(k) for k in ("name", "path", "sha256")}
    render_tune(doc, console)
    paths = write_tune(doc, out_dir)
    console.print(f"{len(doc['cells'])} cells in {doc['wall_s']:.0f} s on {doc['backend']}; "
                  "wrote " + ", ".join(str(p) for p in paths.values()))
    return doc
