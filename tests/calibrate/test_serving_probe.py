"""The serving probe on engines that report per-request times only as Prometheus histograms
(vLLM): the histograms read from ``/metrics`` before and after the probe cell, and the time per
turn outside the engine's queue, prefill and decode. No engine runs: the ``/metrics`` texts are
written in vLLM 0.32's format (its names, labels, buckets and ``_created`` samples)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from turnstile.calibrate import ab_engines, ab_real, serving_probe
from turnstile.calibrate.ab_engines import VLLM_REQUEST_TIMES, request_times_from_metrics
from turnstile.calibrate.serving_probe import (
    RequestTimes,
    prefill_alone_s,
    serving_terms_from_totals,
)
from turnstile.core.state import TurnRecord, WorkflowRecord
from turnstile.sim.fitted_perf import FittedPerf
from turnstile.workload.model import Turn

#: a real engine's /metrics, trimmed to the histograms read and two counters
RECORDED = Path(__file__).parents[1] / "fixtures" / "vllm" / "metrics_0.32.txt"
LABELS = 'engine="0",model_name="tiny"'
BUCKETS = (0.3, 0.5, 1.0, 2.5, 5.0, 10.0)


def histogram(name: str, values: list[float]) -> str:
    """One vLLM request-time histogram in Prometheus text, as prometheus_client renders it."""
    lines = [f"# HELP {name} Histogram of a request time.", f"# TYPE {name} histogram"]
    for le in BUCKETS:
        lines.append(f'{name}_bucket{{{LABELS},le="{le}"}} {sum(v <= le for v in values)}.0')
    lines += [f'{name}_bucket{{{LABELS},le="+Inf"}} {len(values)}.0',
              f"{name}_count{{{LABELS}}} {len(values)}.0",
              f"{name}_sum{{{LABELS}}} {sum(values)!r}",
              f"# HELP {name}_created Histogram of a request time.",
              f"# TYPE {name}_created gauge",
              f"{name}_created{{{LABELS}}} 1.7651e+09"]
    return "\n".join(lines) + "\n"


def vllm_metrics(requests: list[tuple[float, float, float, float]]) -> str:
    """``/metrics`` of one vLLM engine that finished ``requests`` (queue, prefill, decode, and
    the server front's own time on top of the three), with the counters around them."""
    q, p, d, front = (list(x) for x in zip(*requests, strict=True)) if requests else ([],) * 4
    e2e = [a + b + c + f for a, b, c, f in zip(q, p, d, front, strict=True)]
    text = ("# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{LABELS}}} 0.0\n"
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries.\n"
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            f"vllm:prefix_cache_queries_total{{{LABELS}}} 1000.0\n")
    for key, values in (("e2e_s", e2e), ("queue_s", q), ("prefill_s", p), ("decode_s", d)):
        text += histogram(VLLM_REQUEST_TIMES[key], values)
    return text


def test_recorded_vllm_metrics_give_request_times_that_add_up() -> None:
    """vLLM 0.32's own text (three requests): the names exist, one count, and the engine core's
    queue + prefill + decode fit inside the server front's end-to-end time."""
    got = request_times_from_metrics("vllm", RECORDED.read_text())
    assert got is not None and got.requests == 3
    assert 0 < got.engine_s <= got.e2e_s
    assert min(got.queue_s, got.prefill_s, got.decode_s) >= 0


def test_vllm_request_times_are_the_histograms_sums_and_one_count() -> None:
    got = request_times_from_metrics("vllm", vllm_metrics([(0.5, 0.25, 1.0, 0.25),
                                                           (0.0, 0.5, 2.0, 0.5)]))
    assert got == RequestTimes(requests=2, queue_s=0.5, prefill_s=0.75, decode_s=3.0,
                               e2e_s=0.5 + 0.75 + 3.0 + 0.75)
    assert got is not None and got.engine_s == pytest.approx(4.25)
    # nothing finished yet: all zero, not missing
    assert request_times_from_metrics("vllm", vllm_metrics([])) == RequestTimes()
    # llama.cpp's replies carry their own timings: no histograms are read
    assert request_times_from_metrics("llamacpp", "") is None
    # an engine without the histograms (another vLLM version) is an error, not zero seconds
    no_queue = vllm_metrics([(0.1, 0.1, 0.1, 0.1)]).replace("request_queue_time", "queue_time")
    with pytest.raises(ValueError, match="vllm:request_queue_time_seconds"):
        request_times_from_metrics("vllm", no_queue)


def _cell(turns: list[tuple[float, float, int, int]]) -> SimpleNamespace:
    """A served cell: (released, finished, prompt tokens, of them cached) per turn, one
    session; a turn the client never got an answer for is left unfinished."""
    wf = WorkflowRecord("s", 0.0, "default", None)
    usage = {}
    for i, (rel, fin, prompt, cached) in enumerate(turns):
        rec = TurnRecord(wf, i, Turn(input_tokens=prompt, output_tokens=8))
        rec.released_s, rec.finished_s = rel, fin
        wf.turns.append(rec)
        if fin >= 0:
            usage[("s", i)] = (prompt, cached)
    return SimpleNamespace(records=[wf], engine_timings={}, turn_usage=usage)


def test_overhead_is_the_clients_turn_time_beyond_the_engines_queue_prefill_and_decode() -> None:
    perf = FittedPerf(0.0, 1e-3, engine="test")  # 1 ms per prefill token, nothing else
    # the client saw 1.0, 2.0 and 3.0 s from release to reply; the third turn never answered
    cell = _cell([(0.0, 1.0, 100, 0), (2.0, 4.0, 300, 100), (5.0, 8.0, 500, 400),
                  (9.0, -1.0, 600, 0)])
    # two engines' histograms over the cell: 3 requests, 1.2 s of queue+prefill+decode each
    times = (RequestTimes(2, 0.4, 0.6, 1.4, 3.0) + RequestTimes(1, 0.1, 0.3, 0.8, 1.5))
    terms, info = serving_terms_from_totals(cell, times, perf)
    assert terms.turn_overhead_s == pytest.approx(2.0 - 1.2)
    assert terms.engine_slowdown == 1.0  # not measurable from sums (batching): kept at 1
    assert info["turns"] == 3 and info["engine_requests"] == 3
    assert info["engine_front_mean_s"] == pytest.approx((4.5 - 3.6) / 3)
    assert info["outside_engine_server_mean_s"] == pytest.approx(2.0 - 1.5)
    # the front's share and the rest add up to the overhead
    assert (info["engine_front_mean_s"] + info["outside_engine_server_mean_s"]
            == pytest.approx(terms.turn_overhead_s))
    # summed prefill seconds against the uncached tokens computed alone: 0.9 s vs 0.4 s
    # (100 + 200 + 100 tokens at 1 ms), an upper bound on the slowdown, reported only
    assert info["prefill_vs_alone"] == pytest.approx(0.9 / 0.4)
    # engines slower than the client saw (clocks apart, other requests): never negative
    slow = serving_terms_from_totals(cell, RequestTimes(3, 3.0, 3.0, 3.0, 9.5), perf)[0]
    assert slow.turn_overhead_s == 0.0


def test_probe_refuses_an_empty_measurement() -> None:
    perf = FittedPerf(0.0, 1e-3, engine="test")
    with pytest.raises(RuntimeError, match="no answered turns"):
        serving_terms_from_totals(_cell([(0.0, -1.0, 10, 0)]), RequestTimes(1, 0, 0, 0, 0), perf)
    with pytest.raises(RuntimeError, match="counted no finished request"):
        serving_terms_from_totals(_cell([(0.0, 1.0, 10, 0)]), RequestTimes(), perf)


def test_prefill_alone_counts_uncached_tokens_over_the_cached_prefix() -> None:
    # attention over the cached prefix costs too: a model with only that term
    perf = FittedPerf(0.0, 0.0, 0.0, 0.0, 1e-6, engine="test")
    assert prefill_alone_s(perf, [(10, 10)]) == 0.0  # all cached: nothing computed
    longer_prefix = prefill_alone_s(perf, [(300, 200)])
    assert longer_prefix > prefill_alone_s(perf, [(100, 0)]) > 0


def test_measure_serving_reads_the_engines_metrics_around_the_probe_cell(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The vLLM path end to end without engines: ``/metrics`` of two engines before and after
    the probe cell (which the replay plays meanwhile), the difference of their sums used."""
    served = [(0.2, 0.3, 0.5, 0.1)] * 4  # 4 requests per engine in the cell
    pages = {"before": vllm_metrics(served[:1]), "after": vllm_metrics(served[:1] + served)}
    phase = {"now": "before"}
    gets: list[str] = []

    gateway = ("# TYPE turnstile_gateway_turn_seconds histogram\n"
               "turnstile_gateway_turn_seconds_count 8.0\nturnstile_gateway_turn_seconds_sum 12.0\n"
               "# TYPE turnstile_gateway_hold_seconds histogram\n"
               "turnstile_gateway_hold_seconds_count 8.0\nturnstile_gateway_hold_seconds_sum 2.0\n")

    def fake_get(url: str, timeout: float = 0.0) -> bytes:
        gets.append(url)
        return (gateway if url.startswith("http://gw") else pages[phase["now"]]).encode()

    cell = _cell([(0.0, 1.5, 50, 0)] * 8)

    async def fake_agent(self: object, wf: object) -> None:
        phase["now"] = "after"

    monkeypatch.setattr(ab_engines, "http_get", fake_get)
    monkeypatch.setattr(serving_probe, "http_get", fake_get)
    monkeypatch.setattr(ab_real, "Replayer", lambda *a: SimpleNamespace(
        agent=lambda wf: fake_agent(None, wf), records=cell.records, engine_timings={},
        turn_usage=cell.turn_usage))
    run = SimpleNamespace(engine="vllm", request_timeout_s=5.0, probe_seed=1000,
                          max_tokens=8, engines=SimpleNamespace(ctx=1600, n_parallel=1))
    wfs = [SimpleNamespace(id="s")]
    terms, info = ab_real.measure_serving("http://gw", wfs, run, 3.5,  # type: ignore[arg-type]
                                          FittedPerf(0.0, 1e-4, engine="test"),
                                          ["http://e0", "http://e1"])
    assert gets == ["http://e0/metrics", "http://e1/metrics"] * 2 + ["http://gw/metrics"]
    assert info["engine_requests"] == 8  # the cell's, not the engines' lifetime's
    assert terms.turn_overhead_s == pytest.approx(1.5 - 1.0)
    assert info["engine_front_mean_s"] == pytest.approx(0.1)
    # the gateway saw each turn running 1.25 s (turn 1.5 less hold 0.25 on average): 0.25 s
    # beyond the engines' 1.0, and 0.25 s of the client's 1.5 outside its window
    assert info["gateway_running_outside_engine_s"] == pytest.approx(0.25)
    assert info["outside_gateway_mean_s"] == pytest.approx(0.25)
    assert "engine front 0.100 s" in serving_probe.describe_probe(info)


def test_slowdown_is_where_the_simulated_cells_line_meets_the_engines_time() -> None:
    """Engines 1.3x the profile; the simulated cell's engine time grows with the slowdown but
    jitters (events reorder): the line through the grid finds the measured time's slowdown."""
    jitter = iter([0.01, -0.01, 0.012, -0.008, 0.0, 0.005])

    def simulate(s: float) -> float:
        return 0.1 + 0.4 * s + next(jitter)

    slowdown, tried = serving_probe.slowdown_by_simulation(0.1 + 0.4 * 1.3, simulate)
    assert slowdown == pytest.approx(1.3, abs=0.05)
    assert [g for g, _ in tried] == [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]
    # faster than the profile: below 1, within the bounds
    assert serving_probe.slowdown_by_simulation(0.3, lambda s: 0.4 * s)[0] == pytest.approx(0.75)
    assert serving_probe.slowdown_by_simulation(9.0, lambda s: 0.4 * s)[0] == 3.0
    with pytest.raises(ValueError):
        serving_probe.slowdown_by_simulation(0.0, simulate)
    with pytest.raises(RuntimeError, match="does not grow"):
        serving_probe.slowdown_by_simulation(0.5, lambda s: 0.4)
