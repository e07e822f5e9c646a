"""No engine's name in ``core/`` or the general engine model (issue 28, item 3).

Everything one serving engine does differently lives in its profile module
(``turnstile/sim/profiles/``, behind :class:`turnstile.sim.engine_profile.EngineProfile`) or in
its adapter at the edge (``gateway``, ``calibrate``, ``engines``). ``core/`` and the general
simulator modules listed in :data:`GENERAL_SIM` read a profile's rules and never name an
engine: not in code, not in a comment (a docstring that says "as engine X does" is the first
step to an ``if engine == X``). :data:`GENERAL_SIM` must place every module of ``sim/``: a new
module is either general (listed) or an engine's profile (under ``sim/profiles/``).

Beyond names, the rules themselves: ``core/`` declares the shape of an engine's slot pick
(``ServerSlot``, ``SlotRule``) but implements none, and the general modules import no profile
module and default to no engine's rule; they are handed the rule of the engine's profile.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

from turnstile.sim.engine_profile import GENERIC, generic_server_slot, get_profile, profile_names

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "turnstile"
#: what ``grep -ri 'llama\|vllm\|sglang'`` finds
ENGINE_NAMES = re.compile(r"llama|vllm|sglang", re.IGNORECASE)

#: the general simulator: the engine model, its KV pools, the step and step-time models, the
#: cluster driver and the profile interface (not the profiles)
GENERAL_SIM = (
    "__init__.py",
    "batch_scheduler.py",
    "block_pool.py",
    "closed_loop.py",
    "cluster.py",
    "engine.py",
    "engine_config.py",
    "engine_group.py",
    "engine_profile.py",
    "event_loop.py",
    "fitted_perf.py",
    "kernel.py",
    "kv_retention.py",
    "lanes.py",
    "leap_loop.py",
    "leap_sums.py",
    "perf.py",
    "profile_fit.py",
    "request.py",
    "roofline_perf.py",
    "slot_pool.py",
    "step.py",
    "tp_perf.py",
)
#: where engine-specific facts belong in ``sim/``
PROFILES = "profiles"


def _hits(path: Path) -> list[str]:
    return [f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if ENGINE_NAMES.search(line)]


def test_core_names_no_engine() -> None:
    hits = [h for p in sorted((PACKAGE / "core").rglob("*.py")) for h in _hits(p)]
    assert not hits, "engine names in core/ (move the rule to an engine profile):\n" + \
        "\n".join(hits)


def test_the_general_simulator_names_no_engine() -> None:
    hits = [h for name in GENERAL_SIM for h in _hits(PACKAGE / "sim" / name)]
    assert not hits, ("engine names in the general simulator (move the rule to an engine "
                      "profile, sim/profiles/):\n" + "\n".join(hits))


def test_every_simulator_module_is_placed() -> None:
    sim = PACKAGE / "sim"
    found = {p.relative_to(sim).as_posix() for p in sim.rglob("*.py")}
    unplaced = sorted(f for f in found - set(GENERAL_SIM) if not f.startswith(PROFILES + "/"))
    assert not unplaced, (f"place each in GENERAL_SIM or under sim/{PROFILES}/: {unplaced}")
    assert not set(GENERAL_SIM) - found, "GENERAL_SIM lists modules that no longer exist"


def _imported(path: Path, module: str) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of everything ``path`` (module ``module``) imports, wherever the
    import is written; ``from a import b`` gives ``a.b`` as well as ``a``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".")[: -node.level]
                base = ".".join([*pkg, base] if base else pkg)
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def _profile_modules(names: list[tuple[int, str]]) -> list[str]:
    pkg = f"turnstile.sim.{PROFILES}"
    return [f"{line}: {n}" for line, n in names if n == pkg or n.startswith(pkg + ".")]


def test_the_general_modules_reach_profiles_only_through_the_interface() -> None:
    """A general module may import ``turnstile.sim.engine_profile``, never a profile module
    nor the profiles package (``engine_profile`` loads that package by name, as a registry,
    and names no profile module)."""
    bad = {}
    for name in GENERAL_SIM:
        path = PACKAGE / "sim" / name
        module = "turnstile.sim" if name == "__init__.py" else f"turnstile.sim.{name[:-3]}"
        hits = _profile_modules(_imported(path, module))
        # a module named in a string (importlib) other than the profiles package itself
        hits += [f"{node.lineno}: {node.value!r}"
                 for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                 if isinstance(node, ast.Constant) and isinstance(node.value, str)
                 and re.fullmatch(rf"turnstile\.sim\.{PROFILES}\.\w+", node.value)]
        if hits:
            bad[f"sim/{name}"] = hits
    assert not bad, bad


def test_the_import_check_catches_a_profile_import(tmp_path: Path) -> None:
    sample = tmp_path / "x.py"
    for text in ("from turnstile.sim.profiles import llamacpp",
                 "from turnstile.sim.profiles.llamacpp import session_else_lru",
                 "import turnstile.sim.profiles.vllm",
                 "from turnstile.sim import profiles",
                 "def f():\n    from .profiles import llamacpp"):
        sample.write_text(text)
        assert _profile_modules(_imported(sample, "turnstile.sim.lanes")), text
    sample.write_text("from turnstile.sim.engine_profile import profile_for")
    assert not _profile_modules(_imported(sample, "turnstile.sim.lanes"))


def _core_slot_types(tree: ast.Module) -> set[str]:
    """``ServerSlot`` and the type variables bound to it in a module."""
    names = {"ServerSlot"}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and any(isinstance(k.value, ast.Name) and k.value.id == "ServerSlot"
                        for k in node.value.keywords if k.arg == "bound")):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def test_core_implements_no_engines_slot_pick() -> None:
    """``core/`` may say what a server-side slot pick looks like (``ServerSlot``, ``SlotRule``)
    but no function of it takes or returns an engine's slots: which idle slot an engine gives an
    unbound request is that engine's rule, in its profile (issue 28, item 3)."""
    bad = []
    for path in sorted((PACKAGE / "core").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        types = _core_slot_types(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                notes = [a.annotation for a in (*node.args.posonlyargs, *node.args.args,
                                                *node.args.kwonlyargs)] + [node.returns]
                used = {n.id for a in notes if a is not None for n in ast.walk(a)
                        if isinstance(n, ast.Name)}
                if used & types:
                    bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}")
    assert not bad, "a server-side slot rule in core/ (move it to the engine's profile):\n" + \
        "\n".join(bad)
    slots = importlib.import_module("turnstile.core.slots")
    assert set(slots.__all__) == {"GatewaySlot", "ServerSlot", "SlotRule", "choose_slot"}


def test_each_engines_slot_pick_lives_in_its_profile() -> None:
    """Every registered profile's ``server_slot`` is the neutral rule or a function of that
    profile's own module (never one of ``core/``)."""
    for profile in {*(get_profile(n) for n in profile_names()), GENERIC}:
        rule = profile.server_slot
        if rule is generic_server_slot:
            continue
        where = getattr(rule, "__module__", "")
        assert where.startswith(f"turnstile.sim.{PROFILES}."), (profile.name, where)
    assert generic_server_slot.__module__ == "turnstile.sim.engine_profile"


def test_the_general_modules_default_to_no_engines_rule() -> None:
    """No class or function of a general module has a profile's function as a default: the
    slot models (``SlotPool``, ``Lanes``) are handed the rule (no default at all), and
    ``EngineProfile`` defaults to the neutral one."""
    pkg = f"turnstile.sim.{PROFILES}."
    bad = []
    for name in GENERAL_SIM:
        module = importlib.import_module(
            "turnstile.sim" if name == "__init__.py" else f"turnstile.sim.{name[:-3]}")
        for attr, obj in vars(module).items():
            if not (inspect.isclass(obj) or inspect.isfunction(obj)) or \
                    obj.__module__ != module.__name__:
                continue
            try:
                params = inspect.signature(obj).parameters.values()
            except (TypeError, ValueError):
                continue
            bad += [f"{module.__name__}.{attr}({p.name}=...)" for p in params
                    if callable(p.default)
                    and str(getattr(p.default, "__module__", "")).startswith(pkg)]
    assert not bad, bad
    from turnstile.sim.lanes import Lanes
    from turnstile.sim.slot_pool import SlotPool

    for cls in (Lanes, SlotPool):
        assert inspect.signature(cls).parameters["server_slot"].default is inspect.Parameter.empty
    assert GENERIC.server_slot is generic_server_slot


def test_the_check_catches_what_it_should() -> None:
    for text in ("llama.cpp's slots", "as vLLM frees", "SGLang radix", "LlamaCppAdapter",
                 "llama-3.1-8b"):
        assert ENGINE_NAMES.search(text), text
    assert not ENGINE_NAMES.search("a slot-limited engine's profile")
