"""The engine model's request types: :class:`SimRequest` (one request, its progress filled in by
the engine) and :class:`StepOutcome` (what one engine step did, at its end).

The underscored fields of :class:`SimRequest` belong to the engine's modules (the batch
scheduler, the block pool and the step executor share them); drivers read only the public ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# request states (engine-private)
NEW = 0
WAITING = 1
PREFILL = 2
DECODE = 3
DONE = 4


class SimRequest:
    """One request as the engine sees it. Created by the driver; progress filled by the engine.

    ``rid`` is opaque to the engine. ``block_hashes`` (optional) name the prompt's leading hash
    blocks (``EngineConfig.hash_block_tokens`` tokens each); see :mod:`turnstile.sim.engine`.
    """

    __slots__ = (
        "_fin_it",
        "_i0",
        "_m",
        "_n0",
        "_n_exp",
        "_n_hit",
        "_o0",
        "_seg",
        "_seq",
        "_state",
        "_target",
        "arrival_s",
        "block_hashes",
        "cached_tokens",
        "finished_s",
        "first_token_s",
        "num_computed",
        "num_output",
        "output_tokens",
        "preempted",
        "priority",
        "prompt_tokens",
        "rid",
        "session",
        "started_s",
    )

    def __init__(
        self,
        rid: Any,
        session: str,
        prompt_tokens: int,
        output_tokens: int,
        priority: float = 0.0,
        block_hashes: tuple[int, ...] | None = None,
        arrival_s: float = 0.0,
    ) -> None:
        self.rid = rid
        self.session = session
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.priority = priority
        self.block_hashes = block_hashes
        self.arrival_s = arrival_s
        # engine-filled
        #: tokens whose KV is computed (or hit) in the current admission
        self.num_computed = 0
        #: output tokens emitted so far (exact at events; see the engine module's docstring)
        self.num_output = 0
        #: prefix-cache hit (tokens) at the first admission
        self.cached_tokens = 0
        self.started_s = -1.0
        self.first_token_s = -1.0
        self.finished_s = -1.0
        #: times preempted (and later recomputed)
        self.preempted = 0
        # engine-private
        self._state = NEW
        self._seq = -1
        self._target = 0  # tokens to compute in the current admission (prompt + outputs so far)
        self._n_hit = 0  # leading blocks shared with the prefix cache
        self._n_exp = 0  # ... of which hash blocks (each hash_block_tokens // block_size blocks)
        self._m = 0  # leading blocks named by block_hashes (the session segment starts here)
        self._seg: Seg | None = None  # the session segment it holds a prefix of
        self._i0 = 0  # decode: first decode iteration
        self._n0 = 0  # decode: KV length at _i0
        self._o0 = 0  # decode: outputs emitted at _i0
        self._fin_it = 0  # decode: iteration at whose end it finishes

    @property
    def done(self) -> bool:
        return self._state == DONE

    def __repr__(self) -> str:
        return (
            f"<SimRequest {self.rid!r} {self.session} p={self.prompt_tokens} "
            f"o={self.num_output}/{self.output_tokens}>"
        )


class StepOutcome:
    """What one iteration did. Everything happens at ``now + duration_s``.

    A plain ``__slots__`` class rather than a dataclass: one is made per step, and a compiled
    build (``make compiled``) would run a dataclass's generated ``__init__`` as Python."""

    __slots__ = ("busy", "duration_s", "end_s", "finished", "first_token", "iterations",
                 "started")

    def __init__(
        self,
        duration_s: float,
        started: Sequence[SimRequest] | None = None,
        first_token: Sequence[SimRequest] | None = None,
        finished: list[SimRequest] | None = None,
        busy: bool = True,
        end_s: float = 0.0,
        iterations: int = 1,
    ) -> None:
        self.duration_s = duration_s
        #: requests scheduled for the first time this step (their ``started_s`` is ``now``)
        self.started: Sequence[SimRequest] = [] if started is None else started
        #: requests that emitted their first output token at the end of this step
        self.first_token: Sequence[SimRequest] = [] if first_token is None else first_token
        #: requests that finished at the end of this step; their KV went to the prefix cache
        self.finished: list[SimRequest] = [] if finished is None else finished
        #: False for an idle wait (requests queued, KV held by pins, nothing runnable)
        self.busy = busy
        #: when it ends: ``now + duration_s`` after one iteration; after
        #: :meth:`~turnstile.sim.engine.EngineModel.leap` the end of the last iteration, summed
        #: one iteration at a time as stepping would
        self.end_s = end_s
        #: iterations it covers (more than 1 after a leap)
        self.iterations = iterations

    def __repr__(self) -> str:
        return (f"StepOutcome(duration_s={self.duration_s!r}, started={self.started!r}, "
                f"first_token={self.first_token!r}, finished={self.finished!r}, "
                f"busy={self.busy!r}, end_s={self.end_s!r}, iterations={self.iterations!r})")


class Seg:
    """The session-named blocks of one session (from block ``lo`` on) on one engine.

    Blocks ``[lo, g)`` are cached on the GPU and ``[g, c)`` in the CPU tier (``c == g``: none).
    Running requests holding a prefix are ``users`` (request → end block); the evictable part
    is ``[floor, g)`` with ``floor`` the longest held prefix, unless the segment is pinned.
    """

    __slots__ = ("c", "ev", "g", "key", "lo", "pin_until", "users")

    def __init__(self, key: tuple[str, int], lo: int) -> None:
        self.key = key
        self.lo = self.g = self.c = lo
        self.users: dict[SimRequest, int] = {}
        self.pin_until = 0.0  # > 0 while pinned
        self.ev = 0  # evictable blocks as last counted in the pool's total

    def floor(self) -> int:
        return max(self.users.values()) if self.users else self.lo

    def __repr__(self) -> str:
        return f"<Seg {self.key} gpu=[{self.lo},{self.g}) cpu=[{self.g},{self.c})>"
