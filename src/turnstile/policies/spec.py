"""Policy specs with options: what ``--policies``, ``serve --policy`` and config files accept.

Grammar: a *spec* is components joined by ``+``; a component is a registered name with optional
options, ``name[:key=value[,key=value...]]``, e.g. ``cvar:budget=fixed,kv_fill=0.6+kv-affinity
+ttl:max_ttl_s=30``. A list of specs is comma-separated (``--policies eager,auto,cvar:budget=
fixed,las``): a comma-separated piece of the form ``key=value`` continues the options of the
spec before it. Every option is declared (:class:`Option`: type, range or choices, default,
a few *main* values for a search); an unknown key or a value out of range raises
:class:`SpecError`, one line naming the key and the valid ones. An *alias* names a registered
policy with some options fixed (``cvar-fixed`` = ``cvar:budget=fixed,gate=fixed``).

API for tools that search the policy space (``turnstile tune``):

- :func:`configurations` — every registered name by kind, aliases included;
- :func:`options_of` ``(kind, name)`` — the declared options of one configuration, each with
  the few ``main`` values a search should try (:data:`MAIN`; the default first);
- :func:`parse` ``(spec)`` — a :class:`Spec` (aliases resolved, values typed and checked);
- :meth:`Spec.canonical` — the spec as a string that parses to the same policies (options that
  differ from the defaults only, sorted); :meth:`Spec.resolved` — every option with its value,
  defaults included (what ``results.json`` records);
- :func:`split_specs` — a comma-separated list into specs.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from turnstile.core.registry import Registry

__all__ = [
    "ALIASES",
    "Component",
    "Option",
    "Spec",
    "SpecError",
    "configurations",
    "declare",
    "options_of",
    "parse",
    "split_specs",
]


class SpecError(ValueError):
    """A malformed spec: one line naming what is wrong and the valid choices."""


@dataclass(frozen=True)
class Option:
    """One declared option: ``kind`` is bool, int, float or str; numbers lie in [lo, hi] (an
    open end where ``lo_open``/``hi_open``); strings are one of ``choices``. ``main``: the few
    values a search tries (empty: only the default)."""

    name: str
    kind: type
    default: Any
    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple[str, ...] = ()
    main: tuple[Any, ...] = ()
    help: str = ""

    def describe(self) -> str:
        """``key: float in [0, 1] (default 0.5)``."""
        if self.kind is bool:
            dom = "bool"
        elif self.kind is str:
            dom = "one of " + "/".join(self.choices)
        else:
            lo, hi = ("(" if self.lo_open else "["), (")" if self.hi_open else "]")
            dom = f"{self.kind.__name__} in {lo}{_num(self.lo)}, {_num(self.hi)}{hi}"
        return f"{self.name}: {dom} (default {render_value(self.default)})"

    def parse(self, raw: str) -> Any:
        """``raw`` (the text after ``key=``) as a checked value; raises SpecError."""
        raw = raw.strip()
        try:
            if self.kind is bool:
                low = raw.lower()
                if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError
                value: Any = low in ("true", "1", "yes", "on")
            elif self.kind is int:
                value = int(raw)
            elif self.kind is float:
                value = float(raw)
            else:
                value = raw
        except ValueError:
            raise SpecError(f"option {self.name}={raw!r}: expected {self.describe()}") from None
        return self.check(value)

    def check(self, value: Any) -> Any:
        """``value`` (already typed, e.g. from a config file) checked against the declaration."""
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, self.kind) or (self.kind is int and isinstance(value, bool)):
            raise SpecError(f"option {self.name}={value!r}: expected {self.describe()}")
        if self.kind is str:
            if self.choices and value not in self.choices:
                raise SpecError(f"option {self.name}={value!r}: expected {self.describe()}")
        elif self.kind is not bool:
            assert isinstance(value, (int, float))
            low_bad = value < self.lo or (self.lo_open and value == self.lo)
            high_bad = value > self.hi or (self.hi_open and value == self.hi)
            if low_bad or high_bad or (isinstance(value, float) and math.isnan(value)):
                raise SpecError(f"option {self.name}={value!r} out of range: "
                                f"expected {self.describe()}")
        return value


def _num(x: float) -> str:
    return "inf" if x == math.inf else "-inf" if x == -math.inf else render_value(x)


def render_value(v: Any) -> str:
    """A value as spec text that parses back to it (floats by ``repr``)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(int(v)) if v.is_integer() and abs(v) < 1e15 else repr(v)
    return str(v)


# ------------------------------------------------------------------ declarations
#: per (kind, name): its options; filled by :func:`declare` and by :func:`options_of` on demand
_DECLARED: dict[tuple[str, str], tuple[Option, ...]] = {}
#: per (kind, name): option key -> constructor keyword mapping (virtual options)
_TRANSLATE: dict[tuple[str, str], Callable[[dict[str, Any]], dict[str, Any]]] = {}
#: alias -> (the registered name it configures, the options it fixes)
ALIASES: dict[str, tuple[str, dict[str, Any]]] = {
    "cvar-fixed": ("cvar", {"budget": "fixed", "gate": "fixed"}),
    "composite-noshadow": ("composite", {"shadow": 0.0}),
}

#: ranges by option name for options derived from a constructor signature
_RANGES: dict[str, dict[str, Any]] = {
    "alpha": {"lo": 0.0, "hi": 1.0, "lo_open": True, "hi_open": True},
    "q": {"lo": 0.0, "hi": 1.0, "lo_open": True},
    "done_pause_q": {"lo": 0.0, "hi": 1.0},
    "kv_fill": {"lo": 0.0, "hi": 1.0, "lo_open": True},
    "min_kv_fill": {"lo": 0.0, "hi": 1.0, "lo_open": True},
    "max_kv_fill": {"lo": 0.0, "hi": 1.0, "lo_open": True},
    "target_context_miss": {"lo": 0.0, "hi": 1.0},
    "evict_share": {"lo": 0.0, "hi": 1.0},
    "ttft_tail_share": {"lo": -1.0, "hi": 1.0},
    "reload_factor": {"lo": 0.0, "hi": 1.0},
    "kv_saturation": {"lo": 0.0, "hi": 1.0, "lo_open": True},
    "split_ratio": {"lo": 1.0},
    "max_imbalance": {"lo": 1.0},
    "balance_rel": {"lo": 1.0},
}
#: the values a search tries first, by option name (the default is always among them)
MAIN: dict[str, tuple[Any, ...]] = {
    "budget": ("adaptive", "fixed", "none"),
    "gate": ("adaptive", "fixed", "none"),
    "kv_fill": (0.4, 0.5, 0.6, 0.8),
    "hold_frac": (4.0, 8.0, 16.0),
    "evidence_gate": (True, False),
    "max_inflight_per_engine": (8, 16, 32),
    "max_ttl_s": (30.0, 120.0),
    "shadow": (0.0, 1.0),
}
_INT_FLOOR = {"adapt_every", "evict_window", "window", "gate_scan", "min_pause_samples",
              "max_inflight_per_engine", "max_active"}


def declare(kind: str, name: str, options: tuple[Option, ...],
            translate: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
    """Declare ``name``'s options explicitly (replacing those derived from its constructor);
    ``translate`` maps resolved option values to constructor keywords (default: the same)."""
    _DECLARED[(kind, name)] = options
    if translate is not None:
        _TRANSLATE[(kind, name)] = translate


def derive(factory: Callable[..., Any]) -> tuple[Option, ...]:
    """Options from a constructor's keyword parameters with a bool, int, float or str default
    (others, such as tuples or callables, are not options); numbers range over [0, inf) unless
    :data:`_RANGES` says otherwise (int counts from 1 for sizes); a str option's choices are
    the factory's ``option_choices[key]`` (a tuple, or a function returning one). A factory
    that passes ``**kwargs`` to its base class lists the base's options it honours in
    ``inherited_options``."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return ()
    choices: Mapping[str, Any] = getattr(factory, "option_choices", {})
    params = list(sig.parameters.values())
    inherited: tuple[str, ...] = getattr(factory, "inherited_options", ())
    if inherited and isinstance(factory, type):
        base = inspect.signature(factory.__mro__[1]).parameters
        params += [base[n] for n in inherited]
    out = []
    for p in params:
        d = p.default
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or d is p.empty:
            continue
        kind = type(d)
        if kind not in (bool, int, float, str):
            continue
        rng: dict[str, Any] = {}
        if kind in (int, float):
            rng = {"lo": 1.0 if p.name in _INT_FLOOR else 0.0}
            rng.update(_RANGES.get(p.name, {}))
        elif kind is str:
            c = choices.get(p.name, ())
            rng = {"choices": tuple(c() if callable(c) else c)}
        main = tuple(dict.fromkeys((d, *MAIN.get(p.name, ()))))
        out.append(Option(p.name, kind, d, main=main, **rng))
    return tuple(out)


def structured_params(factory: Any) -> frozenset[str]:
    """A constructor's keyword parameters whose values are structured (a tuple or list, an
    object, ``None``): not spec options, but a config file's table may set them (e.g. cmlfq's
    ``bounds``), passed through as given."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in sig.parameters.values()
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
                     and p.default is not p.empty
                     and type(p.default) not in (bool, int, float, str))


def options_of(kind: str, name: str, registry: Registry[Any] | None = None) -> tuple[Option, ...]:
    """The declared options of ``name`` (a registered name of ``kind``; an alias's options are
    its target's)."""
    name = ALIASES.get(name, (name, {}))[0]
    key = (kind, name)
    if key not in _DECLARED:
        if registry is None:
            from turnstile.policies import registry_of

            registry = registry_of(kind)
        _DECLARED[key] = derive(registry.factory(name))
    return _DECLARED[key]


# ------------------------------------------------------------------ parsed specs
@dataclass(frozen=True)
class Component:
    """One policy of a spec: ``kind``, its registered ``name``, the options given (typed);
    ``named``: the spec (or a config's options) named it, rather than it being a default."""

    kind: str
    name: str
    given: Mapping[str, Any] = field(default_factory=dict)
    named: bool = True

    def resolved(self) -> dict[str, Any]:
        """Every declared option with its value (the default where not given)."""
        return {o.name: self.given.get(o.name, o.default) for o in options_of(self.kind, self.name)}

    def kwargs(self) -> dict[str, Any]:
        """Constructor keywords: the options that differ from their defaults (translated)."""
        given = {k: v for k, v in self.given.items()
                 if v != _default(self.kind, self.name, k)}
        tr = _TRANSLATE.get((self.kind, self.name))
        return tr(dict(given)) if tr is not None else given

    def canonical(self) -> str:
        opts = {k: v for k, v in sorted(self.given.items())
                if v != _default(self.kind, self.name, k)}
        if not opts:
            return self.name
        return self.name + ":" + ",".join(f"{k}={render_value(v)}" for k, v in opts.items())


#: the default of a structured parameter (:func:`structured_params`): unlike any value
_NO_DEFAULT = object()


def _default(kind: str, name: str, key: str) -> Any:
    for o in options_of(kind, name):
        if o.name == key:
            return o.default
    return _NO_DEFAULT


@dataclass(frozen=True)
class Spec:
    """A parsed spec: the components given, in the order given (kinds left out take defaults)."""

    text: str
    components: tuple[Component, ...]

    def component(self, kind: str) -> Component | None:
        return next((c for c in self.components if c.kind == kind), None)

    def canonical(self) -> str:
        """A string that parses to the same policies: components in kind order (release,
        routing, admission, retention), non-default options sorted."""
        order = {"release": 0, "routing": 1, "admission": 2, "retention": 3}
        comps = sorted(self.components, key=lambda c: order.get(c.kind, 9))
        return "+".join(c.canonical() for c in comps)

    def resolved(self, defaults: Mapping[str, str]) -> dict[str, dict[str, Any]]:
        """Per kind: ``{"name": ..., "options": {every option: value}}``, defaults included."""
        out: dict[str, dict[str, Any]] = {}
        for kind, default in defaults.items():
            c = self.component(kind) or Component(kind, default)
            out[kind] = {"name": c.name, "options": c.resolved()}
        return out


_KEY = re.compile(r"^\s*[A-Za-z_][A-Za-z0-9_]*\s*=")


def split_specs(text: str) -> list[str]:
    """``a,b:k=1,j=2,c`` -> ``["a", "b:k=1,j=2", "c"]``: a piece of the form ``key=value``
    continues the spec before it."""
    out: list[str] = []
    for piece in text.split(","):
        if not piece.strip():
            continue
        if _KEY.match(piece) and out and ":" in out[-1].rsplit("+", 1)[-1]:
            out[-1] += "," + piece.strip()
        else:
            out.append(piece.strip())
    return out


def parse(spec: str, registries: Mapping[str, Registry[Any]]) -> Spec:
    """Parse ``spec``; raises SpecError (unknown name, kind named twice, bad option)."""
    comps: list[Component] = []
    seen: dict[str, str] = {}
    for raw in spec.split("+"):
        head, _, opts = raw.partition(":")
        name = head.strip()
        target, fixed = ALIASES.get(name, (name, {}))
        kinds = [k for k, reg in registries.items() if target in reg]
        if not name or not kinds:
            valid = ", ".join(f"{k}: {'/'.join(_names(k, r))}" for k, r in registries.items())
            raise SpecError(f"unknown policy {name!r} in spec {spec!r}; valid names — {valid}")
        kind = kinds[0]
        if kind in seen:
            raise SpecError(f"spec {spec!r} names two {kind} policies: {seen[kind]!r} and {name!r}")
        seen[kind] = name
        given = dict(fixed)
        given.update(parse_options(kind, target, opts, registries[kind]))
        comps.append(Component(kind, target, given))
    return Spec(spec, tuple(comps))


def _names(kind: str, reg: Registry[Any]) -> list[str]:
    return sorted([*reg.names(), *(a for a, (t, _) in ALIASES.items() if t in reg)])


def parse_options(kind: str, name: str, text: str, registry: Registry[Any]) -> dict[str, Any]:
    """``k=v,k=v`` for ``name`` as typed, checked values."""
    declared = {o.name: o for o in options_of(kind, name, registry)}
    out: dict[str, Any] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq:
            raise SpecError(f"{name}: option {item.strip()!r} is not key=value; "
                            f"valid keys: {_keys(declared)}")
        out[key] = check_option(name, declared, key, raw)
    return out


def check_option(name: str, declared: Mapping[str, Option], key: str, raw: Any) -> Any:
    """One option's value (text from a spec, or a typed value from a config file), checked."""
    opt = declared.get(key)
    if opt is None:
        raise SpecError(f"{name}: unknown option {key!r}; valid keys: {_keys(declared)}")
    try:
        return opt.parse(raw) if isinstance(raw, str) else opt.check(raw)
    except SpecError as e:
        raise SpecError(f"{name}: {e}; valid keys: {_keys(declared)}") from None


def _keys(declared: Mapping[str, Option]) -> str:
    return ", ".join(declared) if declared else "(none: it takes no options)"


def configurations(registries: Mapping[str, Registry[Any]]) -> dict[str, list[str]]:
    """Every name a spec may use, by kind (registered names and aliases)."""
    return {k: _names(k, r) for k, r in registries.items()}
