"""Coding-agent logs written in mini-swe-agent's trajectory format, to import as a suite family.

The sessions are shaped like SWE-bench runs of a mini-swe-agent-style agent (one bash command
per reply, the command's output appended to the conversation): ~40 LLM calls per session
(lognormal, median 36, 3–145), a ~3k-token system prompt and task, each turn's prompt growing
by a reply (~150 tokens) and an observation (300–600 tokens), so prompts reach a median of
~14k and ~100k at most; a tool call (the command) between replies of 4 s median (lognormal,
p90 ~13 s); one reply in 400 a runaway (8k–32k tokens). Text is random, so every session's
blocks hash apart after the shared system prompt, as real logs do.

The files are then read by the real importer (``turnstile.traces.load_trace``): content-hash
block names, tool times from the ``extra.timestamp`` stamps, ``<returncode>`` statuses — the
path a user's own logs take (``turnstile traces convert``). Nothing here is a real trace.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

__all__ = ["write_mini_swe_agent_logs"]

_ALPHABET = "abcdefghijklmnopqrstuvwxyz ._/\n0123456789"
_SYSTEM = ("You are a helpful assistant that can interact with a computer shell to solve "
           "programming tasks. ") * 120  # ~2.4k tokens, the same for every session


def _text(rng: random.Random, chars: int) -> str:
    return "".join(rng.choices(_ALPHABET, k=chars))


def _session(i: int, rng: random.Random, t0: float) -> dict[str, Any]:
    calls = max(3, min(145, round(rng.lognormvariate(math.log(36), 0.5))))
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": _SYSTEM},
        {"role": "user", "content": f"Solve issue {i}: " + _text(rng, 2_400)}]
    t = t0
    prompt = (len(_SYSTEM) + 2_400) // 4
    for k in range(calls):
        out_chars = 4 * (rng.randint(8_000, 32_000) if rng.random() < 1 / 400 else
                         round(rng.lognormvariate(math.log(150), 0.6)))
        reply = f"THOUGHT: {_text(rng, out_chars)}\n\n```bash\nstep {k}\n```"
        comp = len(reply) // 4
        created = t
        t += 0.02 * comp + prompt / 20_000  # the call's own time, at a provider's speed
        msgs.append({"role": "assistant", "content": reply, "extra": {
            "timestamp": round(t, 3),
            "response": {"id": f"chatcmpl-{i}-{k}", "created": int(created),
                         "object": "chat.completion",
                         "usage": {"prompt_tokens": prompt, "completion_tokens": comp,
                                   "total_tokens": prompt + comp}}}})
        if k == calls - 1:
            break
        t += rng.lognormvariate(math.log(4.0), 0.9)
        rc = 0 if rng.random() < 0.8 else 1
        out = _text(rng, 4 * rng.randint(300, 600))
        msgs.append({"role": "user", "content": f"<returncode>{rc}</returncode>\n<output>\n"
                     f"{out}</output>", "extra": {"timestamp": round(t, 3), "returncode": rc}})
        prompt += comp + (len(out) + 40) // 4
    return {"info": {"exit_status": "Submitted", "model_stats": {"api_calls": calls}},
            "messages": msgs, "trajectory_format": "mini-swe-agent-1"}


def write_mini_swe_agent_logs(root: Path, n: int, seed: int = 0) -> Path:
    """Write ``n`` sessions as ``root/<instance>/<instance>.traj.json`` (deterministic in
    ``seed``); returns ``root``."""
    rng = random.Random(seed)
    for i in range(n):
        inst = f"swe__bench-{i}"
        d = root / inst
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{inst}.traj.json").write_text(
            json.dumps(_session(i, rng, 1.7e9 + 11.0 * i)), encoding="utf-8")
    return root
