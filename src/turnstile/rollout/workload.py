"""RL rollout batches: N prompts × G samples per step, with drift across steps.

Built on :mod:`turnstile.workload.synth` (``DEFAULT_SPEC``, the fit to the AgentCgroup sessions,
or any fitted :class:`~turnstile.workload.synth_spec.SynthSpec`). Per step ``k``:

1. **Drift.** The step's spec scales turns per trajectory by ``turns_growth ** k`` and output
   tokens per turn by ``output_growth ** k`` (both capped), and shifts ``tools_per_turn`` towards
   more calls by ``tool_growth`` per step: trajectories get longer and more tool-heavy as
   training proceeds.
2. **Draw.** ``synth.generate`` draws ``N × G`` trajectories from the step's spec (seeded), so
   every marginal (turns, token sizes, tool latencies, result sizes) stays the fitted one.
3. **Couple.** Each prompt ``p`` of a fixed pool has a latent difficulty ``d_p``; sample ``g``
   has ``z = d_p + ε``. Drawn trajectories are assigned by rank (the hardest ``z`` gets the
   longest draw), so samples of one prompt have correlated lengths — what a length predictor
   with per-prompt history can learn.
4. **Tool outcomes.** Each non-timeout call's error probability is its tool's fitted rate times
   ``exp(error_beta · z)`` (capped at ``max_error_prob``), times ``error_growth ** k``. A failed
   call is followed, with probability ``retry_prob``, by a retry turn (same output size and tool
   names, statuses drawn afresh): errors and retries cause, and so predict, long trajectories.
5. **Contexts** are rebuilt as the chain requires (prompt of turn j = prompt + output of turn
   j-1 + new input; compaction to the task prompt at ``max_prompt_tokens``). Every sample of a
   prompt shares that prompt's first-turn size (the task).

A trajectory carries what a policy may see before it runs (prompt id, first-prompt size, a noisy
``hint`` feature correlated with difficulty); the turns themselves are for the driver only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from turnstile.workload import synth
from turnstile.workload.model import ToolCall, ToolStatus, Turn, Workflow
from turnstile.workload.synth_spec import Dist, SynthSpec

__all__ = [
    "RolloutSpec",
    "RolloutTrajectory",
    "RolloutWorkload",
    "drifted_spec",
    "training_tokens",
]


@dataclass(frozen=True)
class RolloutSpec:
    """Shape and drift of the rollout batches (all seeded through ``seed``)."""

    n_prompts: int = 32
    group_size: int = 8
    #: distinct prompts in the dataset; steps cycle through it in seeded epochs
    pool_size: int = 128
    seed: int = 0
    #: per-step multiplicative growth of turns per trajectory, and its cap
    turns_growth: float = 1.04
    max_turns_scale: float = 2.0
    #: scale of turns at step 0 (RL trajectories start shorter than the fitted agent sessions)
    turns_scale: float = 0.5
    #: per-step growth of output tokens per turn, and its cap
    output_growth: float = 1.02
    max_output_scale: float = 1.5
    #: per-step growth of the expected number of tool calls after a turn, and its cap
    tool_growth: float = 1.03
    max_tool_scale: float = 1.6
    #: per-step growth of error rates, and its cap
    error_growth: float = 1.0
    #: latent difficulty: prompt-level and sample-level spreads (standard deviations)
    prompt_sigma: float = 0.8
    sample_sigma: float = 0.6
    #: how strongly errors follow difficulty (log-odds per standard deviation of z)
    error_beta: float = 0.8
    max_error_prob: float = 0.9
    retry_prob: float = 0.5
    #: noise of the observable ``hint`` feature (standard deviation, on the prompt difficulty)
    hint_sigma: float = 0.8
    #: multiply every tool duration (sandboxed RL tools are often faster than a developer laptop)
    tool_time_scale: float = 1.0
    #: cap on output tokens per turn (RL rollouts set max_tokens); None = as fitted
    max_output_tokens: int | None = 4096

    @property
    def batch_size(self) -> int:
        return self.n_prompts * self.group_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RolloutTrajectory:
    """One sample of one prompt in one step: the workflow (for the driver) plus prompt facts."""

    workflow: Workflow
    prompt_id: str
    sample: int
    step: int
    #: tokens of the first prompt (system prompt + task): known before the trajectory runs
    prompt_tokens: int
    #: an observable feature correlated with the prompt's difficulty (e.g. a task category)
    hint: float
    #: the latent difficulty (for analysis and tests; policies never see it)
    difficulty: float = field(default=0.0, compare=False)

    @property
    def id(self) -> str:
        return self.workflow.id

    @property
    def total_output_tokens(self) -> int:
        return self.workflow.total_output_tokens

    @property
    def num_turns(self) -> int:
        return len(self.workflow.turns)


def _scale_dist(d: Dist, factor: float) -> Dist:
    if factor == 1.0:
        return d
    if d.kind == "empirical":
        return Dist("empirical", tuple(q * factor for q in d.quantiles), d.probs)
    return Dist.lognormal(d.mu + math.log(factor), d.sigma, d.lo * factor, d.hi * factor)


def _shift_tool_counts(p: Sequence[float], scale: float) -> tuple[float, ...]:
    """P(k calls) with the mean scaled by ``scale``: binomial thinning below 1; above 1, a mix
    with the one-call-more distribution (each unit of mix weight adds one call to the mean)."""
    probs = np.asarray(p, dtype=np.float64)
    probs = probs / probs.sum()
    if scale == 1.0 or probs.size == 0:
        return tuple(float(x) for x in probs)
    if scale < 1.0:
        out = np.zeros(probs.size)
        for k, pk in enumerate(probs):
            for j in range(k + 1):
                out[j] += pk * math.comb(k, j) * scale**j * (1 - scale) ** (k - j)
        return tuple(float(x) for x in out)
    mean = float((np.arange(probs.size) * probs).sum())
    w = min(mean * (scale - 1.0), 1.0)
    out = np.append(probs, 0.0) * (1 - w)
    out[1:] += w * probs
    return tuple(float(x) for x in out)


def drifted_spec(base: SynthSpec, spec: RolloutSpec, step: int) -> SynthSpec:
    """The synthetic spec of step ``step``: longer and more tool-heavy as ``step`` grows."""
    turns = min(spec.turns_scale * spec.turns_growth**step, spec.max_turns_scale)
    outs = min(spec.output_growth**step, spec.max_output_scale)
    tools = min(spec.tool_growth**step, spec.max_tool_scale)
    return dataclasses.replace(
        base,
        name=f"{base.name}@step{step}",
        turns=_scale_dist(base.turns, turns),
        output_tokens=_scale_dist(base.output_tokens, outs),
        tools_per_turn=_shift_tool_counts(base.tools_per_turn, tools),
    )


def _seed(*parts: object) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFF_FFFF


def _chain(
    first_prompt: int,
    turns: Sequence[tuple[int, int, tuple[ToolCall, ...]]],
    cap: int | None,
) -> tuple[Turn, ...]:
    """Rebuild chain contexts from (new input, output, tools) per turn (turn 0's input ignored)."""
    out: list[Turn] = []
    prev_prompt = prev_out = 0
    for j, (inp, o, tools) in enumerate(turns):
        if j == 0:
            context, new = 0, first_prompt
        else:
            context, new = prev_prompt + prev_out, max(1, inp)
            if cap is not None and context + new > cap:  # compaction, as synth does
                context = min(first_prompt, max(0, cap - new))
        out.append(Turn(new, max(1, o), context, tools=tools))
        prev_prompt, prev_out = context + new, max(1, o)
    return tuple(out)


class RolloutWorkload:
    """Seeded rollout batches: ``batch(step)`` is the same for the same spec and step."""

    def __init__(self, spec: RolloutSpec | None = None, base: SynthSpec | None = None) -> None:
        self.spec = spec or RolloutSpec()
        self.base = base if base is not None else synth.default_spec()
        s = self.spec
        if s.n_prompts < 1 or s.group_size < 1:
            raise ValueError("n_prompts and group_size must be >= 1")
        rng = np.random.default_rng(_seed("pool", s.seed))
        self.pool_size = max(s.pool_size, s.n_prompts)
        self.difficulty = rng.normal(0.0, s.prompt_sigma, self.pool_size)
        self.hints = self.difficulty + rng.normal(0.0, s.hint_sigma, self.pool_size)
        self.first_prompt = np.maximum(
            1, np.rint(self.base.first_prompt_tokens.sample(rng, self.pool_size))
        ).astype(np.int64)
        self._order: list[int] = []

    def prompts_of(self, step: int) -> list[int]:
        """Prompt indices used at ``step``: seeded epochs over the pool (each prompt once/epoch)."""
        n = self.spec.n_prompts
        need = (step + 1) * n
        while len(self._order) < need:
            epoch = len(self._order) // self.pool_size
            perm = np.random.default_rng(_seed("epoch", self.spec.seed, epoch)).permutation(
                self.pool_size
            )
            self._order.extend(int(i) for i in perm)
        return self._order[step * n : (step + 1) * n]

    def batch(self, step: int) -> list[RolloutTrajectory]:
        s = self.spec
        base = drifted_spec(self.base, s, step)
        n = s.batch_size
        rng = np.random.default_rng(_seed("step", s.seed, step))
        wfs = synth.generate(base, n, _seed("gen", s.seed, step))
        prompts = self.prompts_of(step)
        prompt_of = np.repeat(np.asarray(prompts, dtype=np.int64), s.group_size)
        z = self.difficulty[prompt_of] + rng.normal(0.0, s.sample_sigma, n)
        # comonotone coupling: the hardest sample gets the longest draw
        length_rank = sorted(
            range(n), key=lambda i: (len(wfs[i].turns), wfs[i].total_output_tokens, i)
        )
        z_rank = np.argsort(z, kind="stable")
        assigned = [wfs[0]] * n
        for w_i, t_i in zip(length_rank, z_rank, strict=True):
            assigned[int(t_i)] = wfs[w_i]
        z_std = z / math.hypot(s.prompt_sigma, s.sample_sigma)
        err_scale = s.error_growth**step
        out: list[RolloutTrajectory] = []
        for i in range(n):
            p = int(prompt_of[i])
            g = i % s.group_size
            turns = self._outcomes(assigned[i], float(z_std[i]), err_scale, rng)
            wf = Workflow(
                id=f"s{step}-p{p}-g{g}",
                arrival_s=0.0,
                turns=_chain(int(self.first_prompt[p]), turns, base.max_prompt_tokens),
                meta={"source": "rollout", "spec": base.name, "prompt": str(p), "step": str(step)},
            )
            out.append(
                RolloutTrajectory(
                    workflow=wf,
                    prompt_id=f"p{p}",
                    sample=g,
                    step=step,
                    prompt_tokens=int(self.first_prompt[p]),
                    hint=float(self.hints[p]),
                    difficulty=float(z[i]),
                )
            )
        return out

    def _outcomes(
        self, wf: Workflow, z_std: float, err_scale: float, rng: np.random.Generator
    ) -> list[tuple[int, int, tuple[ToolCall, ...]]]:
        """Redraw tool statuses by difficulty, insert retry turns, scale tool time."""
        s = self.spec
        err_prob = {t.name: t.error_prob for t in self.base.tools}
        mult = math.exp(s.error_beta * z_std) * err_scale
        cap = s.max_output_tokens

        def redraw(calls: tuple[ToolCall, ...]) -> tuple[tuple[ToolCall, ...], bool]:
            new: list[ToolCall] = []
            failed = False
            for c in calls:
                status: ToolStatus = c.status
                if c.status != "timeout":
                    p = min(err_prob.get(c.name, 0.0) * mult, s.max_error_prob)
                    status = "error" if rng.random() < p else "ok"
                failed = failed or status != "ok"
                new.append(
                    ToolCall(c.name, round(c.duration_s * s.tool_time_scale, 6), status,
                             c.result_tokens)
                )
            return tuple(new), failed

        turns: list[tuple[int, int, tuple[ToolCall, ...]]] = []
        last = len(wf.turns) - 1
        for j, t in enumerate(wf.turns):
            o = t.output_tokens if cap is None else min(t.output_tokens, cap)
            tools, failed = redraw(t.tools)
            turns.append((t.input_tokens, o, tools))
            # a failed call may be retried: one more turn with the same shape, fresh outcomes
            tries = 0
            while failed and j < last and tries < 3 and rng.random() < s.retry_prob:
                tools, failed = redraw(t.tools)
                err_tokens = min(sum(c.result_tokens or 32 for c in turns[-1][2]), 2048)
                turns.append((max(1, err_tokens), o, tools))
                tries += 1
        return turns

    def forecast(self, step: int) -> list[RolloutTrajectory]:
        """A batch like step ``step``'s drawn with another seed (what a planner may know
        before the step runs: the workload model, not the batch)."""
        other = RolloutWorkload(dataclasses.replace(self.spec, seed=self.spec.seed + 7919),
                                self.base)
        return other.batch(step)

    def steps(self, k: int) -> Iterator[list[RolloutTrajectory]]:
        for step in range(k):
            yield self.batch(step)


def training_tokens(batch: Sequence[RolloutTrajectory]) -> int:
    """Tokens one training pass reads: each transcript's unique tokens (first prompt, then every
    turn's new input and output)."""
    total = 0
    for tr in batch:
        for t in tr.workflow.turns:
            total += t.input_tokens + t.output_tokens
    return total
