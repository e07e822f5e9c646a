"""The A/B's serving probe on real vLLM engines (the CPU build; ``vllm_engines`` in conftest.py):
a few sessions served through the gateway, the engines' per-request histograms read from their
``/metrics`` before and after, the time per turn outside the engines measured.

Skipped only where vLLM is not installed and ``CI`` is unset (``make vllm`` installs it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from turnstile.calibrate.ab import build_sessions, cell_workload
from turnstile.calibrate.ab_engines import chars_per_token
from turnstile.calibrate.ab_real import measure_serving
from turnstile.calibrate.fidelity import TraceScale
from turnstile.gateway.adapters import make_adapter
from turnstile.gateway.embedded import start_gateway
from turnstile.sim.fitted_perf import FittedPerf

from .conftest import VllmEngines

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_probe_measures_the_time_outside_vllms_queue_prefill_and_decode(
        vllm_engines: VllmEngines) -> None:
    servers = vllm_engines.servers
    urls = [s.base_url for s in servers]
    gw = start_gateway([make_adapter(u, "vllm", engine_id=f"vllm-{i}")
                        for i, u in enumerate(urls)], policy="cvar")
    try:
        scale = TraceScale(token_div=32.0, output_div=8.0, max_output=8, tool_div=40.0,
                           max_tool_s=0.2, max_context=500, max_turns=4)
        wfs = cell_workload(build_sessions([], 0, 4, scale, seed=0), 4.0, 0)
        run = SimpleNamespace(engine="vllm", request_timeout_s=120.0, probe_seed=1000,
                              max_tokens=8, engines=SimpleNamespace(ctx=2048, n_parallel=1))
        perf = FittedPerf(1e-3, 1e-5, engine="test")
        terms, info = measure_serving(gw.url, wfs, run, chars_per_token(urls[0]),  # type: ignore[arg-type]
                                      perf, urls)
    finally:
        gw.stop()
    turns = sum(len(w.turns) for w in wfs)
    # every turn the client saw answered is one request the engines finished in the window
    assert info["turns"] == info["engine_requests"] == turns
    assert info["engine_prefill_mean_s"] > 0 and info["engine_decode_mean_s"] > 0
    # the engines' own view of a request (its API server included) lies inside the client's
    assert 0 < info["engine_e2e_mean_s"] < info["client_mean_s"]
    assert info["engine_front_mean_s"] >= 0
    assert terms.turn_overhead_s == pytest.approx(
        info["client_mean_s"] - info["engine_queue_mean_s"] - info["engine_prefill_mean_s"]
        - info["engine_decode_mean_s"])
    assert terms.turn_overhead_s > 0 and terms.engine_slowdown == 1.0
    assert info["gateway_running_mean_s"] is not None
    assert info["gateway_running_mean_s"] <= info["client_mean_s"]
