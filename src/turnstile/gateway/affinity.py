"""Session affinity without client keys: a session id derived from the conversation itself.

An unmodified OpenAI client sends the whole conversation every turn. The gateway keys it by
hashes of its messages:

* the **root**: system prompt + first user message. A first turn (no assistant message yet)
  starts a new session ``conv-<root>-<request>`` (two agents starting from the same prompt are
  two sessions, not one serialized one); the root remembers the latest such session, so a new
  conversation with the same prefix starts on the engine that holds that prefix's KV;
* each **request**, as sent (``q:``): the hash of its messages. The next request of the
  conversation starts with them, even when the client dropped the reply in between (an agent
  that discards a malformed reply and sends only a correction) or edited it;
* each **assistant message** (``a:``): when a turn's reply is produced, the hash of the
  conversation through it (a chain over the messages' roles, text and tool-call arguments, so
  equal replies in different conversations differ). The next request carries it back;
* **identical conversations** (agents given the same task at temperature 0 send the same
  messages turn after turn): a key holds every session that passed through that state, and a
  session continues only from its latest request or reply. Among the sessions a request may
  continue, the resolver (:mod:`.resolve`) takes an idle one; a busy one only when its running
  turn's request is a prefix of this one (a client that already has that reply); none free: a
  new session (a fork) near the KV of the first — never two agents serialized on one session;
* **sub-agents**: strings the reply produced (its content, each tool-call argument string such
  as a ``Task`` prompt) and the turn's own last user message are remembered too. A new
  conversation whose first user message is one of them is a sub-agent of that session and
  starts near its parent (on the parent's engine) — unless its first messages (the root) are
  a known session's: that is the same task run again, a fork (``forked``) near that session,
  whether the two started together or seconds apart.

Keys live in a :class:`KeyStore`: a bounded dict in one process, Redis across replicas
(:mod:`.shared`). A key's value carries, besides the session, the engine that produced the reply
and the context it grew to, so a replica that never saw the session routes its next turn to its
KV with no further lookup: one round trip per request.
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
    """Where a request belongs: its session, whether that session is new, the engine holding
    its KV (for a new one: the engine of the session it should start near — the same prefix,
    or a sub-agent's parent) and the context it grew to.

    ``candidates``: every known session the conversation may continue, most specific first
    (the deepest state of the request they passed through); ``session_id``/``new`` are the
    default choice (the first candidate, else a new session) until :meth:`choose` or
    :meth:`fork` settles it (the resolver does, knowing which sessions are busy)."""

    session_id: str
    new: bool
    engine: str | None = None
    context_tokens: int = 0
    near: str | None = None
    parent: str | None = None
    #: keys to remember once the session id is final (root → session)
    remember: list[tuple[str, str]] = field(default_factory=list)
    #: the conversation's hash through the request's last message (extended by the reply)
    chain: str = ""
    root: str = ""
    #: (session, engine, context tokens) of the sessions it may continue, best first
    candidates: list[tuple[str, str | None, int]] = field(default_factory=list)
    #: the conversation's hash through each of its messages but the last (its prefixes)
    prefixes: frozenset[str] = frozenset()
    #: the id a new session gets (a first turn, or a fork of an identical conversation)
    fresh_id: str = ""
    #: how the session was found: new, continued, forked, subagent
    how: str = "new"

    def choose(self, candidate: tuple[str, str | None, int]) -> None:
        self.session_id, self.engine, self.context_tokens = candidate
        self.new = False
        self.how = "continued"

    def fork(self) -> None:
        """A new session: the conversation so far is another session's (identical agents, or
        a client that branched it) — it starts near that session's KV."""
        near = self.candidates[0] if self.candidates else None
        self.session_id, self.new, self.how = self.fresh_id, True, "forked"
        self.context_tokens = 0
        if near is not None:
            self.near, self.engine = near[0], near[1]
        self.remember = [(self.root, _value(self.fresh_id))] if self.root else []


def _value(session_id: str, engine: str | None = None, context_tokens: int = 0) -> str:
    return f"{session_id}\t{engine or ''}\t{context_tokens}"


def _parse(value: str) -> tuple[str, str | None, int]:
    sid, _, rest = value.partition("\t")
    engine, _, ctx = rest.partition("\t")
    return sid, engine or None, int(ctx) if ctx.isdigit() else 0


#: sessions kept under one conversation state (identical agents at the same point)
MAX_CANDIDATES = 16


def _values(raw: str | None) -> list[tuple[str, str | None, int]]:
    """The sessions stored under one key, most recent first."""
    if not raw:
        return []
    return [_parse(v) for v in reversed(raw.split("\n")) if v]


class ConversationKeys:
    """``store``: where keys live; with a shared store, the keys this replica wrote are also
    kept in a local cache, and a follow-up whose latest reply came from this replica (the
    usual case behind a connection-level balancer) is resolved without a round trip: that
    reply is the session's latest state.

    Keys (each holds the sessions that passed through that state, several when identical
    conversations run side by side):

    * ``q:<chain>`` — a request's messages, as sent: the next request extends them even when the
      client dropped or edited the reply in between (an agent that discards a malformed reply
      and sends only a correction);
    * ``a:<chain>`` — a reply the engine produced, appended to its request: the usual follow-up;
    * ``r:``/``s:`` — a conversation's first messages and strings a sub-agent may start from.

    A session continues only from its *latest* state (``latest``, per session): a request
    whose messages include a session's latest request or reply is that session's next turn."""

    def __init__(self, store: KeyStore, *, shared: bool = False) -> None:
        self.store = store
        self.local = LocalKeyStore() if shared else None
        #: session → the conversation hashes of its latest request and of the reply to it
        self.latest: OrderedDict[str, tuple[str, ...]] = OrderedDict()
        self.latest_capacity = 200_000

    async def resolve(self, body: dict[str, Any], request_id: str) -> Resolution | None:
        """The session of a chat request without ``x-session-id``; None when the body has no
        usable messages."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        system = ""
        first_user: str | None = None
        chain = ""
        states: list[tuple[str, bool]] = []  # (hash through each message, is it a reply)
        for m in messages:
            if not isinstance(m, dict):
                continue
            role = m.get("role")
            text = _text(m.get("content"))
            chain = _chain(chain, str(role), text, _tool_args(m.get("tool_calls")))
            states.append((chain, role == "assistant"))
            if role in ("system", "developer") and first_user is None:
                system += text
            elif role == "user" and first_user is None:
                first_user = text
        if first_user is None:
            return None
        root = _h("r", system + "\x00" + first_user)
        sid = f"conv-{root[2:14]}-{request_id[:8]}"
        res = Resolution(sid, True, remember=[(root, _value(sid))], chain=chain, root=root,
                         prefixes=frozenset(c for c, _ in states[:-1]), fresh_id=sid)
        keys: list[str] = []
        for c, reply in reversed(states):  # deepest first
            if reply:
                keys.append("a:" + c)
            keys.append("q:" + c)
        found = await self._get(keys)
        seen: set[str] = set()
        within = res.prefixes | {chain}
        for raw in found:
            for cand in _values(raw):
                if cand[0] in seen:
                    continue
                seen.add(cand[0])
                if self._continues(cand[0], res.prefixes, within):
                    res.candidates.append(cand)
        if res.candidates:
            res.choose(res.candidates[0])
            return res
        near, parent = await self.store.get_many([root, _h("s", first_user)])
        if near is not None:
            # it starts as a known session did (the same task again): a fork of it, whether
            # that session is still running or not, and never its sub-agent (a run's first
            # user message is its own turn's last, remembered for sub-agents)
            res.near, res.engine, _ = _parse(near)
            res.how = "forked"
        elif parent is not None:
            res.near, res.engine, _ = _parse(parent)
            res.parent = res.near
            res.how = "subagent"
        return res

    def _continues(self, session_id: str, prefixes: frozenset[str], within: frozenset[str]
                   ) -> bool:
        """Does a request (its message hashes: ``prefixes`` without, ``within`` with the last)
        continue the session from its latest state? It extends the session's latest request
        (the reply in between may have been dropped or edited by the client) or carries the
        reply to it; the same messages again continue it only when no reply came (a retry):
        after a reply they are another conversation starting the same way."""
        latest = self.latest.get(session_id)
        if latest is None:  # not seen by this process (another replica, a restart)
            return True
        if len(latest) == 1:
            return latest[0] in within
        return latest[0] in prefixes or latest[1] in within

    async def _get(self, keys: list[str]) -> list[str | None]:
        if self.local is not None:  # what this replica wrote is the freshest it knows
            mine = [self.local._keys.get(k) for k in keys]
            if any(v is not None for v in mine):
                return mine
        return await self.store.get_many(keys)

    def remember(self, res: Resolution) -> None:
        """The request's session is final: its messages are that session's latest state."""
        self._note(res.session_id, (res.chain,))
        items = list(res.remember)
        if res.chain:
            items.append(("q:" + res.chain, _value(res.session_id, res.engine,
                                                   res.context_tokens)))
        self._put(items)

    def _note(self, session_id: str, states: tuple[str, ...]) -> None:
        self.latest[session_id] = states
        self.latest.move_to_end(session_id)
        while len(self.latest) > self.latest_capacity:
            self.latest.popitem(last=False)

    def _put(self, items: list[tuple[str, str]]) -> None:
        """Store keys; a state key (``q:``/``a:``) keeps every session that passed through it."""
        merged = []
        known = self.local if self.local is not None else self.store
        for k, v in items:
            if k[:2] in ("q:", "a:"):
                old = known._keys.get(k) if isinstance(known, LocalKeyStore) else None
                sid = v.partition("\t")[0]
                kept = [x for x in (old.split("\n") if old else ())
                        if x and x.partition("\t")[0] != sid]
                v = "\n".join([*kept[-(MAX_CANDIDATES - 1):], v])
            merged.append((k, v))
        self.store.put_many(merged)
        if self.local is not None:
            self.local.put_many(merged)

    def reply(self, session_id: str, res_chain: str, root: str, content: str, tool_args: str,
              last_user: str | None, engine: str, context_tokens: int) -> None:
        """A turn of ``session_id`` (its request's conversation hash ``res_chain``) produced
        this reply on ``engine``: the next request carrying it back, a new conversation with the
        same first messages, and a sub-agent started from the reply (or from the turn's own
        request) find the session and its engine."""
        v = _value(session_id, engine, context_tokens)
        after = _chain(res_chain, "assistant", content, tool_args)
        self._note(session_id, (res_chain, after))
        # the request's state too, now with the engine and context its turn left behind
        items = [("a:" + after, v), ("q:" + res_chain, v)]
        if root:
            items.append((root, v))
        for t in reply_texts(content, tool_args):
            items.append((_h("s", t), v))
        if last_user and len(last_user) >= 16:
            items.append((_h("s", last_user), v))
        self._put(items)

    def forget(self, session_id: str) -> None:
        """The session is gone (closed, or refused by the engine before its first turn)."""
        self.latest.pop(session_id, None)


def last_user_text(body: dict[str, Any]) -> str | None:
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in reversed(messages):
            if isinstance(m, dict) and m.get("role") == "user":
                return _text(m.get("content"))
    return None
