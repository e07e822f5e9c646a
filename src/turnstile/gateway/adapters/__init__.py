"""Engine adapters (:mod:`.base`: the interface; :mod:`.kinds`: llama.cpp, vLLM, SGLang,
OpenAI): one small async interface in front of every OpenAI-compatible engine.

The gateway speaks to engines only through :class:`EngineAdapter`:

* :meth:`~EngineAdapter.complete` forwards a non-streaming request and returns the whole
  response; :meth:`~EngineAdapter.stream` forwards a streaming one and yields its server-sent
  events one by one (each a complete ``data: ...`` event, blank line included).
* :meth:`~EngineAdapter.health`, :meth:`~EngineAdapter.stats` (a ``/metrics`` scrape),
  :meth:`~EngineAdapter.models` and :meth:`~EngineAdapter.tokenize` for the control loop.
* :meth:`~EngineAdapter.begin` / :meth:`~EngineAdapter.end` bracket each forwarded turn and
  :meth:`~EngineAdapter.retain` carries out a retention decision (pin, offload, discard); the
  base class does nothing, :class:`LlamaCppAdapter` maps them onto llama.cpp's slots.

Retries: an adapter retries a request only when the engine sent nothing back — a refused
connection, or a kept-alive connection the engine had closed — and never after any response
byte arrived, so a completed turn is never run twice. Anything else surfaces as
:class:`UpstreamError` (the gateway re-routes or fails the turn) or :class:`UpstreamHTTPError`
(the engine answered with an error status; the gateway passes 4xx through).
"""

from turnstile.gateway.adapters.base import (
    FEATURES,
    EngineAdapter,
    EngineStats,
    ForwardHints,
    UpstreamError,
    UpstreamHTTPError,
    UpstreamResponse,
    parse_prometheus,
    split_sse,
)
from turnstile.gateway.adapters.kinds import (
    ADAPTERS,
    LlamaCppAdapter,
    OpenAIAdapter,
    SglangAdapter,
    VllmAdapter,
    make_adapter,
)

__all__ = [
    "ADAPTERS",
    "FEATURES",
    "EngineAdapter",
    "EngineStats",
    "ForwardHints",
    "LlamaCppAdapter",
    "OpenAIAdapter",
    "SglangAdapter",
    "UpstreamError",
    "UpstreamHTTPError",
    "UpstreamResponse",
    "VllmAdapter",
    "make_adapter",
    "parse_prometheus",
    "split_sse",
]
