"""llama.cpp's ``llama-server``, as measured on a CPU (``docs/calibration.md``).

* **Slots.** Started with ``-np N -c C`` it has ``N`` slots of ``C / N`` KV tokens and keeps
  exactly one sequence per slot (``kv_layout = "slots"``, KV counted in tokens): across a tool
  call an engine holds at most ``N`` sessions, whatever their length. turnstile's gateway binds
  each turn to a slot (``id_slot``, :func:`turnstile.core.slots.choose_slot`); an unbound request
  gets the server's ``get_available_slot`` pick: the idle slot whose sequence shares the longest
  prefix with the prompt (its session's, when one holds it), else the least recently used idle
  one, keeping a slot whose ``t_last_used <= t_last`` — ties go to the last slot, and since
  slots start never used (``t_last_used = -1``) a fresh server fills them from the highest id
  down (:func:`session_else_lru`; the general simulator takes it from :data:`PROFILE`, and an
  engine profiled without a rule gets the neutral one, ties to the *lowest* id:
  :func:`turnstile.sim.engine_profile.generic_server_slot`).
* **Forward passes.** A step is cut into micro-batches of at most ``-ub`` tokens (512); without
  ``--kv-unified`` each slot has its own KV stream and the server splits the batch with
  ``split_equal(n_ubatch, sequential=true)``: the same number of tokens from every sequence in a
  pass, and only from a run of *consecutive* slot ids (the ``equal`` split,
  :func:`turnstile.sim.lanes.equal_split_passes`). Three decoders cost 13.2 ms a step on slots
  ``{0, 1, 2}``, 16.7 ms on ``{0, 1, 3}`` (tiny test model, one thread); a one-token pass runs as
  matrix-vector products, a third of a two-token pass (``one_token_pass``). The logical batch
  (``-b``) is 2,048 tokens.
* **Attention kernel.** The CPU flash attention switches to a tiled kernel
  (``ggml_compute_forward_flash_attn_ext_tiled``) for 64 query tokens or more (``GGML_FA_TILE_Q``),
  64 × 64 tiles: 65 query tokens cost about as much as 128 (``attention_tile_tokens = 64``, the
  threshold and tile :func:`turnstile.sim.profile_fit.fit_profile` tries).
* **Cold steps.** The engine keeps its weights in the last-level cache while it steps on small
  batches one after another, and loses them when it idles or computes a large prompt chunk: on a
  shared VM a 1-token append right after a turn's decodes takes 4.5 ms, 11-12 ms after a 0.15 s
  pause or right after an 800-token prefill, 8.6 ms after two decodes; the decodes right after a
  cold append cost 5.8 ms a token over the next seven, against 4.5 warm (``benchmarks/
  warm_steps.py``). So a step is warm after 3 iterations in a row of under 64 prompt tokens,
  none after a pause of more than 0.1 s (:data:`WARM`).
* **Priority.** ``llama-server`` has no request priority: requests run in arrival order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from turnstile.core.slots import ServerSlot
from turnstile.sim.engine_profile import EngineProfile, WarmRule, register

__all__ = ["BATCH_TOKENS", "FA_TILE_Q", "PROFILE", "UBATCH_TOKENS", "WARM", "session_else_lru"]

#: the default logical batch (``-b``): the most tokens one step computes
BATCH_TOKENS = 2048
#: the default physical batch (``-ub``): the most tokens one forward pass computes
UBATCH_TOKENS = 512
#: the query tokens from which the CPU flash attention runs its tiled kernel (its tiles 64 × 64)
FA_TILE_Q = 64.0
#: which steps run with the CPU's caches warm (see the module docstring)
WARM = WarmRule(gap_s=0.1, steps=3, max_prefill=64)

V = TypeVar("V", bound=ServerSlot)


def session_else_lru(slots: Iterable[V], session: str) -> V | None:
    """``llama-server``'s pick of an idle slot for a request sent without ``id_slot`` (a
    :data:`turnstile.core.slots.SlotRule`): the idle slot holding ``session``'s sequence (its
    longest-common-prefix pick finds it), else the least recently used idle one; None when every
    slot is busy.

    Ties go to the *last* such slot in ``slots`` (the server keeps a slot whose ``t_last_used``
    is ``<=`` the best so far): slots that start never used are then filled from the highest id
    down (seen on ``llama-server``: 3, 2, 1 with ``-np 4``). Which slots are busy sets how a step
    is cut into forward passes (:mod:`turnstile.sim.lanes`), so the tie-break is part of the
    rule."""
    lru = None
    for s in slots:
        if s.busy:
            continue
        if s.session == session:
            return s
        if lru is None or s.last_used <= lru.last_used:
            lru = s
    return lru

PROFILE = register(EngineProfile(
    name="llama.cpp",
    aliases=("llama-cpp", "llamacpp", "llama_cpp", "llama-server"),
    kv_layout="slots",
    block_size=1,
    server_slot=session_else_lru,
    max_batched_tokens=BATCH_TOKENS,
    ubatch_tokens=UBATCH_TOKENS,
    ubatch_split="equal",
    one_token_pass=True,
    attention_tile_tokens=FA_TILE_Q,
    warm=WARM,
    priority_order="ignored",
    notes="-np N slots of -c/N tokens; --kv-unified makes the passes 'simple'; --metrics "
          "--slots for the adapter; no request priority",
))
