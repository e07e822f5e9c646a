"""What a synthetic agentic workload is made of, and its JSON form.

* :class:`Dist`: a positive distribution (empirical inverse-CDF quantiles that keep the heavy
  tail, or a clipped lognormal).
* :class:`ToolSpec`: one tool name's call probability, latency (a lognormal mixture plus a timeout
  point mass), error probability and result size.
* :class:`SynthSpec`: turns per workflow, first-prompt size, new input tokens per later turn,
  output tokens, how many tool calls follow a non-final turn, and the tools.
* :func:`save_spec` / :func:`load_spec`: the JSON file (``turnstile traces fit -o``).

Fitting lives in :mod:`turnstile.workload.synth_fit`, drawing in :mod:`turnstile.workload.synth`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

#: probabilities of the stored quantiles: dense in the tail, where heavy-tailed data lives
QUANTILE_PROBS: tuple[float, ...] = tuple(
    [round(i / 100, 4) for i in range(0, 90)]
    + [round(0.90 + i / 200, 4) for i in range(0, 18)]
    + [round(0.99 + i / 1000, 4) for i in range(0, 11)]
)

DistKind = Literal["empirical", "lognormal"]


@dataclass(frozen=True)
class Dist:
    """A positive distribution.

    ``empirical``: inverse CDF through ``(probs[i], quantiles[i])``, linearly interpolated (keeps
    the observed tail up to the observed maximum). ``lognormal``: ``exp(N(mu, sigma))`` clipped to
    ``[lo, hi]``.
    """

    kind: DistKind
    quantiles: tuple[float, ...] = ()
    probs: tuple[float, ...] = ()
    mu: float = 0.0
    sigma: float = 0.0
    lo: float = 0.0
    hi: float = math.inf

    @staticmethod
    def empirical(values: Any, probs: Sequence[float] = QUANTILE_PROBS) -> Dist:
        a = np.asarray(values, dtype=np.float64)
        if a.size == 0:
            raise ValueError("cannot fit a distribution to no values")
        q = np.quantile(a, probs)
        qs = tuple(round(float(x), 4) for x in q)
        return Dist("empirical", qs, tuple(float(p) for p in probs))

    @staticmethod
    def lognormal(mu: float, sigma: float, lo: float = 0.0, hi: float = math.inf) -> Dist:
        return Dist("lognormal", mu=float(mu), sigma=float(sigma), lo=float(lo), hi=float(hi))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "empirical":
            return np.interp(rng.random(n), self.probs, self.quantiles)
        x = rng.lognormal(self.mu, self.sigma, n)
        return np.clip(x, self.lo, self.hi)

    def quantile(self, p: float) -> float:
        if self.kind == "empirical":
            return float(np.interp(p, self.probs, self.quantiles))
        from statistics import NormalDist

        z = NormalDist().inv_cdf(min(max(p, 1e-12), 1 - 1e-12))
        return float(min(max(math.exp(self.mu + self.sigma * z), self.lo), self.hi))

    def to_dict(self) -> dict[str, Any]:
        if self.kind == "empirical":
            return {
                "kind": "empirical",
                "probs": list(self.probs),
                "quantiles": list(self.quantiles),
            }
        d: dict[str, Any] = {"kind": "lognormal", "mu": self.mu, "sigma": self.sigma, "lo": self.lo}
        if math.isfinite(self.hi):
            d["hi"] = self.hi
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Dist:
        if d["kind"] == "empirical":
            probs, qs = tuple(map(float, d["probs"])), tuple(map(float, d["quantiles"]))
            if len(probs) != len(qs) or len(probs) < 2:
                raise ValueError("empirical Dist needs matching probs and quantiles (>= 2)")
            return Dist("empirical", qs, probs)
        if d["kind"] == "lognormal":
            return Dist.lognormal(d["mu"], d["sigma"], d.get("lo", 0.0), d.get("hi", math.inf))
        raise ValueError(f"unknown Dist kind {d['kind']!r}")


@dataclass(frozen=True)
class ToolSpec:
    """One tool name: how often it is called and how it behaves.

    Latency: with probability ``timeout_prob`` exactly ``timeout_s`` (status ``timeout``), else a
    draw from the lognormal mixture ``latency`` (``(weight, mu, sigma)`` of ``ln seconds``)
    clipped to ``max_s``; then ``error`` with probability ``error_prob``.
    """

    name: str
    prob: float
    latency: tuple[tuple[float, float, float], ...]
    error_prob: float = 0.0
    timeout_prob: float = 0.0
    timeout_s: float = 120.0
    max_s: float = math.inf
    #: lognormal (mu, sigma) of the result size in tokens, or None when unknown
    result_tokens: tuple[float, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "prob": round(self.prob, 6),
            "latency": [[round(w, 6), round(m, 6), round(s, 6)] for w, m, s in self.latency],
            "error_prob": round(self.error_prob, 6),
            "timeout_prob": round(self.timeout_prob, 6),
            "timeout_s": self.timeout_s,
        }
        if math.isfinite(self.max_s):
            d["max_s"] = round(self.max_s, 6)
        if self.result_tokens is not None:
            d["result_tokens"] = [round(x, 6) for x in self.result_tokens]
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ToolSpec:
        rt = d.get("result_tokens")
        return ToolSpec(
            name=str(d["name"]),
            prob=float(d["prob"]),
            latency=tuple((float(w), float(m), float(s)) for w, m, s in d["latency"]),
            error_prob=float(d.get("error_prob", 0.0)),
            timeout_prob=float(d.get("timeout_prob", 0.0)),
            timeout_s=float(d.get("timeout_s", 120.0)),
            max_s=float(d.get("max_s", math.inf)),
            result_tokens=(float(rt[0]), float(rt[1])) if rt is not None else None,
        )


@dataclass(frozen=True)
class SynthSpec:
    """Everything :func:`generate` needs; JSON round-trips through ``to_dict``/``from_dict``."""

    name: str
    turns: Dist
    first_prompt_tokens: Dist
    #: new tokens appended by each later turn (tool results, user text)
    input_tokens: Dist
    output_tokens: Dist
    #: P(k tool calls) after a non-final turn, k = 0, 1, 2, ...; the final turn calls none
    tools_per_turn: tuple[float, ...]
    tools: tuple[ToolSpec, ...]
    max_prompt_tokens: int | None = None
    #: provenance and fitted summary numbers (free-form)
    info: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def error_prob(self) -> float:
        """Overall probability that a tool call fails (weighted over tools)."""
        total = sum(t.prob for t in self.tools) or 1.0
        return sum(t.prob * t.error_prob for t in self.tools) / total

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "turns": self.turns.to_dict(),
            "first_prompt_tokens": self.first_prompt_tokens.to_dict(),
            "input_tokens": self.input_tokens.to_dict(),
            "output_tokens": self.output_tokens.to_dict(),
            "tools_per_turn": [round(p, 6) for p in self.tools_per_turn],
            "tools": [t.to_dict() for t in self.tools],
            "max_prompt_tokens": self.max_prompt_tokens,
            "info": self.info,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> SynthSpec:
        mp = d.get("max_prompt_tokens")
        return SynthSpec(
            name=str(d["name"]),
            turns=Dist.from_dict(d["turns"]),
            first_prompt_tokens=Dist.from_dict(d["first_prompt_tokens"]),
            input_tokens=Dist.from_dict(d["input_tokens"]),
            output_tokens=Dist.from_dict(d["output_tokens"]),
            tools_per_turn=tuple(float(p) for p in d["tools_per_turn"]),
            tools=tuple(ToolSpec.from_dict(t) for t in d["tools"]),
            max_prompt_tokens=int(mp) if mp is not None else None,
            info=dict(d.get("info") or {}),
        )


def save_spec(spec: SynthSpec, path: str | Path, note: str = "") -> None:
    d = spec.to_dict()
    if note:
        d = {"_note": note, **d}
    # one top-level key per line, values compact: small diffs when refitted
    body = ",\n".join(
        f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}"
        for k, v in d.items()
    )
    Path(path).write_text("{\n" + body + "\n}\n", encoding="utf-8")


def load_spec(path: str | Path) -> SynthSpec:
    return SynthSpec.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
