"""Does a real vLLM honour the ``priority`` the gateway sends? One scenario, free of races.

The engine (``--max-num-seqs 4``) is paused (``POST /pause?mode=keep&clear_cache=false``, dev
mode: its scheduler admits nothing, requests still enter its queue). Into its queue go, in this
order: three *fillers* straight to the engine (1,500 output tokens each, ``priority``
-1,000,000: first under either policy), then through the gateway (``eager+tiered-aging``:
nothing held there) two long-prompt turns ``low0``, ``low1`` and a short ``high``, which
``tiered-aging`` gives the lowest (earliest) priority of the three. The engine-core process is
stopped (SIGSTOP), told to resume, and continued for a few milliseconds at a time (SIGCONT,
SIGSTOP) until a turn has a token: it has run a few steps, and in
its first one its scheduler admitted four requests — the fillers and *one* turn, the first of
its queue: a heap on (priority, arrival) under ``--scheduling-policy priority`` (``high``), a
FIFO otherwise (``low0``). With the engine stopped, its API server streams every token made so
far, and the clients show which turn that was: the only one with tokens. The host's speed
hardly matters: nothing runs while the scheduler is paused, a stopped process makes no step,
and the engine runs far fewer steps than a turn's 1,024 before it is stopped — unless the host
is so loaded that a shell's ``sleep 0.02`` overruns by seconds; then the fillers end first and
the scenario is set up again (:class:`SetUpDidNotHold`). (On a loaded
host vLLM's API server streams seconds late and in bursts, so neither when a client sees a
token nor an HTTP pause, which that server reads as late, could show the engine's order.)
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from turnstile.engines.vllm_server import VllmServerProcess
from turnstile.gateway.adapters import VllmAdapter, make_adapter, parse_prometheus
from turnstile.gateway.embedded import start_gateway
from turnstile.testing.freeze import frozen

#: ~400 tokens of the tiny vocabulary: a turn whose state costs ``tiered-aging`` seconds
LONG = "plan the work and check each step " * 40
#: the turns, in the order they are sent: (name, prompt)
TURNS = (("low0", "low 0\n" + LONG), ("low1", "low 1\n" + LONG), ("high", "quick question"))
#: a turn's name by its prompt's first line
NAMES = {prompt.split("\n")[0]: name for name, prompt in TURNS}
#: each filler's output
FILLER_TOKENS = 1500
#: each turn's output: far more steps than the engine runs before it is stopped
TURN_TOKENS = 1024
#: how long a request is given to reach the paused engine's queue once sent (its API server
#: is idle then: milliseconds, even on a loaded host)
ARRIVE_S = 2.0


class Filler:
    """A long completion straight to the engine, ahead of every turn in its queue, not streamed
    (so that the engine's API server, on the same two cores, has only the turns to stream);
    cancelled by shutting its connection (vLLM aborts the request) from any thread."""

    def __init__(self, server: VllmServerProcess, i: int) -> None:
        self.i = i
        self.conn = http.client.HTTPConnection(server.HOST, server.port, timeout=300)
        self.cancelled = False
        self.ended = False  # ran to its max_tokens
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": "tiny", "prompt": f"filler {self.i}", "max_tokens": FILLER_TOKENS,
                "priority": -1_000_000}
        try:
            self.conn.request("POST", "/v1/completions", json.dumps(body),
                              {"content-type": "application/json"})
            r = self.conn.getresponse()
            self.ended = r.status == 200 and bool(r.read()) and not self.cancelled
        except (OSError, http.client.HTTPException):
            pass  # cancelled

    def cancel(self) -> None:
        self.cancelled = True
        if self.conn.sock is not None:
            with contextlib.suppress(OSError):
                self.conn.sock.shutdown(socket.SHUT_RDWR)


class Control:
    """Pause and resume ``server``'s scheduler over one kept-alive connection (dev mode)."""

    def __init__(self, server: VllmServerProcess) -> None:
        self.conn = http.client.HTTPConnection(server.HOST, server.port, timeout=60)

    def _post(self, path: str) -> None:
        for attempt in range(2):  # the server closes a connection idle for 5 s: reconnect
            try:
                self.conn.request("POST", path)
                r = self.conn.getresponse()
                break
            except (http.client.RemoteDisconnected, ConnectionError):
                self.conn.close()
                if attempt:
                    raise
        body = r.read()
        assert r.status == 200, body

    def pause(self) -> None:
        """The scheduler runs nothing; requests still enter its queue (``clear_cache=false``:
        a cache reset would also move the running requests back to the queue)."""
        self._post("/pause?mode=keep&clear_cache=false")

    def resume(self) -> None:
        self._post("/resume")

    def close(self) -> None:
        self.conn.close()


def engine_core_pid(server: VllmServerProcess) -> int:
    """The pid of ``server``'s engine-core process (a child of its API server)."""
    assert server.process is not None
    api = server.process.pid
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            pid, rest = stat.read_text().split(" (", 1)
            comm, fields = rest.rsplit(") ", 1)
            if int(fields.split()[1]) == api and comm.startswith("VLLM::EngineCor"):
                return int(pid)
    raise AssertionError(f"no engine-core process under the API server {api}")


def run_for(pid: int, run_s: float) -> None:
    """Continue the stopped process ``pid`` for ``run_s`` and stop it again, timed by a shell of
    its own: this process, streaming through its gateway's threads, may wait for its GIL far
    longer than ``run_s`` (a stop 2 s late let the engine run 1,500 steps)."""
    subprocess.run(["sh", "-c", f"kill -CONT {pid}; sleep {run_s}; kill -STOP {pid}"],
                   check=True, timeout=60)


def engine_counts(server: VllmServerProcess) -> tuple[float, float]:
    m = parse_prometheus(httpx.get(server.base_url + "/metrics", timeout=60).text)
    return m.get("vllm:num_requests_running", -1.0), m.get("vllm:num_requests_waiting", -1.0)


def wait_for(what: str, cond: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not in {timeout_s:.0f} s: {what}"
        time.sleep(0.02)


class SetUpDidNotHold(AssertionError):
    """The engine ran on unobserved (its fillers ended before it was stopped): a host so loaded
    that even a shell's ``sleep 0.02`` overran by seconds. The scenario, not vLLM, failed."""


def first_admitted(server: VllmServerProcess, monkeypatch: pytest.MonkeyPatch,
                   attempts: int = 3) -> tuple[list[str], dict[str, int]]:
    """:func:`first_admitted_once`, set up again (``attempts`` in all) where the set-up did not
    hold (measured: 1 attempt in 6 with two busy loops beside the engines on a 2-core host)."""
    for attempt in range(attempts):
        try:
            return first_admitted_once(server, monkeypatch)
        except SetUpDidNotHold as e:
            print(f"\nset-up {attempt + 1} did not hold: {e}")
            if attempt + 1 == attempts:
                raise
    raise AssertionError("unreachable")


def first_admitted_once(server: VllmServerProcess, monkeypatch: pytest.MonkeyPatch
                        ) -> tuple[list[str], dict[str, int]]:
    """Run the scenario on ``server`` (idle, ``--max-num-seqs 4``, started by this process): the
    turns, the one the engine admitted first ahead of the others, and the priorities the
    adapter sent for them. Asserts that it admitted exactly one turn first (one free slot)."""
    sent: dict[str, int] = {}
    forwarded: list[str] = []
    prepare = VllmAdapter.prepare

    def recording(self: VllmAdapter, body: dict[str, Any], hints: Any) -> dict[str, Any]:
        out = prepare(self, body, hints)
        name = NAMES[body["messages"][0]["content"].split("\n")[0]]
        sent[name] = out["priority"]
        forwarded.append(name)
        return out

    monkeypatch.setattr(VllmAdapter, "prepare", recording)
    gw = start_gateway([make_adapter(server.base_url, "vllm", engine_id="vllm-0")],
                       policy="eager+tiered-aging",
                       policy_params={"admission": {"tokens_per_s": 50.0}})
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0,
                           timeout=180)
    first: dict[str, float] = {}

    def turn(name: str, prompt: str) -> None:
        for ch in client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": prompt}],
                max_tokens=TURN_TOKENS, stream=True, extra_headers={"x-session-id": name}):
            if ch.choices and ch.choices[0].delta.content and name not in first:
                first[name] = time.monotonic()

    fillers = [Filler(server, i) for i in range(3)]
    control = Control(server)
    core = engine_core_pid(server)
    threads: list[threading.Thread] = []
    paused = False
    go_on: Callable[[], None] | None = None  # continues the stopped engine core
    try:
        wait_for("an idle engine", lambda: engine_counts(server) == (0, 0))
        control.pause()
        paused = True
        for f in fillers:
            f.thread.start()
        time.sleep(ARRIVE_S)  # the fillers are in the paused engine's queue, first
        for name, prompt in TURNS:
            threads.append(threading.Thread(target=turn, args=(name, prompt)))
            threads[-1].start()
            wait_for(f"the gateway forwarding {name}", lambda name=name: name in forwarded)
            time.sleep(ARRIVE_S)  # in the engine's queue before the next one is sent
        assert not first and not any(f.ended for f in fillers), first  # nothing ran
        resume = threading.Thread(target=control.resume)  # answered once the core runs
        go_on = frozen(core)
        resume.start()
        paused = False
        time.sleep(ARRIVE_S)  # the resume waits at the stopped core
        run_s = 0.02
        for _ in range(8):  # run the core a few steps at a time, until a turn has tokens
            run_for(core, run_s)
            with contextlib.suppress(AssertionError):
                wait_for("a turn's first token", lambda: bool(first), ARRIVE_S)
                break
            run_s = min(2 * run_s, 0.2)
        time.sleep(ARRIVE_S)  # stopped: every token made so far reaches its client
        admitted = sorted(first)
        fillers_over = [f.i for f in fillers if f.ended]
    finally:
        if go_on is not None:
            go_on()
            if resume.is_alive():
                resume.join(60)
        if paused:
            control.resume()
        control.close()
        for f in fillers:
            f.cancel()
        for t in [*(f.thread for f in fillers), *threads]:
            t.join(180)
        gw.stop()
    assert set(first) == set(NAMES.values()), first  # all served in the end
    later = sorted((n for n in first if n not in admitted), key=first.__getitem__)
    print(f"\nadmitted first: {admitted}; then {later}; priorities sent {sent}; fillers over "
          f"then {fillers_over}")
    if fillers_over:
        raise SetUpDidNotHold(f"fillers {fillers_over} over, turns {admitted} begun")
    # the fillers and one turn took the four slots (had a filler not been in the queue, two
    # turns would have found a slot)
    assert len(admitted) == 1, admitted
    order = admitted + later
    return order, sent
