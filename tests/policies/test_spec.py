"""Policy specs with options (``name:key=value,...``): parsing, checking, canonical form."""

from __future__ import annotations

import math

import pytest

from turnstile.policies import (
    _BY_KIND,
    RELEASE,
    PolicySet,
    SpecError,
    parse_policy_list,
    registry_of,
    resolve,
    resolved_spec,
)
from turnstile.policies.spec import (
    ALIASES,
    Option,
    configurations,
    options_of,
    parse,
    split_specs,
)


def test_options_reach_the_constructors():
    ps = PolicySet.from_spec("cvar:budget=fixed,kv_fill=0.6+kv-affinity+ttl:max_ttl_s=30")
    assert ps.release.budget_mode == "fixed" and ps.release.kv_fill == 0.6
    assert ps.release.gate_mode == "adaptive"
    assert ps.retention.max_ttl_s == 30.0


def test_a_list_of_specs_keeps_options_together():
    got = parse_policy_list("eager,auto,cvar:budget=fixed,kv_fill=0.6+ttl,plas")
    assert got == ["eager", "auto", "cvar:budget=fixed,kv_fill=0.6+ttl", "plas"]
    assert split_specs("a,b:k=1, j=2 ,c") == ["a", "b:k=1,j=2", "c"]


@pytest.mark.parametrize(("spec", "needle"), [
    ("cvar:nope=1", "cvar: unknown option 'nope'; valid keys: alpha,"),
    ("cvar:kv_fill=2", "kv_fill=2.0 out of range: expected kv_fill: float in (0, 1]"),
    ("cvar:kv_fill=0", "out of range"),
    ("cvar:alpha=1", "out of range"),
    ("cvar:budget=huge", "expected budget: one of adaptive/fixed/none"),
    ("cvar:gamma=abc", "expected gamma: float in [0, inf]"),
    ("plas:max_inflight_per_engine=1.5", "expected max_inflight_per_engine: int"),
    ("eager:x=1", "eager: unknown option 'x'; valid keys: (none"),
    ("cvar:kv_fill", "not key=value"),
    ("nosuch", "unknown policy 'nosuch'"),
])
def test_bad_options_are_one_line_naming_the_key_and_the_valid_ones(spec, needle):
    with pytest.raises(SpecError) as e:
        PolicySet.from_spec(spec)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_config_file_options_are_checked_like_the_specs():
    assert PolicySet.from_spec("cvar", {"release": {"kv_fill": 0.7}}).release.kv_fill == 0.7
    with pytest.raises(SpecError, match=r"kv_fill=1\.5 out of range"):
        PolicySet.from_spec("cvar", {"release": {"kv_fill": 1.5}})
    with pytest.raises(SpecError, match=r"unknown option .kv_gate."):
        PolicySet.from_spec("cvar", {"release": {"kv_gate": "x"}})


def test_aliases_are_named_configurations():
    assert ALIASES["cvar-fixed"] == ("cvar", {"budget": "fixed", "gate": "fixed"})
    rel = PolicySet.from_spec("cvar-fixed").release
    assert (rel.budget_mode, rel.gate_mode) == ("fixed", "fixed")
    assert "cvar-fixed" in configurations(_BY_KIND)["release"]
    assert parse("cvar-fixed", _BY_KIND).canonical() == "cvar:budget=fixed,gate=fixed"
    assert PolicySet.from_spec("composite-noshadow").routing.shadow == 0.0


def test_canonical_round_trips_and_resolved_lists_every_option():
    for spec in ("auto", "cvar:kv_fill=0.6,budget=none+ttl:max_ttl_s=30+least-loaded",
                 "plas:starvation_s=5", "cvar-fixed+composite-noshadow"):
        canon = parse(spec, _BY_KIND).canonical()
        assert parse(canon, _BY_KIND).canonical() == canon
        assert resolve(canon).resolved({}) == resolve(spec).resolved({})
        full = resolved_spec(spec)["policies"]
        assert set(full) == {"release", "routing", "admission", "retention"}
        again = resolved_spec(canon)["policies"]
        assert full == again
    full = resolved_spec("cvar:kv_fill=0.6")["policies"]["release"]
    assert full["name"] == "cvar" and full["options"]["kv_fill"] == 0.6
    assert full["options"]["alpha"] == 0.95  # a default, included


def test_every_registered_policy_declares_typed_ranged_options():
    for kind, names in configurations(_BY_KIND).items():
        for name in names:
            for o in options_of(kind, name):
                assert isinstance(o, Option) and o.kind in (bool, int, float, str)
                o.check(o.default)  # every default lies in its own range
                if o.kind is str:
                    assert o.choices, (name, o.name)
                if o.kind in (int, float):
                    assert o.lo <= o.hi and not math.isnan(o.lo)
    assert registry_of("release") is RELEASE


def test_auto_declares_the_cvar_options_it_honours_and_not_the_budget():
    keys = {o.name for o in options_of("release", "auto")}
    assert {"kv_fill", "gate", "hold_frac", "evidence_gate"} <= keys
    assert not keys & {"budget", "budget_per_engine", "target_wait_s", "hold_limit_s"}


def test_main_values_start_with_the_default_and_lie_in_range():
    opts = {o.name: o for o in options_of("release", "cvar")}
    assert opts["budget"].main == ("adaptive", "fixed", "none")
    assert opts["kv_fill"].main[0] == 0.5 and 0.8 in opts["kv_fill"].main
    for kind, names in configurations(_BY_KIND).items():
        for name in names:
            for o in options_of(kind, name):
                assert o.main and o.main[0] == o.default
                for v in o.main:
                    o.check(v)
