"""``turnstile rollout sim|live``: the rollout manager's command line.

The lead wires it in with ``turnstile.rollout.cli.register(app)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from turnstile.bench.flags import FRACTION, NON_NEGATIVE, out_path
from turnstile.bench.progress import QUIET_HELP, out_console, progress_bar

__all__ = ["register", "rollout_app"]

rollout_app = typer.Typer(
    help="Agentic RL rollouts: C-MLFQ bucket routing, rollout/training planner, elastic pool.",
    no_args_is_help=True,
)
console = out_console()
err_console = Console(stderr=True)
#: ``rollout live`` runs every trajectory on two local engines: a batch beyond this is a typo
MAX_LIVE_TRAJECTORIES = 4096


def register(app: typer.Typer) -> None:
    """Add the ``rollout`` sub-app (``sim`` and ``live``) to ``app``."""
    app.add_typer(rollout_app, name="rollout")


def _fail(message: str) -> typer.Exit:
    from turnstile.bench.usage import fail

    return fail(message)


def _policies(text: str, old: str | None = None) -> list[str]:
    """``--policies a,b`` (``--policy``, the old spelling, still works, with a warning)."""
    if old is not None:
        err_console.print("[yellow]warning:[/] --policy is deprecated: use --policies")
        text = old
    out = [p.strip() for p in text.split(",") if p.strip()]
    if not out:
        raise _fail("--policies needs at least one name")
    return out


_OLD_POLICY = typer.Option("--policy", hidden=True, help="Deprecated spelling of --policies")


def render_sim(results: dict[str, Any], con: Console) -> None:
    """Per-step makespan and plan per policy, then the summary (all simulated)."""
    pols = list(results["policies"])
    steps = {p: results["policies"][p]["steps"] for p in pols}
    n = len(steps[pols[0]])

    def plan(s: dict[str, Any]) -> str:
        mark = " *" if s.get("replanned") else ""
        return escape(f"{s['rollout_gpus']}R [{s['mix']}] / {s['train_gpus']}T{mark}")

    # one plan column when every policy ran the same plans, else one per policy
    shared = all(plan(steps[p][k]) == plan(steps[pols[0]][k]) for p in pols for k in range(n))
    table = Table(title="Rollout-step makespan, seconds (simulated)")
    table.add_column("step", justify="right")
    for p in pols:
        table.add_column(p, justify="right")
        if not shared:
            table.add_column(f"{p} plan", style="dim")
    if shared:
        table.add_column("plan", style="dim")
    for k in range(n):
        row = [str(k)]
        for p in pols:
            row.append(f"{steps[p][k]['rollout_makespan_s']:,.0f}")
            if not shared:
                row.append(plan(steps[p][k]))
        if shared:
            row.append(plan(steps[pols[0]][k]))
        table.add_row(*row)
    con.print(table)
    summary = Table(title="Summary (simulated)")
    for col in ("policy", "mean makespan s", "speedup", "RL total s", "trajectories/h", "wall s"):
        summary.add_column(col, justify="right" if col != "policy" else "left")
    base = pols[0]
    for p in pols:
        d = results["policies"][p]
        speed = results["policies"][base]["mean_makespan_s"] / d["mean_makespan_s"]
        summary.add_row(p, f"{d['mean_makespan_s']:,.0f}", f"{speed:.2f}x",
                        f"{d['total_s']:,.0f}", f"{d['throughput_trajectories_per_h']:,.0f}",
                        f"{d['wall_s']:.1f}")
    con.print(summary)
    con.print("[dim]plan: rollout GPUs (R) \\[bucket mix] / training GPUs (T); * = plan changed "
              "after this step (takes effect at the next boundary); speedup vs "
              f"{escape(base)}. {results['config']['timing_assumption']}[/]")


@rollout_app.command("sim")
def sim_cmd(
    steps: Annotated[int, typer.Option("--steps", min=1, max=10_000,
                                       help="RL steps to simulate")] = 5,
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs in the pool (2 to 1,024)")] = 16,
    policies: Annotated[
        str, typer.Option("--policies", help="Comma-separated routing policies: least-open, "
                          "length-predict, cmlfq, cmlfq-adaptive (least-open:nosticky, "
                          "cmlfq-adaptive:notree ...)")
    ] = "least-open,cmlfq",
    out: Annotated[Path | None, typer.Option("-o", "--out", parser=out_path,
                                             help="Write results.json here")] = None,
    workload: Annotated[
        str, typer.Option(help="tool-heavy (fitted agent sessions), r2e-gym, search-r1 or "
                          "dapo-math (Libra-like)")
    ] = "tool-heavy",
    prompts: Annotated[
        int | None, typer.Option(min=1, max=100_000,
                                 help="Prompts per step (N; default: the workload's)")
    ] = None,
    samples: Annotated[
        int | None, typer.Option(min=1, max=100_000,
                                 help="Samples per prompt (G; default: the workload's; "
                                 "N × G at most 100,000)")
    ] = None,
    seed: Annotated[int, typer.Option(min=0)] = 0,
    tool_time_scale: Annotated[
        float, typer.Option(parser=NON_NEGATIVE,
                            help="Multiply fitted tool latencies (1 = as in the traces)")
    ] = 1.0,
    gpu: Annotated[str, typer.Option(help="GPU name (H100, A100-80G, H200, L40S)")] = "H100",
    model: Annotated[str, typer.Option(help="Model name (qwen3-8b, llama-3.1-8b, ...)")] = (
        "qwen3-8b"
    ),
    mix: Annotated[
        str | None, typer.Option(help="Fixed rollout mix, e.g. tp1x8,tp2x2,tp4x1 (no planner)")
    ] = None,
    train_gpus: Annotated[
        int | None, typer.Option(help="Training GPUs with --mix (default: the rest)")
    ] = None,
    any_mix: Annotated[
        bool, typer.Option("--any-mix", help="Let the planner pick single-TP mixes too "
                           "(default: bucketed mixes of >= 2 TPs, as in Libra)")
    ] = False,
    mode: Annotated[str, typer.Option(help="off-policy (overlap, default) or sync")] = (
        "off-policy"
    ),
    partial: Annotated[
        float, typer.Option(parser=FRACTION,
                            help="Partial rollout: a step ends when this fraction is done")
    ] = 1.0,
    policy: Annotated[str | None, _OLD_POLICY] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help=QUIET_HELP)] = False,
) -> None:
    """Simulate RL rollout steps for each policy; per-step makespan and plan (simulated)."""
    from turnstile.bench.usage import check_out_dir
    from turnstile.core.registry import UnknownNameError
    from turnstile.rollout.experiment import RolloutSimRequest, run_rollout_sim

    req = RolloutSimRequest(
        steps=steps, gpus=gpus, policies=_policies(policies, policy), prompts=prompts,
        samples=samples, workload=workload,
        seed=seed, tool_time_scale=tool_time_scale, gpu=gpu, model=model, mix=mix,
        train_gpus=train_gpus, tiered=not any_mix, mode=mode, partial_frac=partial,
    )
    try:
        req.validate()
        if out is not None:
            check_out_dir(out)
        # a step's trajectories: N prompts × G samples (drawing a batch only to count it
        # cost a policy's worth of workload draws)
        n = req.make_workload().spec.batch_size
    except (ValueError, KeyError, UnknownNameError) as e:
        raise _fail(str(e)) from None
    console.print(
        f"[bold]simulated[/] {steps} RL steps × {n} {workload} trajectories on {gpus}× {gpu}"
        f" ({model}); policies: {', '.join(req.policies)}"
    )
    with progress_bar(err_console, quiet=quiet) as bar:
        task = bar.add_task("rollout sim", total=steps * len(req.policies))

        def on_step(pol: str, rec: Any) -> None:
            bar.update(task, advance=1, description=f"{pol} step {rec.step}")

        try:
            results = run_rollout_sim(req, on_step=on_step)
        except (ValueError, UnknownNameError) as e:
            raise _fail(str(e)) from None
    render_sim(results, console)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        path = out / "results.json"
        path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        console.print(f"wrote {path}")


@rollout_app.command("live")
def live_cmd(
    trajectories: Annotated[int, typer.Option(min=1, max=MAX_LIVE_TRAJECTORIES,
                                                    help="Trajectories in the batch")] = 8,
    policy: Annotated[str, typer.Option(help="Routing policy (cmlfq, least-open, ...)")] = (
        "cmlfq"
    ),
    max_turns: Annotated[int, typer.Option(min=1, max=256,
                                                 help="Turns per trajectory at most")] = 4,
    max_tokens: Annotated[int, typer.Option(min=1, max=4096,
                                                  help="Output tokens per turn at most")] = 16,
    seed: Annotated[int, typer.Option(min=0)] = 0,
    model: Annotated[
        Path | None, typer.Option(help="GGUF model (default: the tiny random test model)")
    ] = None,
    out: Annotated[Path | None, typer.Option("-o", "--out", parser=out_path,
                                             help="Write live.json here")] = None,
    steps: Annotated[int, typer.Option(min=1, max=1000,
                                              help="Batches to run (the router learns)")] = 1,
) -> None:
    """Run tool-calling trajectories against two real llama.cpp engines (two buckets).

    The turnstile gateway runs in front of the engines with the policy eager+<policy> and each
    engine's TP and bucket, so the gateway's scheduler core routes every turn with the same
    policy class the simulator runs. Tools are real and deterministic (calculator, file
    read/write in a temp sandbox, sleep-for-N); which tool a turn calls, and whether it fails,
    follow the trajectory spec (the tiny model's text is not parsed); each return goes back to
    the gateway as an OpenAI tool message.
    """
    from turnstile.bench.usage import check_out_dir
    from turnstile.core.registry import UnknownNameError
    from turnstile.engines.llama_server import LlamaServerError
    from turnstile.policies import ROUTING
    from turnstile.rollout.live import LiveConfig, run_live

    try:  # every flag checked before two engines start
        if policy not in ROUTING:
            ROUTING.create(policy)  # raises with the valid names
        if model is not None and not model.is_file():
            raise ValueError(f"--model {model}: no such file")
        if out is not None:
            check_out_dir(out)
    except UnknownNameError as e:
        raise _fail(f"--policy {policy}: {e.args[0]}") from None
    except ValueError as e:
        raise _fail(str(e)) from None
    cfg = LiveConfig(trajectories=trajectories, policy=policy, max_turns=max_turns,
                     max_tokens=max_tokens, seed=seed, model_path=model, steps=steps)
    try:
        result = run_live(cfg, log=lambda m: err_console.print(f"[dim]{m}[/]"))
    except (LlamaServerError, ValueError, RuntimeError) as e:
        raise _fail(str(e)) from None
    table = Table(title=f"Live rollout (gateway eager+{policy}, real llama.cpp engines, "
                        "not simulated)")
    for col in ("step", "trajectories", "completed", "makespan s", "turns", "tool calls",
                "tool errors", "moves"):
        table.add_column(col, justify="right")
    for s in result["steps"]:
        table.add_row(str(s["step"]), str(s["trajectories"]), str(s["completed"]),
                      f"{s['makespan_s']:.2f}", str(s["turns"]), str(s["tool_calls"]),
                      str(s["tool_errors"]), str(s["moves"]))
    console.print(table)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        from turnstile.bench.report import results_header

        path = out / "live.json"
        doc = {**results_header("rollout-live", simulated=False), **result}
        path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        console.print(f"wrote {path}")
