"""A group of identical simulated engines (GPU, model, tensor parallelism, KV capacity, slots)
and how it becomes each engine's configuration and performance model."""

from __future__ import annotations

from dataclasses import dataclass, field

from turnstile.sim.engine import EngineConfig
from turnstile.sim.perf import PerfModel
from turnstile.sim.roofline_perf import (
    RooflinePerf,
    default_model,
    kv_capacity_tokens,
    load_gpu,
    load_model,
)

__all__ = ["EngineGroup"]


@dataclass
class EngineGroup:
    """``count`` identical engines: one GPU type and model at tensor parallelism ``tp``."""

    gpu: str = "H100-SXM"
    model: str = field(default_factory=default_model)
    tp: int = 1
    count: int = 1
    gpu_mem_util: float = 0.9
    #: KV capacity override in tokens (None = from GPU memory and the model); for a
    #: slot-limited engine, the KV capacity its scheduler is told (the gateway's ``kv_tokens``)
    kv_tokens: int | None = None
    cpu_offload_tokens: int = 0
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    perf: PerfModel | None = None  # a fitted model overrides the roofline
    #: slot-limited KV (an engine profile's ``slots`` layout): this many slots, one sequence
    #: each; 0 = paged
    kv_slots: int = 0
    #: KV tokens of one slot; 0 = ``kv_tokens // kv_slots``
    slot_tokens: int = 0

    def build_perf(self) -> PerfModel:
        if self.perf is not None:
            return self.perf
        return RooflinePerf(load_gpu(self.gpu), load_model(self.model), tp=self.tp)

    def build_config(self, block_size: int = 16, hash_block_tokens: int = 0) -> EngineConfig:
        kv = self.kv_tokens
        if kv is None:
            kv = kv_capacity_tokens(load_gpu(self.gpu), load_model(self.model), self.tp,
                                    self.gpu_mem_util)
        if self.kv_slots:  # counted in tokens (block size 1)
            per_slot = self.slot_tokens or kv // self.kv_slots
            return EngineConfig(
                block_size=1,
                num_gpu_blocks=per_slot * self.kv_slots,
                max_num_seqs=min(self.max_num_seqs, self.kv_slots),
                max_batched_tokens=self.max_batched_tokens,
                hash_block_tokens=hash_block_tokens,
                kv_slots=self.kv_slots,
                slot_tokens=per_slot,
            )
        return EngineConfig(
            block_size=block_size,
            num_gpu_blocks=max(1, kv // block_size),
            num_cpu_blocks=self.cpu_offload_tokens // block_size,
            max_num_seqs=self.max_num_seqs,
            max_batched_tokens=self.max_batched_tokens,
            hash_block_tokens=hash_block_tokens,
        )

    def scheduler_kv_tokens(self, config: EngineConfig) -> int:
        """The KV capacity the scheduler is told for an engine built as ``config``: its KV
        tokens, or for a slot-limited engine ``kv_tokens`` when given (what the gateway's KV gate
        is told: the tokens its slots' sessions hold, not ``-c``)."""
        if config.kv_slots and self.kv_tokens is not None:
            return self.kv_tokens
        return config.capacity_tokens
