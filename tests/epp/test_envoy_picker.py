"""The picker behind real Envoy, in front of fake engines (fast; the real llama.cpp engines are
in test_real_engines.py): routing by header and metadata, release control and shedding as the
client sees them, 503s, the subset hint, endpoints changing at run time, gRPC health, metrics,
and Envoy's failure modes when the picker dies or an engine dies."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from turnstile.epp.envoy import EnvoyProcess, envoy_config, free_port
from turnstile.testing.epp import PickerThread, start_picker
from turnstile.testing.fake_engine import FakeServer, chat_body, start_fake

pytestmark = pytest.mark.timeout(90)

HOLD_ONE = {"policy": "fcfs-workflow",
            "policy_params": {"release": {"max_inflight_per_engine": 1}}}


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def ep(f: FakeServer) -> str:
    return f.url.removeprefix("http://")


@pytest.fixture
def fakes() -> Iterator[list[FakeServer]]:
    made: list[FakeServer] = []
    yield made
    for f in made:
        f.stop()


class Stack:
    def __init__(self, picker: PickerThread, envoy: EnvoyProcess) -> None:
        self.picker = picker
        self.envoy = envoy
        self.client = httpx.Client(base_url=envoy.url, timeout=20)

    def chat(self, session: str | None = None, **kw: Any) -> httpx.Response:
        headers = {"x-session-id": session} if session else {}
        headers.update(kw.pop("headers", {}))
        return self.client.post("/v1/chat/completions", json=chat_body(**kw), headers=headers)

    def metrics(self) -> dict[str, float]:
        return series(httpx.get(self.picker.metrics_url + "/metrics").text)


def series(text: str) -> dict[str, float]:
    """``{'name{labels}': value}`` of a Prometheus text page (one entry per label set)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


@pytest.fixture
def stacks(envoy_binary: Path) -> Iterator[Callable[..., Stack]]:
    made: list[Stack] = []

    def make(engines: list[FakeServer], *, mode: str = "original_dst",
             failure_mode_allow: bool = False, fallbacks: int = 0, watch: str = "inline",
             **picker: Any) -> Stack:
        eps = [ep(f) for f in engines]
        pk = start_picker(eps, fallbacks=fallbacks, watch=watch, **picker)
        cfg = envoy_config(listen_port=free_port(), picker_port=pk.grpc_port, mode=mode,
                           endpoints=eps, failure_mode_allow=failure_mode_allow, watch=watch)
        try:
            env = EnvoyProcess(cfg, binary=envoy_binary).start()
        except BaseException:
            pk.stop()
            raise
        s = Stack(pk, env)
        made.append(s)
        return s

    yield make
    for s in made:
        s.client.close()
        s.envoy.stop()
        s.picker.stop()


@pytest.mark.parametrize("watch", ["inline", "observe"])
def test_routes_by_header_and_sessions_stick(fakes: list[FakeServer],
                                             stacks: Callable[..., Stack], watch: str) -> None:
    fakes += [start_fake(ttft_s=0.1), start_fake(ttft_s=0.1)]
    s = stacks(fakes, policy="eager+kv-affinity", watch=watch)
    served: dict[str, set[str]] = {}
    for turn in range(3):  # six agents at once, three turns each
        with ThreadPoolExecutor(6) as pool:
            rs = list(pool.map(lambda i, t=turn: s.chat(
                f"agent-{i}", content=f"agent {i} turn {t}", stream=t % 2 == 1), range(6)))
        for i, r in enumerate(rs):
            assert r.status_code == 200, r.text
            # the engine that answered is the one the picker chose (Envoy's served header)
            assert r.headers["x-gateway-destination-endpoint-served"] == \
                r.headers["x-turnstile-engine"]
            assert r.headers["x-session-id"] == f"agent-{i}"
            served.setdefault(f"agent-{i}", set()).add(r.headers["x-turnstile-engine"])
    assert all(len(v) == 1 for v in served.values())  # every session stuck to one engine
    assert len({e for v in served.values() for e in v}) == 2  # and both engines were used
    # the engines saw the llama.cpp adapter's fields the picker put in the body
    bodies = [q.body for f in fakes for q in f.engine.requests
              if q.path.endswith("completions")]
    assert len(bodies) == 18 and all(b.get("cache_prompt") is True for b in bodies)
    m = s.metrics()
    assert m['turnstile_epp_decisions_total{result="routed"}'] == 18
    assert m["turnstile_gateway_turns_finished_total" '{engine="' + ep(fakes[0]) + '"}'] + \
        m["turnstile_gateway_turns_finished_total" '{engine="' + ep(fakes[1]) + '"}'] == 18
    # output tokens come from the usage the engine streamed back through Envoy
    assert sum(v for k, v in m.items()
               if k.startswith("turnstile_gateway_output_tokens_total")) == 18 * 4
    # requests the scheduler does not see go to any ready endpoint
    assert s.client.get("/v1/models").json()["data"][0]["id"] == "tiny"


def test_hold_reaches_the_client_and_admission_sheds_429(fakes: list[FakeServer],
                                                        stacks: Callable[..., Stack]) -> None:
    fakes.append(start_fake(ttft_s=0.6))
    s = stacks(fakes, max_held=2, **HOLD_ONE)
    results: list[httpx.Response] = []

    def call(i: int) -> None:
        results.append(s.chat(f"s{i}"))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    wait_until(lambda: s.picker.picker.scheduler.held_turns == 2)
    over = s.chat("s-over")
    assert over.status_code == 429
    assert over.headers["retry-after"] == "1"
    assert over.json()["error"]["code"] == "queue_full"
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200, 200, 200]
    holds = sorted(float(r.headers["x-turnstile-hold-ms"]) for r in results)
    assert holds[0] < 100 and holds[2] > 1000  # the last waited for two 0.6 s turns
    assert fakes[0].engine.max_in_flight == 1  # the hold was real: one at a time at the engine
    m = s.metrics()
    assert m['turnstile_epp_decisions_total{result="429"}'] == 1
    assert m["turnstile_gateway_rejected_total"] == 1


@pytest.mark.parametrize("watch", ["inline", "observe"])
def test_client_gone_while_held_is_dropped(fakes: list[FakeServer],
                                           stacks: Callable[..., Stack], watch: str) -> None:
    fakes.append(start_fake(ttft_s=0.8))
    s = stacks(fakes, watch=watch, **HOLD_ONE)
    t = threading.Thread(target=lambda: s.chat("first"))
    t.start()
    wait_until(lambda: fakes[0].engine.in_flight == 1)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(s.envoy.url + "/v1/chat/completions", json=chat_body(content="gone"),
                   headers={"x-session-id": "gone"}, timeout=0.2)
    t.join()
    wait_until(lambda: s.picker.picker.scheduler.held_turns == 0)
    time.sleep(0.2)
    assert len(fakes[0].engine.requests) == 1  # the abandoned turn never reached the engine
    # counted once, as serve counts it: the turn is withdrawn when its client leaves
    assert s.metrics()['turnstile_gateway_turns_cancelled_total{stage="held"}'] == 1


def test_no_ready_endpoint_is_503_and_the_subset_is_obeyed(fakes: list[FakeServer],
                                                           stacks: Callable[..., Stack]) -> None:
    fakes += [start_fake(), start_fake()]
    s = stacks(fakes, policy="eager")
    only = ep(fakes[1])
    for i in range(4):
        r = s.chat(f"sub-{i}", headers={"x-gateway-destination-endpoint-subset": only})
        assert r.status_code == 200 and r.headers["x-gateway-destination-endpoint-served"] == only
    r = s.chat("nowhere", headers={"x-gateway-destination-endpoint-subset": "10.9.9.9:1"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_endpoint"
    for f in fakes:
        f.engine.healthy = False
    wait_until(lambda: not any(s.picker.picker.engine_up.values()), 15)
    r = s.chat("down")
    assert r.status_code == 503


def test_unknown_model_and_bad_json_are_answered_by_the_picker(
        fakes: list[FakeServer], stacks: Callable[..., Stack]) -> None:
    fakes.append(start_fake())
    s = stacks(fakes)
    r = s.client.post("/v1/chat/completions", json={**chat_body(), "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = s.client.post("/v1/chat/completions", content=b"{not json",
                      headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert fakes[0].engine.requests == [] or all(
        q.path == "/v1/models" for q in fakes[0].engine.requests)


def test_endpoints_file_changes_at_run_time(fakes: list[FakeServer], envoy_binary: Path,
                                            tmp_path: Path) -> None:
    fakes += [start_fake(), start_fake()]
    path = tmp_path / "endpoints.txt"
    path.write_text(ep(fakes[0]) + "\n")
    pk = start_picker([], endpoints_file=str(path), policy="eager")
    env = EnvoyProcess(envoy_config(listen_port=free_port(), picker_port=pk.grpc_port),
                       binary=envoy_binary).start()
    try:
        pk.server.cfg.watch_interval_s = 0.1
        c = httpx.Client(base_url=env.url, timeout=10)
        seen = {c.post("/v1/chat/completions", json=chat_body(),
                       headers={"x-session-id": f"a{i}"}).headers["x-turnstile-engine"]
                for i in range(4)}
        assert seen == {ep(fakes[0])}
        path.write_text(json.dumps([ep(fakes[0]), ep(fakes[1])]))
        wait_until(lambda: ep(fakes[1]) in pk.picker.ready_endpoints(), 10)
        path.write_text(f"# the pool now\n{ep(fakes[1])}\n")
        wait_until(lambda: pk.picker.ready_endpoints() == [ep(fakes[1])], 10)
        seen = {c.post("/v1/chat/completions", json=chat_body(),
                       headers={"x-session-id": f"b{i}"}).headers["x-turnstile-engine"]
                for i in range(4)}
        assert seen == {ep(fakes[1])}
    finally:
        env.stop()
        pk.stop()


def test_grpc_health(fakes: list[FakeServer], stacks: Callable[..., Stack]) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    fakes.append(start_fake())
    s = stacks(fakes)
    with grpc.insecure_channel(f"127.0.0.1:{s.picker.grpc_port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            st = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
            assert st == health_pb2.HealthCheckResponse.SERVING, name
        fakes[0].engine.healthy = False
        wait_until(lambda: stub.Check(health_pb2.HealthCheckRequest(service="readiness"),
                                      timeout=5).status
                   == health_pb2.HealthCheckResponse.NOT_SERVING, 15)
        assert stub.Check(health_pb2.HealthCheckRequest(service="liveness"),
                          timeout=5).status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("fail_open", [True, False])
def test_picker_crash_fails_as_envoy_is_configured(fail_open: bool, fakes: list[FakeServer],
                                                   stacks: Callable[..., Stack]) -> None:
    fakes += [start_fake(), start_fake()]
    s = stacks(fakes, mode="override_host", failure_mode_allow=fail_open, fallbacks=1)
    assert s.chat("before").status_code == 200
    s.picker.stop(grace_s=0)  # the picker is gone
    statuses = [s.chat(f"after-{i}").status_code for i in range(4)]
    if fail_open:
        # fail-open: Envoy skips the picker; the cluster's own balancing serves the requests
        assert statuses == [200] * 4
        assert sum(len(f.engine.requests) for f in fakes) >= 5
    else:
        # fail-closed: no request passes without the picker's decision
        assert all(st >= 500 for st in statuses)
        assert sum(1 for f in fakes for q in f.engine.requests
                   if q.path.endswith("completions")) == 1


@pytest.mark.parametrize("watch", ["inline", "observe"])
def test_killed_engine_turns_go_to_the_fallback(fakes: list[FakeServer],
                                                stacks: Callable[..., Stack], watch: str) -> None:
    fakes += [start_fake(), start_fake()]
    s = stacks(fakes, mode="override_host", fallbacks=1, policy="eager+kv-affinity",
               health_interval_s=30.0, watch=watch)
    first = s.chat("victim")
    home = first.headers["x-turnstile-engine"]
    dead = next(f for f in fakes if ep(f) == home)
    other = next(f for f in fakes if f is not dead)
    dead.stop()
    r = s.chat("victim")  # Envoy's retry walks the picker's fallback list
    assert r.status_code == 200
    assert r.headers["x-gateway-destination-endpoint-served"] == ep(other)
    pk = s.picker.picker
    wait_until(lambda: not pk.engine_up[home])  # the picker marked the dead engine down
    assert pk.sessions["victim"].last_engine == ep(other)  # and its KV is now there
    r = s.chat("victim")
    assert r.headers["x-turnstile-engine"] == ep(other)
    m = s.metrics()
    assert m['turnstile_gateway_turns_failed_total{engine="' + home + '",reason="fallback"}'] == 1


def test_other_stacks_session_keys_through_envoy(fakes: list[FakeServer],
                                                 stacks: Callable[..., Stack]) -> None:
    fakes.append(start_fake())
    s = stacks(fakes)
    cases = [({"x-dynamo-session-id": "dyn-1"}, {}, "dyn-1"),
             ({"x-smg-routing-key": "smg-1"}, {}, "smg-1"),
             ({}, {"prompt_cache_key": "pck-1"}, "pck-1"),
             ({}, {"user": "user-1"}, "user-1")]
    for headers, extra, sid in cases:
        for _ in range(2):
            r = s.chat(headers=headers, **extra)
            assert r.status_code == 200 and r.headers["x-session-id"] == sid
        # booked before the picker answers the last chunk, so before the client has it
        assert s.picker.picker.sessions[sid].turns == 2


def test_engine_load_comes_from_their_metrics(fakes: list[FakeServer],
                                              stacks: Callable[..., Stack]) -> None:
    fakes += [start_fake(ttft_s=1.5), start_fake()]
    s = stacks(fakes, stats_interval_s=0.1)
    view = s.picker.picker.scheduler.view
    busy, idle = ep(fakes[0]), ep(fakes[1])
    # load the picker did not send: another client straight at the engine
    t = threading.Thread(target=lambda: httpx.post(fakes[0].url + "/v1/chat/completions",
                                                   json=chat_body(), timeout=10))
    t.start()
    # scraped from the engines' /metrics into the view the policies read, as serve does
    wait_until(lambda: view[busy].running == 1 and view[idle].running == 0, 5)
    assert view[busy].queue_len == 0
    t.join()
    wait_until(lambda: view[busy].running == 0, 5)
