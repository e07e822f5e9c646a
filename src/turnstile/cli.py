"""The ``turnstile`` command line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(
    help="turnstile: a workflow-aware scheduler for agentic LLM workloads.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)


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


def _out() -> Any:
    from turnstile.bench.progress import out_console

    return out_console()


@app.command("policies")
def list_policies(
    spec: Annotated[str | None, typer.Argument(
        help="A policy spec (e.g. cvar:budget=fixed+ttl): show it resolved, every option")] = None,
) -> None:
    """List the registered policies by kind, or show one spec resolved: every policy with
    every option's value (defaults included) and its declared type and range."""
    from turnstile.bench.usage import fail
    from turnstile.policies import DEFAULTS, all_policy_names, resolved_spec
    from turnstile.policies.spec import options_of

    if spec is None:
        for kind, names in all_policy_names().items():
            _out().print(f"[bold]{kind}[/] (default {DEFAULTS[kind]}): {', '.join(names)}")
        return
    try:
        doc = resolved_spec(spec)
    except ValueError as e:
        raise fail(str(e)) from None
    _out().print(f"[bold]{spec}[/] = {doc['canonical']}", highlight=False)
    for kind, pol in doc["policies"].items():
        _out().print(f"[bold]{kind}[/]: {pol['name']}", highlight=False)
        for opt in options_of(kind, pol["name"]):
            value = pol["options"][opt.name]
            _out().print(f"  {opt.name} = {value!r}    [dim]{opt.describe()}[/]",
                         highlight=False)


@app.command("version")
def version() -> None:
    """Print the version, and whether the simulator runs compiled (make compiled)."""
    _out().print(_version_text())


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


def _flags_show_no_type() -> None:
    """A flag takes no value: ``--help`` shows none for it (typer would print ``<bool>``)."""
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


def _register_subcommands() -> None:
    """Each room's commands live in its own ``cli`` module; each registers itself here.

    Registering imports only typer and rich: a command imports its room's packages when it
    runs, and one that needs an extra (``serve``: gateway, ``epp``: epp) says which to install.
    """
    from turnstile.bench.cli import register as register_bench
    from turnstile.bench.traces_cli import register as register_traces
    from turnstile.calibrate.cli import register as register_calibrate
    from turnstile.epp.cli import register as register_epp
    from turnstile.gateway.cli import register as register_gateway
    from turnstile.rollout.cli import register as register_rollout

    register_bench(app)
    register_gateway(app)
    register_calibrate(app)
    register_epp(app)
    register_traces(app)
    register_rollout(app)


_flags_show_no_type()
_register_subcommands()
