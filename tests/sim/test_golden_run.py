"""Bit-identical simulator results: a fixed, small but rich run compared with a stored fixture.

The run exercises what the engine model does: chunked prefill (2,048-token budget, prompts up to
~9k tokens), prefix sharing (session-named blocks and, for half the sessions, hash-named blocks
of four shared system prompts, 64 tokens per hash), a CPU offload tier (``infercept`` offloads
and discards across tool calls; LRU eviction spills to the tier), pins (``ttl``), preemption
(small KV: 1,536 blocks per engine) and two engines with three routing policies.

Every metric, every engine counter and a digest of every turn's timestamps must equal the
fixture exactly (floats compared by ``repr``): any change in the engine's or the driver's
behaviour fails here. Wall times, paths and the event count (an implementation detail of the
driver loop, not a result) are left out. Regenerate the fixture only for a documented bug fix:

    .venv/bin/python tests/sim/test_golden_run.py --write
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any

from turnstile.bench.runner import run_bench
from turnstile.sim.cluster import EngineGroup, run_sim
from turnstile.workload.model import ToolCall, Turn, Workflow

FIXTURE = Path(__file__).with_name("fixtures") / "golden_run.json"
POLICIES = ("eager", "cvar+composite+ttl", "plas+kv-affinity+infercept")
HASH_BLOCK_TOKENS = 64
TOOLS = ("Bash", "Read", "Edit", "Grep")
GROUPS = [
    EngineGroup(gpu="H100", model="llama-3.1-8b", count=2, kv_tokens=24_576,
                cpu_offload_tokens=16_384, max_num_seqs=24, max_batched_tokens=2_048)
]


def golden_workload(n: int = 70, seed: int = 7) -> list[Workflow]:
    """Agent sessions with growing contexts and tool calls; half share system prompts named by
    block hashes. Self-contained (``random.Random``), so it never moves with the generator."""
    rng = random.Random(seed)
    wfs = []
    t = 0.0
    for w in range(n):
        t += rng.expovariate(1.2)
        family = rng.randrange(4) if rng.random() < 0.5 else None
        turns = []
        ctx = 0
        for i in range(rng.randint(2, 6)):
            inp = rng.randint(200, 3_000) if i else rng.randint(1_000, 4_000)
            out = rng.randint(10, 400)
            bh = None
            if family is not None:
                n_hash = (ctx + inp) // HASH_BLOCK_TOKENS
                # the first 16 hash blocks (1,024 tokens) are the family's shared system prompt
                bh = tuple(family * 1_000 + j if j < 16 else (w + 1) * 100_000 + j
                           for j in range(n_hash))
            tools = tuple(ToolCall(rng.choice(TOOLS), round(rng.expovariate(0.4), 3), "ok")
                          for _ in range(rng.randint(1, 2)))
            turns.append(Turn(input_tokens=inp, output_tokens=out, context_tokens=ctx,
                              block_hashes=bh, tools=tools))
            ctx += inp + out
        wfs.append(Workflow(f"w{w}", round(t, 6), tuple(turns)))
    return wfs


def _timeline_digest(records: list[Any]) -> str:
    h = hashlib.sha256()
    for wf in sorted(records, key=lambda r: r.id):
        h.update(f"{wf.id}|{wf.finished_s!r}".encode())
        for t in wf.turns:
            h.update(f"|{t.ready_s!r},{t.released_s!r},{t.started_s!r},{t.first_token_s!r},"
                     f"{t.finished_s!r},{t.engine}".encode())
    return h.hexdigest()


def golden_results() -> dict[str, Any]:
    wfs = golden_workload()
    out: dict[str, Any] = {}
    for spec, res in zip(POLICIES, run_bench(wfs, POLICIES, GROUPS,
                                             hash_block_tokens=HASH_BLOCK_TOKENS), strict=True):
        sim = {k: v for k, v in res["sim"].items()
               if k not in ("wall_s", "iterations_per_s", "events")}
        # the per-turn timeline from a second run of the same spec (run_bench keeps only metrics)
        records = run_sim(wfs, spec, GROUPS, hash_block_tokens=HASH_BLOCK_TOKENS).workflows
        out[spec] = {"metrics": res["metrics"], "sim": sim, "engines": res["engines"],
                     "timeline_sha256": _timeline_digest(records)}
    return out


def _flat(d: Any, prefix: str = "") -> dict[str, str]:
    """Leaves as ``repr`` (exact floats, NaN equal to NaN)."""
    if isinstance(d, dict):
        flat: dict[str, str] = {}
        for k, v in d.items():
            flat.update(_flat(v, f"{prefix}{k}."))
        return flat
    if isinstance(d, list):
        return _flat(dict(enumerate(d)), prefix)
    return {prefix.rstrip("."): repr(d)}


def test_the_fixed_run_is_bit_identical_to_the_fixture():
    want = _flat(json.loads(FIXTURE.read_text()))
    got = _flat(json.loads(json.dumps(golden_results())))
    assert got.keys() == want.keys()
    diff = {k: (want[k], got[k]) for k in want if got[k] != want[k]}
    assert not diff, f"{len(diff)} results changed (fixture, now): {dict(list(diff.items())[:20])}"


def test_the_fixed_run_exercises_every_engine_path():
    """The fixture only guards what the run reaches: prefix hits, eviction, the offload tier,
    reloads, preemption and chunked prefill must all happen in it."""
    got = json.loads(FIXTURE.read_text())
    for key in ("hit_tokens", "evicted_blocks", "offloaded_blocks", "reloaded_blocks",
                "preemptions", "recomputed_tokens"):
        total = sum(e[key] for r in got.values() for e in r["engines"].values())
        assert total > 0, key
    wfs = golden_workload()
    assert max(t.prompt_tokens for w in wfs for t in w.turns) > 2 * GROUPS[0].max_batched_tokens


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: test_golden_run.py --write   (regenerates the fixture)")
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(golden_results(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
