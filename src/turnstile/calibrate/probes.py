"""Probes: one step-time measurement at a time from one live engine, through its HTTP API.

:class:`EngineProber` sends token-id prompts (exact lengths, exact prefixes) and times the
streamed tokens; each probe returns a :class:`Measurement`, one ``(features, step_time)`` sample
(:mod:`turnstile.calibrate.features`) with where it came from:

* **prefill** (cache miss): one fresh prompt per length; the step time is llama.cpp's own
  ``timings.prompt_ms`` when the engine reports it, else the TTFT;
* **cache hit**: a prefix is computed once, then the prefix plus a new suffix is sent; the
  engine's reported hit (``cached_tokens`` / ``cache_n``) sets the features;
* **warm append**: as an agent's next turn, right after a turn's generation the prompt plus
  the generated tokens plus a new suffix is sent: the same work as a cache hit, with the
  engine's caches warm from the decodes instead of cold from a prefill
  (the engine profile's warm rule, :data:`~turnstile.sim.profiles.llamacpp.WARM`);
* **decode**: ``k`` concurrent streams over a shared (cached) prefix of a given context; the
  step time is the token inter-arrival time while all ``k`` decode;
* **mixed**: ``k`` streams decoding while a new prompt arrives; the decoders' gap that ends with
  the newcomer's first token is one step holding both (llama.cpp's ``timings.prompt_ms`` of the
  newcomer times that step when the engine reports it).

On llama.cpp the concurrent streams are pinned to slots ``0..k-1`` (the newcomer to slot ``k``):
with one KV stream per slot the server runs one forward pass per run of consecutive busy slots,
so slots it picked itself could split a measured step into passes the sample does not count.

:mod:`turnstile.calibrate.profile` plans the sweep, runs these probes and fits the profile.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from turnstile.calibrate.client import EngineInfo, StreamResult, stream_completion
from turnstile.calibrate.features import (
    DecodeStream,
    Sample,
    decode_window_sample,
    mixed_sample,
    prefill_sample,
)

__all__ = ["COLD_KINDS", "EngineProber", "Measurement", "cold_flags"]

#: the probes whose step runs with the engine's caches cold: a prompt right after a prefill or
#: a single decode; the others follow runs of small steps
COLD_KINDS = ("prefill", "cache_hit")


def cold_flags(kinds: Sequence[str]) -> list[bool] | None:
    """Which of the samples of these kinds ran cold, for the fit's cold-step term; None
    without warm appends, whose contrast with the cache hits alone measures it (else the
    term would fit whatever else tells the kinds apart)."""
    if "warm_append" not in kinds:
        return None
    return [k in COLD_KINDS for k in kinds]


@dataclass
class Measurement:
    """One sample with where it came from."""

    kind: str  # prefill | cache_hit | warm_append | decode | mixed
    features: tuple[float, float, float, float]
    step_s: float
    steps: int = 1
    note: dict[str, Any] = field(default_factory=dict)

    @property
    def cold(self) -> bool:
        """Whether the step ran with the engine's caches cold (:data:`COLD_KINDS`)."""
        return self.kind in COLD_KINDS

    def sample(self) -> Sample:
        return self.features, self.step_s


class _Tokens:
    """Fresh random token ids (distinct prompts never share a prefix by accident)."""

    def __init__(self, seed: int, lo: int = 33, hi: int = 127) -> None:
        self._rng = random.Random(seed)
        self.lo, self.hi = lo, hi

    def take(self, n: int) -> list[int]:
        r = self._rng
        return [r.randrange(self.lo, self.hi) for _ in range(n)]


class EngineProber:
    """Takes one measurement at a time from one live engine (see the module docstring)."""

    def __init__(
        self,
        info: EngineInfo,
        chunk: int,
        seed: int,
        token_range: tuple[int, int],
        timeout: float,
    ) -> None:
        self.info = info
        self.chunk = chunk
        self.tokens = _Tokens(seed, *token_range)
        self.timeout = timeout
        self.overheads: list[float] = []
        self._prefixes: dict[int, list[int]] = {}

    def warm_up(self) -> None:
        """The first request pays one-off costs (graph allocation, page faults): pay them here."""
        self._send(self.tokens.take(32), 4)

    def _send(self, prompt: list[int], max_tokens: int, slot: int | None = None,
              **stream: Any) -> StreamResult:
        """One streamed completion; ``stream`` passes ``on_token`` / ``should_stop`` on."""
        return stream_completion(
            self.info.url,
            prompt,
            max_tokens,
            api="openai",
            model=self.info.model,
            timeout=self.timeout,
            extra=self._slot(slot),
            **stream,
        )

    def serve_one(self, prompt_tokens: int, output_tokens: int,
                  should_stop: Callable[[], bool] | None = None) -> StreamResult:
        """One fresh request, untimed: load on this engine while another one is probed."""
        return self._send(self.tokens.take(prompt_tokens), output_tokens,
                          should_stop=should_stop)

    def ttft(self, new_tokens: int, cached_prefix: int = 0) -> float:
        """The time to first token of ``new_tokens`` fresh tokens after a cached prefix of
        ``cached_prefix`` tokens (0: none), as this client sees it: the engine's prompt time
        plus the request's way in and the first token's way out."""
        prefix = self._prefix(cached_prefix) if cached_prefix else []
        return self._send(prefix + self.tokens.take(new_tokens), 2).ttft_s

    def prompt_time(self, n: int) -> float:
        """The engine's time to compute ``n`` fresh tokens from scratch (one token out)."""
        return self._prompt_time(self._send(self.tokens.take(n), 1))

    def _slot(self, i: int | None) -> dict[str, Any] | None:
        """llama.cpp's ``id_slot`` for the ``i``-th concurrent stream (see the module docstring);
        None elsewhere, or when the engine has fewer slots."""
        if i is None or self.info.kind != "llama.cpp" or i >= (self.info.n_parallel or 0):
            return None
        return {"id_slot": i}

    def _prompt_time(self, res: StreamResult) -> float:
        """Prompt processing time: llama.cpp's own measure when present, else the TTFT."""
        t = res.timings
        if t and t.get("prompt_ms") is not None and float(t.get("prompt_n", 1)) > 0:
            self.overheads.append(res.ttft_s - float(t["prompt_ms"]) / 1e3)
            return float(t["prompt_ms"]) / 1e3
        return res.ttft_s

    def _cached(self, res: StreamResult, expect: int) -> int:
        if res.cached_tokens is not None:
            return res.cached_tokens
        if res.timings and "prompt_n" in res.timings:
            return max(0, res.prompt_tokens - int(res.timings["prompt_n"]))
        return expect

    def _prompt_measurement(self, kind: str, res: StreamResult, expect_cached: int,
                            note: dict[str, Any]) -> Measurement:
        """A lone prompt's processing, ``res``, as one sample of ``kind`` (mean over its
        chunks); its cached tokens as the engine reports them (``expect_cached`` where it
        does not) join ``note``."""
        cached = self._cached(res, expect_cached)
        secs = self._prompt_time(res)
        feats, step = prefill_sample(res.prompt_tokens, cached, self.chunk, secs)
        return Measurement(kind, feats, step, max(1, round(secs / step)),
                           {**note, "cached": cached})

    def prefill(self, n: int, probe: int) -> Measurement:
        res = self._send(self.tokens.take(n), probe)
        return self._prompt_measurement("prefill", res, 0, {"prompt": n})

    def _prefix(self, n: int) -> list[int]:
        """A prefix of ``n`` tokens, computed (and so cached) once and reused."""
        got = self._prefixes.get(n)
        if got is None:
            got = self._prefixes[n] = self.tokens.take(n)
            if n > 16:
                self._send(got, 1)
        return got

    def cache_hit(self, prefix_len: int, suffix: int, probe: int) -> Measurement:
        prefix = self._prefix(prefix_len)
        res = self._send(prefix + self.tokens.take(suffix), probe)
        # without a reported hit assume the prefix's full KV blocks hit (vLLM caches blocks)
        block = int(self.info.extra.get("block_size", 1) or 1)
        return self._prompt_measurement("cache_hit", res, prefix_len // block * block,
                                        {"prefix": prefix_len, "suffix": suffix})

    def warm_append(self, prefix_len: int, suffix: int, probe: int,
                    gen: int = 16) -> Measurement | None:
        """A turn of ``gen`` tokens over a cached ``prefix_len``-token prefix, then at once its
        prompt and output plus ``suffix`` new tokens (None when the engine does not return the
        generated ids, without which the next prompt would miss its cache)."""
        head = self._prefix(prefix_len) + self.tokens.take(4)
        # llama.cpp returns the generated ids on its own endpoint only
        turn = stream_completion(
            self.info.url, head, gen, api="llamacpp" if self.info.kind == "llama.cpp" else "openai",
            model=self.info.model, return_ids=True, timeout=self.timeout)
        if not turn.output_ids:
            return None
        prompt = head + list(turn.output_ids) + self.tokens.take(suffix)
        res = self._send(prompt, probe)
        return self._prompt_measurement("warm_append", res, len(prompt) - suffix - 1,
                                        {"prefix": prefix_len, "suffix": suffix, "gen": gen})

    def _streams(self, prompts: Sequence[list[int]], max_tokens: int) -> list[StreamResult]:
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            futs = [pool.submit(self._send, p, max_tokens, i) for i, p in enumerate(prompts)]
            return [f.result() for f in futs]

    def decode(self, k: int, context: int, gen: int) -> Measurement | None:
        # a shared prefix (cached once) keeps the set-up cheap; a short unique suffix per stream
        suffix = min(8, max(1, context // 8))
        prefix = self._prefix(max(1, context - suffix))
        prompts = [prefix + self.tokens.take(suffix) for _ in range(k)]
        results = self._streams(prompts, gen)
        streams = [DecodeStream(r.prompt_tokens, r.token_times) for r in results]
        got = decode_window_sample(streams)
        if got is None:
            return None
        feats, step = got
        return Measurement("decode", feats, step, gen, {"k": k, "context": context})

    def mixed(self, k: int, newcomer: int, context: int) -> Measurement | None:
        """``k`` decoders (``context``-token prompts) run; once each has a few tokens a fresh
        ``newcomer``-token prompt is sent; the decoders are cut off after its first token."""
        prompts = [self.tokens.take(context) for _ in range(k)]
        fresh = self.tokens.take(newcomer)
        counts = [0] * k
        warm = threading.Event()
        stop = threading.Event()
        limit = max(64, (self.info.ctx_per_seq or 4096) - context - 8)

        def decoder(i: int) -> StreamResult:
            def on_token(n: int, _t: float) -> None:
                counts[i] = n
                if min(counts) >= 4:
                    warm.set()

            return self._send(prompts[i], limit, i, on_token=on_token, should_stop=stop.is_set)

        with ThreadPoolExecutor(max_workers=k) as pool:
            futs = [pool.submit(decoder, i) for i in range(k)]
            try:
                if not warm.wait(self.timeout):
                    return None
                new = self._send(fresh, 2, k)
                time.sleep(0.05)  # let the decoders read the token of the newcomer's step
            finally:
                stop.set()
            results = [f.result() for f in futs]
        cached = self._cached(new, 0)
        streams = [DecodeStream(r.prompt_tokens, r.token_times) for r in results]
        got = mixed_sample(streams, new.prompt_tokens, cached, new.first_token_s, self.chunk)
        if got is None:
            return None
        feats, step = got
        note: dict[str, Any] = {"k": k, "prompt": newcomer, "decoder_gap_s": step}
        t = new.timings
        if t and t.get("prompt_ms") is not None and float(t.get("prompt_n", 0)) > 0:
            # the engine's own time for the newcomer's prompt is that one step, timed on the
            # server: the decoders' token gap is timed in this process, whose threads (on a
            # small host) can deliver a token late enough to pair the newcomer with the next
            # step's gap instead
            step = float(t["prompt_ms"]) / 1e3
        return Measurement("mixed", feats, step, 1, note)
