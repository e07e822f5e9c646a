"""The policy registries, keyed by CLI name (``--policies cvar+kv-affinity+ttl``).

The interfaces a policy of each kind implements are declared by the core
(:mod:`turnstile.core.interfaces`); the actions and decisions they return are in
:mod:`turnstile.core.actions`.
"""

from __future__ import annotations

from turnstile.core.interfaces import (
    AdmissionPolicy,
    ReleasePolicy,
    RetentionPolicy,
    RoutingPolicy,
)
from turnstile.core.registry import Registry

RELEASE: Registry[ReleasePolicy] = Registry("release")
ROUTING: Registry[RoutingPolicy] = Registry("routing")
ADMISSION: Registry[AdmissionPolicy] = Registry("admission")
RETENTION: Registry[RetentionPolicy] = Registry("retention")
REGISTRIES: tuple[Registry, ...] = (RELEASE, ROUTING, ADMISSION, RETENTION)
