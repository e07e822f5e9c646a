"""Synthetic workloads: reproducible, fitted to the real traces, with heavy tails; arrivals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from turnstile.traces import load_agentcgroup
from turnstile.workload import Turn, Workflow, validate_workflow
from turnstile.workload.synth import (
    DEFAULT_SPEC,
    default_spec,
    generate,
    poisson_arrivals,
    superimpose,
)
from turnstile.workload.synth_fit import fit_lognormal_mixture, fit_spec
from turnstile.workload.synth_spec import Dist, SynthSpec, ToolSpec, load_spec, save_spec


def _small_spec() -> SynthSpec:
    return SynthSpec(
        name="small",
        turns=Dist.lognormal(2.0, 0.8, lo=1, hi=200),
        first_prompt_tokens=Dist.empirical([1000, 2000, 4000]),
        input_tokens=Dist.lognormal(5.0, 1.0, lo=1),
        output_tokens=Dist.lognormal(4.0, 0.7, lo=1),
        tools_per_turn=(0.1, 0.8, 0.1),
        tools=(
            ToolSpec("Bash", 0.6, ((0.7, -2.0, 0.5), (0.3, 2.0, 0.3)), error_prob=0.2,
                     timeout_prob=0.05, timeout_s=120.0),
            ToolSpec("Read", 0.4, ((1.0, -3.5, 0.2),), result_tokens=(5.0, 1.0)),
        ),
        max_prompt_tokens=20_000,
    )


def test_reproducible_for_a_seed_and_different_across_seeds() -> None:
    spec = _small_spec()
    a = generate(spec, 200, seed=7)
    b = generate(spec, 200, seed=7)
    c = generate(spec, 200, seed=8)
    assert a == b
    assert [w.meta for w in a] == [w.meta for w in b]
    assert a != c
    assert [len(w.turns) for w in a] != [len(w.turns) for w in c]
    d = generate(DEFAULT_SPEC, 20, seed=1, arrivals=2.0)
    assert d == generate(DEFAULT_SPEC, 20, seed=1, arrivals=2.0)


def test_generated_workflows_are_valid_and_context_grows() -> None:
    spec = _small_spec()
    wfs = generate(spec, 300, seed=3)
    compactions = 0
    for wf in wfs:
        assert validate_workflow(wf) == []
        assert wf.is_chain and wf.arrival_s == 0.0
        assert wf.turns[0].context_tokens == 0
        assert wf.turns[-1].tools == ()  # the final turn calls no tool
        for prev, t in zip(wf.turns, wf.turns[1:], strict=False):
            grown = prev.prompt_tokens + prev.output_tokens
            if t.context_tokens == grown:
                continue
            # only when the cap forces a compaction back to the first prompt
            compactions += 1
            assert grown + t.input_tokens > 20_000
            assert t.context_tokens <= wf.turns[0].prompt_tokens
        assert all(t.prompt_tokens <= 20_000 for t in wf.turns[1:])
    assert compactions > 0  # the cap is exercised by this spec
    statuses = {tool.status for wf in wfs for t in wf.turns for tool in t.tools}
    assert statuses == {"ok", "error", "timeout"}
    reads = [tool for wf in wfs for t in wf.turns for tool in t.tools if tool.name == "Read"]
    assert all(r.result_tokens is not None and r.status == "ok" for r in reads)


def test_arrival_options() -> None:
    spec = _small_spec()
    times = np.array([5.0, 1.0, 3.0])
    wfs = generate(spec, 3, seed=0, arrivals=times)
    assert [w.arrival_s for w in wfs] == [1.0, 3.0, 5.0]
    with pytest.raises(ValueError, match="arrival times"):
        generate(spec, 4, seed=0, arrivals=times)
    poisson = generate(spec, 500, seed=0, arrivals=10.0)
    gaps = np.diff([w.arrival_s for w in poisson])
    assert np.all(gaps >= 0) and 0.08 < gaps.mean() < 0.12
    # the arrival stream does not change the workload itself, nor does the number drawn
    assert [w.turns for w in poisson[:3]] == [w.turns for w in generate(spec, 3, seed=0)]
    assert np.array_equal(poisson_arrivals(3.0, 5, 9), poisson_arrivals(3.0, 50, 9)[:5])


def test_poisson_arrivals() -> None:
    a = poisson_arrivals(4.0, 20_000, seed=1)
    assert np.array_equal(a, poisson_arrivals(4.0, 20_000, seed=1))
    assert not np.array_equal(a, poisson_arrivals(4.0, 20_000, seed=2))
    gaps = np.diff(np.concatenate(([0.0], a)))
    assert np.all(gaps > 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)  # exponential: sd = mean
    assert poisson_arrivals(1.0, 3, seed=0, start=100.0)[0] > 100.0
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 3, seed=0)


def _sessions(n: int) -> list[Workflow]:
    return [Workflow(f"s{i}", 0.0, (Turn(10 + i, 1),), meta={"k": "v"}) for i in range(n)]


@pytest.mark.parametrize("mode", ["cycle", "shuffle", "sample"])
def test_superimpose_more_arrivals_than_sessions(mode: str) -> None:
    sessions = _sessions(4)
    times = poisson_arrivals(1.0, 10, seed=5)
    out = superimpose(sessions, times, seed=1, mode=mode)  # type: ignore[arg-type]
    assert len(out) == 10
    assert [w.arrival_s for w in out] == sorted(times.tolist())
    assert len({w.id for w in out}) == 10  # fresh ids for reused sessions
    by_id = {w.id: w for w in sessions}
    for w in out:
        base, _, rep = w.id.partition("#")
        assert w.turns == by_id[base].turns
        assert w.meta.get("replica", "0") == (rep or "0")
        assert w.meta["k"] == "v"
    if mode == "cycle":
        assert [w.id.split("#")[0] for w in out][:4] == ["s0", "s1", "s2", "s3"]
    if mode in ("cycle", "shuffle"):  # every session used 2 or 3 times
        uses = {s.id: sum(w.id.split("#")[0] == s.id for w in out) for s in sessions}
        assert sorted(uses.values()) == [2, 2, 3, 3]
    assert sessions[0].meta == {"k": "v"}  # inputs untouched


def test_superimpose_fewer_arrivals_and_errors() -> None:
    out = superimpose(_sessions(5), [2.0, 1.0], seed=0, mode="cycle")
    assert [(w.id, w.arrival_s) for w in out] == [("s0", 1.0), ("s1", 2.0)]
    assert superimpose(_sessions(3), [], seed=0) == []
    with pytest.raises(ValueError):
        superimpose([], [1.0])
    with pytest.raises(ValueError, match="unknown mode"):
        superimpose(_sessions(2), [1.0], mode="nope")  # type: ignore[arg-type]


def test_mixture_fit_recovers_components() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.lognormal(-3.0, 0.3, 3000), rng.lognormal(2.0, 0.5, 1000)])
    comps = fit_lognormal_mixture(x, k=2)
    assert len(comps) == 2
    (w1, m1, s1), (w2, m2, s2) = comps
    assert w1 == pytest.approx(0.75, abs=0.02) and w2 == pytest.approx(0.25, abs=0.02)
    assert m1 == pytest.approx(-3.0, abs=0.05) and m2 == pytest.approx(2.0, abs=0.1)
    assert s1 == pytest.approx(0.3, abs=0.05) and s2 == pytest.approx(0.5, abs=0.1)
    assert len(fit_lognormal_mixture([1.0, 2.0, 3.0], k=3)) == 1  # too few points


def test_fit_then_generate_matches_the_source() -> None:
    src = generate(_small_spec(), 3000, seed=11)
    spec = fit_spec(src, name="refit")
    again = generate(spec, 3000, seed=12)

    def q(ws: list[Workflow], p: float) -> float:
        return float(np.percentile([len(w.turns) for w in ws], p))

    for p in (50, 90, 99):
        assert q(again, p) == pytest.approx(q(src, p), rel=0.15)
    names = {t.name: t for t in spec.tools}
    assert set(names) == {"Bash", "Read"}
    assert names["Bash"].prob == pytest.approx(0.6, abs=0.03)
    assert names["Bash"].timeout_prob == pytest.approx(0.05, abs=0.015)
    assert names["Bash"].error_prob == pytest.approx(0.2 * 0.95, abs=0.03)
    assert spec.tools_per_turn[1] == pytest.approx(0.8, abs=0.03)
    assert spec.max_prompt_tokens is not None and spec.max_prompt_tokens <= 20_000


def test_spec_json_round_trip(tmp_path: Path) -> None:
    spec = _small_spec()
    p = tmp_path / "s.json"
    save_spec(spec, p, note="made by a test")
    assert json.loads(p.read_text())["_note"] == "made by a test"
    assert load_spec(p) == spec
    assert SynthSpec.from_dict(DEFAULT_SPEC.to_dict()) == DEFAULT_SPEC


def test_default_spec_is_the_packaged_glm_fit_with_a_heavy_tail() -> None:
    spec = default_spec()
    assert spec is DEFAULT_SPEC
    assert spec.name == "agentcgroup:glm47flash_local"
    assert spec.info["fitted_workflows"] == 111 and spec.info["fitted_turns"] == 5641
    wfs = generate(spec, 3000, seed=0)
    n = np.array([len(w.turns) for w in wfs])
    p50, p99 = np.percentile(n, [50, 99])
    assert p99 / p50 > 2.3  # heavy tail: the real trace has 132.8 / 46 ≈ 2.9
    assert p50 == pytest.approx(spec.info["turns_p50"], rel=0.15)
    assert p99 == pytest.approx(spec.info["turns_p99"], rel=0.15)
    lat = np.array([t.duration_s for w in wfs for tr in w.turns for t in tr.tools])
    assert np.percentile(lat, 50) < 0.2 < 5.0 < np.percentile(lat, 95)  # ms typical, s tail
    names = [t.name for t in spec.tools]
    assert names[0] == "Bash" and "Read" in names
    assert 0.05 < spec.error_prob < 0.3
    assert math.isclose(sum(t.prob for t in spec.tools), 1.0, abs_tol=1e-4)


@pytest.mark.traces
def test_default_spec_matches_a_refit_of_the_real_trace(traces_dir: Path) -> None:
    lt = load_agentcgroup(traces_dir / "agentcgroup_swerebench_claude_code",
                          subset="glm47flash_local")
    spec = fit_spec(lt.workflows, name="agentcgroup:glm47flash_local")
    assert spec.turns == DEFAULT_SPEC.turns
    assert spec.output_tokens == DEFAULT_SPEC.output_tokens
    assert spec.max_prompt_tokens == DEFAULT_SPEC.max_prompt_tokens
    assert [t.name for t in spec.tools] == [t.name for t in DEFAULT_SPEC.tools]
    for a, b in zip(spec.tools, DEFAULT_SPEC.tools, strict=True):
        assert a.prob == pytest.approx(b.prob, abs=1e-5)
        assert a.error_prob == pytest.approx(b.error_prob, abs=1e-5)
    real_turns = np.array([len(w.turns) for w in lt.workflows])
    p50, p99 = np.percentile(real_turns, [50, 99])
    assert p99 / p50 > 2.5
