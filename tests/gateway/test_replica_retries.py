"""A client's retry with the same ``x-request-id`` across Redis-backed replicas (two gateways in
this process sharing a real redis-server, fake engines): it gets the answer or the turn is run
for it, never a ``409`` that no later retry can clear (docs/reliability.md, the client's side of
the contract), and a turn taken over from a dead replica is generated once.

Each case failed before the fix it names:

* an answered, non-streamed turn was marked done in Redis *before* its answer went out, with no
  answer kept: a replica killed in that instant left every retry a ``409 "was already
  answered"`` for ``result_ttl_s`` (the replica-kill test's rare 409);
* a turn that ended without an answer (every attempt failed, or its client went away while it
  was held) was marked done all the same: its retry got that 409 too;
* a retry reaching the replica that had just claimed the dead replica's turn in Redis, before
  it adopted the turn locally, was served as a new request while the adopted copy ran too;
* a retry whose lookup of the turn's row spanned this replica's takeover of it (it found no
  turn here, then read the row naming this replica as owner) was served as a new request
  after the adopted copy: a third generation in the replica-kill test on a loaded host;
* a claim took every unanswered turn in the dead replica's set, even one a live replica had
  accepted again meanwhile (and was running);
* a retry waiting for another replica's answer took one failed read of the turn's row for
  "no such turn" and was served as well;
* a claim slower than ``replica_ttl_s`` let the claiming replica's heartbeat lapse (it was
  refreshed by the same loop), so its turns could be claimed and run again by another;
* an event loop blocked past ``replica_ttl_s`` let the heartbeat lapse likewise;
* a stopped replica whose sync loop lost its cancellation kept syncing (and logging) forever;
* a replica whose heartbeat lapsed once (a stalled event loop) was dropped from the replica set
  for good, so the turns it accepted afterwards would never be taken over if it died.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from turnstile.gateway.embedded import GatewayServer
from turnstile.gateway.shared import RedisState
from turnstile.gateway.store import HeldTurnRow
from turnstile.testing.fake_engine import FakeServer, chat_body
from turnstile.testing.redis_server import RedisServer

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("redis_server_binary")]


@pytest.fixture
def redis_url() -> Iterator[str]:
    with RedisServer() as r:
        yield r.url


@pytest.fixture
def pair(redis_url: str, fake_engines: Callable[..., FakeServer],
         gateways: Callable[..., GatewayServer]
         ) -> Callable[..., tuple[FakeServer, GatewayServer, GatewayServer]]:
    def start(policy: str = "eager", **engine: Any
              ) -> tuple[FakeServer, GatewayServer, GatewayServer]:
        eng = fake_engines(**engine)
        params = {"release": {"max_inflight_per_engine": 1}} if "fcfs" in policy else None
        a, b = (gateways([eng.url], policy=policy, policy_params=params,
                         backend=RedisState(redis_url, replica_id=name, replica_ttl_s=1.0))
                for name in ("a", "b"))
        return eng, a, b
    return start


def post(gw: GatewayServer, rid: str, body: dict[str, Any] | None = None,
         timeout: float = 30.0) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", json=body or chat_body(f"job {rid}"),
                      headers={"x-request-id": rid, "x-session-id": f"s-{rid}"},
                      timeout=timeout)


def dead_replica_accepted(redis_url: str, rid: str) -> None:
    """A replica "dead" accepted turn ``rid`` (held, session ``s-rid``) and died: its
    heartbeat is gone, so a live replica claims the turn."""
    async def accept() -> None:
        dead = RedisState(redis_url, replica_id="dead", replica_ttl_s=1.0)
        await dead.open()
        now = time.time() - dead.clock_origin(0.0)
        dead.put_held(HeldTurnRow(rid, f"s-{rid}", "/v1/chat/completions",
                                  chat_body(f"job {rid}"), False, now, 8, 8, 4), now)
        await dead.flush()
        await dead.redis.delete("ts:hb:dead")  # its heartbeat stops: it died
        await dead.redis.aclose()

    asyncio.run(accept())


def generations(eng: FakeServer, rid: str) -> int:
    return sum(1 for r in eng.engine.requests if r.request_id == rid)


def test_a_retry_of_an_answered_request_gets_the_kept_answer_on_any_replica(pair: Any) -> None:
    eng, a, b = pair()
    first = post(a, "x1")
    assert first.status_code == 200
    for gw in (b, a):  # the client lost the answer (its replica died as it went out): retry
        again = post(gw, "x1")
        assert again.status_code == 200, again.text
        assert again.headers["x-turnstile-cached"] == "1"
        assert again.json()["choices"] == first.json()["choices"]
    assert generations(eng, "x1") == 1


def test_a_retry_of_a_streamed_answer_is_answered_not_refused(pair: Any) -> None:
    """A streamed answer is not kept (docs: the retry of a stream delivered in full runs the
    turn again); the retry is answered all the same."""
    _, a, b = pair()
    body = chat_body("stream me", stream=True)
    first = post(a, "x2", body)
    assert first.status_code == 200 and first.text.rstrip().endswith("data: [DONE]")
    again = post(b, "x2", body)
    assert again.status_code == 200, again.text
    assert again.text.rstrip().endswith("data: [DONE]")


def test_a_retry_after_every_attempt_failed_is_served(pair: Any) -> None:
    eng, a, b = pair()
    eng.engine.fail = "status:500"
    assert post(a, "x3").status_code >= 500  # every attempt failed
    eng.engine.fail = None
    time.sleep(1.5)  # the engine is seen up again
    again = post(b, "x3")
    assert again.status_code == 200, again.text
    assert again.headers.get("x-turnstile-cached") is None


def test_a_retry_after_the_client_gave_up_on_a_held_turn_is_served(pair: Any) -> None:
    eng, a, b = pair("fcfs-workflow", ttft_s=1.0)
    blocker = threading.Thread(target=post, args=(a, "busy"))
    blocker.start()
    time.sleep(0.2)  # "busy" runs; the next turn is held behind it
    with pytest.raises(httpx.ReadTimeout):
        post(a, "x4", timeout=0.3)
    blocker.join()
    again = post(b, "x4")
    assert again.status_code == 200, again.text
    assert generations(eng, "x4") == 1


def test_a_retry_during_the_takeover_is_attached_not_run_twice(pair: Any,
                                                               redis_url: str) -> None:
    import redis

    eng, a, b = pair(ttft_s=1.5)
    b.stop()  # one live replica: it claims the dead replica's turn
    state = a.gateway.replicas.state
    claim = state.claim_orphans
    claimed = threading.Event()

    async def slow_claim() -> list[HeldTurnRow]:
        rows = await claim()
        if rows:
            claimed.set()
            await asyncio.sleep(1.0)  # claimed in Redis, not adopted here yet
        return rows

    state.claim_orphans = slow_claim

    dead_replica_accepted(redis_url, "x5")
    assert claimed.wait(10)
    t0 = time.monotonic()
    answers: list[httpx.Response] = []
    retry = threading.Thread(target=lambda: answers.append(post(a, "x5")))
    retry.start()  # the client's retry, inside the takeover
    time.sleep(max(1.3 - (time.monotonic() - t0), 0.0))  # adopted; its turn still running
    row = redis.Redis.from_url(redis_url).hgetall("ts:turn:x5")
    retry.join(30)
    assert answers and answers[0].status_code == 200, answers
    time.sleep(0.3)
    if state.read_errors:
        # Redis itself did not answer a lookup within its 2 s timeout (a starved host): the
        # replica then serves on what it knows, and duplicate detection pauses (documented)
        pytest.xfail(f"{state.read_errors} Redis lookups timed out on this host")
    assert row[b"owner"] == b"a" and b"done" not in row, row  # a retry elsewhere would wait
    assert generations(eng, "x5") == 1


def test_a_retry_whose_lookup_spans_the_takeover_is_attached_not_run_again(
        pair: Any, redis_url: str) -> None:
    """The replica-kill test's third generation (CI, loaded host): a retry found no turn here,
    and while it read the turn's row this replica claimed and adopted the dead replica's turn;
    the row then named this replica as owner and the retry was served as a new request, queued
    behind the adopted copy in its session and run after it."""
    eng, a, b = pair(ttft_s=0.5)
    b.stop()
    state = a.gateway.replicas.state
    claim, status = state.claim_orphans, state.turn_status
    looking = threading.Event()

    async def claim_once_the_retry_looks() -> list[HeldTurnRow]:
        return await claim() if looking.is_set() else []

    async def status_read_after_the_takeover(rid: str) -> tuple[str | None, bool]:
        looking.set()
        deadline = time.monotonic() + 10
        while rid not in a.gateway.by_request and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # claimed and adopted meanwhile
        return await status(rid)

    state.claim_orphans = claim_once_the_retry_looks
    state.turn_status = status_read_after_the_takeover

    dead_replica_accepted(redis_url, "x7")
    r = post(a, "x7")
    assert r.status_code == 200, r.text
    time.sleep(0.3)
    assert state.read_errors == 0
    assert generations(eng, "x7") == 1


def test_a_turn_served_again_by_a_live_replica_is_not_claimed_from_the_dead_one(
        pair: Any, redis_url: str) -> None:
    """A dead replica's turn that a live replica accepted again (its retry was served there:
    the lookup failed, or the row was not yet written) is that replica's: the claim of the dead
    replica's turns leaves it, instead of running it a third time."""
    import redis

    pair(ttft_s=0.2)

    async def dead_then_b_accepts() -> None:
        dead = RedisState(redis_url, replica_id="dead", replica_ttl_s=1.0)
        await dead.open()
        now = time.time() - dead.clock_origin(0.0)
        for rid in ("y1", "y2"):
            dead.put_held(HeldTurnRow(rid, f"s-{rid}", "/v1/chat/completions",
                                      chat_body(f"job {rid}"), False, now, 8, 8, 4), now)
        await dead.flush()
        await dead.redis.aclose()
        b_side = RedisState(redis_url, replica_id="b-live", replica_ttl_s=30.0)
        await b_side.open()  # a live replica re-accepts y1 (its own row now)
        b_side.put_held(HeldTurnRow("y1", "s-y1", "/v1/chat/completions",
                                    chat_body("job y1"), False, now, 8, 8, 4), now)
        await b_side.flush()
        await b_side.redis.aclose()

    asyncio.run(dead_then_b_accepts())
    r = redis.Redis.from_url(redis_url)
    r.delete("ts:hb:dead")  # the dead replica's heartbeat stops
    deadline = time.monotonic() + 10
    while r.sismember("ts:replicas", "dead") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.hget("ts:turn:y1", "owner") == b"b-live"  # left to the replica serving it
    assert r.hget("ts:turn:y2", "owner") in (b"a", b"b")  # claimed


def test_a_failed_read_while_a_retry_waits_is_not_taken_for_a_turn_gone(
        pair: Any, redis_url: str) -> None:
    """A retry waiting for the replica that serves its turn polls the turn's row; one poll that
    Redis did not answer in time (a loaded host) read as "no such turn" and the retry was
    served here while the owner ran the turn too (a third generation in the replica-kill test
    when the owner had adopted a turn cut at the dead replica). It waits on, and gets the
    owner's answer."""
    eng, a, _ = pair()
    state = a.gateway.replicas.state
    status = state.turn_status
    polls = 0

    async def one_poll_fails(rid: str) -> tuple[str | None, bool]:
        nonlocal polls
        polls += 1
        if polls == 3:
            state.read_errors += 1  # what RedisState does when a read times out
            return None, False
        return await status(rid)

    state.turn_status = one_poll_fails
    kept = (b'{"id": "c1", "object": "chat.completion", "choices": [{"index": 0, "message": '
            b'{"role": "assistant", "content": "kept"}, "finish_reason": "stop"}]}')

    async def other(answer: bool) -> None:
        o = RedisState(redis_url, replica_id="other", replica_ttl_s=60.0)  # alive throughout
        await o.open()
        now = time.time() - o.clock_origin(0.0)
        if answer:
            o.put_result("x9", "s-x9", "/v1/chat/completions", 200, kept, now)
            o.drop_turn("x9", answered=True)
        else:
            o.put_held(HeldTurnRow("x9", "s-x9", "/v1/chat/completions", chat_body("job x9"),
                                   False, now, 8, 8, 4), now)
        await o.flush()
        await o.redis.aclose()

    asyncio.run(other(answer=False))
    answers: list[httpx.Response] = []
    retry = threading.Thread(target=lambda: answers.append(post(a, "x9")))
    retry.start()
    deadline = time.monotonic() + 10
    while polls < 5 and time.monotonic() < deadline and retry.is_alive():
        time.sleep(0.05)
    asyncio.run(other(answer=True))
    retry.join(30)
    assert answers and answers[0].status_code == 200, answers
    assert answers[0].headers.get("x-turnstile-cached") == "1"
    assert generations(eng, "x9") == 0  # served by its owner only


def test_the_heartbeat_outlives_a_slow_claim(pair: Any, redis_url: str) -> None:
    """The heartbeat was refreshed only by the load sync, which also claims (adopting each
    claimed turn after a session lookup): a claim slower than ``replica_ttl_s`` (a loaded host)
    let a live replica's heartbeat lapse, and another replica could claim its turns, running
    them a second time. The heartbeat has its own loop now."""
    import redis

    _, a, _ = pair()
    state = a.gateway.replicas.state
    claim = state.claim_orphans
    slow = threading.Event()

    async def slow_claim() -> list[HeldTurnRow]:
        slow.set()
        await asyncio.sleep(2.5)  # 2.5 x replica_ttl_s
        return await claim()

    state.claim_orphans = slow_claim
    assert slow.wait(5)
    r = redis.Redis.from_url(redis_url)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 2.0:
        assert r.exists("ts:hb:a"), f"heartbeat lapsed {time.monotonic() - t0:.1f} s in"
        time.sleep(0.1)


def test_the_heartbeat_outlives_a_blocked_event_loop_then_lapses(pair: Any,
                                                                  redis_url: str) -> None:
    """An event loop blocked past ``replica_ttl_s`` (CPU-starved on a loaded host) let a live
    replica's heartbeat lapse: its turns could be claimed and run again by another (a third
    generation of a turn it had taken over). A thread beats on for 5 x ``replica_ttl_s`` of
    such a stall; a replica that stops beats no more."""
    import redis

    _, a, _ = pair()
    r = redis.Redis.from_url(redis_url)
    loop = a.server.server.servers[0].get_loop()
    time.sleep(0.3)
    loop.call_soon_threadsafe(time.sleep, 2.5)  # the loop runs nothing for 2.5 x ttl
    t0 = time.monotonic()
    while time.monotonic() - t0 < 2.3:
        assert r.exists("ts:hb:a"), f"heartbeat lapsed {time.monotonic() - t0:.1f} s in"
        time.sleep(0.1)
    a.stop()
    time.sleep(1.5)
    assert not r.exists("ts:hb:a")  # stopped: taken for dead after replica_ttl_s


def test_a_stopped_replica_syncs_no_more_even_if_a_cancellation_is_lost(pair: Any) -> None:
    """A stopped in-process replica whose sync loop lost its cancellation (the Redis client
    turned it into an error, caught as a failed sync) went on syncing — against a Redis long
    gone, logging a traceback every 100 ms into later tests — and its stop never finished."""
    _, a, _ = pair()
    sync = a.gateway.replicas
    exchange = sync.state.exchange_load
    lost, entered = threading.Event(), threading.Event()

    async def losing_the_cancel(*args: Any) -> Any:
        entered.set()
        try:
            await asyncio.sleep(5.0)  # cancelled by the stop below, long before
        except asyncio.CancelledError:
            lost.set()
            raise RuntimeError("connection closed") from None
        return await exchange(*args)

    sync.state.exchange_load = losing_the_cancel
    # the stop must find the loop inside the exchange (a fixed 0.3 s wait on a loaded host
    # found it between syncs at times: nothing to lose, a flaky failure)
    assert entered.wait(10)
    a.server.stop(timeout_s=3.0)
    assert lost.is_set()
    assert a.server.thread is not None and not a.server.thread.is_alive()


def test_a_replica_whose_heartbeat_lapsed_rejoins_the_replica_set(pair: Any,
                                                                  redis_url: str) -> None:
    import redis

    pair()
    r = redis.Redis.from_url(redis_url)
    assert r.sismember("ts:replicas", "a")
    r.srem("ts:replicas", "a")  # what another replica's claim does after a lapse
    deadline = time.monotonic() + 5
    while not r.sismember("ts:replicas", "a") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.sismember("ts:replicas", "a")


def test_one_process_gateway_keeps_whole_answers_for_retries(
        fake_engines: Callable[..., FakeServer], gateways: Callable[..., GatewayServer],
        tmp_path: Any) -> None:
    """With ``--db`` a whole answer is kept in SQLite before it goes out: a client that lost it
    (its gateway crashed as it went out, or the connection broke) gets it on retry, from the
    same process or after a restart, and the engine runs the turn once. Before, the retry ran
    it again (the chaos table's duplicates at a gateway kill)."""
    eng = fake_engines()
    db = str(tmp_path / "gw.sqlite3")
    gw = gateways([eng.url], db=db)
    first = post(gw, "y1")
    assert first.status_code == 200
    again = post(gw, "y1")
    assert again.status_code == 200 and again.headers["x-turnstile-cached"] == "1"
    assert again.json()["choices"] == first.json()["choices"]
    gw.stop()
    gw = gateways([eng.url], db=db)  # a restart on the same file
    again = post(gw, "y1")
    assert again.status_code == 200 and again.headers["x-turnstile-cached"] == "1"
    assert generations(eng, "y1") == 1
