"""The picker behind real Envoy in front of two real llama.cpp ``llama-server`` engines (the tiny
random-weight model), the ``openai`` client as the agents: sessions stick to the engine holding
their KV (the engines' own cached-token counts say so), holds and 429s reach the client, a
picker crash fails open or closed as Envoy is configured, and a killed engine's unstreamed
turns go to the other engine.

Skipped where the llama-server binary or Envoy is missing, except under CI.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from turnstile.engines.llama_server import LlamaServerProcess
from turnstile.engines.tiny_model import write_tiny_gguf
from turnstile.epp.envoy import EnvoyProcess, envoy_config, free_port
from turnstile.testing.epp import PickerProcess, PickerThread, start_picker
from turnstile.testing.freeze import freezing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, llama_server_binary: Path) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf")


def _engines(model: Path, tmp: Path, binary: Path, n: int = 2, n_parallel: int = 4
             ) -> list[LlamaServerProcess]:
    procs: list[LlamaServerProcess] = []
    try:
        for i in range(n):
            procs.append(LlamaServerProcess(model, n_parallel=n_parallel, ctx=8192, threads=1,
                                            slot_save_dir=tmp / f"slots{i}",
                                            binary=binary).start())
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


@pytest.fixture(scope="module")
def engines(model: Path, tmp_path_factory: pytest.TempPathFactory, llama_server_binary: Path
            ) -> Iterator[list[LlamaServerProcess]]:
    procs = _engines(model, tmp_path_factory.mktemp("engines"), llama_server_binary)
    yield procs
    for p in procs:
        p.stop()


def ep(p: LlamaServerProcess) -> str:
    return p.base_url.removeprefix("http://")


class Stack:
    def __init__(self, picker: PickerThread, envoy: EnvoyProcess) -> None:
        self.picker = picker
        self.envoy = envoy
        self.client = openai.OpenAI(base_url=envoy.url + "/v1", api_key="none", max_retries=0,
                                    timeout=60)

    def close(self) -> None:
        self.envoy.stop()
        self.picker.stop()


@pytest.fixture
def stacks(envoy_binary: Path) -> Iterator[Callable[..., Stack]]:
    made: list[Stack] = []

    def make(procs: list[LlamaServerProcess], *, mode: str = "original_dst",
             failure_mode_allow: bool = False, fallbacks: int = 0, **picker: Any) -> Stack:
        eps = [ep(p) for p in procs]
        pk = start_picker(eps, fallbacks=fallbacks, **picker)
        try:
            env = EnvoyProcess(envoy_config(listen_port=free_port(), picker_port=pk.grpc_port,
                                            mode=mode, endpoints=eps,
                                            failure_mode_allow=failure_mode_allow),
                               binary=envoy_binary).start()
        except BaseException:
            pk.stop()
            raise
        made.append(Stack(pk, env))
        return made[-1]

    yield make
    for s in made:
        s.close()


def _agent(s: Stack, sid: int, *, turns: int, max_tokens: int, stream: bool,
           named: bool) -> list[dict[str, Any]]:
    """One closed-loop agent; ``named``: sends ``x-session-id``, else the picker derives the
    session from the conversation, as ``serve`` does."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": f"You are agent {sid}. " + "Plan carefully. " * 10},
        {"role": "user", "content": f"task {sid}: " + "fix the failing test " * 20}]
    out = []
    for t in range(turns):
        headers = {"x-session-id": f"agent-{sid}"} if named else {}
        if stream:
            raw = s.client.chat.completions.with_raw_response.create(
                model="tiny", messages=messages, max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True}, extra_headers=headers)
            text, usage = "", None
            for ch in raw.parse():
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                if ch.usage is not None:
                    usage = ch.usage
        else:
            raw = s.client.chat.completions.with_raw_response.create(
                model="tiny", messages=messages, max_tokens=max_tokens, extra_headers=headers)
            r = raw.parse()
            text, usage = r.choices[0].message.content or "", r.usage
        assert usage is not None
        out.append({"engine": raw.headers["x-turnstile-engine"],
                    "served": raw.headers["x-gateway-destination-endpoint-served"],
                    "session": raw.headers["x-session-id"],
                    "completion_tokens": usage.completion_tokens,
                    "prompt_tokens": usage.prompt_tokens,
                    "cached": (usage.prompt_tokens_details.cached_tokens
                               if usage.prompt_tokens_details else 0) or 0})
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": f"tool result {t}: " + "ok " * 30}]
    return out


def test_sessions_stick_to_the_engine_holding_their_kv(engines: list[LlamaServerProcess],
                                                        stacks: Callable[..., Stack]) -> None:
    s = stacks(engines, policy="cvar+kv-affinity+ttl")
    n = 8
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(_agent, s, i, turns=3, max_tokens=12, stream=i % 2 == 0,
                               named=i < n // 2) for i in range(n)]
        results = [f.result(timeout=120) for f in futures]
    for r in results:
        assert all(t["completion_tokens"] == 12 for t in r)
        assert len({t["engine"] for t in r}) == 1  # one engine per session...
        assert all(t["served"] == t["engine"] for t in r)  # ...the one Envoy connected to
        assert len({t["session"] for t in r}) == 1  # derived sessions held together too
        # ...and that engine still held the conversation's KV: later turns hit its cache
        for t in r[1:]:
            assert t["cached"] >= t["prompt_tokens"] // 2, r
    assert len({t["engine"] for r in results for t in r}) == 2
    derived = {r[0]["session"] for r in results[n // 2:]}
    assert all(sid.startswith("conv-") for sid in derived) and len(derived) == n // 2
    # the picker read the engines' real usage through Envoy's response stream
    text = httpx.get(s.picker.metrics_url + "/metrics").text
    total = sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                if ln.startswith("turnstile_gateway_output_tokens_total{"))
    assert total == n * 3 * 12
    # the engine refuses an oversized prompt itself (400 through Envoy); no session is left open
    before = len(s.picker.picker.sessions)
    with pytest.raises(openai.BadRequestError):
        s.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "word " * 6000}], max_tokens=4)
    time.sleep(0.1)
    assert len(s.picker.picker.sessions) == before


def test_holds_and_429s_reach_the_client(model: Path, tmp_path: Path, llama_server_binary: Path,
                                         stacks: Callable[..., Stack]) -> None:
    procs = _engines(model, tmp_path, llama_server_binary, n=1)
    try:
        s = stacks(procs, policy="fcfs-workflow", max_held=2,
                   policy_params={"release": {"max_inflight_per_engine": 1}})
        results: list[Any] = []

        def call(i: int) -> None:
            results.append(s.client.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": f"hold {i}"}],
                max_tokens=200, extra_headers={"x-session-id": f"h{i}"}))

        threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
        # the engine frozen until the 429 is back: the first turn still runs, the other two
        # wait for it, at any speed (unfrozen, 50 tokens for the 800 of then, as on a host 16x
        # faster, ended the first turn in under 20 ms; at 200 tokens, 4x, it held)
        assert procs[0].process is not None
        with freezing(procs[0].process.pid):
            for t in threads:
                t.start()
            deadline = time.monotonic() + 20
            while s.picker.picker.scheduler.held_turns < 2:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with pytest.raises(openai.RateLimitError) as exc:
                s.client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "one too many"}],
                    max_tokens=4, extra_headers={"x-session-id": "over"})
            time.sleep(0.05)  # the second turn's hold: over 20 ms, however fast the rest ran
        assert exc.value.response.headers["retry-after"] == "1"
        for t in threads:
            t.join(60)
        assert len(results) == 3
        holds = sorted(float(r.headers["x-turnstile-hold-ms"]) for r in results)
        assert holds[0] < holds[1] < holds[2] and holds[1] > 20  # each waited for the one before
        assert all(r.parse().usage.completion_tokens == 200 for r in results)
    finally:
        for p in procs:
            p.stop()


@pytest.mark.parametrize("fail_open", [True, False])
def test_picker_crash_fails_as_configured(fail_open: bool, engines: list[LlamaServerProcess],
                                          envoy_binary: Path) -> None:
    """The picker is its own process (``turnstile epp``), killed with SIGKILL."""
    eps = [ep(p) for p in engines]
    picker = PickerProcess(eps, policy="cvar+kv-affinity+ttl", extra=["--fallbacks", "1"])
    env = EnvoyProcess(envoy_config(listen_port=free_port(), picker_port=picker.grpc_port,
                                    mode="override_host", endpoints=eps,
                                    failure_mode_allow=fail_open), binary=envoy_binary).start()
    client = openai.OpenAI(base_url=env.url + "/v1", api_key="none", max_retries=0, timeout=60)
    try:
        ok = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "before the crash"}],
            max_tokens=4)
        assert ok.parse().usage.completion_tokens == 4 and "x-turnstile-engine" in ok.headers
        picker.kill()
        outcomes = []
        for i in range(3):
            try:
                r = client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": f"after {i}"}],
                    max_tokens=4)
                outcomes.append(r.usage.completion_tokens if r.usage else -1)
            except openai.APIStatusError as e:
                outcomes.append(-e.status_code)
        if fail_open:
            assert outcomes == [4, 4, 4]  # Envoy served them without the picker
        else:
            assert all(o <= -500 for o in outcomes)  # nothing passes without a decision
        # a picker restarted on the same port takes over again
        picker = PickerProcess(eps, grpc_port=picker.grpc_port, extra=["--fallbacks", "1"])
        deadline = time.monotonic() + 30
        while True:
            try:
                r = client.chat.completions.with_raw_response.create(
                    model="tiny", messages=[{"role": "user", "content": "after the restart"}],
                    max_tokens=4)
                if "x-turnstile-engine" in r.headers:  # decided by the new picker
                    break
            except openai.APIStatusError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        env.stop()
        picker.stop()


def test_killed_engine_unstreamed_turns_go_elsewhere(model: Path, tmp_path: Path,
                                                     llama_server_binary: Path,
                                                     stacks: Callable[..., Stack]) -> None:
    procs = _engines(model, tmp_path, llama_server_binary)
    try:
        s = stacks(procs, mode="override_host", fallbacks=1, policy="eager+kv-affinity",
                   health_interval_s=30.0)
        pk = s.picker.picker
        with ThreadPoolExecutor(4) as pool:  # at once, so that both engines get sessions
            got = pool.map(lambda i: _agent(s, i, turns=1, max_tokens=64, stream=False,
                                            named=True)[0], range(4))
            first = dict(enumerate(got))
        homes = {t["engine"] for t in first.values()}
        assert len(homes) == 2, first
        victim = procs[0]
        assert victim.process is not None
        os.kill(victim.process.pid, signal.SIGKILL)
        victim.process.wait(10)
        survivor = ep(procs[1])
        for i in range(4):  # every session's next turn, including the victim's sessions
            r = s.client.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": f"again {i}"}],
                max_tokens=4, extra_headers={"x-session-id": f"agent-{i}"})
            assert r.parse().usage.completion_tokens == 4
            assert r.headers["x-gateway-destination-endpoint-served"] == survivor
        assert not pk.engine_up[ep(victim)]  # the picker marked it down
        moved = [i for i, t in first.items() if t["engine"] == ep(victim)]
        assert moved and all(pk.sessions[f"agent-{i}"].last_engine == survivor for i in moved)
    finally:
        for p in procs:
            p.stop()
