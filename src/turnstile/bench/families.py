"""The robustness suite's workload families: real traces, importer formats, synthetic families
that each stretch one dimension, and a generator nobody here wrote (AIPerf).

A :class:`Family` builds ``n`` *sessions* (arrival times are the suite's business: Poisson at a
rate, or a closed loop of workers). Each family belongs to the ``tune`` half (parameters may be
chosen on it) or the ``report`` half (reported separately, never tuned on).

Synthetic families draw from a :class:`~turnstile.workload.synth_spec.SynthSpec` of lognormal
distributions, one dimension moved away from the AgentCgroup fit at a time: turns per session
(3–150), context growth per turn (100–5,000 tokens), starting context (1k–100k), tool-time tails
(10 ms to minutes, heavy-tailed), long reasoning outputs; plus sub-agent fan-out (a DAG) and a
closed-loop worker pool, and long-context coding-agent sessions
(:mod:`turnstile.bench.long_context`). Real families need the real traces
(``$TURNSTILE_TRACES`` or ``traces/`` in the checkout: docs/traces.md); where absent they are
skipped and say so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from turnstile.bench.long_context import long_context_sessions
from turnstile.workload import synth
from turnstile.workload.model import ToolCall, Turn, Workflow
from turnstile.workload.synth_spec import Dist, SynthSpec, ToolSpec

__all__ = ["FAMILIES", "Family", "family_names", "get_family"]

#: prompts are capped here (the synthetic sessions compact, as Claude Code does)
MAX_PROMPT_TOKENS = 120_000


@dataclass(frozen=True)
class Family:
    name: str
    #: real | importer | synthetic | generator
    kind: str
    #: tune | report
    split: str
    describe: str
    build: Callable[[int, int], tuple[list[Workflow], dict[str, Any]]]
    #: open (Poisson arrivals at a rate) or closed (a pool of workers)
    arrivals: str = "open"
    #: part of the ``--quick`` suite
    quick: bool = False
    #: its sessions reach the gateway keyed (an agent's session id), which learns of their end
    #: only by the idle rule: the suite's gateway-facing cells (ends unannounced). False for
    #: request traces without session keys, whose one-turn sessions close at their answer
    keyed: bool = True

    def sessions(self, n: int, seed: int) -> tuple[list[Workflow], dict[str, Any]]:
        """``n`` sessions (resampled with replacement from a trace when it has fewer), and
        where they came from; raises FileNotFoundError when a trace is absent."""
        return self.build(n, seed)


# ------------------------------------------------------------------------------ synthetic
def _ln(median: float, sigma: float, lo: float = 1.0, hi: float = math.inf) -> Dist:
    return Dist.lognormal(math.log(median), sigma, lo, hi)


def _spec(name: str, *, turns: Dist, first: Dist, growth: Dist, out: Dist,
          tool_median_s: float = 1.5, tool_sigma: float = 1.2, tool_max_s: float = 300.0,
          ) -> SynthSpec:
    tool = ToolSpec("tool", 1.0, ((1.0, math.log(tool_median_s), tool_sigma),),
                    error_prob=0.05, max_s=tool_max_s, result_tokens=None)
    return SynthSpec(name=name, turns=turns, first_prompt_tokens=first, input_tokens=growth,
                     output_tokens=out, tools_per_turn=(0.0, 1.0), tools=(tool,),
                     max_prompt_tokens=MAX_PROMPT_TOKENS)


_BASE = {"turns": _ln(20, 0.5, 3, 150), "first": _ln(6_000, 0.5, 500, 60_000),
         "growth": _ln(800, 0.8, 20, 20_000), "out": _ln(250, 0.9, 4, 16_000)}


def _synth(name: str, **over: Any) -> Callable[[int, int], tuple[list[Workflow], dict]]:
    kw = {**_BASE, **over}
    spec = _spec(name, **kw)

    def build(n: int, seed: int) -> tuple[list[Workflow], dict[str, Any]]:
        return synth.generate(spec, n, seed), {"name": f"synthetic:{name}", "path": None}
    return build


def _default_fit(n: int, seed: int) -> tuple[list[Workflow], dict[str, Any]]:
    return (synth.generate(synth.DEFAULT_SPEC, n, seed),
            {"name": "synthetic: AgentCgroup glm47flash_local fit", "path": None})


def _fanout(n: int, seed: int) -> tuple[list[Workflow], dict[str, Any]]:
    """A lead agent plans (one turn), spawns 2–8 sub-agents (chains of 3–10 turns, each with its
    own fresh context), and joins their summaries in a final turn: a DAG per session."""
    rng = np.random.default_rng([seed, 7])
    out: list[Workflow] = []
    for w in range(n):
        k = int(rng.integers(2, 9))
        lead = int(rng.lognormal(math.log(8_000), 0.4))
        turns: list[Turn] = [Turn(lead, int(rng.lognormal(math.log(400), 0.5)) + 1, 0,
                                  tools=(ToolCall("spawn", 0.05, "ok"),))]
        ends: list[int] = []
        for _ in range(k):
            ctx = 0
            length = int(rng.integers(3, 11))
            start = len(turns)
            for j in range(length):
                inp = int(rng.lognormal(math.log(3_000 if j == 0 else 600), 0.6)) + 1
                o = int(rng.lognormal(math.log(200), 0.8)) + 1
                dur = float(min(rng.lognormal(math.log(1.0), 1.3), 120.0))
                tools = (ToolCall("tool", round(dur, 4), "ok"),) if j + 1 < length else ()
                parents = (0,) if j == 0 else (len(turns) - 1,)
                turns.append(Turn(inp, o, ctx, tools=tools, parents=parents))
                ctx += inp + o
            ends.append(start + length - 1)
        join_in = 300 * k
        turns.append(Turn(join_in, int(rng.lognormal(math.log(600), 0.5)) + 1,
                          turns[0].prompt_tokens + turns[0].output_tokens,
                          parents=tuple(ends)))
        out.append(Workflow(f"fanout-{seed}-{w:05d}", 0.0, tuple(turns),
                            meta={"source": "synth-fanout"}))
    return out, {"name": "synthetic: sub-agent fan-out (DAG)", "path": None}


# ----------------------------------------------------------------------------------- real
def traces_dir() -> Path | None:
    from turnstile.traces import default_traces_dir

    return default_traces_dir()


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[3]


@lru_cache(maxsize=16)
def _load(path: str, subset: str | None) -> tuple[tuple[Workflow, ...], str, int]:
    from turnstile.traces import load_trace

    kw = {"subset": subset} if subset else {}
    t = load_trace(path, **kw)
    return tuple(t.workflows), t.name, t.hash_block_tokens


def _resample(pool: list[Workflow], n: int, seed: list[int]) -> list[Workflow]:
    """``n`` sessions drawn from ``pool`` (a permutation; with replacement when ``n`` is
    larger, repeats renamed ``id#k``), arrivals at 0."""
    rng = np.random.default_rng(seed)
    pick = rng.permutation(len(pool))[:n] if n <= len(pool) else \
        rng.integers(0, len(pool), size=n)
    chosen = []
    seen: dict[int, int] = {}
    for i in pick.tolist():
        r = seen.get(i, 0)
        seen[i] = r + 1
        w = pool[i]
        chosen.append(Workflow(w.id if r == 0 else f"{w.id}#{r}", 0.0, w.turns, w.tenant,
                               w.meta))
    return chosen


def _trace(rel: str, subset: str | None = None, *, root: str = "traces",
           multi_turn_only: bool = False) -> Callable[[int, int], tuple[list[Workflow], dict]]:
    def build(n: int, seed: int) -> tuple[list[Workflow], dict[str, Any]]:
        if root == "traces":
            base = traces_dir()
            if base is None:
                raise FileNotFoundError("real traces not found (set TURNSTILE_TRACES or run "
                                        "scripts/fetch_traces.sh)")
            path = base / rel
        elif root == "package":
            path = Path(str(resources.files("turnstile.bench").joinpath(rel)))
        else:
            path = _repo_root() / rel
        if not path.exists():
            raise FileNotFoundError(f"{path} not found")
        wfs, name, block = _load(str(path), subset)
        pool = [w for w in wfs if len(w.turns) > 1] if multi_turn_only else list(wfs)
        chosen = _resample(pool, n, [seed, 11])
        return chosen, {"name": name, "path": str(path), "hash_block_tokens": block,
                        "pool": len(pool), "resampled": n > len(pool)}
    return build


@lru_cache(maxsize=2)
def _swe_pool(n: int, seed: int) -> tuple[tuple[Workflow, ...], str, int]:
    import tempfile

    from turnstile.bench.agent_logs import write_mini_swe_agent_logs

    with tempfile.TemporaryDirectory(prefix="turnstile-swe-logs-") as d:
        return _load.__wrapped__(str(write_mini_swe_agent_logs(Path(d), n, seed)), None)


def _swe_logs(n: int, seed: int) -> tuple[list[Workflow], dict[str, Any]]:
    """SWE-bench-like mini-swe-agent logs (:mod:`turnstile.bench.agent_logs`), written and
    read back by the importer: a pool of 200 sessions, resampled."""
    wfs, name, block = _swe_pool(200, 0)
    chosen = _resample(list(wfs), n, [seed, 13])
    return chosen, {"name": name, "path": "generated (bench.agent_logs, seed 0)",
                    "hash_block_tokens": block, "pool": len(wfs), "resampled": n > len(wfs)}


AC = "agentcgroup_swerebench_claude_code"

FAMILIES: tuple[Family, ...] = (
    # -- real traces
    Family("agentcgroup-glm", "real", "tune", "AgentCgroup Claude Code sessions, glm47flash_local "
           "(40k–130k contexts, KV-bound)", _trace(AC, "glm47flash_local")),
    Family("agentcgroup-haiku", "real", "report", "AgentCgroup Claude Code sessions, haiku",
           _trace(AC, "haiku"), quick=True),
    Family("tracelab", "real", "report", "TraceLab round_trace (2 sessions, resampled)",
           _trace("tracelab_example/round_trace.jsonl")),
    Family("mooncake-conv", "real", "tune", "Mooncake FAST'25 conversation trace (inferred "
           "sessions, 1.5 turns each)", _trace("mooncake_fast25/conversation_trace.jsonl"),
           keyed=False),
    Family("azure-conv", "real", "report", "Azure LLM 2023 conversation requests (single turns)",
           _trace("azure_llm_2023_conv/AzureLLMInferenceTrace_conv.csv"), quick=True,
           keyed=False),
    # -- the importers' own formats (the repository's small fixtures)
    Family("mini-swe-agent", "importer", "report", "mini-swe-agent trajectories (test fixture, "
           "resampled)", _trace("tests/fixtures/traces/mini_swe_agent", root="repo")),
    Family("swe-agent", "importer", "tune", "SWE-agent trajectory (test fixture, resampled)",
           _trace("tests/fixtures/traces/swe_agent_tiny.traj", root="repo")),
    Family("litellm-log", "importer", "report", "LiteLLM request log grouped into sessions "
           "(test fixture, resampled)",
           _trace("tests/fixtures/traces/litellm_tiny.jsonl", root="repo")),
    Family("swe-bench-logs", "importer", "report", "SWE-bench-like mini-swe-agent logs "
           "(generated: ~40 calls, prompts growing 300–600 tokens a turn to ~14k median, 4 s "
           "tools), read by the importer with content-hash blocks", _swe_logs, quick=True),
    # -- a generator nobody here wrote
    Family("aiperf-agentic-code", "generator", "report", "AIPerf 0.13.0 `synthesize agentic-code "
           "--num-sessions 60 --seed 42 --max-isl 120000` (the shipped file: ~62k-token "
           "starting contexts sharing a 32k system prompt, 11.6 turns per session)",
           _trace("data/aiperf_agentic_code.jsonl.gz", root="package"), quick=True),
    # -- synthetic, one dimension at a time
    Family("syn-agentcgroup-fit", "synthetic", "tune", "the packaged AgentCgroup fit",
           _default_fit, quick=True),
    Family("syn-few-turns", "synthetic", "report", "3–8 turns per session",
           _synth("few-turns", turns=_ln(5, 0.3, 3, 8))),
    Family("syn-many-turns", "synthetic", "tune", "60–150 turns per session, small growth",
           _synth("many-turns", turns=_ln(100, 0.3, 60, 150), growth=_ln(300, 0.6, 20, 3_000))),
    Family("syn-growth-100", "synthetic", "report", "context grows ~100 tokens per turn",
           _synth("growth-100", growth=_ln(100, 0.4, 10, 1_000))),
    Family("syn-growth-5000", "synthetic", "tune", "context grows ~5,000 tokens per turn",
           _synth("growth-5000", growth=_ln(5_000, 0.4, 500, 20_000))),
    Family("syn-start-1k", "synthetic", "tune", "starting context ~1k tokens",
           _synth("start-1k", first=_ln(1_000, 0.3, 200, 4_000))),
    Family("syn-start-100k", "synthetic", "report", "starting context ~100k tokens",
           _synth("start-100k", first=_ln(100_000, 0.1, 60_000, 110_000),
                  turns=_ln(8, 0.4, 3, 30), growth=_ln(500, 0.6, 20, 3_000))),
    Family("syn-tools-10ms", "synthetic", "report", "tool calls ~10 ms",
           _synth("tools-10ms", tool_median_s=0.01, tool_sigma=0.5, tool_max_s=1.0)),
    Family("syn-tools-heavy", "synthetic", "tune", "heavy-tailed tool time: median 5 s, "
           "σ=2 (tail to 10 min)",
           _synth("tools-heavy", tool_median_s=5.0, tool_sigma=2.0, tool_max_s=600.0),
           quick=True),
    Family("syn-reasoning", "synthetic", "report", "long reasoning outputs (median 4k, to 32k)",
           _synth("reasoning", out=_ln(4_000, 0.8, 200, 32_000), turns=_ln(8, 0.4, 3, 30))),
    Family("syn-fanout", "synthetic", "report", "sub-agent fan-out: 2–8 sub-agents per "
           "session, joined", _fanout),
    Family("syn-long-context", "synthetic", "report", "long-context coding agent: prompts "
           "~100k tokens (median) growing towards 400k by hundreds of tokens a turn, short "
           "outputs, think/tool gaps of seconds to minutes, sub-agents spawned mid-session",
           long_context_sessions, quick=True),
    Family("syn-closed-pool", "synthetic", "report", "closed-loop worker pool running the "
           "AgentCgroup fit (load = workers)", _default_fit, arrivals="closed", quick=True),
)


def family_names() -> list[str]:
    return [f.name for f in FAMILIES]


def get_family(name: str) -> Family:
    for f in FAMILIES:
        if f.name == name:
            return f
    raise ValueError(f"unknown family {name!r}; valid: {', '.join(family_names())}")
