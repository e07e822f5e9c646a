"""Libra-like RL rollout workloads: long generations, few and fast tools, causal tool returns.

Beside :class:`~turnstile.rollout.workload.RolloutWorkload` (agent sessions fitted to Claude Code
traces: many turns, slow tools), three workloads shaped like the ones Libra trains on
(NetX-lab/Libra ``configs/``), producing the same :class:`RolloutTrajectory` batches so the
rollout simulator, the routers and the planner consume them unchanged:

``r2e-gym``
    SWE-style repair agent with a local validator: ≤ 12 turns, ≤ 30,000 new tokens per
    trajectory, first prompt ≤ 2,048 tokens, context ≤ 32,768 (``r2e_max_turns``,
    ``max_new_tokens``, ``r2e_max_prompt_tokens``, ``max_seq_length`` of
    ``r2e_gym_qwen3_14b_mcore_gpu_6node48_100step_no_ehp.yaml``); 8 prompts × 4 samples per step
    (``..._production_base.yaml``). Tools run locally (file editor, search, bash tests): ~0.1 s.
``search-r1``
    Question answering with a web-search tool: short generations (≤ 1,024 new tokens per turn,
    context ≤ 4,096: ``configs/search_r1.yaml``), up to 4 searches, each ~1 s with a tail of
    calls that hit the 30 s search timeout.
``dapo-math``
    One long reasoning generation, no tools (``configs/dapo_math_cmlfq_qwen3_4b.yaml``:
    ``max_new_tokens: 32768``; the DAPO paper itself caps responses at 20,480).

The caps, turn limits and batch shapes above are cited; the *shapes* of the distributions
(medians, spreads, probabilities: the ``*Spec`` dataclasses below) are our assumptions, chosen to
give the long-tailed lengths Libra's buckets are built for. They are seeded and deterministic.

**Causality.** Each trajectory has a latent difficulty ``z`` (prompt level + sample noise). It
raises tool failure rates and failure payload sizes, and failures cause what follows: longer
next generations, more turns (a passing test run usually ends the episode; a failing one almost
never does). So the remaining output length depends on the sequence of tool-return keys
``tool:size:status`` (:func:`turnstile.rollout.state.tool_key`) — what C-MLFQ's prefix tree
learns. A trajectory carries only what a policy may see before it runs (prompt id, first-prompt
size, a noisy ``hint``); ``difficulty`` is for analysis.

``make_workload(name, **overrides)`` builds any of them, ``"tool-heavy"`` included.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from turnstile.core.registry import UnknownNameError
from turnstile.rollout.workload import RolloutSpec, RolloutTrajectory, RolloutWorkload
from turnstile.workload.model import ToolCall, ToolStatus, Turn, Workflow

__all__ = [
    "WORKLOADS",
    "DapoMathSpec",
    "LibraSpec",
    "LibraWorkload",
    "R2EGymSpec",
    "SearchR1Spec",
    "make_workload",
    "workload_names",
]


@dataclass(frozen=True)
class LibraSpec:
    """What every Libra-like workload shares: batch shape, caps, difficulty, drift."""

    #: GRPO shape: prompts per step × samples per prompt
    n_prompts: int = 8
    group_size: int = 4
    #: distinct prompts in the dataset; steps cycle through it in seeded epochs
    pool_size: int = 128
    seed: int = 0
    #: LLM calls per trajectory (the last one answers; the others each call one tool)
    max_turns: int = 12
    #: new (generated) tokens per trajectory, all turns together
    max_new_tokens: int = 30_000
    #: new tokens per LLM call (None: only the trajectory budget applies)
    max_turn_tokens: int | None = None
    #: context window: prompt + everything generated and returned so far
    max_seq_length: int = 32_768
    #: first prompt (system + task): lognormal median and spread, capped
    prompt_median_tokens: float = 1_200.0
    prompt_sigma: float = 0.35
    max_prompt_tokens: int = 2_048
    #: generation per LLM call: lognormal median and spread
    output_median_tokens: float = 900.0
    output_sigma: float = 0.8
    #: generations scale by exp(output_beta · z) with the standardised difficulty z
    output_beta: float = 0.35
    #: the first call plans (longer); a call after a failed/timed-out tool debugs (longer)
    first_turn_scale: float = 1.5
    after_failure_scale: float = 1.5
    #: latent difficulty: prompt-level and sample-level spreads; hint noise (on the prompt level)
    difficulty_sigma: float = 0.8
    sample_sigma: float = 0.6
    hint_sigma: float = 0.8
    #: per-step growth of generation lengths (RL responses lengthen as training proceeds; DAPO
    #: and Libra both report it), and its cap
    output_growth: float = 1.01
    max_output_scale: float = 1.5

    @property
    def batch_size(self) -> int:
        return self.n_prompts * self.group_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class R2EGymSpec(LibraSpec):
    """R2E-Gym-like repair episodes (defaults: Libra's 48-GPU R2E-Gym configs)."""

    #: tool durations: local file editor / grep / test runs (Libra: "local validator")
    tool_median_s: float = 0.15
    tool_sigma: float = 0.8
    #: a test run that hangs hits the sandbox timeout (rare)
    bash_timeout_prob: float = 0.01
    bash_timeout_s: float = 30.0
    #: failure log-odds of a test run: base + beta·z − decay per earlier edit (fixes accumulate)
    bash_fail_logit: float = 0.4
    bash_fail_beta: float = 1.2
    bash_fail_decay: float = 0.35
    #: file-editor (bad match / syntax) and search (no hit) failure probabilities
    edit_fail_prob: float = 0.12
    search_fail_prob: float = 0.15
    #: payload tokens: passing test summary, failing traceback (grows with z), file/search views
    pass_payload_median: float = 120.0
    fail_payload_median: float = 900.0
    fail_payload_beta: float = 0.5
    view_payload_median: float = 600.0
    small_payload_median: float = 60.0
    payload_sigma: float = 0.7
    #: stopping: P(answer next | last test passed), P(answer next | last test failed or timed
    #: out: the agent keeps fixing), else a logistic in (turn, z)
    finish_after_pass: float = 0.65
    finish_after_fail: float = 0.03
    finish_logit: float = -2.4
    finish_turn_slope: float = 0.25
    finish_beta: float = 0.6


@dataclass(frozen=True)
class SearchR1Spec(LibraSpec):
    """Search-R1-like QA: short calls, a web-search tool with a 30 s timeout tail."""

    n_prompts: int = 16
    group_size: int = 5
    #: 4 searches then an answer
    max_turns: int = 5
    max_new_tokens: int = 4_096
    #: configs/search_r1.yaml: max_new_tokens 1024 (per call), max_seq_length 4096
    max_turn_tokens: int | None = 1_024
    max_seq_length: int = 4_096
    prompt_median_tokens: float = 180.0
    prompt_sigma: float = 0.3
    max_prompt_tokens: int = 1_024
    output_median_tokens: float = 120.0
    output_sigma: float = 0.55
    output_beta: float = 0.3
    first_turn_scale: float = 1.3
    after_failure_scale: float = 1.3
    #: web search round trip: lognormal median/spread; timeouts wait the full timeout
    search_median_s: float = 0.9
    search_sigma: float = 0.6
    search_timeout_s: float = 30.0
    search_timeout_prob: float = 0.04
    #: HTTP error / empty result, and "weak" results (few short snippets), rising with z
    search_fail_prob: float = 0.06
    weak_logit: float = -1.0
    weak_beta: float = 1.0
    #: payload tokens: top-3 passages, weak results, error text
    passages_median: float = 450.0
    weak_median: float = 120.0
    error_tokens: int = 24
    payload_sigma: float = 0.35
    #: P(answer next | good passages) and | weak/failed/timeout
    answer_after_good: float = 0.7
    answer_after_weak: float = 0.2


@dataclass(frozen=True)
class DapoMathSpec(LibraSpec):
    """DAPO-Math-like: one long chain-of-thought per sample, no tools."""

    n_prompts: int = 32
    group_size: int = 8
    max_turns: int = 1
    #: configs/dapo_math_cmlfq_qwen3_4b.yaml: max_new_tokens = max_seq_length = 32768
    max_new_tokens: int = 32_768
    max_seq_length: int = 32_768
    prompt_median_tokens: float = 150.0
    prompt_sigma: float = 0.4
    max_prompt_tokens: int = 1_024
    output_median_tokens: float = 3_500.0
    output_sigma: float = 0.75
    output_beta: float = 0.5
    first_turn_scale: float = 1.0


def _seed(*parts: object) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFF_FFFF


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


#: one LLM call as drawn: (new input tokens, output tokens, the tool it calls, if any)
_Call = tuple[int, int, tuple[ToolCall, ...]]


class LibraWorkload:
    """Seeded batches of one Libra-like workload: ``batch(step)`` is the same for the same spec
    and step. Same interface as :class:`RolloutWorkload` (``batch``, ``forecast``, ``steps``,
    ``prompts_of``, ``spec``)."""

    def __init__(self, spec: LibraSpec) -> None:
        if type(spec) not in _KIND:
            raise TypeError(f"unknown Libra workload spec {type(spec).__name__}")
        s = self.spec = spec
        self.kind = _KIND[type(spec)]
        if s.n_prompts < 1 or s.group_size < 1 or s.max_turns < 1:
            raise ValueError("n_prompts, group_size and max_turns must be >= 1")
        rng = np.random.default_rng(_seed("pool", self.kind, s.seed))
        self.pool_size = max(s.pool_size, s.n_prompts)
        self.difficulty = rng.normal(0.0, s.difficulty_sigma, self.pool_size)
        self.hints = self.difficulty + rng.normal(0.0, s.hint_sigma, self.pool_size)
        first = rng.lognormal(math.log(s.prompt_median_tokens), s.prompt_sigma, self.pool_size)
        self.first_prompt = np.clip(np.rint(first), 16, s.max_prompt_tokens).astype(np.int64)
        self._order: list[int] = []

    def prompts_of(self, step: int) -> list[int]:
        """Prompt indices used at ``step``: seeded epochs over the pool (each prompt once/epoch)."""
        n = self.spec.n_prompts
        while len(self._order) < (step + 1) * n:
            epoch = len(self._order) // self.pool_size
            perm = np.random.default_rng(_seed("epoch", self.kind, self.spec.seed, epoch))
            self._order.extend(int(i) for i in perm.permutation(self.pool_size))
        return self._order[step * n : (step + 1) * n]

    def batch(self, step: int) -> list[RolloutTrajectory]:
        s = self.spec
        rng = np.random.default_rng(_seed("step", self.kind, s.seed, step))
        growth = min(s.output_growth**step, s.max_output_scale)
        spread = math.hypot(s.difficulty_sigma, s.sample_sigma)
        out: list[RolloutTrajectory] = []
        for p in self.prompts_of(step):
            for g in range(s.group_size):
                z = float(self.difficulty[p] + rng.normal(0.0, s.sample_sigma))
                first = int(self.first_prompt[p])
                calls = self._draw(rng, z / spread, growth, first)
                wf = Workflow(
                    id=f"{self.kind}-s{step}-p{p}-g{g}",
                    arrival_s=0.0,
                    turns=_chain(first, calls),
                    meta={"source": "libra-like", "workload": self.kind, "prompt": str(p),
                          "step": str(step), "hint": f"{self.hints[p]:.9g}"},
                )
                out.append(RolloutTrajectory(workflow=wf, prompt_id=f"p{p}", sample=g, step=step,
                                             prompt_tokens=first, hint=float(self.hints[p]),
                                             difficulty=z))
        return out

    def forecast(self, step: int) -> list[RolloutTrajectory]:
        """A batch like step ``step``'s drawn with another seed (the model, not the batch)."""
        other = dataclasses.replace(self.spec, seed=self.spec.seed + 7919)
        return LibraWorkload(other).batch(step)

    def steps(self, k: int) -> Iterator[list[RolloutTrajectory]]:
        for step in range(k):
            yield self.batch(step)

    # -- drawing one trajectory ----------------------------------------------------------------

    def _draw(self, rng: np.random.Generator, z: float, growth: float, first: int) -> list[_Call]:
        s = self.spec
        calls: list[_Call] = []
        budget = s.max_new_tokens
        context = first
        failed = False
        for j in range(s.max_turns):
            scale = growth * math.exp(s.output_beta * z)
            if j == 0:
                scale *= s.first_turn_scale
            if failed:
                scale *= s.after_failure_scale
            o = int(rng.lognormal(math.log(s.output_median_tokens * scale), s.output_sigma))
            if s.max_turn_tokens is not None:
                o = min(o, s.max_turn_tokens)
            o = max(1, min(o, budget, s.max_seq_length - context))
            budget -= o
            context += o
            last = j == s.max_turns - 1 or budget <= 0 or context >= s.max_seq_length - 16
            tool: ToolCall | None = None
            if not last and not self._finishes(rng, j, z, calls):
                tool = self._tool(rng, j, z, calls)
                # a tool result that would overflow the context is cut there; the episode ends
                room = s.max_seq_length - context - 1
                if tool.result_tokens is not None and tool.result_tokens > room:
                    tool = None
            inp = 0 if j == 0 else max(1, _result_tokens(calls[-1][2]))
            calls.append((inp, o, () if tool is None else (tool,)))
            if tool is None:
                break
            context += tool.result_tokens or 0
            failed = tool.status != "ok"
        return calls

    def _finishes(self, rng: np.random.Generator, j: int, z: float, calls: list[_Call]) -> bool:
        """Whether call ``j`` answers instead of calling a tool (decided before the tool)."""
        s = self.spec
        if isinstance(s, DapoMathSpec):
            return True
        last = calls[-1][2][0] if calls and calls[-1][2] else None
        if isinstance(s, R2EGymSpec):
            if last is not None and last.name == "execute_bash":
                p = s.finish_after_pass if last.status == "ok" else s.finish_after_fail
                return bool(rng.random() < p)
            p = _sigmoid(s.finish_logit + s.finish_turn_slope * j - s.finish_beta * z)
            return bool(rng.random() < p)
        assert isinstance(s, SearchR1Spec)
        if last is None:
            return False  # Search-R1 always searches at least once
        good = last.status == "ok" and (last.result_tokens or 0) >= 256
        return bool(rng.random() < (s.answer_after_good if good else s.answer_after_weak))

    def _tool(self, rng: np.random.Generator, j: int, z: float, calls: list[_Call]) -> ToolCall:
        s = self.spec
        if isinstance(s, SearchR1Spec):
            return _search_call(s, rng, z)
        assert isinstance(s, R2EGymSpec)
        return _r2e_call(s, rng, j, z, calls)


def _r2e_call(s: R2EGymSpec, rng: np.random.Generator, j: int, z: float,
              calls: list[_Call]) -> ToolCall:
    """One R2E-Gym tool call: explore first, then edit and test; outcomes follow z."""
    if j == 0:
        name = "search" if rng.random() < 0.6 else "file_editor"
    else:
        name = str(rng.choice(["file_editor", "execute_bash", "search"], p=[0.45, 0.45, 0.10]))
    duration = float(rng.lognormal(math.log(s.tool_median_s), s.tool_sigma))
    status: ToolStatus = "ok"
    if name == "execute_bash":
        edits = sum(1 for c in calls for t in c[2] if t.name == "file_editor" and t.status == "ok")
        if rng.random() < s.bash_timeout_prob:
            status, duration, median = "timeout", s.bash_timeout_s, s.small_payload_median
        elif rng.random() < _sigmoid(s.bash_fail_logit + s.bash_fail_beta * z
                                     - s.bash_fail_decay * edits):
            status = "error"
            median = s.fail_payload_median * math.exp(s.fail_payload_beta * z)
        else:
            median = s.pass_payload_median
    elif name == "file_editor":
        if rng.random() < s.edit_fail_prob * math.exp(0.3 * z):
            status, median = "error", s.small_payload_median
        else:  # a view returns the file, an edit a short diff: half and half
            median = s.view_payload_median if rng.random() < 0.5 else s.small_payload_median * 2
    else:
        if rng.random() < s.search_fail_prob:
            status, median = "error", s.small_payload_median
        else:
            median = s.view_payload_median
    tokens = max(1, int(rng.lognormal(math.log(median), s.payload_sigma)))
    return ToolCall(name, round(duration, 6), status, tokens)


def _search_call(s: SearchR1Spec, rng: np.random.Generator, z: float) -> ToolCall:
    """One web search: a timeout waits the full timeout; hard questions get weak results."""
    if rng.random() < s.search_timeout_prob:
        return ToolCall("search", s.search_timeout_s, "timeout", s.error_tokens)
    duration = round(float(rng.lognormal(math.log(s.search_median_s), s.search_sigma)), 6)
    duration = min(duration, s.search_timeout_s)
    if rng.random() < s.search_fail_prob:
        return ToolCall("search", duration, "error", s.error_tokens)
    weak = rng.random() < _sigmoid(s.weak_logit + s.weak_beta * z)
    median = s.weak_median if weak else s.passages_median
    tokens = max(1, int(rng.lognormal(math.log(median), s.payload_sigma)))
    return ToolCall("search", duration, "ok", tokens)


def _result_tokens(tools: tuple[ToolCall, ...]) -> int:
    return sum(t.result_tokens or 0 for t in tools)


def _chain(first_prompt: int, calls: list[_Call]) -> tuple[Turn, ...]:
    """Turns of a growing transcript: call j's prompt is call j−1's prompt and output (its
    context) plus the tool result (its new input). No compaction: the context cap ends it."""
    turns: list[Turn] = []
    prompt = 0
    for j, (inp, out, tools) in enumerate(calls):
        if j == 0:
            turns.append(Turn(first_prompt, out, 0, tools=tools))
            prompt = first_prompt
        else:
            context = prompt + calls[j - 1][1]
            turns.append(Turn(inp, out, context, tools=tools))
            prompt = context + inp
    return tuple(turns)


_KIND: dict[type[LibraSpec], str] = {
    R2EGymSpec: "r2e-gym",
    SearchR1Spec: "search-r1",
    DapoMathSpec: "dapo-math",
}

#: workload names the rollout CLI and benchmark accept
WORKLOADS: tuple[str, ...] = ("tool-heavy", *_KIND.values())


def workload_names() -> list[str]:
    return list(WORKLOADS)


def make_workload(name: str, **overrides: Any) -> RolloutWorkload | LibraWorkload:
    """The workload of that name with spec fields overridden (``n_prompts=4, seed=1``);
    ``"tool-heavy"`` is :class:`RolloutWorkload` with a :class:`RolloutSpec`."""
    if name == "tool-heavy":
        return RolloutWorkload(RolloutSpec(**overrides))
    for cls, kind in _KIND.items():
        if kind == name:
            return LibraWorkload(cls(**overrides))
    raise UnknownNameError(f"unknown workload {name!r}; valid names: {', '.join(WORKLOADS)}")
