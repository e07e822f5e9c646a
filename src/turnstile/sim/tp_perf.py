"""Tensor-parallel performance: what a TP4 replica buys a straggler, and what it costs per GPU.

:class:`~turnstile.sim.roofline_perf.RooflinePerf` already splits weights and KV across a ``tp``
group and charges two all-reduces per layer, but with one bandwidth for every message size. Decode
moves small messages (``batch × hidden × 2`` bytes: kilobytes to a megabyte), where an all-reduce
is latency- and kernel-bound, far from the link's line rate; prefill moves large ones (a 4k-token
chunk of a 70B model is 64 MB), where NCCL's ring runs near its bus bandwidth. This module adds:

* :class:`InterconnectSpec` (``data/interconnects.json``, each entry cited): per GPU, the
  one-shot custom all-reduce line for small messages and NCCL's ring line for large ones;
* :class:`TpRooflinePerf`: the roofline with ``2·layers`` all-reduces per step, each costing
  ``min(a_small + r·B/bw_small, a_nccl + r·B/busbw)`` with ``r = 2(p−1)/p`` and ``B = tokens ×
  hidden × dtype`` (the engine picks the faster kernel), plus a per-layer overhead (kernel tails
  and launch gaps) that does not shrink with ``tp``;
* :func:`tp_perf_model` / :func:`tp_perf_factory`: the factories the simulator takes
  (``SimConfig(perf=tp_perf_factory(gpu, model))`` or ``EngineModel(perf=tp_perf_model(...))``);
* :func:`decode_latency_s`, :func:`per_gpu_throughput` and :func:`check_tp_reference`: the two laws
  and the check against published TP scaling figures (``data/tp_reference.json``).

The laws this produces (tests assert them): at batch 1 the per-token latency falls with ``tp``
(weights are read ``tp`` ways in parallel) but less than ``1/tp`` (all-reduce and per-layer costs
stay); at large batch the tokens per second *per GPU* fall with ``tp`` (compute is split, the
all-reduce volume per token is not, and the fixed costs are paid by ``tp`` GPUs).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from turnstile.core.registry import UnknownNameError
from turnstile.sim.perf import PerfModel
from turnstile.sim.roofline_perf import (
    _DATA,
    GpuSpec,
    ModelSpec,
    RooflinePerf,
    as_model,
    kv_capacity_tokens,
    load_gpu,
)

__all__ = [
    "DEFAULT_LAYER_OVERHEAD_S",
    "InterconnectSpec",
    "ReferenceCheck",
    "TpRooflinePerf",
    "check_tp_reference",
    "decode_latency_s",
    "interconnect_names",
    "load_interconnect",
    "max_decode_batch",
    "per_gpu_throughput",
    "tp_gpu",
    "tp_perf_factory",
    "tp_perf_model",
    "tp_scaling_table",
]

#: per-layer cost that does not shrink with TP: ~10 kernels per decoder layer (norms, QKV, rope,
#: attention, output, gate/up, activation, down, residuals), each leaving ~1 µs of tail or
#: launch gap even under CUDA graphs. An assumption, not a measurement; the reference check
#: (docs/rollout-tp-model.md) shows its effect.
DEFAULT_LAYER_OVERHEAD_S = 10e-6


@dataclass(frozen=True, slots=True)
class InterconnectSpec:
    """One GPU's tensor-parallel all-reduce constants (see ``data/interconnects.json``)."""

    gpu: str
    link: str
    #: marketed per-GPU NVLink (or PCIe) bandwidth, both directions together, GB/s
    nvlink_bidir_gbps: float
    #: NCCL ring bus bandwidth for large messages, GB/s (≈80% of the one-way line rate)
    busbw_gbps: float
    nccl_latency_us: float
    #: one-shot custom all-reduce (serving engines' own kernel) for decode-sized messages:
    #: intercept and slope
    small_latency_us: float
    small_gbps: float
    #: for GPUs missing from gpus.json: the GPU they are derived from
    base_gpu: str = ""
    source: str = ""

    def allreduce_s(self, nbytes: float, tp: int) -> float:
        """Seconds for one all-reduce of ``nbytes`` (per GPU) over ``tp`` GPUs (0 when tp=1)."""
        if tp <= 1:
            return 0.0
        ring = 2.0 * (tp - 1) / tp * nbytes
        small = self.small_latency_us * 1e-6 + ring / (self.small_gbps * 1e9)
        large = self.nccl_latency_us * 1e-6 + ring / (self.busbw_gbps * 1e9)
        return small if small < large else large


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


@cache
def _interconnects() -> dict[str, dict[str, Any]]:
    raw = json.loads((_DATA / "interconnects.json").read_text())
    if raw.get("format") != "turnstile-interconnects" or raw.get("version") != 1:
        raise ValueError("interconnects.json: unexpected format/version header")
    return dict(raw["interconnects"])


def interconnect_names() -> list[str]:
    return sorted(_interconnects())


def _canonical(name: str) -> str:
    """The interconnect table's key for ``name`` (its own keys, then gpus.json aliases)."""
    table = _interconnects()
    by_norm = {_norm(k): k for k in table}
    key = by_norm.get(_norm(name))
    if key is None and _norm(name) in {"a800", "a800-sxm", "a800-sxm4-80gb"}:
        key = "A800-80G"
    if key is None:
        try:
            key = load_gpu(name).name
        except UnknownNameError:
            key = None
        if key not in table:
            raise UnknownNameError(
                f"no interconnect data for GPU {name!r}; valid names: "
                f"{', '.join(interconnect_names())}"
            )
    return key


def load_interconnect(gpu: GpuSpec | str) -> InterconnectSpec:
    """The all-reduce constants of a GPU, by name or alias (``"H100"``, ``"A800"``)."""
    key = _canonical(gpu.name if isinstance(gpu, GpuSpec) else gpu)
    e = _interconnects()[key]
    return InterconnectSpec(
        gpu=key,
        link=str(e.get("link", "")),
        nvlink_bidir_gbps=float(e["nvlink_bidir_gbps"]),
        busbw_gbps=float(e["busbw_gbps"]),
        nccl_latency_us=float(e["nccl_latency_us"]),
        small_latency_us=float(e["small_latency_us"]),
        small_gbps=float(e["small_gbps"]),
        base_gpu=str(e.get("base_gpu", "")),
        source=str(e.get("source", "")),
    )


def tp_gpu(gpu: GpuSpec | str) -> GpuSpec:
    """A GPU from gpus.json, or one the interconnect table derives (``A800``: an A100 with
    400 GB/s NVLink); ``interconnect_gbps`` is the marketed bidirectional figure either way."""
    if isinstance(gpu, GpuSpec):
        return gpu
    try:
        return load_gpu(gpu)
    except UnknownNameError:
        pass
    ic = load_interconnect(gpu)
    if not ic.base_gpu:
        return load_gpu(gpu)
    base = load_gpu(ic.base_gpu)
    return dataclasses.replace(
        base, name=ic.gpu, interconnect_gbps=ic.nvlink_bidir_gbps, source=ic.source
    )


class TpRooflinePerf(RooflinePerf):
    """:class:`RooflinePerf` with message-size-aware all-reduces and a per-layer overhead.

    ``step_time = max(compute, memory) + overhead_s + layers·layer_overhead_s
    + 2·layers·allreduce(tokens·hidden·dtype)`` where compute and memory are the parent's (FLOPs
    split ``tp`` ways; weights and KV read per GPU) and ``allreduce`` is
    :meth:`InterconnectSpec.allreduce_s`. O(1) per call.
    """

    __slots__ = (
        "_ar_a_large",
        "_ar_a_small",
        "_ar_b_large",
        "_ar_b_small",
        "_n_ar",
        "interconnect",
        "layer_overhead_s",
    )

    def __init__(
        self,
        gpu: GpuSpec | str,
        model: ModelSpec | str,
        tp: int = 1,
        *,
        interconnect: InterconnectSpec | None = None,
        flops_eff: float = 0.65,
        bw_eff: float = 0.85,
        overhead_s: float = 0.002,
        layer_overhead_s: float = DEFAULT_LAYER_OVERHEAD_S,
    ) -> None:
        g, m = tp_gpu(gpu), as_model(model)
        super().__init__(g, m, tp, flops_eff=flops_eff, bw_eff=bw_eff, overhead_s=overhead_s,
                         allreduce_latency_s=0.0)
        ic = interconnect if interconnect is not None else load_interconnect(g)
        self.interconnect = ic
        self.layer_overhead_s = layer_overhead_s
        self.name = f"tp-roofline:{m.name}@{g.name}x{tp}"
        # the parent's single-bandwidth all-reduce term is replaced by the two-line one below
        self._ar_s = 0.0
        self._ar_tok_s = 0.0
        self._overhead_s = overhead_s + m.num_layers * layer_overhead_s
        self._n_ar = 2 * m.num_layers if tp > 1 else 0
        ring_bytes_per_token = 2.0 * (tp - 1) / tp * m.hidden_size * m.dtype_bytes
        self._ar_a_small = ic.small_latency_us * 1e-6
        self._ar_b_small = ring_bytes_per_token / (ic.small_gbps * 1e9)
        self._ar_a_large = ic.nccl_latency_us * 1e-6
        self._ar_b_large = ring_bytes_per_token / (ic.busbw_gbps * 1e9)

    def allreduce_s(self, tokens: int) -> float:
        """One all-reduce of the activations of ``tokens`` tokens (0 when tp=1)."""
        if not self._n_ar:
            return 0.0
        small = self._ar_a_small + self._ar_b_small * tokens
        large = self._ar_a_large + self._ar_b_large * tokens
        return small if small < large else large

    def comm_s(self, tokens: int) -> float:
        """All-reduce time of one step over ``tokens`` tokens (both all-reduces of every layer)."""
        return self._n_ar * self.allreduce_s(tokens)

    def step_time(
        self,
        prefill_tokens: int,
        decode_seqs: int,
        kv_read_tokens: int,
        prefill_attn_tokens2: float = 0.0,
        passes: tuple[int, int] | None = None,  # never given: no ``lane_ubatch``
        prompts: Sequence[tuple[int, int]] | None = None,  # never given, as ``passes``
    ) -> float:
        # the parent's roofline and overheads (its linear all-reduce term is zeroed above)
        t = RooflinePerf.step_time(
            self, prefill_tokens, decode_seqs, kv_read_tokens, prefill_attn_tokens2
        )
        if not self._n_ar:
            return t
        tokens = prefill_tokens + decode_seqs
        small = self._ar_a_small + self._ar_b_small * tokens
        large = self._ar_a_large + self._ar_b_large * tokens
        return t + self._n_ar * (small if small < large else large)

    def __repr__(self) -> str:
        return f"<TpRooflinePerf {self.name} eff={self.flops_eff}/{self.bw_eff}>"


def tp_perf_model(gpu: GpuSpec | str, model: ModelSpec | str, tp: int = 1,
                  **kwargs: Any) -> TpRooflinePerf:
    """The TP-aware performance model of a ``tp``-GPU replica (keywords: see
    :class:`TpRooflinePerf`). A :class:`~turnstile.sim.perf.PerfModel`: the engine model and the
    rollout simulator take it unchanged."""
    return TpRooflinePerf(gpu, model, tp, **kwargs)


def tp_perf_factory(gpu: GpuSpec | str, model: ModelSpec | str,
                    **kwargs: Any) -> Callable[[int], PerfModel]:
    """``tp → TpRooflinePerf`` (memoised), the shape ``rollout.sim.SimConfig.perf`` takes."""
    g, m = tp_gpu(gpu), as_model(model)
    made: dict[int, TpRooflinePerf] = {}

    def perf_for(tp: int) -> PerfModel:
        p = made.get(tp)
        if p is None:
            p = made[tp] = TpRooflinePerf(g, m, tp, **kwargs)
        return p

    return perf_for


# ---------------------------------------------------------------------------------------------
# the two laws


def decode_latency_s(perf: PerfModel, batch: int = 1, context_tokens: int = 1024) -> float:
    """Seconds per decode step (= per output token of each sequence) at ``batch`` sequences of
    ``context_tokens`` each."""
    return perf.step_time(0, batch, batch * (context_tokens + 1))


def per_gpu_throughput(perf: PerfModel, tp: int, batch: int, context_tokens: int = 1024) -> float:
    """Decode tokens per second per GPU of a ``tp``-GPU replica at ``batch`` sequences."""
    return batch / (decode_latency_s(perf, batch, context_tokens) * tp)


def max_decode_batch(gpu: GpuSpec | str, model: ModelSpec | str, tp: int,
                     context_tokens: int, cap: int = 1024) -> int:
    """Sequences of ``context_tokens`` whose KV fits a ``tp``-GPU replica (at most ``cap``, the
    engine's max_num_seqs)."""
    return max(0, min(cap, kv_capacity_tokens(tp_gpu(gpu), model, tp) // max(1, context_tokens)))


# ---------------------------------------------------------------------------------------------
# check against published figures


@dataclass(frozen=True, slots=True)
class ReferenceCheck:
    """One published figure, the model's prediction, and the relative error."""

    reference: str
    model: str
    gpu: str
    tp: int
    #: sequences decoding together; the metric is decode tokens per second of the replica
    batch: int
    published: float
    predicted: float

    @property
    def rel_err(self) -> float:
        """``predicted / published − 1`` (positive: the model is optimistic)."""
        return self.predicted / self.published - 1.0


@cache
def _reference_doc() -> dict[str, Any]:
    raw = json.loads((_DATA / "tp_reference.json").read_text())
    if raw.get("format") != "turnstile-tp-reference" or raw.get("version") != 1:
        raise ValueError("tp_reference.json: unexpected format/version header")
    return dict(raw)


def _reference_model(name: str) -> ModelSpec:
    models = _reference_doc()["models"]
    if name not in models:
        return as_model(name)
    e = models[name]
    return ModelSpec(
        name=name,
        **{k: e[k] for k in ("params", "active_params", "num_layers", "hidden_size",
                             "num_heads", "num_kv_heads", "head_dim")},
        dtype_bytes=int(e.get("dtype_bytes", 2)),
        intermediate_size=int(e.get("intermediate_size", 0)),
        vocab_size=int(e.get("vocab_size", 0)),
        source=str(e.get("source", "")),
    )


def check_tp_reference(**overrides: Any) -> list[ReferenceCheck]:
    """Predict every published figure of ``data/tp_reference.json`` with the reference's stated
    settings (``overrides`` replace them, e.g. ``layer_overhead_s=0`` to see that term's
    effect) and return the errors."""
    out: list[ReferenceCheck] = []
    for ref in _reference_doc()["references"]:
        settings = dict(ref.get("settings", {}))
        context = int(settings.pop("context_tokens", 1024))
        settings.update(overrides)
        for pt in ref["points"]:
            model = _reference_model(pt["model"])
            tp = int(pt["tp"])
            batch = int(pt.get("batch", 1))
            perf = TpRooflinePerf(ref["gpu"], model, tp, **settings)
            if ref["metric"] != "decode_tokens_per_s":
                raise ValueError(f"unknown reference metric {ref['metric']!r}")
            predicted = batch / decode_latency_s(perf, batch, context)
            out.append(ReferenceCheck(ref["name"], model.name, perf.gpu.name, tp, batch,
                                      float(pt["value"]), predicted))
    return out


def tp_scaling_table(
    gpu: GpuSpec | str,
    model: ModelSpec | str,
    tps: Sequence[int] = (1, 2, 4, 8),
    context_tokens: int = 4096,
    large_batch: int = 256,
    **kwargs: Any,
) -> list[dict[str, float]]:
    """Per ``tp``: batch-1 ms/token, and per-GPU tokens/s at ``large_batch`` (or as many
    sequences as fit), for the docs and the rollout planner's intuition."""
    rows: list[dict[str, float]] = []
    for tp in tps:
        try:
            fit = max_decode_batch(gpu, model, tp, context_tokens, cap=large_batch)
        except ValueError:  # weights do not fit at this tp
            continue
        perf = tp_perf_model(gpu, model, tp, **kwargs)
        rows.append({
            "tp": tp,
            "batch1_ms": 1e3 * decode_latency_s(perf, 1, context_tokens),
            "batch": fit,
            "per_gpu_tok_s": per_gpu_throughput(perf, tp, fit, context_tokens) if fit else 0.0,
        })
    return rows
