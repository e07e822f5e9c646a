"""A small streaming client for measuring an engine (over the one transport's blocking mode,
:mod:`turnstile.transport.blocking`: standard library only).

Every request sends a *token-id* prompt, so prompt lengths and prefixes are exact (no chat
template, no tokenizer round trip), and streams the answer as server-sent events, time-stamping
each chunk as it arrives (``time.perf_counter``). Two wire formats:

``openai``
    ``POST /v1/completions`` with ``prompt: [ids]`` and ``stream: true``: llama.cpp's
    ``llama-server`` and vLLM both accept it. llama.cpp adds a ``timings`` object to the last
    chunk (``prompt_ms``, ``predicted_ms``, ``cache_n`` ...); vLLM returns the generated ids per
    chunk when asked (``return_token_ids``).
``llamacpp``
    ``POST /completion`` (llama.cpp's native endpoint) with ``return_tokens``: each chunk carries
    the generated token ids, which a multi-turn replay appends to the next turn's prompt so the
    engine's prefix cache hits exactly as it would for a real conversation.

Engine discovery (:func:`discover`) reads ``/props`` (llama.cpp), ``/v1/models`` and ``/metrics``
(vLLM's ``cache_config_info``) for the engine kind, model, slots and context size.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from turnstile.transport import blocking

__all__ = [
    "EngineInfo",
    "EngineRequestError",
    "StreamResult",
    "discover",
    "stream_completion",
]

Api = Literal["openai", "llamacpp"]


class EngineRequestError(RuntimeError):
    """The engine answered with an error, or the connection failed."""


@dataclass(slots=True)
class StreamResult:
    """One streamed completion, times in ``time.perf_counter`` seconds."""

    send_s: float
    #: arrival time of each output token (chunks carrying several tokens share a time)
    token_times: list[float]
    end_s: float
    prompt_tokens: int
    completion_tokens: int
    #: prefix-cache hit reported by the engine (``None`` when it does not say)
    cached_tokens: int | None = None
    #: llama.cpp's ``timings`` object of the last chunk, when present
    timings: dict[str, float] | None = None
    #: generated token ids, when the engine returned them
    output_ids: list[int] | None = None
    finish_reason: str | None = None

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.send_s if self.token_times else math.nan

    @property
    def first_token_s(self) -> float:
        return self.token_times[0] if self.token_times else math.nan


@dataclass(slots=True)
class EngineInfo:
    """What an engine says about itself (fields it does not expose are ``None``)."""

    url: str
    kind: str  # "llama.cpp", "vllm" or "openai"
    model: str
    #: parallel sequences (llama.cpp slots); vLLM does not expose max_num_seqs
    n_parallel: int | None = None
    #: context limit of one request (llama.cpp per-slot n_ctx; vLLM max_model_len)
    ctx_per_seq: int | None = None
    #: KV capacity of the whole engine in tokens (llama.cpp slots × n_ctx; vLLM blocks × size)
    kv_tokens: int | None = None
    n_vocab: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def api(self) -> Api:
        return "llamacpp" if self.kind == "llama.cpp" else "openai"


def _base(url: str) -> str:
    url = url.rstrip("/")
    for suffix in ("/v1/completions", "/v1/chat/completions", "/v1"):
        if url.endswith(suffix):
            return url[: -len(suffix)]
    return url


def _get_json(url: str, timeout: float = 10.0) -> Any | None:
    data = blocking.get(url, timeout=timeout)
    try:
        return None if data is None else json.loads(data)
    except ValueError:
        return None


def _get_text(url: str, timeout: float = 10.0) -> str | None:
    data = blocking.get(url, timeout=timeout)
    return None if data is None else data.decode("utf-8", errors="replace")


_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def discover(url: str, timeout: float = 10.0) -> EngineInfo:
    """Ask the engine at ``url`` what it is. Raises :class:`EngineRequestError` when nothing
    answers at ``/v1/models``."""
    base = _base(url)
    models = _get_json(base + "/v1/models", timeout)
    if not isinstance(models, dict) or not models.get("data"):
        raise EngineRequestError(f"{base}/v1/models did not answer with a model list")
    first = models["data"][0]
    model = str(first.get("id", "?"))
    owned = str(first.get("owned_by", "")).lower()
    info = EngineInfo(url=base, kind="openai", model=model)
    meta = first.get("meta")
    if isinstance(meta, dict) and meta.get("n_vocab"):
        info.n_vocab = int(meta["n_vocab"])
    props = _get_json(base + "/props", timeout)
    if isinstance(props, dict) and "total_slots" in props:
        info.kind = "llama.cpp"
        info.n_parallel = int(props["total_slots"])
        n_ctx = props.get("default_generation_settings", {}).get("n_ctx")
        if n_ctx:
            info.ctx_per_seq = int(n_ctx)
            info.kv_tokens = int(n_ctx) * info.n_parallel
        info.extra["model_path"] = props.get("model_path")
        info.extra["build"] = props.get("build_info")
        return info
    if "vllm" in owned:
        info.kind = "vllm"
        if first.get("max_model_len"):
            info.ctx_per_seq = int(first["max_model_len"])
        version = _get_json(base + "/version", timeout)
        if isinstance(version, dict):
            info.extra["version"] = version.get("version")
        text = _get_text(base + "/metrics", timeout) or ""
        m = _CACHE_INFO.search(text)
        if m:
            labels = dict(_LABEL.findall(m.group("labels")))
            try:
                info.kv_tokens = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
                info.extra["block_size"] = int(labels["block_size"])
            except (KeyError, ValueError):
                pass
    return info


def _token_id(tok: Any) -> int | None:
    """vLLM's ``return_tokens_as_token_ids`` spells ids ``"token_id:123"``."""
    if isinstance(tok, int):
        return tok
    if isinstance(tok, str) and tok.startswith("token_id:"):
        try:
            return int(tok[9:])
        except ValueError:
            return None
    return None


def stream_completion(
    url: str,
    prompt: list[int],
    max_tokens: int,
    *,
    api: Api = "openai",
    model: str | None = None,
    return_ids: bool = False,
    timeout: float = 600.0,
    extra: dict[str, Any] | None = None,
    on_token: Callable[[int, float], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> StreamResult:
    """Stream one completion of the token-id ``prompt``; ``max_tokens`` tokens are generated
    (``ignore_eos``). Raises :class:`EngineRequestError` on an HTTP error.

    ``on_token(tokens_so_far, t)`` is called as output arrives; when ``should_stop()`` turns
    true the stream is closed early (the engine frees the sequence on disconnect) and the result
    holds the tokens received so far."""
    base = _base(url)
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    if model:
        body["model"] = model
    if api == "llamacpp":
        path = "/completion"
        body["n_predict"] = max_tokens
        body["cache_prompt"] = True
        if return_ids:
            body["return_tokens"] = True
    else:
        path = "/v1/completions"
        body["stream_options"] = {"include_usage": True}
        if return_ids:
            body["return_token_ids"] = True
    if extra:
        body.update(extra)
    payload = json.dumps(body).encode()
    conn: http.client.HTTPConnection | None = None
    times: list[float] = []  # one per chunk that carried output
    counts: list[int] = []  # tokens each such chunk carried (-1: unknown, assume 1)
    ids: list[int] = []
    ids_seen = False
    usage: dict[str, Any] = {}
    timings: dict[str, float] | None = None
    finish: str | None = None
    finish_chunk_time: float | None = None
    native_last: dict[str, Any] = {}
    stopped = False
    try:
        send = time.perf_counter()
        conn, resp = blocking.open_post(
            base + path, payload,
            {"Content-Type": "application/json", "Accept": "text/event-stream"},
            timeout=timeout,
        )
        if resp.status != 200:
            detail = resp.read()[:500].decode("utf-8", errors="replace")
            raise EngineRequestError(f"{base}{path}: HTTP {resp.status}: {detail}")
        seen = 0  # chunks already reported to on_token
        ntok = 0
        while True:
            if on_token is not None and len(counts) > seen:
                ntok += sum(max(c, 1) for c in counts[seen:])
                seen = len(counts)
                on_token(ntok, times[-1])
            if should_stop is not None and should_stop():
                stopped = True
                break
            line = resp.readline()
            if not line:
                break
            now = time.perf_counter()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if not data or data == b"[DONE]":
                if data == b"[DONE]":
                    break
                continue
            chunk = json.loads(data)
            if "error" in chunk and not chunk.get("choices"):
                raise EngineRequestError(f"{base}{path}: {chunk['error']}")
            if api == "llamacpp":
                toks = chunk.get("tokens")
                if chunk.get("stop"):
                    native_last = chunk
                    timings = chunk.get("timings")
                    if toks:
                        times.append(now)
                        counts.append(len(toks))
                        ids.extend(int(t) for t in toks)
                    break
                if isinstance(toks, list):
                    ids_seen = True
                    ids.extend(int(t) for t in toks)
                    if toks:
                        times.append(now)
                        counts.append(len(toks))
                else:
                    times.append(now)
                    counts.append(-1)
                continue
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("timings"):
                timings = chunk["timings"]
            for choice in chunk.get("choices") or ():
                tids = choice.get("token_ids")
                if tids is None:
                    lp = choice.get("logprobs")
                    if isinstance(lp, dict) and isinstance(lp.get("tokens"), list):
                        tids = [_token_id(t) for t in lp["tokens"]]
                        tids = [t for t in tids if t is not None]
                if isinstance(tids, list):
                    ids_seen = True
                    ids.extend(int(t) for t in tids)
                fr = choice.get("finish_reason")
                if fr is not None:
                    finish = str(fr)
                    # llama.cpp sends the finish as its own empty chunk; vLLM sends it with the
                    # last token: decided below from the counts
                    finish_chunk_time = now
                    if tids:
                        times.append(now)
                        counts.append(len(tids))
                        finish_chunk_time = None
                    continue
                times.append(now)
                counts.append(len(tids) if isinstance(tids, list) else -1)
        end = time.perf_counter()
    except (OSError, http.client.HTTPException, ValueError) as exc:
        # ValueError: a chunk that is not JSON
        raise EngineRequestError(f"{base}{path}: {exc}") from exc
    finally:
        if conn is not None:
            conn.close()

    if stopped:
        completion = sum(max(c, 1) for c in counts)
        if len(ids) != completion:
            ids_seen = False
        return StreamResult(
            send_s=send,
            token_times=_expand(times, counts, completion),
            end_s=end,
            prompt_tokens=len(prompt),
            completion_tokens=completion,
            output_ids=ids if ids_seen else None,
            finish_reason="client_stop",
        )
    if api == "llamacpp":
        completion = int(native_last.get("tokens_predicted", sum(max(c, 1) for c in counts)))
        prompt_n = int(native_last.get("tokens_evaluated", len(prompt)))
        cached = native_last.get("tokens_cached")
        cached_tokens: int | None = None
        if timings and "cache_n" in timings:
            cached_tokens = int(timings["cache_n"])
        elif cached is not None:
            cached_tokens = None  # tokens_cached counts prompt + output: not a prefix hit
        finish = native_last.get("stop_type") or ("length" if native_last else None)
    else:
        completion = int(usage.get("completion_tokens", sum(max(c, 1) for c in counts)))
        prompt_n = int(usage.get("prompt_tokens", len(prompt)))
        details = usage.get("prompt_tokens_details") or {}
        cached_tokens = details.get("cached_tokens")
        if cached_tokens is None and timings and "cache_n" in timings:
            cached_tokens = int(timings["cache_n"])
        if finish_chunk_time is not None and sum(max(c, 1) for c in counts) < completion:
            times.append(finish_chunk_time)  # the finish chunk carried the last token
            counts.append(-1)
    token_times = _expand(times, counts, completion)
    return StreamResult(
        send_s=send,
        token_times=token_times,
        end_s=end,
        prompt_tokens=prompt_n,
        completion_tokens=completion,
        cached_tokens=int(cached_tokens) if cached_tokens is not None else None,
        timings=timings,
        output_ids=ids if ids_seen and len(ids) == completion else None,
        finish_reason=finish,
    )


def _expand(times: list[float], counts: list[int], n: int) -> list[float]:
    """Per-token arrival times from per-chunk times; when chunks and tokens disagree (several
    tokens per chunk without ids), tokens are spread evenly over the chunks' span."""
    if not times or n <= 0:
        return []
    per = [c if c > 0 else 1 for c in counts]
    if sum(per) == n:
        out: list[float] = []
        for t, c in zip(times, per, strict=True):
            out.extend([t] * c)
        return out
    if len(times) == 1:
        return [times[0]] * n
    t0, t1 = times[0], times[-1]
    return [t0 + (t1 - t0) * i / (n - 1) for i in range(n)] if n > 1 else [t0]
