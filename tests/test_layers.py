"""Imports point down the layers (the developer guide's rule, read from the source with ``ast``).

    transport, workload → traces → core → policies → sim → bench → gateway / calibrate → rollout

A module may import its own layer or layers to its left (``gateway`` and ``calibrate`` share
one layer). ``engines`` is an edge adapter (the real llama.cpp engine): importable from
calibrate, gateway, rollout and the top, and it imports nothing of turnstile but the root
package and ``transport``. ``cli.py``, ``demo.py`` and every ``__main__`` are on top and may
import anything.
A ``testing`` module or package (helpers that start fakes for tests) is importable only from
tests and from other testing modules; being test-side code, it may import anything. The root
package (``turnstile/__init__.py``: the version) is importable from everywhere.

Every import is checked wherever it is written: at module level, inside functions (lazy
imports) and inside ``if TYPE_CHECKING:`` blocks alike (a type-only import still couples the
rooms; none is exempt). A second test checks that no two modules import each other, directly
or around a longer circle.

Violations that are being fixed elsewhere are listed in ``KNOWN`` with the issue that owns
them, so that this test passes today and fails as soon as a new one appears; delete an entry
when its fix lands (the test also fails on an entry that no longer matches anything).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "turnstile"

#: layer rank of each room; a room may import rooms of the same or a lower rank
RANK = {
    "transport": 0,  # the one HTTP transport: imports nothing of turnstile
    "workload": 0,
    "traces": 1,
    "core": 2,
    "policies": 3,
    "sim": 4,
    "bench": 5,
    "gateway": 6,
    "calibrate": 6,
    "rollout": 7,
    "epp": 7,
    # adapters into stacks users run (verl's rollout router): imports core/policies/workload
    # only (test_integrations_import_only_the_core_and_policies); nothing imports them
    "integrations": 8,
}
TOP = {"cli", "demo", "__main__"}  # top-level modules, and any package's __main__
EDGE = "engines"
EDGE_USERS = {"calibrate", "gateway", "rollout", "epp"}
ROOT = "turnstile"  # the root package itself

#: (importing module, imported module) pairs known to break the rule, with their owner.
#: Each one must still occur; delete it when it is fixed.
KNOWN: dict[tuple[str, str], str] = {
}

#: import circles known to exist, as the sorted tuple of their modules, with their owner
KNOWN_CYCLES: dict[tuple[str, ...], str] = {
}


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    imported: str  # dotted module name as written (``from a.b import c`` gives ``a.b.c`` if a
    #               module ``a/b/c.py`` exists, else ``a.b``)
    file: Path
    line: int

    def where(self) -> str:
        return f"{self.file.relative_to(SRC.parent)}:{self.line}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    p = SRC.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def imports_of(path: Path) -> list[Import]:
    return imports_in(path.read_text(encoding="utf-8"), path)


def imports_in(text: str, path: Path) -> list[Import]:
    """Every turnstile import in ``text`` (the source of ``path``), wherever written (module
    level, functions, TYPE_CHECKING blocks), relative imports resolved."""
    name = module_name(path)
    is_package = path.name == "__init__.py"
    out: list[Import] = []
    for node in ast.walk(ast.parse(text, str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_package else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            # ``from turnstile.policies import cvar`` imports the module turnstile.policies.cvar
            subs = [f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")]
            targets = subs or [base]
        for t in targets:
            if t == ROOT or t.startswith(ROOT + "."):
                out.append(Import(name, t, path, node.lineno))
    return out


def all_imports() -> list[Import]:
    return [i for p in sorted(PACKAGE.rglob("*.py")) for i in imports_of(p)]


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def is_top(module: str) -> bool:
    parts = module.split(".")
    return parts[-1] == "__main__" or (len(parts) == 2 and parts[1] in TOP)


def is_testing(module: str) -> bool:
    return "testing" in module.split(".")


def violation(imp: Import) -> str | None:
    """Why ``imp`` breaks the layering, or None when it does not."""
    src, dst = imp.importer, imp.imported
    if is_testing(src):
        return None  # test-side code, like the tests themselves
    if is_testing(dst):
        return "imports a testing helper (importable only from tests)"
    if is_top(src) or room(dst) == ROOT or room(src) == room(dst):
        return None
    if is_top(dst):
        return f"imports {dst}, which is on top of every layer"
    s, d = room(src), room(dst)
    if s == EDGE:  # the one HTTP transport (it imports nothing of turnstile) it may use
        return None if d == "transport" else f"the edge adapter {EDGE!r} imports the {d!r} layer"
    if d == EDGE:
        return None if s in EDGE_USERS else f"{s!r} uses the edge adapter {EDGE!r}"
    if s not in RANK or d not in RANK:
        return f"unknown room {s if s not in RANK else d!r}: give it a layer in this test"
    if RANK[d] > RANK[s]:
        return f"{s!r} (layer {RANK[s]}) imports the higher layer {d!r} ({RANK[d]})"
    return None


def test_every_import_points_down_the_layers():
    found: dict[tuple[str, str], list[str]] = {}
    problems: list[str] = []
    for imp in all_imports():
        why = violation(imp)
        if why is None:
            continue
        key = (imp.importer, imp.imported)
        found.setdefault(key, []).append(imp.where())
        if key not in KNOWN:
            problems.append(f"{imp.where()}: {imp.importer} → {imp.imported}: {why}")
    stale = [f"KNOWN entry {k} ({owner}) no longer occurs: delete it"
             for k, owner in KNOWN.items() if k not in found]
    assert not problems + stale, "\n".join(problems + stale)


def _cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[tuple[str, ...]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_another_that_imports_it_back():
    """Circles are checked between modules, through every import but a package's imports of
    its own submodules (``__init__`` re-exporting them is how a package is built)."""
    graph: dict[str, set[str]] = {}
    for imp in all_imports():
        src, dst = imp.importer, imp.imported
        if dst.startswith(src + ".") or src == dst:
            continue  # a package importing its own submodules
        if not _is_module(dst):
            continue
        if (SRC.joinpath(*dst.split(".")) / "__init__.py").is_file():
            continue  # importing a package's __init__ (re-exports) is not a circle by itself
        graph.setdefault(src, set()).add(dst)
    cycles = _cycles(graph)
    new = [c for c in cycles if c not in KNOWN_CYCLES]
    stale = [f"KNOWN_CYCLES entry {c} ({owner}) no longer occurs: delete it"
             for c, owner in KNOWN_CYCLES.items() if c not in cycles]
    assert not new + stale, "\n".join([*(" ↔ ".join(c) for c in new), *stale])


def test_integrations_import_only_the_core_and_policies():
    """``integrations`` is an edge into foreign stacks: it builds on the core, the policies and
    the workload model, never on a driver (sim, gateway, rollout), and no room imports it."""
    allowed = {"core", "policies", "workload", "integrations", ROOT}
    bad = [f"{i.where()}: {i.imported}" for i in all_imports()
           if (room(i.importer) == "integrations" and room(i.imported) not in allowed)
           or (room(i.imported) == "integrations" and room(i.importer) != "integrations")]
    assert not bad, bad


def test_policies_do_not_import_the_cores_write_path():
    """Policies read the view; only the core changes it (core/state.py's write functions)."""
    writers = {"add_engine", "charge", "discharge", "pause_session", "resume_session",
               "report_stats", "count_ready", "count_released"}
    bad = []
    for path in sorted((PACKAGE / "policies").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "turnstile.core.state":
                bad += [f"{path.name}:{node.lineno}: {a.name}"
                        for a in node.names if a.name in writers]
    assert not bad, bad


def test_the_checker_catches_what_it_should():
    """The rule itself, on made-up imports (so a checker that accepts everything fails)."""
    def v(src: str, dst: str) -> str | None:
        return violation(Import(src, dst, PACKAGE / "x.py", 1))

    assert v("turnstile.core.scheduler", "turnstile.policies") is not None  # up a layer
    assert v("turnstile.workload.synth", "turnstile.traces") is not None
    assert v("turnstile.sim.cluster", "turnstile.gateway.service") is not None
    assert v("turnstile.sim.engine", "turnstile.engines.llama_server") is not None  # not a user
    assert v("turnstile.engines.tiny_model", "turnstile.core") is not None  # edge imports in
    assert v("turnstile.engines.process", "turnstile.transport.blocking") is None
    assert v("turnstile.gateway.service", "turnstile.gateway.testing") is not None
    assert v("turnstile.bench.runner", "turnstile.cli") is not None
    assert v("turnstile.newroom.x", "turnstile.core") is not None  # unknown rooms must be placed
    assert v("turnstile.policies.cvar", "turnstile.core.state") is None  # down
    assert v("turnstile.gateway.app", "turnstile.calibrate.client") is None  # same layer
    assert v("turnstile.gateway.app", "turnstile.engines.llama_server") is None
    assert v("turnstile.cli", "turnstile.rollout.cli") is None  # top
    assert v("turnstile.gateway.__main__", "turnstile.rollout") is None
    assert v("turnstile.testing.fakes", "turnstile.gateway.testing") is None
    assert v("turnstile.core.scheduler", "turnstile") is None  # the root package

    probe = PACKAGE / "core" / "scheduler.py"  # parsed as if it were this file
    text = ("def f():\n    from turnstile.gateway import service\n"
            "if TYPE_CHECKING:\n    import turnstile.rollout\n"
            "from . import state\nfrom ..policies.base import RELEASE\n")
    found = {(i.imported, i.line) for i in imports_in(text, probe)}
    assert found == {("turnstile.gateway.service", 2), ("turnstile.rollout", 4),
                     ("turnstile.core.state", 5), ("turnstile.policies.base", 6)}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]
