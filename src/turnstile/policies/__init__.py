"""Policies behind the four core interfaces, registered by CLI name.

A *policy spec* names one configuration: component names joined by ``+`` in any order, e.g.
``eager`` or ``cvar+kv-affinity+ttl``. Each name is looked up in whichever registry holds it;
kinds left out take their defaults. ``--policies`` takes several specs separated by commas.
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
    gated,
    release,
    retention,
    routing,
)
from turnstile.policies.base import ADMISSION, RELEASE, RETENTION, ROUTING

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
        """The one way to build a set: ``spec`` names the policies (``cvar+kv-affinity``),
        ``params`` gives constructor arguments per kind (``{"release": {"budget": 8}}``, a
        gateway's ``[policy.release]`` table), ``router`` an already-built routing policy
        used in place of the one the spec names (a rollout ablation). Raises ValueError on an
        unknown name or kind and on bad parameters."""
        params = params or {}
        for kind in params:
            if kind not in _BY_KIND:
                raise ValueError(f"unknown policy kind {kind!r}; valid: {', '.join(_BY_KIND)}")
        chosen = dict(DEFAULTS)
        given: dict[str, str] = {}
        for raw in spec.split("+"):
            name = raw.strip()
            kinds = [k for k, reg in _BY_KIND.items() if name in reg]
            if not kinds:
                valid = ", ".join(f"{k}: {'/'.join(r.names())}" for k, r in _BY_KIND.items())
                raise ValueError(f"unknown policy {name!r} in spec {spec!r}; valid names — {valid}")
            kind = kinds[0]
            if kind in given:
                raise ValueError(
                    f"spec {spec!r} names two {kind} policies: {given[kind]!r} and {name!r}"
                )
            given[kind] = name
            chosen[kind] = name

        def make(kind: str) -> Any:
            if kind not in params:
                return _BY_KIND[kind].create(chosen[kind])
            try:
                return _BY_KIND[kind].create(chosen[kind], **params[kind])
            except TypeError as e:
                bad = f"bad parameters for {kind} policy {chosen[kind]!r}: {e}"
                raise ValueError(bad) from None

        rel = make("release")
        # a release policy may declare the engine-queue order that goes with it (PLAS's
        # levels); it applies unless the spec names an admission policy or gives it parameters
        own = "admission" in given or "admission" in params
        adm = None if own else rel.admission_order()
        return cls(
            release=rel,
            routing=router if router is not None else make("routing"),
            admission=adm if adm is not None else make("admission"),
            retention=make("retention"),
            spec=spec,
        )


def parse_policy_list(specs: str) -> list[str]:
    """Split ``--policies a,b+c`` into specs, validating each; raises ValueError on unknowns."""
    out = [s.strip() for s in specs.split(",") if s.strip()]
    if not out:
        raise ValueError("no policy given")
    for s in out:
        PolicySet.from_spec(s)
    return out


def all_policy_names() -> dict[str, list[str]]:
    return {k: r.names() for k, r in _BY_KIND.items()}


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
    "all_policy_names",
    "parse_policy_list",
]
