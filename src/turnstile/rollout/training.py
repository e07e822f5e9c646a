"""How long one RL training step takes on ``n`` GPUs (an analytic model, labelled simulated).

``time = 6 · params · tokens / (n · peak · MFU(dp, tp, pp))``: forward + backward of a dense
transformer is ≈ 6 FLOPs per parameter per token. ``MFU`` starts at ``mfu`` (pure data parallel)
and loses ``tp_penalty`` per doubling of tensor parallelism (its all-reduces sit on the critical
path) and the pipeline bubble ``(pp − 1) / (microbatches + pp − 1)``. A configuration must fit in
memory: bf16 weights and gradients sharded over ``tp · pp``, fp32 Adam states and master weights
(12 bytes/param) sharded over ``dp · tp · pp`` (ZeRO-1), plus ``activation_fraction`` of the GPU
kept for activations. :meth:`TrainModel.step_time` returns the fastest configuration that fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from turnstile.sim.roofline_perf import as_gpu, as_model

__all__ = ["ParallelConfig", "TrainModel"]


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    dp: int
    tp: int
    pp: int

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        return f"dp{self.dp}·tp{self.tp}·pp{self.pp}"


@dataclass(frozen=True)
class TrainModel:
    """Training-step time of a dense model on a GPU type (see the module docstring)."""

    params: float
    peak_flops: float
    gpu_memory_bytes: float
    mfu: float = 0.4
    tp_penalty: float = 0.06
    microbatches: int = 16
    activation_fraction: float = 0.3
    tp_options: tuple[int, ...] = (1, 2, 4, 8)
    pp_options: tuple[int, ...] = (1, 2, 4)
    #: fixed per-step overhead: optimizer step, weight broadcast to the rollout engines
    overhead_s: float = 5.0

    @classmethod
    def for_names(cls, gpu: str, model: str, **kwargs: float) -> TrainModel:
        g, m = as_gpu(gpu), as_model(model)
        return cls(params=m.params, peak_flops=g.peak_flops, gpu_memory_bytes=g.memory_bytes,
                   **kwargs)  # type: ignore[arg-type]

    def fits(self, cfg: ParallelConfig) -> bool:
        shard = cfg.tp * cfg.pp
        need = 4.0 * self.params / shard + 12.0 * self.params / (shard * cfg.dp)
        return need <= self.gpu_memory_bytes * (1.0 - self.activation_fraction)

    def efficiency(self, cfg: ParallelConfig) -> float:
        bubble = (cfg.pp - 1) / (self.microbatches + cfg.pp - 1)
        return self.mfu * max(0.05, 1.0 - self.tp_penalty * math.log2(cfg.tp)) * (1.0 - bubble)

    def options(self, n_gpus: int) -> list[ParallelConfig]:
        out = []
        for tp in self.tp_options:
            for pp in self.pp_options:
                if n_gpus % (tp * pp) == 0:
                    cfg = ParallelConfig(n_gpus // (tp * pp), tp, pp)
                    if self.fits(cfg):
                        out.append(cfg)
        return out

    def step_time(self, n_gpus: int, tokens: float) -> tuple[float, ParallelConfig | None]:
        """Seconds for one step over ``tokens`` on ``n_gpus`` and the configuration used
        (``inf, None`` when nothing fits)."""
        if n_gpus < 1 or tokens <= 0:
            return (0.0 if tokens <= 0 else math.inf), None
        best: tuple[float, ParallelConfig | None] = (math.inf, None)
        for cfg in self.options(n_gpus):
            t = 6.0 * self.params * tokens / (n_gpus * self.peak_flops * self.efficiency(cfg))
            if t < best[0]:
                best = (t, cfg)
        if best[1] is None:
            return best
        return best[0] + self.overhead_s, best[1]

    def min_gpus(self) -> int:
        """The fewest GPUs any configuration fits on."""
        for n in range(1, 65):
            if self.options(n):
                return n
        return 64
