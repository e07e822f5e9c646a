"""Run one request trace through Vidur 0.0.26 and time its simulation loop (prints JSON).

Runs in the throwaway Vidur venv, never in turnstile's::

    /tmp/vidur-venv/bin/python benchmarks/vidur/run_vidur.py TRACE.csv --cache /tmp/vidur-cache

``TRACE.csv`` is in the format of Vidur's ``trace_replay`` request generator (columns ``Date``,
``Time`` (arrival, s), ``PromptTokenCount``, ``CompletionTokenCount``); the scale factors are set
to 1 so Vidur sees exactly the tokens and times in the file. The profile comes from
``make_profile.py`` (synthetic roofline, written into the hub cache layout; the hub itself is
unreachable, so ``HF_HUB_OFFLINE=1``). Setup (profile load, random-forest training, prediction
tables) is timed apart from ``Simulator.run``; the output writing at the end of ``run`` is timed
apart too, so ``loop_s`` is the event loop alone. Nothing is patched inside the loop.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub is imported
os.environ.setdefault("WANDB_MODE", "disabled")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_profile

P = "random_forrest_execution_time_predictor_config"


def vidur_args(a: argparse.Namespace) -> list[str]:
    """The Vidur CLI flags (``python -m vidur.main`` takes the same)."""
    args = {
        "--seed": "42",
        "--log_level": "warning",
        "--replica_config_model_name": make_profile.MODEL,
        "--replica_config_device": make_profile.DEVICE,
        "--replica_config_network_device": make_profile.NETWORK_DEVICE,
        "--replica_config_num_pipeline_stages": "1",
        "--replica_config_tensor_parallel_size": "1",
        "--cluster_config_num_replicas": str(a.replicas),
        "--global_scheduler_config_type": "round_robin",
        "--replica_scheduler_config_type": "sarathi",
        "--sarathi_scheduler_config_batch_size_cap": str(a.batch_cap),
        "--sarathi_scheduler_config_chunk_size": str(a.chunk),
        "--request_generator_config_type": "trace_replay",
        "--trace_request_generator_config_trace_file": str(a.trace),
        "--trace_request_generator_config_date": a.date,
        "--trace_request_generator_config_prefill_scale_factor": "1",
        "--trace_request_generator_config_decode_scale_factor": "1",
        "--trace_request_generator_config_time_scale_factor": "1",
        "--trace_request_generator_config_max_tokens": str(a.max_tokens),
        "--execution_time_predictor_config_type": "random_forrest",
        f"--{P}_model_profiling_dataset": make_profile.COMPUTE_DATASET,
        f"--{P}_network_profiling_dataset": make_profile.NETWORK_DATASET,
        f"--{P}_cache_dir": str(a.cache),
        # the default grid covers 2M tokens per request (hours of prediction); 16k is plenty
        f"--{P}_prediction_max_tokens_per_request": "16384",
        f"--{P}_prediction_max_batch_size": str(a.batch_cap),
        f"--{P}_prediction_max_prefill_chunk_size": "4096",
        # a small grid: the fit only shapes the simulated clock, not the simulator's speed
        f"--{P}_num_estimators": "50",
        f"--{P}_max_depth": "16",
        f"--{P}_min_samples_split": "2",
        f"--{P}_k_fold_cv_splits": "3",
        "--metrics_config_output_dir": str(a.out),
    }
    flat = [x for kv in args.items() for x in kv]
    # Vidur's defaults write a Chrome trace from inside the loop and plot at the end: off
    flat += ["--no-metrics_config_enable_chrome_trace", "--no-metrics_config_store_plots"]
    if a.native:
        flat.append(f"--{P}_use_native_execution_time_predictor")
    if a.no_metrics:
        flat.append("--no-metrics_config_write_metrics")
    return flat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/vidur-cache"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/vidur-out"))
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--batch-cap", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--date", default="2023-11-16")
    ap.add_argument("--native", action="store_true",
                    help="use Vidur's C++ execution-time predictor")
    ap.add_argument("--no-metrics", action="store_true",
                    help="turn off Vidur's metrics store (its fastest, least useful setting)")
    ap.add_argument("--print-args", action="store_true",
                    help="print the equivalent `python -m vidur.main` flags and exit")
    a = ap.parse_args()
    flags = vidur_args(a)
    if a.print_args:
        print(" ".join(flags))
        return
    a.out.mkdir(parents=True, exist_ok=True)
    make_profile.write_profile(a.cache)

    t0 = time.perf_counter()
    from vidur.config import SimulationConfig
    from vidur.entities.batch import Batch
    from vidur.events.base_event import BaseEvent
    from vidur.simulator import Simulator
    from vidur.utils.random import set_seeds

    sys.argv = ["vidur", *flags]
    config = SimulationConfig.create_from_cli_args()
    set_seeds(config.seed)
    t1 = time.perf_counter()
    sim = Simulator(config)  # trains (or loads cached) predictors, reads the trace
    n_req = len(sim._event_queue)
    ev0, b0 = BaseEvent._id, Batch._id
    t2 = time.perf_counter()
    write = {"s": 0.0, "cpu_s": 0.0}
    orig = sim._write_output

    def timed_write() -> None:
        w0, c0 = time.perf_counter(), time.process_time()
        orig()
        write["s"] = time.perf_counter() - w0
        write["cpu_s"] = time.process_time() - c0

    sim._write_output = timed_write
    c2 = time.process_time()
    sim.run()
    t3 = time.perf_counter()
    run_s = t3 - t2
    loop_s = run_s - write["s"]
    loop_cpu_s = time.process_time() - c2 - write["cpu_s"]
    print(json.dumps({
        "simulator": "vidur",
        "version": importlib.metadata.version("vidur"),
        "native_predictor": a.native,
        "write_metrics": not a.no_metrics,
        "requests": n_req,
        "events": BaseEvent._id - ev0 + n_req,  # arrivals were created in __init__
        "batches": Batch._id - b0,
        "simulated_s": sim._time,
        "import_s": t1 - t0,
        "setup_s": t2 - t1,
        "run_s": run_s,
        "write_s": write["s"],
        "loop_s": loop_s,
        "loop_cpu_s": loop_cpu_s,
        "requests_per_s": n_req / loop_s,
        "batches_per_s": (Batch._id - b0) / loop_s,
        "flags": flags,
    }))


if __name__ == "__main__":
    main()
