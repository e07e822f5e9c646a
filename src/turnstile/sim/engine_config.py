"""The engine model's knobs (:class:`EngineConfig`), named as serving engines name them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from turnstile.sim.roofline_perf import GpuSpec, ModelSpec, as_model, kv_capacity_tokens


@dataclass(slots=True, kw_only=True)
class EngineConfig:
    """Engine knobs. Keyword-only."""

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
    #: slot-limited KV (an engine profile's ``slots`` layout): this many slots of ``slot_tokens``
    #: each hold
    #: one sequence apiece (:mod:`turnstile.sim.slot_pool`); 0 = paged KV with a prefix cache
    kv_slots: int = 0
    #: KV tokens of one slot; 0 = ``capacity_tokens // kv_slots``
    slot_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_gpu_blocks < 1 or self.block_size < 1:
            raise ValueError("num_gpu_blocks and block_size must be >= 1")
        if self.num_cpu_blocks < 0:
            raise ValueError("num_cpu_blocks must be >= 0")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_batched_tokens < self.max_num_seqs:
            # every running decode must fit in one iteration's budget
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
        if self.kv_slots:
            self._check_slots()

    def _check_slots(self) -> None:
        if self.kv_slots < 0 or self.slot_tokens < 0:
            raise ValueError("kv_slots and slot_tokens must be >= 0")
        if self.block_size != 1 or self.num_cpu_blocks:
            raise ValueError("slot-limited KV counts tokens (block_size 1) and has no tier")
        if not self.slot_tokens:
            self.slot_tokens = self.capacity_tokens // self.kv_slots
        if self.slot_tokens < 1 or self.slot_tokens * self.kv_slots > self.capacity_tokens:
            raise ValueError(
                f"{self.kv_slots} slots of {self.slot_tokens} tokens do not fit in "
                f"{self.capacity_tokens} KV tokens")
        if self.max_num_seqs > self.kv_slots:
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) must be <= kv_slots ({self.kv_slots}): "
                "a request runs in a slot")

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

