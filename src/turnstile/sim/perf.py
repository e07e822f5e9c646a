"""Performance models: how long one engine iteration takes.

An engine iteration (one forward pass of a continuous-batching engine) is summarised by four
features, all cheap running sums the engine model keeps:

``prefill_tokens``
    new (uncached) prompt tokens computed this step, over all requests;
``decode_seqs``
    sequences decoding one token this step;
``kv_read_tokens``
    context tokens whose KV the attention reads this step (decode contexts plus the cached
    prefix of each prefill chunk);
``prefill_attn_tokens2``
    attention token pairs of the prefill chunks: for a chunk of ``n`` tokens after ``c``
    already-computed ones, ``n·c + n(n+1)/2`` (causal).

Two models implement :class:`PerfModel`:

* :class:`RooflinePerf`: FLOPs against HBM bytes for a named GPU and model (the default when
  nothing was measured);
* :class:`FittedPerf`: ``b0 + b1·prefill + b2·decode + b3·kv_read + b4·attn2``, fitted with
  non-negative least squares to step times measured on a real engine (:func:`fit_profile`) and
  stored as a ``turnstile-profile`` JSON file.

GPU and model constants live in ``data/gpus.json`` and ``data/models.json`` (each entry cites its
source); :func:`load_gpu` and :func:`load_model` read them by name, case-insensitively.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from turnstile.core.registry import UnknownNameError

_DATA = Path(__file__).parent / "data"

PROFILE_FORMAT = "turnstile-profile"
PROFILE_VERSION = 1


@runtime_checkable
class PerfModel(Protocol):
    """Seconds per engine iteration. ``step_time`` must be O(1): it runs once per iteration."""

    #: a short label for reports (``roofline:llama-3.1-8b@H100-SXMx1``, ``fitted:llama.cpp/...``)
    name: str
    #: KV-cache bytes per token on *one* GPU of the tensor-parallel group (what one GPU stores
    #: and what one GPU's host link moves when the offload tier reloads a block)
    kv_bytes_per_token: float

    def step_time(
        self,
        prefill_tokens: int,
        decode_seqs: int,
        kv_read_tokens: int,
        prefill_attn_tokens2: float = 0.0,
    ) -> float: ...


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
        replica of one head (vLLM's behaviour), so the per-GPU size stops shrinking.
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
    """KV-cache capacity in tokens of a ``tp``-GPU engine (vLLM's ``gpu_memory_utilization``).

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

    ``flops_eff`` and ``bw_eff`` are the achievable fractions of peak (DESIGN.md: ~0.6–0.75 of
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
    ) -> float:
        tokens = prefill_tokens + decode_seqs
        compute = self._flop_s * tokens + self._attn_s * (kv_read_tokens + prefill_attn_tokens2)
        memory = self._weights_s + self._kv_s * kv_read_tokens
        busy = compute if compute > memory else memory
        return busy + self._overhead_s + self._ar_tok_s * tokens

    def __repr__(self) -> str:
        return f"<RooflinePerf {self.name} eff={self.flops_eff}/{self.bw_eff}>"


# ---------------------------------------------------------------------------------------------
# fitted


FEATURES: tuple[str, ...] = (
    "prefill_tokens",
    "decode_seqs",
    "kv_read_tokens",
    "prefill_attn_tokens2",
)


@dataclass(slots=True)
class FittedPerf:
    """``step_time = b0 + b1·prefill + b2·decode + b3·kv_read + b4·attn2`` (all ``b ≥ 0``),
    plus, when fitted, a small-chunk attention term ``b5·attn2·k/(k + prefill)``.

    The extra term is what a CPU engine shows (llama.cpp): a prefill chunk of a few tokens
    appended to a long cached context pays more per attention pair than a large chunk (the
    attention runs as matrix-vector products instead of a tiled matrix product), so each pair
    costs ``b4 + b5`` when the step's prefill is much smaller than the knee ``k``
    (``small_chunk_tokens``) and ``b4`` when much larger. ``b5 = 0`` is the linear model.
    """

    b0: float
    b1: float = 0.0
    b2: float = 0.0
    b3: float = 0.0
    b4: float = 0.0
    kv_bytes_per_token: float = 0.0
    engine: str = ""
    model: str = ""
    measured_at: str = ""
    #: fit diagnostics and provenance (samples, rmse_s, r2, hardware...)
    meta: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    #: extra seconds per attention pair of a small prefill chunk (0: the linear model)
    b5: float = 0.0
    #: the knee ``k`` of the small-chunk term, in prefill tokens per step
    small_chunk_tokens: float = 0.0

    def __post_init__(self) -> None:
        if not self.name:
            self.name = f"fitted:{self.engine or '?'}/{self.model or '?'}"

    @property
    def coefficients(self) -> tuple[float, float, float, float, float]:
        return (self.b0, self.b1, self.b2, self.b3, self.b4)

    def step_time(
        self,
        prefill_tokens: int,
        decode_seqs: int,
        kv_read_tokens: int,
        prefill_attn_tokens2: float = 0.0,
    ) -> float:
        t = (
            self.b0
            + self.b1 * prefill_tokens
            + self.b2 * decode_seqs
            + self.b3 * kv_read_tokens
            + self.b4 * prefill_attn_tokens2
        )
        if self.b5:
            k = self.small_chunk_tokens
            t += self.b5 * prefill_attn_tokens2 * k / (k + prefill_tokens)
        return t

    # -- profile files -------------------------------------------------------------------------

    def to_profile(self, path: str | Path) -> None:
        doc = {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "engine": self.engine,
            "model": self.model,
            "measured_at": self.measured_at,
            "features": list(FEATURES),
            "coefficients": {
                "b0_s": self.b0,
                "b1_s_per_prefill_token": self.b1,
                "b2_s_per_decode_seq": self.b2,
                "b3_s_per_kv_read_token": self.b3,
                "b4_s_per_attn_pair": self.b4,
                "b5_s_per_small_chunk_attn_pair": self.b5,
                "small_chunk_tokens": self.small_chunk_tokens,
            },
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "meta": self.meta,
        }
        Path(path).write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")

    @classmethod
    def from_profile(cls, path: str | Path) -> FittedPerf:
        p = Path(path)
        try:
            doc = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}: not JSON ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{p}: not a {PROFILE_FORMAT} file (missing 'format' header)")
        if doc.get("version") != PROFILE_VERSION:
            raise ValueError(
                f"{p}: {PROFILE_FORMAT} version {doc.get('version')!r} is not supported "
                f"(this build reads version {PROFILE_VERSION})"
            )
        c = doc.get("coefficients", {})
        keys = (
            "b0_s",
            "b1_s_per_prefill_token",
            "b2_s_per_decode_seq",
            "b3_s_per_kv_read_token",
            "b4_s_per_attn_pair",
        )
        if "b0_s" not in c:
            raise ValueError(f"{p}: coefficients.b0_s is required")
        b = [float(c.get(k, 0.0)) for k in keys]
        if any(v < 0 or not math.isfinite(v) for v in b):
            raise ValueError(f"{p}: coefficients must be finite and non-negative, got {b}")
        b5 = float(c.get("b5_s_per_small_chunk_attn_pair", 0.0))
        knee = float(c.get("small_chunk_tokens", 0.0))
        if b5 < 0 or knee < 0 or not (math.isfinite(b5) and math.isfinite(knee)):
            raise ValueError(f"{p}: the small-chunk term must be finite and non-negative")
        return cls(
            *b,
            b5=b5 if knee > 0 else 0.0,
            small_chunk_tokens=knee,
            kv_bytes_per_token=float(doc.get("kv_bytes_per_token", 0.0)),
            engine=str(doc.get("engine", "")),
            model=str(doc.get("model", "")),
            measured_at=str(doc.get("measured_at", "")),
            meta=dict(doc.get("meta", {})),
        )


Sample = tuple[Sequence[float], float]


def nnls(a: np.ndarray, b: np.ndarray, tol: float | None = None) -> np.ndarray:
    """Non-negative least squares ``min ||a x − b||, x ≥ 0`` (Lawson–Hanson active set)."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    m, n = a.shape
    if tol is None:
        tol = 10.0 * np.finfo(float).eps * np.linalg.norm(a, 1) * max(m, n)
    passive = np.zeros(n, dtype=bool)
    x = np.zeros(n)
    w = a.T @ (b - a @ x)
    for _ in range(3 * n + 10):
        if passive.all() or w[~passive].max() <= tol:
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            s = np.zeros(n)
            s[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if s[passive].min() > 0:
                break
            neg = passive & (s <= 0)
            alpha = np.min(x[neg] / (x[neg] - s[neg]))
            x = x + alpha * (s - x)
            passive &= x > tol
            x[~passive] = 0.0
        x = s
        w = a.T @ (b - a @ x)
    return x


def _nnls_scaled(x: np.ndarray, y: np.ndarray, wgt: np.ndarray) -> np.ndarray:
    """Weighted NNLS with columns scaled to unit norm (features span ten orders of magnitude)."""
    a = x * wgt[:, None]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    return nnls(a / scale, y * wgt) / scale


def fit_profile(
    samples: Iterable[Sample],
    *,
    relative: bool = False,
    kv_bytes_per_token: float = 0.0,
    engine: str = "",
    model: str = "",
    measured_at: str = "",
    meta: dict[str, Any] | None = None,
    small_chunk_knees: Sequence[float] = (),
) -> FittedPerf:
    """Fit :class:`FittedPerf` to measured ``(features, step_time_s)`` samples.

    ``small_chunk_knees``: candidate knees ``k`` of the small-chunk attention term; each is
    fitted (its column ``attn2·k/(k + prefill)`` beside the five linear ones) and the knee with
    the smallest weighted error is kept, or none when no knee beats the linear model by 2%
    (empty: the linear model only).

    ``features`` is ``(prefill_tokens, decode_seqs, kv_read_tokens[, prefill_attn_tokens2])``.
    Coefficients are constrained non-negative (a negative per-token cost would make bigger
    batches faster). Columns are scaled before solving, so features of very different
    magnitudes (attention pairs ~1e8 vs decode seqs ~10) are fitted equally well. With
    ``relative`` each sample is weighted by ``1 / step_time`` (minimises relative error, which
    is what TTFT fidelity cares about when step times span orders of magnitude).
    """
    rows: list[list[float]] = []
    ys: list[float] = []
    for feats, y in samples:
        f = [float(v) for v in feats]
        if len(f) == 3:
            f.append(0.0)
        if len(f) != 4:
            raise ValueError(f"a sample needs 3 or 4 features {FEATURES}, got {len(f)}")
        rows.append([1.0, *f])
        ys.append(float(y))
    if len(rows) < 2:
        raise ValueError(f"need at least 2 samples to fit, got {len(rows)}")
    x = np.asarray(rows)
    y = np.asarray(ys)
    if relative:
        if (y <= 0).any():
            raise ValueError("relative=True needs positive step times")
        wgt = 1.0 / y
    else:
        wgt = np.ones_like(y)
    coef = _nnls_scaled(x, y, wgt)
    sse = float((((x @ coef) - y) * wgt) ** 2 @ np.ones_like(y))
    knee = 0.0
    for k in small_chunk_knees:
        if k <= 0:
            raise ValueError(f"small-chunk knees must be > 0, got {k}")
        xk = np.column_stack([x, x[:, 4] * k / (k + x[:, 1])])
        ck = _nnls_scaled(xk, y, wgt)
        sse_k = float((((xk @ ck) - y) * wgt) ** 2 @ np.ones_like(y))
        if ck[5] > 0 and sse_k < 0.98**2 * sse:
            coef, sse, knee = ck, sse_k, float(k)
    if knee:
        x = np.column_stack([x, x[:, 4] * knee / (knee + x[:, 1])])
    pred = x @ coef
    resid = y - pred
    ss_tot = float(((y - y.mean()) ** 2).sum())
    stats = {
        "samples": len(ys),
        "rmse_s": float(np.sqrt((resid**2).mean())),
        "median_abs_rel_err": float(np.median(np.abs(resid) / np.maximum(np.abs(y), 1e-12))),
        "r2": 1.0 - float((resid**2).sum()) / ss_tot if ss_tot > 0 else 1.0,
        "relative": relative,
        "small_chunk_tokens": knee,
    }
    return FittedPerf(
        *(float(c) for c in coef[:5]),
        b5=float(coef[5]) if knee else 0.0,
        small_chunk_tokens=knee,
        kv_bytes_per_token=kv_bytes_per_token,
        engine=engine,
        model=model,
        measured_at=measured_at,
        meta={**(meta or {}), "fit": stats},
    )
