"""Which slot of an engine each running request occupies, and how the engine cuts a step into
forward passes because of it.

An engine that keeps one KV stream per slot and cuts a step with the ``equal`` split (an engine
profile's ``ubatch_split``): a forward pass (micro-batch) takes the same number of tokens from
every sequence in it, and only from a run of *consecutive* slot ids. So the same four decoders
cost one pass on slots ``{0, 1, 2, 3}`` but two on ``{0, 1, 3}``; two decoders on ``{0, 2}`` are
two one-token passes (matrix-vector products, cheaper on a CPU than one two-token pass). The
engine's profile module says what was measured.

:func:`equal_split_passes` counts the passes of one step from its sequences' slots and tokens;
:class:`Lanes` tracks the slots (the engine's choice on a paged engine model, by its profile's
rule; the slot pool's own on a slot-limited one) for a perf model that prices passes
(:attr:`turnstile.sim.fitted_perf.FittedPerf.lane_ubatch`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from turnstile.core.slots import SlotRule
from turnstile.sim.request import SimRequest

__all__ = ["Lane", "Lanes", "equal_split_passes"]


def equal_split_passes(seqs: Sequence[tuple[int, int]], ubatch_tokens: int) -> tuple[int, int]:
    """``(passes of two or more tokens, passes of one token)`` of a step whose sequences are
    ``seqs`` — ``(slot, tokens)`` in the server's batch order (the decoders by slot, then the prompt
    chunks by slot) — as the ``equal`` split cuts it. Each pass starts from the first sequence with
    tokens left, adds every later one whose slot is the last added slot plus one, and takes from
    each ``min(tokens left of any of them, ubatch_tokens // how many)`` tokens. A sequence's tokens
    are contiguous in the batch, so scanning sequences is scanning tokens."""
    left = [n for _, n in seqs]
    multi = one = 0
    n = len(seqs)
    while True:
        chain: list[int] = []
        last = -2
        least = 0
        for i in range(n):
            if left[i] <= 0:
                continue
            lane = seqs[i][0]
            if not chain or lane == last + 1:
                chain.append(i)
                last = lane
                if len(chain) == 1 or left[i] < least:
                    least = left[i]
        if not chain:
            return multi, one
        k = len(chain)
        take = ubatch_tokens // k
        if take < 1:
            take = 1
        if least < take:
            take = least
        for i in chain:
            left[i] -= take
        if k * take == 1:
            one += 1
        else:
            multi += 1


class Lane:
    """One slot as the engine sees it (:class:`turnstile.core.slots.ServerSlot`)."""

    __slots__ = ("busy", "id", "last_used", "session")

    def __init__(self, slot_id: int) -> None:
        self.id = slot_id
        self.busy = False
        self.session: str | None = None
        self.last_used = 0


class Lanes:
    """The slots of one engine's running requests: which one each request runs in (``of``),
    which slots decode (``decoding``, a bit per slot), the prompt chunks of the step being
    scheduled (``chunks``), and per slot the session it last held and when it was last used.

    On a paged engine model the slot is the engine's choice, ``server_slot``: the rule its
    profile names (``EngineProfile.server_slot``; the engine model passes it; there is no
    default here, so no engine's pick is assumed). On a slot-limited one the slot pool has
    chosen and :meth:`admit` is told."""

    __slots__ = ("chunks", "decoding", "lanes", "n", "of", "prompts", "server_slot", "tick",
                 "ubatch_tokens")

    def __init__(self, n: int, ubatch_tokens: int, server_slot: SlotRule) -> None:
        if n < 1:
            raise ValueError(f"an engine needs at least one slot, got {n}")
        if ubatch_tokens < 2:
            raise ValueError(f"ubatch_tokens must be >= 2, got {ubatch_tokens}")
        self.n = n
        self.ubatch_tokens = ubatch_tokens
        self.server_slot = server_slot
        self.lanes = [Lane(i) for i in range(n)]
        self.of: dict[SimRequest, int] = {}
        self.tick = 0
        self.decoding = 0
        self.chunks: list[tuple[int, int]] = []
        #: the step's prompt chunks as ``(tokens, tokens computed before them)``
        self.prompts: list[tuple[int, int]] = []

    def choose(self, req: SimRequest) -> int:
        """The idle slot the engine gives ``req`` (see the class docstring)."""
        lane = self.server_slot(self.lanes, req.session)
        if lane is None:
            raise RuntimeError(f"no idle slot for {req!r}: more running requests than slots")
        return lane.id

    def admit(self, req: SimRequest, slot: int = -1) -> int:
        """``req`` starts running in ``slot`` (-1: the engine's choice); returns the slot."""
        if slot < 0:
            slot = self.choose(req)
        lane = self.lanes[slot]
        if lane.busy:
            raise RuntimeError(f"slot {slot} is busy: cannot run {req!r} there")
        lane.busy = True
        lane.session = req.session
        self.of[req] = slot
        return slot

    def chunk(self, req: SimRequest, tokens: int, context: int = 0) -> None:
        """``req`` computes ``tokens`` prompt tokens after ``context`` computed ones in the step
        being scheduled."""
        self.chunks.append((self.of[req], tokens))
        self.prompts.append((tokens, context))

    def start_decoding(self, req: SimRequest) -> None:
        self.decoding |= 1 << self.of[req]

    def release(self, req: SimRequest) -> None:
        """``req`` finished or was preempted: its slot is idle (and keeps its session)."""
        slot = self.of.pop(req)
        lane = self.lanes[slot]
        lane.busy = False
        self.decoding &= ~(1 << slot)
        self.tick += 1
        lane.last_used = self.tick

    def step_passes(self) -> tuple[int, int]:
        """The passes of the step just scheduled (the decoders, then ``chunks``, which it
        clears)."""
        seqs = self._decoders()
        if self.chunks:
            seqs += sorted(self.chunks)
            self.chunks.clear()
        return equal_split_passes(seqs, self.ubatch_tokens)

    def step_prompts(self) -> list[tuple[int, int]] | None:
        """The prompt chunks of the step just scheduled, ``(tokens, context)`` each, when there
        are two or more (one is told exactly by the step's sums); clears them."""
        prompts = self.prompts
        if not prompts:
            return None
        self.prompts = []
        return prompts if len(prompts) > 1 else None

    def decode_passes(self) -> tuple[int, int]:
        """The passes of a step of the decoders alone."""
        return equal_split_passes(self._decoders(), self.ubatch_tokens)

    def prefill_passes(self, req: SimRequest, tokens: int) -> tuple[int, int]:
        """The passes of a step of the decoders and ``tokens`` prompt tokens of ``req``."""
        return equal_split_passes([*self._decoders(), (self.of[req], tokens)],
                                  self.ubatch_tokens)

    def check_integrity(self, running: Iterable[SimRequest],
                        decoding: Iterable[SimRequest]) -> None:
        """Between steps: every running request holds a busy slot of its own and nothing else
        does, the decoders' bits are their slots, and no prompt chunk is left over (tests)."""
        running = set(running)
        assert set(self.of) == running, (set(self.of) ^ running)
        slots = list(self.of.values())
        assert len(set(slots)) == len(slots), slots
        assert {lane.id for lane in self.lanes if lane.busy} == set(slots)
        mask = 0
        for req in decoding:
            mask |= 1 << self.of[req]
        assert mask == self.decoding, (bin(mask), bin(self.decoding))
        assert not self.chunks, self.chunks
        assert not self.prompts, self.prompts

    def _decoders(self) -> list[tuple[int, int]]:
        mask = self.decoding
        return [(i, 1) for i in range(self.n) if mask >> i & 1]
