"""A turn's size before it runs: prompt tokens from characters (a ratio learned from the
engines' real ``usage.prompt_tokens``) or the engine's tokenizer, output from ``max_tokens`` —
or from the client's own expectation, Dynamo's ``nvext.agent_hints.osl``, capped by
``max_tokens``."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

from turnstile.gateway.protocol import CHAT_PATH
from turnstile.workload.model import Turn

__all__ = ["TokenEstimator", "output_hint", "prompt_chars", "prompt_text"]


def prompt_chars(path: str, body: dict[str, Any]) -> int:
    if path == CHAT_PATH:
        n = 0
        for m in body.get("messages") or ():
            if not isinstance(m, dict):
                continue
            c = m.get("content")
            if isinstance(c, str):
                n += len(c)
            elif isinstance(c, list):
                for part in c:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        n += len(part["text"])
            n += 16  # role and template tokens
        return n
    p = body.get("prompt")
    if isinstance(p, str):
        return len(p)
    if isinstance(p, list):
        return sum(len(x) if isinstance(x, str) else 4 for x in p)
    return 0


def prompt_text(path: str, body: dict[str, Any]) -> str:
    if path == CHAT_PATH:
        parts = []
        for m in body.get("messages") or ():
            if isinstance(m, dict) and isinstance(m.get("content"), str):
                parts.append(m["content"])
        return "\n".join(parts)
    p = body.get("prompt")
    return p if isinstance(p, str) else ""



def output_hint(body: dict[str, Any]) -> int | None:
    """Dynamo's ``nvext.agent_hints.osl``: the output tokens the client expects, when given."""
    nvext = body.get("nvext")
    hints = nvext.get("agent_hints") if isinstance(nvext, dict) else None
    osl = hints.get("osl") if isinstance(hints, dict) else None
    if isinstance(osl, int | float) and not isinstance(osl, bool) and osl >= 1:
        return int(osl)
    return None


class TokenEstimator:
    """``tokenize`` (optional) counts a prompt exactly through an engine; None when it cannot."""

    def __init__(self, default_output_tokens: int,
                 tokenize: Callable[[str], Awaitable[int | None]] | None = None) -> None:
        self.default_output_tokens = default_output_tokens
        self.tokenize = tokenize
        self.tokens_per_char = 0.25

    async def estimate(self, path: str, body: dict[str, Any], known_context_tokens: int
                       ) -> tuple[Turn, int]:
        """The turn (new input on top of the session's known context) and its prompt chars."""
        chars = prompt_chars(path, body)
        prompt = max(1, math.ceil(chars * self.tokens_per_char))
        if self.tokenize is not None:
            counted = await self.tokenize(prompt_text(path, body))
            if counted is not None:
                prompt = max(1, counted)
        context = min(known_context_tokens, max(prompt - 1, 0))
        cap = body.get("max_completion_tokens") or body.get("max_tokens")
        cap = cap if isinstance(cap, int) and cap > 0 else None
        hint = output_hint(body)  # the client's expected output, within its cap
        out = (min(hint, cap) if cap else hint) if hint is not None else (
            cap or self.default_output_tokens)
        return Turn(input_tokens=prompt - context, output_tokens=out,
                    context_tokens=context), chars

    def learn(self, prompt_tokens: int, chars: int) -> None:
        """An engine reported a prompt's real token count: move the ratio towards it."""
        if prompt_tokens > 0 and chars > 0:
            self.tokens_per_char += 0.1 * (prompt_tokens / chars - self.tokens_per_char)
