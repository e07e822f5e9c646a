"""Contract: every registered routing, admission and retention policy keeps the core invariants.

Each combination drives a small multi-workflow run (chains and a DAG, tools of several kinds,
an open gateway-style session, an engine that goes down and comes back) through a fake driver
whose engines admit queued turns by the policy's priority, two at a time.
"""

from __future__ import annotations

import heapq
import inspect
import itertools
import math
import random
import typing

import pytest

from turnstile.core import (
    AdmissionPolicy,
    Release,
    ReleasePolicy,
    Retain,
    RetentionPolicy,
    RoutingPolicy,
    Scheduler,
    TurnState,
)
from turnstile.core.state import EngineLoad, TurnRecord
from turnstile.policies import ADMISSION, RELEASE, RETENTION, ROUTING, PolicySet
from turnstile.workload import ToolCall, Turn, Workflow

TOOLS = (("Bash", 0.5), ("Read", 0.05), ("Build", 20.0), ("Train", 300.0))
ACTIONS = {"lru", "pin", "offload", "discard"}
SLOTS = 2  # turns an engine runs at once


def workload(seed: int) -> list[Workflow]:
    rng = random.Random(seed)
    out = []
    for w in range(8):
        n = rng.randint(1, 4)
        turns, context = [], 0
        for i in range(n):
            name, scale = TOOLS[rng.randrange(len(TOOLS))]
            tools = (ToolCall(name, scale * rng.uniform(0.5, 1.5), "ok"),) if i < n - 1 else ()
            inp, out_tokens = rng.choice((50, 800, 6_000)), rng.randint(1, 300)
            turns.append(Turn(input_tokens=inp, output_tokens=out_tokens,
                              context_tokens=context, tools=tools))
            context += inp + out_tokens
        out.append(Workflow(f"w{w}", rng.uniform(0.0, 5.0), tuple(turns)))
    dag = (
        Turn(input_tokens=100, output_tokens=5, tools=(ToolCall("Bash", 0.3),)),
        Turn(input_tokens=100, output_tokens=5, parents=()),
        Turn(input_tokens=100, output_tokens=5, parents=(0, 1)),
    )
    out.append(Workflow("dag", 1.0, dag))
    return out


class FakeCluster:
    """Virtual-time driver: engines admit by (priority, release order), ``SLOTS`` at a time."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.queues: dict[str, list[tuple[float, int, TurnRecord]]] = {e: [] for e in sched.view}
        self.running: dict[str, int] = dict.fromkeys(sched.view, 0)
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.down: set[str] = set()
        self.tick_at: float | None = None  # the pending policy timer, if any

    def at(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def apply(self, now: float, actions: list) -> None:
        for a in actions:
            if isinstance(a, Release):
                assert a.engine in self.sched.view and a.engine not in self.down
                assert isinstance(a.priority, float | int) and math.isfinite(a.priority)
                heapq.heappush(self.queues[a.engine], (a.priority, next(self.seq), a.turn))
            else:
                assert isinstance(a, Retain)
                assert a.decision.action in ACTIONS
                assert math.isfinite(a.decision.ttl_s) and a.decision.ttl_s >= 0.0
                rec = a.turn
                if rec.turn.tools:
                    self.at(now + rec.turn.tool_duration_s, "tool", rec)
        for engine, q in self.queues.items():
            while q and self.running[engine] < SLOTS:
                _, _, rec = heapq.heappop(q)
                self.running[engine] += 1
                self.sched.turn_started(now, rec.workflow_id, rec.index)
                work = rec.prompt_tokens + rec.turn.output_tokens
                self.at(now + 0.01 + work / 20_000, "finish", rec)

    def run(self, workflows: list[Workflow]) -> None:
        for wf in workflows:
            self.at(wf.arrival_s, "arrive", wf)
        self.at(0.5, "open", "sess")
        self.at(2.0, "health", ("e1", False))
        self.at(6.0, "health", ("e1", True))
        steps = 0
        while self.events:
            steps += 1
            assert steps < 10_000, "driver did not converge"
            now, _, kind, payload = heapq.heappop(self.events)
            s = self.sched
            if kind == "arrive":
                assert isinstance(payload, Workflow)
                self.apply(now, s.workflow_arrived(now, payload))
            elif kind == "finish":
                assert isinstance(payload, TurnRecord)
                self.running[payload.engine] -= 1  # type: ignore[index]
                self.apply(now, s.turn_finished(now, payload.workflow_id, payload.index))
                if payload.workflow.source is None:  # the open session's client runs a tool
                    self.at(now + 1.0, "next", payload)
            elif kind == "tool":
                assert isinstance(payload, TurnRecord)
                self.apply(now, s.tool_finished(now, payload.workflow_id, payload.index))
            elif kind == "health":
                engine, healthy = payload  # type: ignore[misc]
                (self.down.discard if healthy else self.down.add)(engine)
                self.apply(now, s.engine_stats(now, engine, healthy=healthy))
            elif kind == "open":
                s.open_session(now, "sess")
                self.at(now, "next", None)
            elif kind == "next":
                done = 0 if payload is None else len(s.workflows["sess"].turns)
                if done < 3:
                    turn = Turn(input_tokens=200, output_tokens=20, context_tokens=220 * done)
                    _, actions = s.turn_ready(now, "sess", turn)
                    self.apply(now, actions)
                else:
                    self.apply(now, s.close_session(now, "sess"))
            elif kind == "tick":
                self.tick_at = None
                self.apply(now, s.tick(now))
            wake = s.next_wakeup(now)
            if s.held_turns and wake is not None:
                wake = max(wake, now + 1e-3)
                if self.tick_at is None or wake < self.tick_at:
                    self.tick_at = wake
                    self.at(wake, "tick", None)


COMBOS = [
    (r, a, x)
    for r in ROUTING.names()
    for a in ADMISSION.names()
    for x in RETENTION.names()
]


def run_and_check(ps: PolicySet, seed: int) -> None:
    done: list[str] = []
    engines = [EngineLoad("e0"), EngineLoad("e1"), EngineLoad("e2", weight=2.0)]
    sched = Scheduler(ps, engines, on_workflow_done=lambda wf: done.append(wf.id))
    wfs = workload(seed)
    FakeCluster(sched).run(wfs)

    assert sorted(done) == sorted([w.id for w in wfs] + ["sess"])
    for wf in sched.workflows.values():
        assert wf.done and all(t.state == TurnState.DONE for t in wf.turns)
    view = sched.view
    assert view.released_turns == 0 and view.released_tokens == 0 and view.ready_turns == 0
    for e in view.values():
        assert e.outstanding_turns == 0 and e.outstanding_tokens == 0
        assert e.paused_context_tokens == 0 and not e.cached_sessions
    assert sched.active_workflows == 0 and sched.held_turns == 0
    assert len(sched.workflows["sess"].turns) == 3


@pytest.mark.parametrize(("routing", "admission", "retention"), COMBOS)
@pytest.mark.parametrize("seed", [0, 1])
def test_every_policy_keeps_the_core_invariants(routing, admission, retention, seed):
    ps = PolicySet(
        release=RELEASE.create("eager"),
        routing=ROUTING.create(routing),
        admission=ADMISSION.create(admission),
        retention=RETENTION.create(retention),
    )
    run_and_check(ps, seed)


@pytest.mark.parametrize("release", RELEASE.names())
@pytest.mark.parametrize("retention", RETENTION.names())
def test_retention_bound_to_every_release_policy(release, retention):
    """Retention policies that bind to the release policy (budget-keep) work with each one."""
    ps = PolicySet(
        release=RELEASE.create(release),
        routing=ROUTING.create("composite"),
        admission=ADMISSION.create("tiered-aging"),
        retention=RETENTION.create(retention),
    )
    if retention == "budget-keep":
        assert ps.retention.release is ps.release
    run_and_check(ps, 0)


_INTERFACES = {"release": ReleasePolicy, "routing": RoutingPolicy,
               "admission": AdmissionPolicy, "retention": RetentionPolicy}
_REGISTRIES = {"release": RELEASE, "routing": ROUTING, "admission": ADMISSION,
               "retention": RETENTION}


@pytest.mark.parametrize("kind", sorted(_INTERFACES))
def test_every_registered_policy_implements_every_declared_hook(kind):
    """The core calls each declared hook on every policy of its kind, so each must have all."""
    interface = _INTERFACES[kind]
    hooks = [n for n in vars(interface) if not n.startswith("_") and callable(vars(interface)[n])]
    assert hooks, interface
    for name in _REGISTRIES[kind].names():
        policy = _REGISTRIES[kind].create(name)
        assert isinstance(policy, interface), name
        for hook in hooks:
            assert callable(getattr(policy, hook, None)), f"{kind} policy {name!r} lacks {hook}"


def _hook_signature_problems(interface: type, policy: object) -> list[str]:
    """How ``policy``'s hooks differ from ``interface``'s: the same parameters (names, kinds,
    order) and the same resolved parameter and return types; extra parameters need defaults."""
    problems = []
    for hook, declared in vars(interface).items():
        if hook.startswith("_") or not callable(declared) or hook == "__len__":
            continue
        impl = getattr(type(policy), hook)
        want = list(inspect.signature(declared).parameters.values())
        got = list(inspect.signature(impl).parameters.values())
        extra = got[len(want):]
        shape = [(p.name, p.kind) for p in got[: len(want)]]
        if shape != [(p.name, p.kind) for p in want] or any(
            p.default is inspect.Parameter.empty for p in extra
        ):
            problems.append(f"{hook}{inspect.signature(impl)} != {inspect.signature(declared)}")
            continue
        want_types = typing.get_type_hints(declared)
        got_types = typing.get_type_hints(impl)
        for arg, t in want_types.items():
            if got_types.get(arg) != t:
                problems.append(f"{hook}: {arg} is {got_types.get(arg)}, declared {t}")
    return problems


@pytest.mark.parametrize("kind", sorted(_INTERFACES))
def test_every_registered_policy_matches_the_declared_signatures(kind):
    """Each hook takes the declared parameters with the declared types (what mypy checks on the
    registrations, checked here on the objects the registries build)."""
    interface = _INTERFACES[kind]
    for name in _REGISTRIES[kind].names():
        policy = _REGISTRIES[kind].create(name)
        assert _hook_signature_problems(interface, policy) == [], f"{kind} policy {name!r}"
        assert type(policy).name == name


def test_the_signature_check_catches_a_mismatch():
    class Bad:
        name = "bad"

        def priority(self, turn: TurnRecord, now: float) -> float:  # engine missing
            return 0.0

    class BadType:
        name = "bad"

        def priority(self, turn: TurnRecord, engine: EngineLoad, now: float) -> int:
            return 0

    assert _hook_signature_problems(AdmissionPolicy, Bad())
    assert _hook_signature_problems(AdmissionPolicy, BadType())


@pytest.mark.parametrize("release", RELEASE.names())
def test_a_release_policy_orders_admission_only_when_it_declares_so(release):
    rel = RELEASE.create(release)
    declared = rel.admission_order()
    ps = PolicySet.from_spec(release)
    if declared is None:
        assert ps.admission.name == "fcfs"  # the default
    else:
        assert isinstance(declared, AdmissionPolicy)
        assert type(ps.admission) is type(declared)
    # a spec that names an admission policy always gets it
    assert PolicySet.from_spec(f"{release}+tiered-aging").admission.name == "tiered-aging"


def test_from_spec_is_the_one_builder():
    """Parameters per kind (a gateway's [policy.*] tables) and a prebuilt router (a rollout
    ablation) go through the same ``PolicySet.from_spec``."""
    ps = PolicySet.from_spec("plas", {"release": {"max_inflight_per_engine": 3}})
    assert ps.release.max_inflight_per_engine == 3  # type: ignore[attr-defined]
    assert ps.admission is ps.release  # PLAS still orders its own engine queues
    ps = PolicySet.from_spec("plas", {"admission": {}})
    assert ps.admission.name == "fcfs"  # admission parameters: the admission policy itself
    router = ROUTING.create("least-loaded")
    ps = PolicySet.from_spec("eager+least-loaded", router=router)
    assert ps.routing is router and ps.spec == "eager+least-loaded"
    with pytest.raises(ValueError, match="unknown option 'nope'; valid keys: balance"):
        PolicySet.from_spec("eager", {"routing": {"nope": 1}})
    with pytest.raises(ValueError, match="unknown policy kind 'planner'"):
        PolicySet.from_spec("eager", {"planner": {}})
