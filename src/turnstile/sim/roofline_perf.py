"""The roofline performance model, and the GPU and model constants it reads.

:class:`RooflinePerf` prices an engine iteration (the four features of
:class:`~turnstile.sim.perf.PerfModel`) as FLOPs against HBM bytes for a named GPU and model; it
is the default when nothing was measured on a real engine.

GPU and model constants live in ``data/gpus.json`` and ``data/models.json`` (each entry cites its
source); :func:`load_gpu` and :func:`load_model` read them by name, case-insensitively.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from turnstile.core.registry import UnknownNameError

_DATA = Path(__file__).parent / "data"


# ---------------------------------------------------------------------------------------------
# hardware and model constants


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU: dense BF16 peak, HBM bandwidth and capacity, link, price and power."""

    name: str
    peak_tflops: float
    hbm_tbps: float
    memory_gb: float
    interconnect_gbps: float
    price_per_hour: float
    power_w: float
    source: str = ""

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tbps * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A transformer's shape. MoE models set ``num_experts`` and ``experts_per_token``."""

    name: str
    params: float
    active_params: float
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    intermediate_size: int = 0
    vocab_size: int = 0
    tie_embeddings: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    source: str = ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_width(self) -> int:
        """Width of the query projection (``num_heads × head_dim``)."""
        return self.num_heads * self.head_dim

    @property
    def weight_bytes(self) -> float:
        """All weights (every expert of an MoE model), in bytes."""
        return self.params * self.dtype_bytes

    def kv_bytes_per_token(self, tp: int = 1) -> float:
        """KV bytes per token on one GPU of a ``tp``-way group.

        KV heads are split across the group; when ``tp`` exceeds the KV heads each GPU keeps a
        replica of one head (as serving engines shard them), so the per-GPU size stops shrinking.
        """
        heads_per_gpu = max(1, self.num_kv_heads // tp)
        return 2.0 * self.num_layers * heads_per_gpu * self.head_dim * self.dtype_bytes

    def shape_params(self) -> tuple[float, float]:
        """(total, active) parameters recomputed from the shape (a consistency check)."""
        h, L = self.hidden_size, self.num_layers
        attn = h * self.attention_width * 2 + h * self.num_kv_heads * self.head_dim * 2
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        if self.is_moe:
            expert = 3 * h * self.intermediate_size
            router = h * self.num_experts
            total = embed + L * (attn + router + self.num_experts * expert)
            active = embed + L * (attn + router + self.experts_per_token * expert)
            return float(total), float(active)
        total = embed + L * (attn + 3 * h * self.intermediate_size)
        return float(total), float(total)


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


@cache
def _table(kind: str) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    raw = json.loads((_DATA / f"{kind}.json").read_text())
    if raw.get("format") != f"turnstile-{kind}" or raw.get("version") != 1:
        raise ValueError(f"{kind}.json: unexpected format/version header")
    entries: dict[str, dict[str, Any]] = raw[kind]
    index: dict[str, str] = {}
    for canonical, entry in entries.items():
        for alias in (canonical, *entry.get("aliases", ())):
            index[_norm(alias)] = canonical
    return entries, index


def _lookup(kind: str, name: str) -> tuple[str, dict[str, Any]]:
    entries, index = _table(kind)
    canonical = index.get(_norm(name))
    if canonical is None:
        raise UnknownNameError(
            f"unknown {kind[:-1]} {name!r}; valid names: {', '.join(sorted(entries))}"
        )
    return canonical, entries[canonical]


@cache
def default_model() -> str:
    """The model a simulation runs when none is named (``data/models.json``'s ``default``)."""
    return str(json.loads((_DATA / "models.json").read_text())["default"])


def gpu_names() -> list[str]:
    return sorted(_table("gpus")[0])


def model_names() -> list[str]:
    return sorted(_table("models")[0])


def load_gpu(name: str) -> GpuSpec:
    """A GPU by name or alias (``"H100"``, ``"h100-sxm"``, ``"A100-80G"``), case-insensitive."""
    canonical, e = _lookup("gpus", name)
    return GpuSpec(
        name=canonical,
        peak_tflops=float(e["peak_tflops"]),
        hbm_tbps=float(e["hbm_tbps"]),
        memory_gb=float(e["memory_gb"]),
        interconnect_gbps=float(e["interconnect_gbps"]),
        price_per_hour=float(e["price_per_hour"]),
        power_w=float(e["power_w"]),
        source=e.get("source", ""),
    )


def load_model(name: str) -> ModelSpec:
    """A model by name or Hugging Face id (``"qwen3-8b"``, ``"Qwen/Qwen3-8B"``)."""
    canonical, e = _lookup("models", name)
    return ModelSpec(
        name=canonical,
        params=float(e["params"]),
        active_params=float(e["active_params"]),
        num_layers=int(e["num_layers"]),
        hidden_size=int(e["hidden_size"]),
        num_heads=int(e["num_heads"]),
        num_kv_heads=int(e["num_kv_heads"]),
        head_dim=int(e["head_dim"]),
        dtype_bytes=int(e.get("dtype_bytes", 2)),
        intermediate_size=int(e.get("intermediate_size", 0)),
        vocab_size=int(e.get("vocab_size", 0)),
        tie_embeddings=bool(e.get("tie_embeddings", False)),
        num_experts=int(e.get("num_experts", 0)),
        experts_per_token=int(e.get("experts_per_token", 0)),
        source=e.get("source", ""),
    )


def as_gpu(gpu: GpuSpec | str) -> GpuSpec:
    """``gpu`` itself, or the GPU of that name."""
    return load_gpu(gpu) if isinstance(gpu, str) else gpu


def as_model(model: ModelSpec | str) -> ModelSpec:
    """``model`` itself, or the model of that name."""
    return load_model(model) if isinstance(model, str) else model


def kv_capacity_tokens(
    gpu: GpuSpec | str,
    model: ModelSpec | str,
    tp: int = 1,
    gpu_mem_util: float = 0.9,
    reserve_gb: float = 1.0,
) -> int:
    """KV-cache capacity in tokens of a ``tp``-GPU engine (``gpu_mem_util``: the fraction of GPU
    memory the engine may use).

    Per GPU: ``memory × gpu_mem_util − weights / tp − reserve_gb`` (activations, CUDA graphs),
    divided by the per-GPU KV bytes per token. Every GPU of the group holds the same tokens, so
    this is also the engine's capacity.
    """
    g, m = as_gpu(gpu), as_model(model)
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    free = g.memory_bytes * gpu_mem_util - m.weight_bytes / tp - reserve_gb * 1e9
    if free <= 0:
        raise ValueError(
            f"{m.name} ({m.weight_bytes / 1e9:.1f} GB of weights) does not fit on {tp}× {g.name} "
            f"at gpu_mem_util={gpu_mem_util}: raise tp or gpu_mem_util"
        )
    return int(free // m.kv_bytes_per_token(tp))


# ---------------------------------------------------------------------------------------------
# roofline


class RooflinePerf:
    """``max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth) + overheads``.

    * FLOPs = ``2·active_params·(prefill + decode tokens) + 4·layers·attention_width·pairs``
      with ``pairs = kv_read_tokens + prefill_attn_tokens2`` (decode attention reads each
      context token once; prefill pairs are causal; the prefill-prefix part of
      ``kv_read_tokens`` is counted twice, an error below one token pair per chunk token).
    * bytes per GPU = ``weight_bytes / tp`` (all weights, every expert, once per step) +
      ``kv_read_tokens × kv_bytes_per_token``.
    * overheads: ``overhead_s`` per step (scheduling, launches, sampling) and, when ``tp > 1``,
      two all-reduces per layer: ``2·layers·(allreduce_latency_s + 2(tp−1)/tp · tokens·hidden·
      dtype / interconnect)``.

    ``flops_eff`` and ``bw_eff`` are the achievable fractions of peak (docs/design.md: ~0.6–0.75 of
    peak FLOPs for large GEMMs, ~0.8–0.9 of HBM bandwidth).
    """

    __slots__ = (
        "_ar_s",
        "_ar_tok_s",
        "_attn_s",
        "_flop_s",
        "_kv_s",
        "_overhead_s",
        "_weights_s",
        "bw_eff",
        "flops_eff",
        "gpu",
        "kv_bytes_per_token",
        "model",
        "name",
        "overhead_s",
        "tp",
        "weight_bytes_per_gpu",
    )

    def __init__(
        self,
        gpu: GpuSpec | str,
        model: ModelSpec | str,
        tp: int = 1,
        flops_eff: float = 0.65,
        bw_eff: float = 0.85,
        overhead_s: float = 0.002,
        allreduce_latency_s: float = 5e-6,
    ) -> None:
        g, m = as_gpu(gpu), as_model(model)
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        if not (0 < flops_eff <= 1 and 0 < bw_eff <= 1):
            raise ValueError("flops_eff and bw_eff must be in (0, 1]")
        self.gpu, self.model, self.tp = g, m, tp
        self.flops_eff, self.bw_eff, self.overhead_s = flops_eff, bw_eff, overhead_s
        self.name = f"roofline:{m.name}@{g.name}x{tp}"
        self.kv_bytes_per_token = m.kv_bytes_per_token(tp)
        self.weight_bytes_per_gpu = m.weight_bytes / tp
        flops_per_s = g.peak_flops * tp * flops_eff
        bytes_per_s = g.hbm_bytes_per_s * bw_eff  # per GPU; bytes below are per GPU too
        self._flop_s = 2.0 * m.active_params / flops_per_s
        self._attn_s = 4.0 * m.num_layers * m.attention_width / flops_per_s
        self._weights_s = self.weight_bytes_per_gpu / bytes_per_s
        self._kv_s = self.kv_bytes_per_token / bytes_per_s
        if tp > 1:
            self._ar_s = 2.0 * m.num_layers * allreduce_latency_s
            ring = 2.0 * (tp - 1) / tp
            self._ar_tok_s = (
                2.0
                * m.num_layers
                * ring
                * m.hidden_size
                * m.dtype_bytes
                / (g.interconnect_gbps * 1e9)
            )
        else:
            self._ar_s = 0.0
            self._ar_tok_s = 0.0
        self._overhead_s = overhead_s + self._ar_s

    def step_time(
        self,
        prefill_tokens: int,
        decode_seqs: int,
        kv_read_tokens: int,
        prefill_attn_tokens2: float = 0.0,
        passes: tuple[int, int] | None = None,  # never given: no ``lane_ubatch``
        prompts: Sequence[tuple[int, int]] | None = None,  # never given, as ``passes``
    ) -> float:
        tokens = prefill_tokens + decode_seqs
        compute = self._flop_s * tokens + self._attn_s * (kv_read_tokens + prefill_attn_tokens2)
        memory = self._weights_s + self._kv_s * kv_read_tokens
        busy = compute if compute > memory else memory
        return busy + self._overhead_s + self._ar_tok_s * tokens

    def __repr__(self) -> str:
        return f"<RooflinePerf {self.name} eff={self.flops_eff}/{self.bw_eff}>"
