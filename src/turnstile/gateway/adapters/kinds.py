"""The engine kinds: llama.cpp (slots for KV affinity and retention), vLLM, SGLang, and any
other OpenAI-compatible server; :func:`make_adapter` picks one by name."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import httpx

from turnstile.core.actions import RetentionDecision
from turnstile.core.slots import choose_slot
from turnstile.gateway.adapters.base import (
    EngineAdapter,
    ForwardHints,
)

__all__ = ["ADAPTERS", "LlamaCppAdapter", "OpenAIAdapter", "SglangAdapter", "VllmAdapter",
           "make_adapter"]


# --------------------------------------------------------------------------- llama.cpp
@dataclass(slots=True)
class _Slot:
    id: int
    owner: str | None = None  # session whose KV the slot holds
    bound: int = 0  # turns forwarded with this id_slot and not over
    pinned_until_s: float = 0.0
    gw_last_used: float = 0.0


class LlamaCppAdapter(EngineAdapter):
    """llama.cpp's C++ ``llama-server``.

    * KV affinity inside the engine: each session is pinned to a slot (``id_slot``) with
      ``cache_prompt=true``, so its next turn reuses the slot's KV prefix. A slot is chosen as:
      the session's own slot if idle; else an idle slot nobody pinned (empty first, then least
      recently used); else none (the server picks and queues).
    * Retention: ``pin`` keeps other sessions off the slot for the TTL; ``offload`` saves the
      slot to ``--slot-save-path`` (``POST /slots/{id}?action=save``) so it can be restored into
      any slot later (``action=restore``); ``discard`` erases it. Offload needs the server
      started with ``--slot-save-path``; without it offload degrades to LRU.
    * ``/metrics`` (``--metrics``): ``requests_processing``/``requests_deferred`` and prompt
      token counters; ``/tokenize`` for exact prompt lengths.
    """

    kind = "llama.cpp"
    running_metrics = ("llamacpp:requests_processing",)
    waiting_metrics = ("llamacpp:requests_deferred",)
    counter_metrics: ClassVar[Mapping[str, str]] = {
        "llamacpp:prompt_tokens_total": "prompt_tokens_computed",
        "llamacpp:prompt_tokens_cached_total": "prefix_hit_tokens",
        "llamacpp:tokens_predicted_total": "output_tokens",
    }

    def __init__(self, base_url: str, **kw: Any) -> None:
        super().__init__(base_url, **kw)
        self.slots: list[_Slot] = []
        self.offload_enabled = bool(self.options.get("offload", True))
        #: session → (file name, expiry) of KV saved through the slots API
        self.offloaded: dict[str, tuple[str, float]] = {}
        self.slot_errors = 0

    async def start(self) -> None:
        n = self.options.get("slots")
        if n is None:
            try:
                resp = await self._get("/slots")
                if resp.status_code == 200 and isinstance(resp.json(), list):
                    n = len(resp.json())
            except (httpx.HTTPError, ValueError):
                n = None
        if n is None:
            try:
                resp = await self._get("/props")
                n = int(resp.json().get("total_slots", 0)) if resp.status_code == 200 else 0
            except (httpx.HTTPError, ValueError, AttributeError, TypeError):
                n = 0
        self.slots = [_Slot(i) for i in range(int(n or 0))]

    def prepare(self, body: dict[str, Any], hints: ForwardHints) -> dict[str, Any]:
        out = dict(body)
        out.setdefault("cache_prompt", True)
        if hints.slot is not None:
            out["id_slot"] = hints.slot
        return out

    async def begin(self, hints: ForwardHints) -> None:
        if not self.slots:
            return
        now_s = hints.now_s
        # a session owns at most one slot (an owner is set only here, on the chosen slot)
        own, slot = choose_slot(self.slots, hints.session_id, now_s)
        if own is not None and own is not slot:
            own.owner = None  # the turn moves, or the server picks: ownership is unknown now
        if slot is None:
            return
        k = slot.id
        restore = self.offloaded.pop(hints.session_id, None)
        if slot.owner != hints.session_id and restore is not None and restore[1] >= now_s:
            try:
                await self._post_json(f"/slots/{k}?action=restore", {"filename": restore[0]})
            except httpx.HTTPError:
                self.slot_errors += 1
        slot.owner = hints.session_id
        slot.bound += 1
        slot.pinned_until_s = 0.0
        slot.gw_last_used = now_s
        hints.slot = k

    def end(self, hints: ForwardHints) -> None:
        if hints.slot is not None and hints.slot < len(self.slots):
            slot = self.slots[hints.slot]
            slot.bound = max(0, slot.bound - 1)
            slot.gw_last_used = hints.now_s

    def _owned(self, session_id: str) -> _Slot | None:
        for s in self.slots:
            if s.owner == session_id:
                return s
        return None

    async def retain(self, session_id: str, decision: RetentionDecision, now_s: float) -> None:
        slot = self._owned(session_id)
        if slot is None:
            return
        if decision.action == "pin":
            slot.pinned_until_s = now_s + decision.ttl_s
        elif decision.action == "offload" and self.offload_enabled and slot.bound == 0:
            name = "ts-" + re.sub(r"[^A-Za-z0-9_.-]", "_", session_id)[:80] + ".bin"
            try:
                resp = await self._post_json(f"/slots/{slot.id}?action=save", {"filename": name})
            except httpx.HTTPError:
                self.slot_errors += 1
                return
            if resp.status_code == 200:
                self.offloaded[session_id] = (name, now_s + max(decision.ttl_s, 1.0))
            else:  # no --slot-save-path: offload is unavailable on this server
                self.offload_enabled = False
        elif decision.action == "discard" and slot.bound == 0:
            try:
                await self._post_json(f"/slots/{slot.id}?action=erase", {})
            except httpx.HTTPError:
                self.slot_errors += 1
                return
            slot.owner = None

    async def tokenize(self, text: str) -> int | None:
        try:
            resp = await self._post_json("/tokenize", {"content": text})
            if resp.status_code != 200:
                return None
            return len(resp.json()["tokens"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None


# --------------------------------------------------------------------------- vLLM
class VllmAdapter(EngineAdapter):
    """vLLM's OpenAI server.

    Sends the admission priority as vLLM's ``priority`` request field (an integer, lower runs
    first; the server must run with ``--scheduling-policy priority``, else set the engine
    option ``priority = false``). Prefix caching is vLLM's own (automatic); retention
    decisions have no per-session API in vLLM and are no-ops. Stats from ``/metrics``.
    """

    kind = "vllm"
    running_metrics = ("vllm:num_requests_running",)
    waiting_metrics = ("vllm:num_requests_waiting",)
    kv_metrics = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    counter_metrics: ClassVar[Mapping[str, str]] = {
        "vllm:prompt_tokens_total": "prompt_tokens",
        "vllm:prefix_cache_hits_total": "prefix_hit_tokens",
        "vllm:prefix_cache_queries_total": "prefix_query_tokens",
        "vllm:num_preemptions_total": "preemptions",
        "vllm:generation_tokens_total": "output_tokens",
    }
    #: the admission priority (seconds or tokens, a float) is scaled to vLLM's integer
    priority_scale: ClassVar[float] = 1000.0

    def prepare(self, body: dict[str, Any], hints: ForwardHints) -> dict[str, Any]:
        if not self.options.get("priority", True):
            return body
        out = dict(body)
        out["priority"] = _int_priority(hints.priority, self.priority_scale)
        return out

    # vLLM finishes the requests it drops (shutdown, engine error) with these reasons, as a 200
    def aborted_reply(self, reply: Any) -> bool:
        choices = reply.get("choices") if isinstance(reply, dict) else None
        return any(isinstance(c, dict) and c.get("finish_reason") in _VLLM_ABORTED
                   for c in choices or ())

    def aborted_event(self, event: bytes) -> bool:
        return b'"finish_reason":"abort"' in event or b'"finish_reason":"error"' in event

    async def tokenize(self, text: str) -> int | None:
        try:
            resp = await self._post_json("/tokenize", {"prompt": text})
            if resp.status_code != 200:
                return None
            data = resp.json()
            return int(data.get("count", len(data.get("tokens", ()))))
        except (httpx.HTTPError, ValueError, TypeError, AttributeError):
            return None


_VLLM_ABORTED = ("abort", "error")


def _int_priority(priority: float, scale: float) -> int:
    if not math.isfinite(priority):
        return 2**62 if priority > 0 else -(2**62)
    return max(-(2**62), min(2**62, math.floor(priority * scale)))


# --------------------------------------------------------------------------- SGLang
class SglangAdapter(EngineAdapter):
    """SGLang's OpenAI-compatible server (``--enable-metrics`` for ``/metrics``).

    SGLang's RadixAttention caches prefixes on its own. With the engine option
    ``priority = true`` (server started with ``--enable-priority-scheduling``) the admission
    priority is sent as ``priority``; SGLang runs *higher* values first unless started with
    ``--schedule-low-priority-values-first`` (option ``low_priority_first = true``), so the
    sign is flipped by default.
    """

    kind = "sglang"
    running_metrics = ("sglang:num_running_reqs",)
    waiting_metrics = ("sglang:num_queue_reqs",)
    kv_metrics = ("sglang:token_usage",)
    counter_metrics: ClassVar[Mapping[str, str]] = {
        "sglang:prompt_tokens_total": "prompt_tokens",
        "sglang:cached_tokens_total": "prefix_hit_tokens",
        "sglang:generation_tokens_total": "output_tokens",
    }

    def prepare(self, body: dict[str, Any], hints: ForwardHints) -> dict[str, Any]:
        if not self.options.get("priority", False):
            return body
        out = dict(body)
        p = _int_priority(hints.priority, 1000.0)
        out["priority"] = p if self.options.get("low_priority_first", False) else -p
        return out


# --------------------------------------------------------------------------- generic
class OpenAIAdapter(EngineAdapter):
    """Any OpenAI-compatible endpoint: forwarding only; health is ``GET /v1/models``."""

    kind = "openai"
    health_path = "/v1/models"
    metrics_path = None


ADAPTERS: dict[str, type[EngineAdapter]] = {
    "llama.cpp": LlamaCppAdapter,
    "llamacpp": LlamaCppAdapter,
    "llama-cpp": LlamaCppAdapter,
    "vllm": VllmAdapter,
    "sglang": SglangAdapter,
    "openai": OpenAIAdapter,
}


def make_adapter(url: str, kind: str = "llama.cpp", **kw: Any) -> EngineAdapter:
    """Build the adapter for ``kind`` (``llama.cpp``, ``vllm``, ``sglang``, ``openai``)."""
    try:
        cls = ADAPTERS[kind.lower()]
    except KeyError:
        valid = ", ".join(sorted({c.kind for c in ADAPTERS.values()}))
        raise ValueError(f"unknown engine kind {kind!r}; valid kinds: {valid}") from None
    return cls(url, **kw)
