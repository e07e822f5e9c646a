"""The agentic RL rollout manager: rollout workloads, bucket routing (C-MLFQ), a fast rollout
simulator, the rollout/training planner with an elastic GPU pool, and a live driver for real
llama.cpp engines. ``turnstile rollout sim|live`` is :mod:`turnstile.rollout.cli`.
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
from turnstile.rollout.routing import (
    ROLLOUT_ROUTING,
    CMLFQRouter,
    LengthPredictRouter,
    LevelBounds,
    LoadBalanceRouter,
    NoEngineError,
    PrefixTree,
    RolloutRouter,
    create_router,
)
from turnstile.rollout.sim import (
    BatchResult,
    Bucket,
    RolloutSim,
    SimConfig,
    format_mix,
    parse_mix,
    simulate_batch,
)
from turnstile.rollout.state import (
    BucketInfo,
    EngineInfo,
    PoolView,
    ToolResult,
    TrajectoryState,
    tool_key,
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
    "ROLLOUT_ROUTING",
    "BatchResult",
    "Bucket",
    "BucketInfo",
    "CMLFQRouter",
    "EngineInfo",
    "LengthPredictRouter",
    "LevelBounds",
    "LoadBalanceRouter",
    "NoEngineError",
    "ParallelConfig",
    "Plan",
    "Planner",
    "PlannerConfig",
    "PoolView",
    "PrefixTree",
    "RLLoop",
    "RLResult",
    "RolloutRouter",
    "RolloutSim",
    "RolloutSpec",
    "RolloutTrajectory",
    "RolloutWorkload",
    "SimConfig",
    "StepRecord",
    "ToolResult",
    "TrainModel",
    "TrajectoryState",
    "accept_plan",
    "best_static",
    "candidate_mixes",
    "create_router",
    "drifted_spec",
    "format_mix",
    "parse_mix",
    "simulate_batch",
    "tool_key",
    "training_tokens",
]
