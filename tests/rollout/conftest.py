"""Hand-made rollout trajectories and a simple performance model for the rollout tests."""

from __future__ import annotations

from collections.abc import Sequence

from turnstile.rollout.workload import RolloutTrajectory
from turnstile.workload.model import ToolCall, ToolStatus, Turn, Workflow


class LinearPerf:
    """``step_time = (base + per_seq·decode + per_prefill·prefill + per_kv·kv) / tp``."""

    name = "linear-test"
    kv_bytes_per_token = 1.0

    def __init__(self, tp: int = 1, base: float = 0.0, per_seq: float = 1e-3,
                 per_prefill: float = 1e-5, per_kv: float = 0.0) -> None:
        self.tp = tp
        self.base, self.per_seq, self.per_prefill, self.per_kv = base, per_seq, per_prefill, per_kv

    def step_time(self, prefill_tokens: int, decode_seqs: int, kv_read_tokens: int,
                  prefill_attn_tokens2: float = 0.0) -> float:
        return (self.base + self.per_seq * decode_seqs + self.per_prefill * prefill_tokens
                + self.per_kv * kv_read_tokens) / self.tp


def make_traj(
    traj_id: str,
    turns: Sequence[tuple[int, int, Sequence[tuple[str, ToolStatus, float]]]],
    *,
    prompt_id: str = "p0",
    first_prompt: int = 100,
    step: int = 0,
) -> RolloutTrajectory:
    """``turns``: (new input tokens, output tokens, [(tool, status, seconds), ...]) per turn."""
    out: list[Turn] = []
    prev_prompt = prev_out = 0
    for j, (inp, o, tools) in enumerate(turns):
        context, new = (0, first_prompt) if j == 0 else (prev_prompt + prev_out, inp)
        calls = tuple(ToolCall(n, d, s, 10) for n, s, d in tools)
        out.append(Turn(new, o, context, tools=calls))
        prev_prompt, prev_out = context + new, o
    wf = Workflow(traj_id, 0.0, tuple(out))
    return RolloutTrajectory(wf, prompt_id, 0, step, first_prompt, 0.0)


def simple_batch(n: int, turns: int = 3, out: int = 50, tool_s: float = 1.0,
                 step: int = 0) -> list[RolloutTrajectory]:
    return [
        make_traj(f"s{step}-t{i}", [(20, out, [("Bash", "ok", tool_s)])] * turns,
                  prompt_id=f"p{i % 4}", step=step)
        for i in range(n)
    ]
