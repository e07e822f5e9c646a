"""A minimal driver for the rollout routers: trajectories through the real scheduler core,
turn by turn, recording the engine each turn was released to."""

from __future__ import annotations

from collections.abc import Sequence

from turnstile.core import Release, Scheduler
from turnstile.core.state import EngineLoad
from turnstile.policies import ADMISSION, RELEASE, RETENTION, PolicySet, RoutingPolicy
from turnstile.workload import ToolCall, Turn, Workflow
from turnstile.workload.model import ToolStatus


def two_level() -> list[EngineLoad]:
    """Two TP1 engines (level 0) and one TP4 engine (level 1)."""
    return [
        EngineLoad("a0", 100_000, tp=1, tpot_s=0.02, prefill_s_per_token=1e-5),
        EngineLoad("a1", 100_000, tp=1, tpot_s=0.02, prefill_s_per_token=1e-5),
        EngineLoad("b0", 400_000, tp=4, tpot_s=0.005, prefill_s_per_token=3e-6),
    ]


def trajectory(wf_id: str, outputs: Sequence[int], codes: Sequence[tuple[str, ToolStatus]] = (),
               *, prompt: str = "p", step: int = 1, result_tokens: int = 10) -> Workflow:
    """Turns of ``outputs`` tokens; after turn i the tool ``codes[i]`` (name, status) runs."""
    turns, context = [], 0
    for i, out in enumerate(outputs):
        tools = ()
        if i < len(codes):
            name, status = codes[i]
            tools = (ToolCall(name, 0.1, status, result_tokens),)
        turns.append(Turn(input_tokens=100 if i == 0 else 20, output_tokens=out,
                          context_tokens=context, tools=tools))
        context += (100 if i == 0 else 20) + out
    return Workflow(wf_id, 0.0, tuple(turns), meta={"prompt": prompt, "step": str(step)})


class Driver:
    """Releases turns through the core; finishes them when told (no engine model)."""

    def __init__(self, routing: RoutingPolicy, engines: list[EngineLoad] | None = None) -> None:
        self.routing = routing
        policies = PolicySet(release=RELEASE.create("eager"), routing=routing,
                             admission=ADMISSION.create("fcfs"),
                             retention=RETENTION.create("lru"))
        self.sched = Scheduler(policies, engines or two_level())
        self.now = 0.0
        #: workflow id → engine of each released turn, in order
        self.path: dict[str, list[str]] = {}

    def _record(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, Release):
                self.path.setdefault(a.turn.workflow.id, []).append(a.engine)

    def start(self, wf: Workflow) -> str:
        self._record(self.sched.workflow_arrived(self.now, wf))
        return self.path[wf.id][-1]

    def step(self, wf: Workflow) -> str | None:
        """Finish the trajectory's running turn (and its tool); the next turn's engine."""
        rec = self.sched.workflows[wf.id].turns[len(self.path[wf.id]) - 1]
        self.now += 1.0
        self._record(self.sched.turn_finished(self.now, wf.id, rec.index))
        if rec.turn.tools:
            self.now += 0.1
            self._record(self.sched.tool_finished(self.now, wf.id, rec.index))
        done = len(self.path[wf.id]) == rec.index + 1
        return None if done else self.path[wf.id][-1]

    def run(self, wf: Workflow) -> list[str]:
        self.start(wf)
        while self.step(wf) is not None:
            pass
        return self.path[wf.id]
