"""No engine's name in ``core/`` or the general engine model (issue 28, item 3).

Everything one serving engine does differently lives in its profile module
(``turnstile/sim/profiles/``, behind :class:`turnstile.sim.engine_profile.EngineProfile`) or in
its adapter at the edge (``gateway``, ``calibrate``, ``engines``). ``core/`` and the general
simulator modules listed in :data:`GENERAL_SIM` read a profile's rules and never name an
engine: not in code, not in a comment (a docstring that says "as engine X does" is the first
step to an ``if engine == X``). :data:`GENERAL_SIM` must place every module of ``sim/``: a new
module is either general (listed) or an engine's profile (under ``sim/profiles/``).
"""

from __future__ import annotations

import re
from pathlib import Path

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


def test_the_general_modules_reach_profiles_only_through_the_interface() -> None:
    """A general module may import ``turnstile.sim.engine_profile``, never a profile module."""
    bad = [f"sim/{name}" for name in GENERAL_SIM
           if re.search(r"sim\.profiles\.|from turnstile\.sim\.profiles import",
                        (PACKAGE / "sim" / name).read_text(encoding="utf-8"))]
    assert not bad, bad


def test_the_check_catches_what_it_should() -> None:
    for text in ("llama.cpp's slots", "as vLLM frees", "SGLang radix", "LlamaCppAdapter",
                 "llama-3.1-8b"):
        assert ENGINE_NAMES.search(text), text
    assert not ENGINE_NAMES.search("a slot-limited engine's profile")
