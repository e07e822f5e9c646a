"""Three gateway replicas (processes) + two real llama.cpp engines + a real redis-server.

Unmodified OpenAI clients (no session header): the replicas derive the session from the
conversation and agree on where each one runs; a replica killed with SIGKILL loses no accepted
turn and none is answered twice; a restarted replica routes sessions to the engine holding
their KV. Timing assertions are loose (a shared 2-core machine).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from turnstile.engines.llama_server import LlamaServerProcess
from turnstile.engines.tiny_model import write_tiny_gguf
from turnstile.gateway.adapters import parse_prometheus
from turnstile.testing.freeze import freezing
from turnstile.testing.redis_server import RedisServer
from turnstile.testing.replicas import GatewayProcess, write_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("redis_server_binary"),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, llama_server_binary: Path
            ) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("replicas")
    model = write_tiny_gguf(tmp / "tiny.gguf")
    engines: list[LlamaServerProcess] = []
    with RedisServer() as redis:
        try:
            for i in range(2):
                engines.append(LlamaServerProcess(model, n_parallel=4, ctx=8192, threads=1,
                                                  slot_save_dir=tmp / f"slots{i}",
                                                  binary=llama_server_binary).start())
            yield {"tmp": tmp, "redis": redis, "engines": engines}
        finally:
            for e in engines:
                e.stop()


def _replicas(cluster: dict[str, Any], name: str, n: int, policy: str,
              **params: Any) -> list[GatewayProcess]:
    cfg = write_config(cluster["tmp"] / f"{name}.toml",
                       [(e.base_url, "llama.cpp") for e in cluster["engines"]], policy,
                       params or None, state=cluster["redis"].url, replica_ttl_s=1.0,
                       stats_interval_s=0.0)
    return [GatewayProcess(cfg, replica_id=f"{name}-{i}").start() for i in range(n)]


def _wait_for(gw: GatewayProcess, cond: Callable[[dict[str, float]], bool],
              timeout_s: float = 30.0) -> None:
    """Until ``cond`` holds of ``gw``'s metrics."""
    deadline = time.monotonic() + timeout_s
    while not cond(m := parse_prometheus(httpx.get(gw.url + "/metrics", timeout=10).text)):
        assert time.monotonic() < deadline, m
        time.sleep(0.02)


def _client(gw: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _turn(gw: GatewayProcess, messages: list[dict[str, Any]], stream: bool
          ) -> tuple[str, str, str]:
    """One turn through ``gw``: (reply text, session id, engine)."""
    c = _client(gw)
    if stream:
        raw = c.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=12, stream=True)
        text = "".join(ch.choices[0].delta.content or "" for ch in raw.parse() if ch.choices)
    else:
        raw = c.chat.completions.with_raw_response.create(model="tiny", messages=messages,
                                                          max_tokens=12)
        text = raw.parse().choices[0].message.content or ""
    return text, raw.headers["x-session-id"], raw.headers["x-turnstile-engine"]


def test_replicas_agree_on_derived_sessions_and_their_engines(cluster: dict[str, Any]) -> None:
    gws = _replicas(cluster, "agree", 3, "eager+kv-affinity")
    try:
        convs: dict[int, list[dict[str, Any]]] = {}
        placed: dict[int, tuple[str, str]] = {}

        def first(i: int) -> None:
            msgs = [{"role": "system", "content": "you are a careful coding agent"},
                    {"role": "user", "content": f"issue {i}: " + "fix the parser " * 30}]
            text, sid, engine = _turn(gws[i % 3], msgs, stream=i % 2 == 0)
            convs[i] = [*msgs, {"role": "assistant", "content": text}]
            placed[i] = (sid, engine)

        threads = [threading.Thread(target=first, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({sid for sid, _ in placed.values()}) == 6
        for turn in range(1, 3):
            for i in range(6):
                msgs = [*convs[i], {"role": "user", "content": f"tool output {turn}: ok"}]
                text, sid, engine = _turn(gws[(i + turn) % 3], msgs, stream=turn % 2 == 1)
                assert (sid, engine) == placed[i], (i, turn)
                convs[i] = [*msgs, {"role": "assistant", "content": text}]
    finally:
        for g in gws:
            g.close()


# Seen once in a fresh-clone CI run on a loaded 2-core host (2026-12-07): a retried request
# answered 409. The cause: a non-streamed answer was marked done in Redis before it went out,
# with no answer kept, so a turn finishing as its replica was killed left its retry a 409 on
# every replica (fixed: the answer is kept first; tests/gateway/test_replica_retries.py). The
# reruns stay (a loaded host); each attempt has its own request ids
# and replica names, so an attempt never sees an earlier one's turns in the shared Redis.
@pytest.mark.flaky(reruns=2)
def test_killed_replica_loses_no_turn_and_serves_none_twice(cluster: dict[str, Any]) -> None:
    tag = uuid.uuid4().hex[:6]
    gws = _replicas(cluster, f"kill{tag}", 3, "fcfs-workflow+least-loaded",
                    release={"max_inflight_per_engine": 1})
    try:
        n = 8
        answers: dict[str, list[tuple[int, str]]] = {f"job-{tag}-{i}": [] for i in range(n)}
        retried: list[str] = []

        def client(i: int) -> None:
            rid = f"job-{tag}-{i}"
            body = {"model": "tiny", "max_tokens": 200,
                    "messages": [{"role": "user", "content": f"job {i}: " + "work " * 40}]}
            headers = {"x-request-id": rid, "x-session-id": f"job-session-{tag}-{i}"}
            try:
                r = httpx.post(gws[0].url + "/v1/chat/completions", json=body,
                               headers=headers, timeout=60)
            except httpx.TransportError:  # the replica died: the client retries elsewhere
                retried.append(rid)
                r = httpx.post(gws[1 + i % 2].url + "/v1/chat/completions", json=body,
                               headers=headers, timeout=120)
            answers[rid].append((r.status_code, r.headers.get("x-turnstile-cached", "")))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        # the engines frozen until kill-0 dies: two turns on them, the rest held by kill-0's
        # release policy, at the kill whatever the host's speed (with a 0.5 s sleep instead, and
        # 200 tokens for the 800 of then, as on a host 4x faster: every turn answered before
        # the kill in 2 runs of 3)
        with freezing(*(e.process.pid for e in cluster["engines"] if e.process)):
            for t in threads:
                t.start()
            _wait_for(gws[0], lambda m: m.get("turnstile_gateway_held_turns") == n - 2
                      and m.get("turnstile_gateway_released_turns") == 2)
            gws[0].kill()
        for t in threads:
            t.join(150)
        # every request answered exactly once, successfully
        assert all(len(a) == 1 and a[0][0] == 200 for a in answers.values()), answers
        # every turn was held or running at kill-0 when it died (the engines frozen): each
        # client retried, and the survivors took each turn over and ran it once
        assert len(retried) == n, (retried, answers)
        finished = sum(parse_prometheus(httpx.get(g.url + "/metrics", timeout=10).text)
                       .get("turnstile_gateway_turns_finished_total", 0.0) for g in gws[1:])
        assert finished == n, (finished, retried)
        # a second try of an answered request gets the kept result, not a second run
        again = httpx.post(gws[2].url + "/v1/chat/completions",
                           json={"model": "tiny", "max_tokens": 200,
                                 "messages": [{"role": "user", "content": "job 7"}]},
                           headers={"x-request-id": f"job-{tag}-7"}, timeout=60)
        assert again.status_code == 200, (again.status_code, again.text, retried, answers)
        assert again.headers.get("x-turnstile-cached") == "1", (retried, answers)
    finally:
        for g in gws:
            g.close()


def test_residency_survives_a_replica_restart(cluster: dict[str, Any]) -> None:
    (gw,) = _replicas(cluster, "restart", 1, "eager+kv-affinity")
    placed: dict[int, str] = {}
    convs: dict[int, list[dict[str, Any]]] = {}

    def first(i: int) -> None:
        msgs = [{"role": "user", "content": f"session {i}: " + "read the code " * 30}]
        text, _, engine = _turn(gw, msgs, stream=False)
        placed[i] = engine
        convs[i] = [*msgs, {"role": "assistant", "content": text}]

    threads = [threading.Thread(target=first, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(placed.values())) == 2
    gw.kill()
    (again,) = _replicas(cluster, "restart-again", 1, "eager+kv-affinity")
    try:
        for i, engine in placed.items():
            msgs = [*convs[i], {"role": "user", "content": "tool output: done"}]
            _, _, now_on = _turn(again, msgs, stream=False)
            assert now_on == engine, i
    finally:
        again.close()
