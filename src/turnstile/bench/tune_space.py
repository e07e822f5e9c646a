"""The configurations ``turnstile tune`` searches, declared as data (``turnstile tune --list``).

A *space* is an ordered list of :class:`Candidate`: a policy spec that ``bench`` and ``serve``
accept, and one line saying what it tries. ``eager`` (release every turn at once) is always
the first candidate: it is the baseline every other one must not harm.

``default``: each named release configuration on the default routing and retention, then the
retention choices (``ttl``: Continuum's learned time-to-live; ``infercept``: keep, offload or
drop by memory × time), a routing choice (``composite``) and a main option (``cvar-fixed``'s KV
gate fill, ``name:key=value``) on the release configurations they pair with. ``wide``: every
release configuration × retention × routing (for the benchmark of how the search time grows
with the space).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BASELINE", "SPACES", "Candidate", "custom_space", "get_space", "space_names"]

#: the spec every candidate is compared with
BASELINE = "eager"


@dataclass(frozen=True)
class Candidate:
    spec: str
    note: str


_RELEASE = {
    "auto": "the default: CVaR ordering with evidence-gated KV admission",
    "cvar": "WSPT order with CVaR tail weights, adaptive released-work budget",
    "cvar-fixed": "cvar with a fixed released-work budget (a fixed KV gate)",
    "plas": "least attained service per program",
    "fcfs-workflow": "first come first served by workflow arrival",
}
_RETENTION = {"lru": "LRU eviction", "ttl": "learned TTL retention",
              "infercept": "keep / offload / drop (InferCept)"}
_ROUTING = {"kv-affinity": "KV-affinity routing", "least-loaded": "least-loaded routing",
            "composite": "composite (affinity + load) routing"}


def _default() -> list[Candidate]:
    out = [Candidate(BASELINE, "release every turn at once (baseline)")]
    out += [Candidate(name, note) for name, note in _RELEASE.items()]
    out += [
        Candidate("auto+ttl", "auto with learned TTL retention"),
        Candidate("cvar-fixed+ttl", "cvar-fixed with learned TTL retention"),
        Candidate("auto+infercept", "auto with keep / offload / drop retention"),
        Candidate("cvar:budget=fixed,gate=fixed,kv_fill=0.65",
                  "cvar-fixed with its KV gate at 65% fill (default 50%)"),
        Candidate("cvar-fixed+composite", "cvar-fixed with composite routing"),
    ]
    return out


def _wide() -> list[Candidate]:
    out = [Candidate(BASELINE, "release every turn at once (baseline)")]
    for rel, rnote in _RELEASE.items():
        for ret, tnote in _RETENTION.items():
            for rt, onote in _ROUTING.items():
                parts = [rel] + [p for p, d in ((ret, "lru"), (rt, "kv-affinity")) if p != d]
                out.append(Candidate("+".join(parts), f"{rnote}; {tnote}; {onote}"))
    return out


SPACES = {"default": _default, "wide": _wide}


def space_names() -> list[str]:
    return list(SPACES)


def get_space(name: str) -> list[Candidate]:
    """The named space's candidates, the baseline first. ValueError on an unknown name."""
    try:
        return SPACES[name]()
    except KeyError:
        raise ValueError(f"--space {name!r}: expected one of {', '.join(SPACES)}") from None


def custom_space(specs: Sequence[str]) -> list[Candidate]:
    """A space from explicit specs (``--candidates``): the baseline first, then each spec
    once, in order."""
    out = [Candidate(BASELINE, "release every turn at once (baseline)")]
    for spec in specs:
        spec = spec.strip()
        if spec and spec not in {c.spec for c in out}:
            out.append(Candidate(spec, "given"))
    return out
