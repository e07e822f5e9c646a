"""A fake verl rollout server for the verl router tests: a CPU stand-in for a vLLM/SGLang replica
behind verl's ``LLMServerClient`` (its ``generate`` has the replica server's keyword shape and
returns verl's ``TokenOutput``). It lives in an importable module so Ray workers can load it.
Imports verl and Ray only when used."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["FakeRolloutServer", "ScriptedRolloutServer"]


class FakeRolloutServer:
    """Answers ``max_tokens`` tokens after ``delay_s``; records, per call, the first prompt token
    (the tests put the trajectory's number there) and the prompt length."""

    def __init__(self, name: str, delay_s: float = 0.005) -> None:
        self.name = name
        self.delay_s = delay_s
        self.calls: list[tuple[int, int]] = []

    async def generate(self, request_id: str, prompt_ids: list[int],
                       sampling_params: dict[str, Any], image_data: Any = None,
                       video_data: Any = None, **kwargs: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        await asyncio.sleep(self.delay_s)
        self.calls.append((int(prompt_ids[0]), len(prompt_ids)))
        n = int(sampling_params.get("max_tokens", 4))
        return TokenOutput(token_ids=[3] * n, stop_reason="completed",
                           extra_fields={"global_steps": 0})

    def served(self) -> list[tuple[int, int]]:
        return list(self.calls)


class ScriptedRolloutServer:
    """Answers its ``k``-th call with ``responses[k]`` (the last one once they run out): token
    ids the test tokenized beforehand, e.g. a hermes ``<tool_call>`` then a final answer."""

    def __init__(self, responses: list[list[int]]) -> None:
        self.responses = responses
        self.prompt_lengths: list[int] = []

    async def generate(self, request_id: str, prompt_ids: list[int],
                       sampling_params: dict[str, Any], image_data: Any = None,
                       video_data: Any = None, **kwargs: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        k = min(len(self.prompt_lengths), len(self.responses) - 1)
        self.prompt_lengths.append(len(prompt_ids))
        return TokenOutput(token_ids=list(self.responses[k]), stop_reason="completed",
                           extra_fields={"global_steps": 0})

    def served(self) -> list[int]:
        return list(self.prompt_lengths)
