"""The gateway: an OpenAI-compatible scheduler in front of real engines.

Agents point their OpenAI client at the gateway instead of the engine. Each request is a turn
of a session (``x-session-id`` or the ``user`` field); the gateway holds it until the release
policy lets it go, routes it, forwards it through an engine adapter (llama.cpp, vLLM, SGLang, any
OpenAI-compatible server) and streams the answer back — the same scheduler core and policy
objects as the simulator, in wall-clock time. See ``docs/gateway.md``.

Importing this package imports nothing else (the names below load on first use): the CLI
registers ``serve`` and ``replay`` without the ``gateway`` extra's packages (httpx, uvicorn)
installed, and those commands say which extra to install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

#: each public name -> the module it lives in
_WHERE = {
    "EngineAdapter": "adapters", "LlamaCppAdapter": "adapters", "OpenAIAdapter": "adapters",
    "SglangAdapter": "adapters", "VllmAdapter": "adapters", "make_adapter": "adapters",
    "GatewayApp": "app", "create_app": "app",
    "EngineConfig": "config", "GatewayConfig": "config", "load_config": "config",
    "Gateway": "service", "GatewayError": "service",
}

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


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{where}"), name)
