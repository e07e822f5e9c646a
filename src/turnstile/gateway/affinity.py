"""Session affinity without client keys: a session id derived from the conversation itself.

An unmodified OpenAI client sends the whole conversation every turn. The gateway keys it by
hashes of its messages:

* the **root**: system prompt + first user message. A first turn (no assistant message yet)
  starts a new session ``conv-<root>-<request>`` (two agents starting from the same prompt are
  two sessions, not one serialized one); the root remembers the latest such session, so a new
  conversation with the same prefix starts on the engine that holds that prefix's KV;
* each **assistant message**: when a turn's reply is produced, the hash of the conversation
  through it (a chain over the messages' roles, text and tool-call arguments, so equal replies in
  different conversations differ) is remembered → session. The next request carries that reply
  back as its last assistant message, so the lookup finds the session;
* **sub-agents**: strings the reply produced (its content, each tool-call argument string such
  as a ``Task`` prompt) and the turn's own last user message are remembered too. A new
  conversation whose first user message is one of them is a sub-agent of that session and
  starts near its parent (on the parent's engine).

Keys live in a :class:`KeyStore`: a bounded dict in one process, Redis across replicas
(:mod:`.shared`). Lookups of one request go in one round trip.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["ConversationKeys", "KeyStore", "LocalKeyStore", "Resolution", "reply_texts"]


class KeyStore(Protocol):
    async def get_many(self, keys: list[str]) -> list[str | None]: ...

    def put_many(self, items: Iterable[tuple[str, str]]) -> None: ...


class LocalKeyStore:
    """The single-process key store: the most recent ``capacity`` keys."""

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[str, str] = OrderedDict()

    async def get_many(self, keys: list[str]) -> list[str | None]:
        return [self._keys.get(k) for k in keys]

    def put_many(self, items: Iterable[tuple[str, str]]) -> None:
        for k, v in items:
            self._keys[k] = v
            self._keys.move_to_end(k)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)


def _h(kind: str, text: str) -> str:
    return kind + ":" + hashlib.blake2b(text.strip().encode(), digest_size=12).hexdigest()


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(p["text"] for p in content
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _tool_args(tool_calls: Any) -> str:
    if not isinstance(tool_calls, list):
        return ""
    parts = []
    for c in tool_calls:
        f = c.get("function") if isinstance(c, dict) else None
        if isinstance(f, dict) and isinstance(f.get("arguments"), str):
            parts.append(f["arguments"])
    return "".join(parts)


def _chain(prev: str, role: str, text: str, tool_args: str) -> str:
    """The conversation's hash through one more message."""
    data = "\x00".join((prev, role, text.strip(), tool_args)).encode()
    return hashlib.blake2b(data, digest_size=12).hexdigest()


def reply_texts(content: str, tool_args: str) -> list[str]:
    """Strings a reply produced that a sub-agent's first message may be: its text and every
    string inside its tool-call arguments (e.g. a ``Task`` tool's ``prompt``)."""
    out = [content] if content.strip() else []
    if tool_args:
        try:
            args: Any = json.loads(tool_args)
        except ValueError:
            args = None
        stack = [args]
        while stack:
            x = stack.pop()
            if isinstance(x, str) and len(x) >= 16:
                out.append(x)
            elif isinstance(x, dict):
                stack.extend(x.values())
            elif isinstance(x, list):
                stack.extend(x)
    return out


@dataclass(slots=True)
class Resolution:
    """Where a request belongs: its session, whether that session is new, and for a new one
    the session whose engine it should start on (same prefix, or a sub-agent's parent)."""

    session_id: str
    new: bool
    near: str | None = None
    parent: str | None = None
    #: keys to remember once the session id is final (root → session)
    remember: list[tuple[str, str]] = field(default_factory=list)
    #: the conversation's hash through the request's last message (extended by the reply)
    chain: str = ""


class ConversationKeys:
    def __init__(self, store: KeyStore) -> None:
        self.store = store

    async def resolve(self, body: dict[str, Any], request_id: str) -> Resolution | None:
        """The session of a chat request without ``x-session-id``; None when the body has no
        usable messages."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        system = ""
        first_user: str | None = None
        assistants: list[str] = []
        chain = ""
        for m in messages:
            if not isinstance(m, dict):
                continue
            role = m.get("role")
            text = _text(m.get("content"))
            chain = _chain(chain, str(role), text, _tool_args(m.get("tool_calls")))
            if role in ("system", "developer") and first_user is None:
                system += text
            elif role == "user" and first_user is None:
                first_user = text
            elif role == "assistant":
                assistants.append("a:" + chain)
        if first_user is None:
            return None
        root = _h("r", system + "\x00" + first_user)
        if assistants:
            # the latest assistant message we produced names the session
            found = await self.store.get_many(assistants[::-1])
            for sid in found:
                if sid is not None:
                    return Resolution(sid, False, chain=chain)
        sid = f"conv-{root[2:14]}-{request_id[:8]}"
        near, parent = await self.store.get_many([root, _h("s", first_user)])
        return Resolution(sid, True, near=parent or near, parent=parent,
                          remember=[(root, sid)], chain=chain)

    def remember(self, res: Resolution) -> None:
        if res.remember:
            self.store.put_many(res.remember)

    def reply(self, session_id: str, chain: str, content: str, tool_args: str,
              last_user: str | None) -> None:
        """A turn of ``session_id`` (its request's conversation hash ``chain``) produced this
        reply: the next request carrying it back, and a sub-agent started from it (or from the
        turn's own request), find the session."""
        items = [("a:" + _chain(chain, "assistant", content, tool_args), session_id)]
        for t in reply_texts(content, tool_args):
            items.append((_h("s", t), session_id))
        if last_user and len(last_user) >= 16:
            items.append((_h("s", last_user), session_id))
        self.store.put_many(items)


def last_user_text(body: dict[str, Any]) -> str | None:
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in reversed(messages):
            if isinstance(m, dict) and m.get("role") == "user":
                return _text(m.get("content"))
    return None
