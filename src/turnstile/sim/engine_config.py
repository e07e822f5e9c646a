"""The engine model's knobs (:class:`EngineConfig`), named after vLLM's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from turnstile.sim.roofline_perf import GpuSpec, ModelSpec, as_model, kv_capacity_tokens


@dataclass(slots=True, kw_only=True)
class EngineConfig:
    """Engine knobs, named after vLLM's. Keyword-only."""

    num_gpu_blocks: int
    block_size: int = 16
    #: blocks of the CPU offload tier (0 = no tier: evicted blocks are gone)
    num_cpu_blocks: int = 0
    #: host link bandwidth of the offload tier, in gigaBYTES per second (PCIe 4.0 x16 ≈ 25)
    cpu_bandwidth_gbps: float = 25.0
    max_num_seqs: int = 256
    #: token budget per iteration (decodes count 1 each; the rest goes to chunked prefill)
    max_batched_tokens: int = 8192
    enable_prefix_cache: bool = True
    #: admit waiting requests by (priority, arrival); False = FIFO by arrival
    priority_scheduling: bool = True
    #: tokens named by one entry of ``SimRequest.block_hashes`` (0 = ``block_size``); a
    #: multiple of ``block_size``, e.g. 512 for Mooncake's hash ids on 16-token KV blocks
    hash_block_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_gpu_blocks < 1 or self.block_size < 1:
            raise ValueError("num_gpu_blocks and block_size must be >= 1")
        if self.num_cpu_blocks < 0:
            raise ValueError("num_cpu_blocks must be >= 0")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_batched_tokens < self.max_num_seqs:
            # as in vLLM: every running decode must fit in one iteration's budget
            raise ValueError(
                f"max_batched_tokens ({self.max_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs})"
            )
        if self.hash_block_tokens < 0 or self.hash_block_tokens % self.block_size:
            raise ValueError(
                f"hash_block_tokens ({self.hash_block_tokens}) must be a multiple of "
                f"block_size ({self.block_size})"
            )
        if self.num_cpu_blocks and self.cpu_bandwidth_gbps <= 0:
            raise ValueError("cpu_bandwidth_gbps must be > 0 with an offload tier")

    @property
    def capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    @classmethod
    def sized_for(
        cls,
        gpu: GpuSpec | str,
        model: ModelSpec | str,
        tp: int = 1,
        *,
        gpu_mem_util: float = 0.9,
        cpu_offload_gb: float = 0.0,
        **kwargs: Any,
    ) -> EngineConfig:
        """A config whose KV blocks fill a ``tp``-GPU engine, plus ``cpu_offload_gb`` of host
        memory per GPU for the offload tier. Other fields are passed through."""
        bs = int(kwargs.pop("block_size", 16))
        tokens = kv_capacity_tokens(gpu, model, tp, gpu_mem_util)
        cpu_blocks = 0
        if cpu_offload_gb > 0:
            per_token = as_model(model).kv_bytes_per_token(tp)
            cpu_blocks = int(cpu_offload_gb * 1e9 // (per_token * bs))
        return cls(num_gpu_blocks=tokens // bs, block_size=bs, num_cpu_blocks=cpu_blocks, **kwargs)

