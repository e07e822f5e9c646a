"""The normalized workload: workflows made of LLM turns separated by tool calls.

Every trace loader, the synthetic generator, the simulator, the gateway's replay driver and the
rollout manager speak this one schema. The types are frozen, slotted dataclasses: immutable,
hashable, and cheap enough to create in the millions (no validation in ``__init__``; files are
validated once, at load time, by :mod:`turnstile.workload.jsonl`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Literal

ToolStatus = Literal["ok", "error", "timeout", "unknown"]
TOOL_STATUSES: tuple[str, ...] = ("ok", "error", "timeout", "unknown")
_DURATION_S = attrgetter("duration_s")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call that runs after an LLM turn and before the next one becomes ready."""

    name: str
    duration_s: float
    status: ToolStatus = "unknown"
    #: size of the tool's result in tokens, when known (feeds C-MLFQ's causal keys)
    result_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Turn:
    """One LLM call of a workflow.

    The prompt is ``context_tokens`` reused from earlier turns of the same workflow (a prefix the
    engine may still hold in its KV cache) followed by ``input_tokens`` new tokens. ``tools`` run
    back to back after the turn finishes; the next turn is ready when the last one returns.
    """

    input_tokens: int
    output_tokens: int
    context_tokens: int = 0
    #: prefix block hashes of the whole prompt (Mooncake-style, ``block_size`` tokens each)
    block_hashes: tuple[int, ...] | None = None
    tools: tuple[ToolCall, ...] = ()
    #: indices of the turns this one waits for; ``None`` means "the previous turn" (a chain)
    parents: tuple[int, ...] | None = None
    #: client-side think time after the tools return and before the turn is ready
    think_s: float = 0.0
    #: prompt tokens the engine served from its prefix cache when this turn was *recorded*
    #: (an observation kept for comparison; the simulator computes its own cache hits)
    cached_tokens: int | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.context_tokens + self.input_tokens

    @property
    def tool_duration_s(self) -> float:
        return sum(map(_DURATION_S, self.tools))  # the same additions as a loop, in C


@dataclass(frozen=True, slots=True)
class Workflow:
    """An agent session or RL trajectory: turns in order (or a DAG via ``Turn.parents``)."""

    id: str
    arrival_s: float
    turns: tuple[Turn, ...]
    tenant: str = "default"
    #: free-form provenance (source trace, task name, model); policies read only what is known
    #: before a workflow runs: the rollout routers' ``prompt``, ``step`` and ``hint``
    meta: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def parents_of(self, index: int) -> tuple[int, ...]:
        p = self.turns[index].parents
        if p is None:
            return () if index == 0 else (index - 1,)
        return p

    @property
    def is_chain(self) -> bool:
        return all(t.parents is None for t in self.turns)

    @property
    def total_output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.turns)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(t.prompt_tokens for t in self.turns)

    def shifted(self, arrival_s: float, id: str | None = None) -> Workflow:
        """The same workflow arriving at another time (used to superimpose sessions on arrivals)."""
        return Workflow(
            id=self.id if id is None else id,
            arrival_s=arrival_s,
            turns=self.turns,
            tenant=self.tenant,
            meta=self.meta,
        )


#: the most tokens (prompt + output) one turn may have: ten times the longest context any
#: model serves today; more is a corrupt record, rejected when loaded, not half-way through a run
MAX_TURN_TOKENS = 10_000_000


def check_turn_sizes(workflows: Iterable[Workflow], source: object) -> None:
    """Raise ``ValueError`` naming ``source`` when a turn has more than :data:`MAX_TURN_TOKENS`
    (every trace loader's output goes through this, not only the JSONL reader's checks)."""
    for wf in workflows:
        for i, t in enumerate(wf.turns):
            n = t.prompt_tokens + t.output_tokens
            if n > MAX_TURN_TOKENS:
                raise ValueError(f"{source}: workflow {wf.id} turn {i} has {n:,} tokens (prompt "
                                 f"+ output), over the limit of {MAX_TURN_TOKENS:,} per turn")


def validate_workflow(wf: Workflow) -> list[str]:
    """Return human-readable problems with a workflow (empty when valid)."""
    problems: list[str] = []
    if not wf.turns:
        problems.append("turns: a workflow needs at least one turn")
    if wf.arrival_s < 0:
        problems.append(f"arrival_s: must be >= 0, got {wf.arrival_s}")
    for i, t in enumerate(wf.turns):
        where = f"turns[{i}]"
        if t.input_tokens < 0 or t.context_tokens < 0:
            problems.append(f"{where}: token counts must be >= 0")
        if t.input_tokens + t.context_tokens <= 0:
            problems.append(f"{where}: a turn needs a prompt of at least one token")
        if t.cached_tokens is not None and not 0 <= t.cached_tokens <= t.prompt_tokens:
            problems.append(f"{where}.cached_tokens: must be in [0, prompt tokens], got "
                            f"{t.cached_tokens}")
        if t.output_tokens < 1:
            problems.append(f"{where}.output_tokens: must be >= 1, got {t.output_tokens}")
        if t.prompt_tokens + t.output_tokens > MAX_TURN_TOKENS:
            problems.append(f"{where}: {t.prompt_tokens + t.output_tokens:,} tokens (prompt + "
                            f"output) is over the limit of {MAX_TURN_TOKENS:,} per turn")
        if t.parents is not None:
            for p in t.parents:
                if not 0 <= p < i:
                    problems.append(f"{where}.parents: {p} is not an earlier turn")
        for j, tool in enumerate(t.tools):
            if tool.duration_s < 0:
                problems.append(f"{where}.tools[{j}].duration_s: must be >= 0")
            if tool.status not in TOOL_STATUSES:
                problems.append(f"{where}.tools[{j}].status: unknown status {tool.status!r}")
    return problems
