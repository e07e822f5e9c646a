"""Prometheus metrics of one gateway (a registry per app, so tests can run several).

Counters and histograms are updated on the request path; gauges (queue lengths, held turns,
released work, per-engine load) are read from the scheduler when ``/metrics`` is scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from turnstile.core.clock import Clock
from turnstile.core.scheduler import Scheduler

__all__ = ["GatewayMetrics", "GatewayState"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0)
_FLOW_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


class GatewayState(Protocol):
    """What the gauges read from a gateway (the service satisfies it; no import of it here)."""

    @property
    def scheduler(self) -> Scheduler: ...

    @property
    def session_queued(self) -> int: ...

    @property
    def sessions(self) -> Sized: ...

    @property
    def engine_up(self) -> dict[str, bool]: ...

    @property
    def engine_config(self) -> dict[str, dict[str, str | None]]: ...

    @property
    def engine_max_model_len(self) -> dict[str, int]: ...

    @property
    def clock(self) -> Clock: ...


class _StateCollector(Collector):
    """Gauges read from the gateway at scrape time."""

    def __init__(self, gateway: Callable[[], GatewayState | None]) -> None:
        self._gateway = gateway

    def collect(self) -> Iterator[Metric]:
        gw = self._gateway()
        if gw is None:
            return
        sched = gw.scheduler
        view = sched.view
        yield GaugeMetricFamily("turnstile_gateway_held_turns",
                                "Ready turns held by the release policy", value=sched.held_turns)
        now = gw.clock.now()
        yield GaugeMetricFamily("turnstile_oldest_hold_seconds",
                                "Age of the oldest ready turn the release policy holds (0: none)",
                                value=sched.oldest_hold_age(now))
        yield GaugeMetricFamily("turnstile_hold_bound_seconds",
                                "The release policy's bound on a hold (0: it never holds)",
                                value=sched.hold_bound_s(now))
        yield GaugeMetricFamily("turnstile_gateway_session_queued_turns",
                                "Turns queued behind a running turn of the same session",
                                value=gw.session_queued)
        yield GaugeMetricFamily("turnstile_gateway_released_turns",
                                "Released turns not finished", value=view.released_turns)
        yield GaugeMetricFamily("turnstile_gateway_released_tokens",
                                "Estimated work (tokens) of released, unfinished turns",
                                value=view.released_tokens)
        yield GaugeMetricFamily("turnstile_gateway_active_sessions", "Open sessions",
                                value=len(gw.sessions))
        outstanding = GaugeMetricFamily("turnstile_gateway_engine_outstanding_turns",
                                        "Turns released to the engine and not finished",
                                        labels=["engine"])
        tokens = GaugeMetricFamily("turnstile_gateway_engine_outstanding_tokens",
                                   "Estimated tokens released to the engine, not finished",
                                   labels=["engine"])
        paused = GaugeMetricFamily("turnstile_gateway_engine_paused_context_tokens",
                                   "Context of sessions in a tool call whose KV is on the engine",
                                   labels=["engine"])
        healthy = GaugeMetricFamily("turnstile_gateway_engine_healthy",
                                    "1 when the engine passed its last health check",
                                    labels=["engine"])
        queue = GaugeMetricFamily("turnstile_gateway_engine_queue_len",
                                  "Requests waiting inside the engine (its /metrics)",
                                  labels=["engine"])
        for eid in view.ids:
            e = view[eid]
            outstanding.add_metric([eid], e.outstanding_turns)
            tokens.add_metric([eid], e.outstanding_tokens)
            paused.add_metric([eid], e.paused_context_tokens)
            healthy.add_metric([eid], 1.0 if gw.engine_up.get(eid, True) else 0.0)
            if e.queue_len >= 0:
                queue.add_metric([eid], e.queue_len)
        warning = GaugeMetricFamily(
            "turnstile_engine_config_warning",
            "1 when a chosen policy relies on an engine feature the engine ignores (or, for "
            "priority, that cannot be confirmed), or (feature kind) when the engine answers "
            "as another kind than declared; the gateway's log says which and why",
            labels=["engine", "feature"])
        for eid, verdicts in gw.engine_config.items():
            for feature, msg in verdicts.items():
                warning.add_metric([eid, feature], 0.0 if msg is None else 1.0)
        context = GaugeMetricFamily(
            "turnstile_engine_max_model_len",
            "The longest context (prompt + output tokens) the engine accepts, as read at start "
            "(vLLM: --max-model-len; llama.cpp: a slot's context)", labels=["engine"])
        for eid, n in gw.engine_max_model_len.items():
            context.add_metric([eid], n)
        yield outstanding
        yield tokens
        yield paused
        yield healthy
        yield queue
        yield warning
        yield context


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter("turnstile_gateway_requests",
                                "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.turns_finished = Counter("turnstile_gateway_turns_finished",
                                      "Turns the engine finished, by engine", ["engine"],
                                      registry=r)
        self.turns_failed = Counter("turnstile_gateway_turns_failed",
                                    "Turn attempts that failed at the engine, by engine and reason",
                                    ["engine", "reason"], registry=r)
        self.turns_rerouted = Counter("turnstile_gateway_turns_rerouted",
                                      "Turns re-routed after an engine failure", registry=r)
        self.turns_cancelled = Counter("turnstile_gateway_turns_cancelled",
                                       "Turns whose client went away", ["stage"], registry=r)
        self.released = Counter("turnstile_gateway_released_turns",
                                "Turns released to engines", ["engine"], registry=r)
        self.rejected = Counter("turnstile_gateway_rejected", "Requests refused with 429",
                                registry=r)
        self.derived_sessions = Counter(
            "turnstile_gateway_derived_sessions",
            "Requests naming no session, by how their session was derived from the conversation "
            "(new, continued, forked: it starts as a known session did, subagent)",
            ["how"], registry=r)
        self.output_tokens = Counter("turnstile_gateway_output_tokens",
                                     "Output tokens reported by engines", ["engine"], registry=r)
        self.ttft = Histogram("turnstile_gateway_ttft_seconds",
                              "Turn ready at the gateway to first token (streamed turns)",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.hold = Histogram("turnstile_gateway_hold_seconds",
                              "Turn ready to released (the gateway's holding queue)",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("turnstile_gateway_turn_seconds", "Turn ready to finished",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.flow = Histogram("turnstile_gateway_flow_time_seconds",
                              "Session flow time (first turn ready to last turn finished)",
                              buckets=_FLOW_BUCKETS, registry=r)
        self._gateway: GatewayState | None = None
        r.register(_StateCollector(lambda: self._gateway))

    def bind(self, gateway: GatewayState) -> None:
        self._gateway = gateway

    def render(self) -> bytes:
        return generate_latest(self.registry)
