"""The performance-model interface: how long one engine iteration takes.

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

An engine that cuts an iteration into several forward passes by where its sequences live
(micro-batches over runs of consecutive slots: the ``equal`` split) is priced from one more
argument, ``passes``: ``(passes of two or more tokens, passes of one token)``, which the engine
model counts (:mod:`turnstile.sim.lanes`) and passes only to a model whose ``lane_ubatch`` attribute
is set; other models never receive it. The same engine model also gives such a model the step's
prompt chunks, ``prompts``: ``(n, c)`` for each, when there are two or more (the sums
cannot say which kernel each chunk's attention runs where the engine picks it by a sequence's
query tokens in the pass: the engine profile's ``attention_tile_tokens``).

Implementations of :class:`PerfModel`:

* :class:`~turnstile.sim.roofline_perf.RooflinePerf`: FLOPs against HBM bytes for a named GPU
  and model (the default when nothing was measured); the GPU and model constants live there too;
* :class:`~turnstile.sim.tp_perf.TpRooflinePerf`: the roofline with a per-TP all-reduce model;
* :class:`~turnstile.sim.fitted_perf.FittedPerf`: a linear step-time model fitted to step times
  measured on a real engine and stored as a ``turnstile-profile`` JSON file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

#: the step's features, in the order :meth:`PerfModel.step_time` takes them
FEATURES: tuple[str, ...] = (
    "prefill_tokens",
    "decode_seqs",
    "kv_read_tokens",
    "prefill_attn_tokens2",
)


@runtime_checkable
class PerfModel(Protocol):
    """Seconds per engine iteration. ``step_time`` must be O(1): it runs once per iteration."""

    #: a short label for reports (``roofline:MODEL@GPUxTP``, ``fitted:ENGINE/MODEL``)
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
        passes: tuple[int, int] | None = None,
        prompts: Sequence[tuple[int, int]] | None = None,
    ) -> float: ...
