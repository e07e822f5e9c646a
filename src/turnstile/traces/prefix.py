"""Prefix block hashes of a prompt, computed from its text: a hash chain over fixed-size blocks.

A prompt (chat ``messages`` with their ``tools``, or a completions ``prompt``) is serialized to a
canonical text — one compact JSON object per message, in order, so that a conversation's turn
n+1 text starts with turn n's text whenever the client appended to the transcript — and cut into
blocks of :data:`BLOCK_CHARS` characters. Block ``j``'s hash covers block ``j`` *and* every
block before it (a chain, like vLLM's and Mooncake's block ids), so equal hashes mean equal
prefixes, across sessions too (a shared system prompt and tool list give shared leading blocks).
Only full blocks are hashed.

The simulator reads a hash as naming ``hash_block_tokens`` tokens (a multiple of its KV block
size). Character blocks are not token blocks: a workload built from these hashes declares
``hash_block_tokens`` from the measured tokens per character (:func:`hash_block_tokens`), so a
block's token count is right on average, not per block. Only the hashes leave this module; the
text is never stored.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any

#: characters per hashed block (≈ 256 tokens of English text or code at ~4 characters/token)
BLOCK_CHARS = 1024
#: the simulator's KV block size: ``hash_block_tokens`` must be a multiple of it
SIM_BLOCK_TOKENS = 16
#: hashes are cut to 53 bits so that every JSON reader keeps them exact
_HASH_BITS = 53
#: message keys that are part of what the model reads (``extra`` and the like are not)
_MESSAGE_KEYS = ("role", "name", "content", "tool_calls", "tool_call_id", "function_call")


def _dump(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def canonical_message(message: Any) -> str:
    """One message as compact JSON of the fields the model reads (stable key order)."""
    if not isinstance(message, dict):
        return _dump(message)
    return _dump({k: message[k] for k in _MESSAGE_KEYS if message.get(k) is not None})


def prompt_text(messages: Sequence[Any] | None = None, prompt: Any = None,
                tools: Any = None) -> str:
    """The canonical text of a chat prompt (``tools`` first, then each message on its own line)
    or of a completions ``prompt``; turn n+1's text extends turn n's when the client appended."""
    parts: list[str] = []
    if tools:
        parts.append(_dump({"tools": tools}))
    if messages is not None:
        parts.extend(canonical_message(m) for m in messages)
    elif isinstance(prompt, str):
        parts.append(prompt)
    elif prompt is not None:
        parts.append(_dump(prompt))
    return "\n".join(parts)


def body_text(body: dict[str, Any]) -> str:
    """The canonical prompt text of an OpenAI chat-completions or completions request body."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return prompt_text(messages, tools=body.get("tools") or body.get("functions"))
    return prompt_text(prompt=body.get("prompt"))


def chain_hashes(text: str, block_chars: int = BLOCK_CHARS) -> tuple[int, ...]:
    """Hash chain over the full ``block_chars`` blocks of ``text`` (53-bit non-negative ints)."""
    out: list[int] = []
    prev = b""
    shift = 64 - _HASH_BITS
    for start in range(0, len(text) - block_chars + 1, block_chars):
        digest = hashlib.blake2b(prev + text[start:start + block_chars].encode("utf-8"),
                                 digest_size=8).digest()
        out.append(int.from_bytes(digest, "big") >> shift)
        prev = digest
    return tuple(out)


def text_digest(text: str) -> bytes:
    """A short digest of a whole text (to test later whether another text starts with it)."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def shared_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading blocks two hash chains share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def hash_block_tokens(tokens_per_char: float, block_chars: int = BLOCK_CHARS) -> int:
    """Tokens one hashed block stands for, rounded to the simulator's KV block size (≥ 1 block)."""
    est = block_chars * max(tokens_per_char, 0.0)
    return max(SIM_BLOCK_TOKENS, round(est / SIM_BLOCK_TOKENS) * SIM_BLOCK_TOKENS)


def tokens_per_char(pairs: Iterable[tuple[int, int]]) -> float:
    """Aggregate ratio of (prompt tokens, prompt characters) pairs; 0.25 when there are none."""
    tokens = chars = 0
    for t, c in pairs:
        if t > 0 and c > 0:
            tokens += t
            chars += c
    return tokens / chars if chars else 0.25
