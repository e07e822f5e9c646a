"""The gateway: an OpenAI-compatible scheduler in front of real engines.

Agents point their OpenAI client at the gateway instead of the engine. Each request is a turn
of a session (``x-session-id`` or the ``user`` field); the gateway holds it until the release
policy lets it go, routes it, forwards it through an engine adapter (llama.cpp, vLLM, SGLang, any
OpenAI-compatible server) and streams the answer back — the same scheduler core and policy
objects as the simulator, in wall-clock time. See ``docs/gateway.md``.
"""

from turnstile.gateway.adapters import (
    EngineAdapter,
    LlamaCppAdapter,
    OpenAIAdapter,
    SglangAdapter,
    VllmAdapter,
    make_adapter,
)
from turnstile.gateway.app import GatewayApp, create_app
from turnstile.gateway.config import EngineConfig, GatewayConfig, load_config
from turnstile.gateway.service import Gateway, GatewayError

__all__ = [
    "EngineAdapter",
    "EngineConfig",
    "Gateway",
    "GatewayApp",
    "GatewayConfig",
    "GatewayError",
    "LlamaCppAdapter",
    "OpenAIAdapter",
    "SglangAdapter",
    "VllmAdapter",
    "create_app",
    "load_config",
    "make_adapter",
]
