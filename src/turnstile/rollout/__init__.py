"""The agentic RL rollout manager: rollout workloads, rollout batches on the shared simulator
(bucket routing by the core's ``cmlfq`` / ``least-open`` / ``length-predict`` policies), the
rollout/training planner with an elastic GPU pool, and a live driver for real llama.cpp engines
behind the gateway. ``turnstile rollout sim|live`` is :mod:`turnstile.rollout.cli`.
"""

from turnstile.rollout.planner import (
    Plan,
    Planner,
    PlannerConfig,
    RLLoop,
    RLResult,
    StepRecord,
    accept_plan,
    best_static,
    candidate_mixes,
)
from turnstile.rollout.sim import (
    BatchResult,
    Bucket,
    RolloutCluster,
    SimConfig,
    format_mix,
    parse_mix,
    simulate_batch,
)
from turnstile.rollout.training import ParallelConfig, TrainModel
from turnstile.rollout.workload import (
    RolloutSpec,
    RolloutTrajectory,
    RolloutWorkload,
    drifted_spec,
    training_tokens,
)

__all__ = [
    "BatchResult",
    "Bucket",
    "ParallelConfig",
    "Plan",
    "Planner",
    "PlannerConfig",
    "RLLoop",
    "RLResult",
    "RolloutCluster",
    "RolloutSpec",
    "RolloutTrajectory",
    "RolloutWorkload",
    "SimConfig",
    "StepRecord",
    "TrainModel",
    "accept_plan",
    "best_static",
    "candidate_mixes",
    "drifted_spec",
    "format_mix",
    "parse_mix",
    "simulate_batch",
    "training_tokens",
]
