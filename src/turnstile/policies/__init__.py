"""Policies behind the four core interfaces, registered by CLI name.

A *policy spec* names one configuration: components joined by ``+`` in any order, each a name
with optional options, e.g. ``eager`` or ``cvar:budget=fixed+kv-affinity+ttl:max_ttl_s=30``.
Each name is looked up in whichever registry holds it; kinds left out take their defaults.
``--policies`` takes several specs separated by commas. The grammar, the declared options and
the API a search uses are in :mod:`turnstile.policies.spec`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from turnstile.core.interfaces import (
    AdmissionPolicy,
    ReleasePolicy,
    RetentionPolicy,
    RoutingPolicy,
)
from turnstile.core.registry import Registry

# importing the modules registers their policies
from turnstile.policies import (  # noqa: F401
    admission,
    auto,
    buckets,
    cmlfq,
    cvar,
    field,
    gated,
    release,
    retention,
    routing,
)
from turnstile.policies.base import ADMISSION, RELEASE, RETENTION, ROUTING
from turnstile.policies.spec import (
    Component,
    Spec,
    SpecError,
    check_option,
    configurations,
    options_of,
    parse,
    split_specs,
    structured_params,
)

DEFAULTS = {"release": "auto", "routing": "kv-affinity", "admission": "fcfs", "retention": "lru"}
_BY_KIND: dict[str, Registry[Any]] = {
    "release": RELEASE, "routing": ROUTING, "admission": ADMISSION, "retention": RETENTION,
}


@dataclass
class PolicySet:
    """One configuration: a policy of each kind, freshly constructed (policies hold state)."""

    release: ReleasePolicy
    routing: RoutingPolicy
    admission: AdmissionPolicy
    retention: RetentionPolicy
    spec: str = ""

    def __post_init__(self) -> None:
        # a retention policy that reads the release policy's holds (budget-keep) keeps it
        self.retention.bind(self.release)

    @classmethod
    def from_spec(
        cls,
        spec: str,
        params: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        router: RoutingPolicy | None = None,
    ) -> PolicySet:
        """The one way to build a set: ``spec`` names the policies and their options
        (``cvar:budget=fixed+kv-affinity``, grammar in :mod:`turnstile.policies.spec`),
        ``params`` gives further option values per kind (``{"release": {"kv_fill": 0.6}}``, a
        gateway's ``[policy.release]`` table; checked like the spec's), ``router`` an
        already-built routing policy used in place of the one the spec names (a rollout
        ablation). Raises :class:`~turnstile.policies.spec.SpecError` (a ValueError) on an
        unknown name, kind or option and on a value out of range."""
        parsed = resolve(spec, params)
        comps = {c.kind: c for c in parsed.components}

        def make(kind: str) -> Any:
            c = comps[kind]
            try:
                return _BY_KIND[kind].create(c.name, **c.kwargs())
            except TypeError as e:
                raise SpecError(f"bad options for {kind} policy {c.name!r}: {e}") from None

        rel = make("release")
        # a release policy may declare the engine-queue order that goes with it (PLAS's
        # levels); it applies unless the spec names an admission policy or gives it options
        own = comps["admission"].named
        adm = None if own else rel.admission_order()
        return cls(
            release=rel,
            routing=router if router is not None else make("routing"),
            admission=adm if adm is not None else make("admission"),
            retention=make("retention"),
            spec=spec,
        )


def resolve(spec: str, params: Mapping[str, Mapping[str, Any]] | None = None) -> Spec:
    """``spec`` parsed, with ``params`` merged into its components and every kind present
    (those the spec leaves out at their defaults); raises SpecError."""
    params = params or {}
    for kind in params:
        if kind not in _BY_KIND:
            raise SpecError(f"unknown policy kind {kind!r}; valid: {', '.join(_BY_KIND)}")
    parsed = parse(spec, _BY_KIND)
    named = {c.kind: c for c in parsed.components}
    comps = []
    for kind, default in DEFAULTS.items():
        c = named.get(kind)
        base = c if c is not None else Component(kind, default, named=False)
        if kind in params:
            extra = params[kind]
            declared = {o.name: o for o in options_of(kind, base.name)}
            merged = dict(base.given)
            structured = structured_params(registry_of(kind).factory(base.name))
            merged.update({k: v if k in structured and k not in declared
                           else check_option(base.name, declared, k, v)
                           for k, v in extra.items()})
            base = Component(kind, base.name, merged, named=True)
        comps.append(base)
    return Spec(spec, tuple(comps))


def registry_of(kind: str) -> Registry[Any]:
    """The registry of policies of ``kind`` (release, routing, admission, retention)."""
    return _BY_KIND[kind]


def parse_policy_list(specs: str) -> list[str]:
    """Split ``--policies a,b:k=1,j=2+c`` into specs (:func:`split_specs`), validating each;
    raises SpecError (a ValueError) on an unknown name or a bad option."""
    out = split_specs(specs)
    if not out:
        raise ValueError("no policy given")
    for s in out:
        PolicySet.from_spec(s)
    return out


def resolved_spec(spec: str) -> dict[str, Any]:
    """What ``results.json`` records for ``spec``: its canonical string and, per kind, the
    policy's name and every option's value, defaults included."""
    parsed = resolve(spec)
    return {"spec": spec, "canonical": parse(spec, _BY_KIND).canonical(),
            "policies": parsed.resolved(DEFAULTS)}


def all_policy_names() -> dict[str, list[str]]:
    """Every name a spec may use, by kind (registered names and aliases)."""
    return configurations(_BY_KIND)


__all__ = [
    "ADMISSION",
    "DEFAULTS",
    "RELEASE",
    "RETENTION",
    "ROUTING",
    "AdmissionPolicy",
    "PolicySet",
    "ReleasePolicy",
    "RetentionPolicy",
    "RoutingPolicy",
    "SpecError",
    "all_policy_names",
    "parse_policy_list",
    "registry_of",
    "resolve",
    "resolved_spec",
]
