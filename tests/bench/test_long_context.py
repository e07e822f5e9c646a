"""The long-context coding-agent family's generator: its distribution and its sub-agents."""

from __future__ import annotations

import itertools

import numpy as np

from turnstile.bench.families import get_family
from turnstile.bench.long_context import MAX_PROMPT_TOKENS, long_context_sessions


def _lead(wf):
    """The lead agent's turns: the chain from turn 0 along each turn's first parent."""
    child = {}
    for i in range(1, len(wf.turns)):
        p = wf.parents_of(i)
        if p:
            child.setdefault(p[0], []).append(i)
    out, i = [0], 0
    while True:
        nxt = [c for c in child.get(i, []) if wf.turns[c].context_tokens > 0]
        if not nxt:
            return out
        i = nxt[0]
        out.append(i)


def test_prompts_are_long_grow_by_small_inputs_and_stay_in_range():
    wfs, info = long_context_sessions(120, 0)
    assert info["path"] is None and len(wfs) == 120
    prompts = np.array([t.prompt_tokens for w in wfs for t in w.turns])
    assert 85_000 <= np.median(prompts) <= 115_000
    assert prompts.max() <= MAX_PROMPT_TOKENS
    peaks = np.array([max(t.prompt_tokens for t in w.turns) for w in wfs])
    assert np.percentile(peaks, 90) > 200_000  # some grow far past 100k
    grown = [t.input_tokens for w in wfs for t in w.turns if t.context_tokens > 0]
    assert 200 <= np.median(grown) <= 800  # new input per turn: hundreds of tokens
    assert np.median([t.output_tokens for w in wfs for t in w.turns]) <= 300
    # each lead turn reuses the previous one's whole prompt and output (until it compacts)
    w = wfs[0]
    lead = _lead(w)
    assert len(lead) >= 6
    for a, b in itertools.pairwise(lead):
        ta, tb = w.turns[a], w.turns[b]
        assert tb.context_tokens in (ta.prompt_tokens + ta.output_tokens, 0)


def test_gaps_are_heavy_tailed_seconds_to_minutes():
    wfs, _ = long_context_sessions(120, 0)
    gaps = np.array([c.duration_s for w in wfs for t in w.turns for c in t.tools
                     if c.name == "tool"])
    assert 2.0 <= np.median(gaps) <= 15.0
    assert np.percentile(gaps, 99) >= 60.0  # minutes in the tail
    assert np.percentile(gaps, 99) / np.median(gaps) > 10


def test_sub_agents_are_spawned_mid_session_and_joined():
    wfs, _ = long_context_sessions(120, 0)
    with_sub = 0
    for w in wfs:
        assert not w.is_chain
        lead = set(_lead(w))
        subs = [i for i in range(len(w.turns)) if i not in lead]
        if not subs:
            continue
        with_sub += 1
        for i in subs:
            t = w.turns[i]
            if t.context_tokens == 0:  # a sub-agent's first turn: a fresh context
                (spawner,) = w.parents_of(i)
                assert spawner in lead and spawner != 0  # spawned mid-session
                assert w.turns[spawner].tools[0].name == "task"
                assert t.prompt_tokens < w.turns[spawner].prompt_tokens
        # the lead's turn after a spawn waits for every sub-agent's last turn
        joins = [i for i in lead if len(w.parents_of(i)) > 1]
        assert joins
    assert 0.3 * len(wfs) <= with_sub <= 0.9 * len(wfs)


def test_seeded_and_prefix_stable():
    a, _ = long_context_sessions(30, 3)
    b, _ = long_context_sessions(30, 3)
    c, _ = long_context_sessions(10, 3)
    d, _ = long_context_sessions(10, 4)
    assert [w.turns for w in a] == [w.turns for w in b]
    assert [w.turns for w in a[:10]] == [w.turns for w in c]
    assert [w.turns for w in c] != [w.turns for w in d]


def test_it_is_a_report_family_of_the_quick_suite():
    fam = get_family("syn-long-context")
    assert (fam.split, fam.kind, fam.quick, fam.keyed) == ("report", "synthetic", True, True)
