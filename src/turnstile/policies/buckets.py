"""Rollout routers over tensor-parallel buckets: the load-balance control and the
length-prediction baseline (C-MLFQ is in :mod:`turnstile.policies.cmlfq`).

* ``least-open``: least connections — the engine with the fewest open trajectories (turns
  released there plus sessions paused in a tool call with their KV there: Libra's load),
  per engine or per GPU; sticky per trajectory (cache affinity) unless ``sticky=False``.
* ``length-predict``: an online ridge predictor of a trajectory's total output tokens routes
  its first turn to the level whose GPU share matches the prediction; sticky afterwards.
"""

from __future__ import annotations

from typing import ClassVar

from turnstile.core.state import ClusterView, TurnRecord, WorkflowRecord
from turnstile.policies.base import ROUTING
from turnstile.policies.estimators import LevelBounds, RidgePredictor, StagedUpdates
from turnstile.policies.routing import StatelessRouting
from turnstile.policies.trajectory import Levels, TrajectoryTracker, home_engine, least_open

__all__ = ["LeastOpenRouting", "LengthPredictRouting"]


@ROUTING.register("least-open")
class LeastOpenRouting(StatelessRouting):
    """Least open trajectories (tool time included), sticky to the engine holding the KV.

    ``weighted``: compare open trajectories per GPU (``False``, the default: per engine, as
    Libra's load-balance control does); ``cap``: skip engines holding ``cap`` open
    trajectories while another has room.
    """

    name: ClassVar[str] = "least-open"

    def __init__(self, *, sticky: bool = True, weighted: bool = False,
                 cap: int | None = None) -> None:
        self.sticky = sticky
        self.weighted = weighted
        self.cap = cap

    def route(self, turn: TurnRecord, view: ClusterView, now: float) -> str:
        if self.sticky:
            home = home_engine(turn, view)
            if home is not None:
                return home.id
        return least_open(view.healthy(), self.weighted, self.cap).id


@ROUTING.register("length-predict")
class LengthPredictRouting:
    """Route a trajectory once, by predicted total length (learned online), then stay.

    Before the predictor has data: least open per GPU. With a prediction, the level whose share
    of the predicted token mass matches it (bounds split the recent *predictions* at the levels'
    GPU shares: predictions shrink towards the mean, so bounds from true lengths would send
    almost everything to level 0); least open inside the level. When that level holds more than
    ``max_imbalance`` × the pool's open trajectories per GPU it balances instead. Observations
    of a step apply from the next step (``same_step=False``: no censoring bias).
    """

    name: ClassVar[str] = "length-predict"

    def __init__(self, *, max_imbalance: float = 1.1, same_step: bool = False) -> None:
        self.max_imbalance = max_imbalance
        self.predictor = RidgePredictor()
        self.bounds = LevelBounds(min_obs=16)
        self._staged = StagedUpdates(same_step)
        self._tracker = TrajectoryTracker()

    def route(self, turn: TurnRecord, view: ClusterView, now: float) -> str:
        home = home_engine(turn, view)
        if home is not None:
            return home.id
        tr = self._tracker.observe(turn)
        self._staged.flush(tr.step)
        engines = view.healthy()
        pred = self.predictor.predict(tr.prompt_id, tr.prompt_tokens, tr.hint)
        if pred is None:
            return least_open(engines, weighted=True).id
        self.bounds.observe(pred)
        levels = Levels(view)
        e = least_open(levels.nearest(self.bounds.level(pred, levels.gpus)), weighted=True)
        avg = sum(x.open_sessions for x in engines) / max(1, sum(x.tp for x in engines))
        if e.open_sessions / e.tp > self.max_imbalance * avg + 1:
            e = least_open(engines, weighted=True)  # the predicted level is full: balance
        return e.id

    def on_workflow_done(self, workflow: WorkflowRecord, now: float) -> None:
        tr = self._tracker.finish(workflow)
        total = tr.attained_output_tokens
        self._staged.add(tr.step, lambda: self.predictor.observe(
            tr.prompt_id, tr.prompt_tokens, tr.hint, total))
