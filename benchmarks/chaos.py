"""Chaos and load suite: faults injected under agent load, on real llama.cpp engines.

Processes, all on 127.0.0.1: two ``llama-server`` engines (the tiny GGUF model), each behind a
:class:`~turnstile.testing.fault_proxy.FaultProxy` (it counts generations per request id and
injects 5xx, delays and stalls); the gateway as a process (``python -m turnstile.gateway serve``)
with its SQLite state, then two replicas on a redis-server. Clients are closed-loop agents
(explicit sessions, tools offered, a tool pause between turns) that **retry a failed turn with
the same** ``x-request-id`` (after ``Retry-After`` on a 429, on the next replica when one is
down) until a per-turn deadline.

Phases (one fault each, bounded in turns and seconds): engine SIGKILL and SIGTERM (restarted
after ``--heal-s``), the engine answering 5xx, a slow engine (each response piece delayed) and a
stalled one (no byte for ``--stall-s``), the gateway SIGKILLed and restarted on its SQLite file,
hostile bodies (a hypothesis-generated corpus of malformed OpenAI requests) sent alongside the
agents, a replica SIGKILLed, Redis restarted (no persistence: its state is lost), and a load of
``--streams`` concurrent one-turn streams. One table:

* turns sent / completed / lost (the client gave up) / duplicated (a request id generated to
  its end more than once at the engines) / partial re-runs (generated again after a cut);
* answered (s): over the attempts under way in the 5 s after the fault, the longest silence
  (no status, no byte, no end) after it — how long the fault leaves a client waiting before it
  hears something (an error it can retry counts); recovered (s): until the first turn sent
  after the fault completed;
* peak memory (max RSS of the gateway processes) and requests/s completed.

The clients and the table's figures are in ``chaos_measure.py``.

    .venv/bin/python benchmarks/chaos.py                 # the full form (a few minutes)
    .venv/bin/python benchmarks/chaos.py --smoke   # CI-sized: tests/gateway/test_chaos_smoke.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from chaos_measure import Clients, Row, judge, raw_stream, streaming, table

from turnstile.engines.llama_server import LlamaServerProcess, find_llama_server, free_port
from turnstile.engines.tiny_model import write_tiny_gguf
from turnstile.testing.fault_proxy import Generation, ProxyProcess
from turnstile.testing.freeze import frozen
from turnstile.testing.redis_server import RedisServer, find_redis_server
from turnstile.testing.replicas import GatewayProcess, write_config
from turnstile.transport.blocking import wait_ready


# ============================================================================ engines
class Engine:
    """One engine process on a fixed port (llama-server, or the fake engine with --fake)."""

    def __init__(self, model: Path | None, port: int, tmp: Path) -> None:
        self.model, self.port, self.tmp = model, port, tmp
        self.proc: subprocess.Popen[bytes] | None = None
        self.llama: LlamaServerProcess | None = None

    def start(self) -> Engine:
        if self.model is not None:
            self.llama = LlamaServerProcess(self.model, port=self.port, n_parallel=4, ctx=8192,
                                            threads=1, slot_save_dir=self.tmp / f"s{self.port}")
            self.llama.start()
            self.proc = self.llama.process
            return self
        code = ("import uvicorn; from turnstile.testing.fake_engine import FakeEngine; "
                f"uvicorn.run(FakeEngine(ttft_s=0.02, tpot_s=0.01, record=False), "
                f"host='127.0.0.1', port={self.port}, log_level='error', loop='asyncio')")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)
        if wait_ready(f"http://127.0.0.1:{self.port}/health", timeout_s=20,
                      process=self.proc) == "ready":
            return self
        raise TimeoutError("fake engine did not start")

    def signal(self, sig: int, sent: Callable[[], None] | None = None) -> None:
        """Send ``sig`` and wait for the process to end; ``sent``: called once it is sent (a
        frozen engine is continued there, to act on it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            if sent is not None:
                sent()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.llama is not None:
            self.llama.process = None
            self.llama.stop()

    def stop(self) -> None:
        self.signal(signal.SIGTERM)


def peak_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Suite:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        binary = None if args.fake else find_llama_server()
        if not args.fake and binary is None:
            raise SystemExit("llama-server not found (make engine, or TURNSTILE_LLAMA_SERVER)")
        model = None if args.fake else write_tiny_gguf(tmp / "tiny.gguf")
        self.engines = [Engine(model, free_port(), tmp).start() for _ in range(2)]
        self.proxies = [ProxyProcess("127.0.0.1", e.port) for e in self.engines]
        self.gateways: list[GatewayProcess] = []
        self.rows: list[Row] = []
        self.peak_mb = 0.0
        self.hostile_failures: list[str] = []
        self.frozen: list[Callable[[], None]] = []

    def generations(self) -> list[Generation]:
        return [g for p in self.proxies for g in p.generations()]

    def targets(self) -> list[str]:
        return [g.url for g in self.gateways]

    def gateway(self, name: str, port: int | None = None, **cfg: Any) -> GatewayProcess:
        path = write_config(self.tmp / f"{name}.toml", [(p.url, "llama.cpp")
                                                        for p in self.proxies],
                            self.args.policy, None, stats_interval_s=0.5,
                            max_held=self.args.max_held, recheck_interval_s=0.25,
                            health_interval_s=0.5, stall_probe_s=self.args.stall_probe_s,
                            **cfg)
        return GatewayProcess(path, replica_id=name, port=port).start(60)

    def freeze(self) -> None:
        """Stop the engines (SIGSTOP): a turn under way stays under way, at any host speed."""
        self.frozen += [frozen(e.proc.pid) for e in self.engines
                        if e.proc is not None and e.proc.poll() is None]

    def thaw(self) -> None:
        """Continue the engines :meth:`freeze` stopped (nothing where none is)."""
        go_on, self.frozen = self.frozen, []
        for g in go_on:
            g()

    async def under_way(self, clients: Clients, timeout_s: float = 10.0) -> str:
        """Freeze the engines with a stream under way, running them a slice at a time until
        there is one (on a host 4x faster, 16-token turns were over before a fault 0.3 s in:
        the faults hit nothing); returns its engine, or "" (the engines running) when none
        came in ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.freeze()
            await asyncio.sleep(0.05)  # the bytes made so far reach their clients
            if engine := streaming(clients):
                return engine
            self.thaw()
            await asyncio.sleep(0.01)
        return ""

    def note_memory(self) -> None:
        for g in self.gateways:
            if g.proc is not None and g.proc.poll() is None:
                self.peak_mb = max(self.peak_mb, peak_rss_mb(g.proc.pid))

    async def phase(self, name: str, inject: Callable[[int], Any] | None,
                    heal: Callable[[int], Any] | None = None, *, injected: int = 1,
                    extra: Callable[[], Any] | None = None, on_engine: bool = False) -> Row:
        """Agents run while ``inject(i)`` is called once, when a stream is under way (``i``:
        the index of the engine serving it), then ``heal(i)`` after ``--heal-s``."""
        a = self.args
        clients = Clients(self.targets, a.max_tokens, a.turn_deadline_s)
        t_start = time.monotonic()
        load = [asyncio.ensure_future(clients.agent(f"{name}-{i}", a.turns, a.tool_s, i))
                for i in range(a.sessions)]
        faults: list[float] = []
        note = ""
        engine = ""
        hit: bool | None = None
        if inject is not None:
            # the load settled: --fault-at-s in, or half its turns sent (a fast host)
            while (time.monotonic() - t_start < a.fault_at_s
                   and len(clients.turns) < a.sessions * a.turns // 2):
                await asyncio.sleep(0.005)
            try:
                engine = await self.under_way(clients)
                i = next((k for k, p in enumerate(self.proxies)
                          if engine.endswith(f":{p.port}")), 0)
                hit = bool(engine)
                engine = f":{self.proxies[i].port}" if on_engine else ""
                faults.append(time.monotonic())
                note = str(await asyncio.to_thread(inject, i) or "")
            finally:
                self.thaw()
            if heal is not None:
                await asyncio.sleep(a.heal_s)
                await asyncio.to_thread(heal, i)
        if extra is not None:
            note = str(await extra() or "")
        _, pending = await asyncio.wait(load, timeout=a.phase_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await clients.aclose()
        self.note_memory()
        row = judge(Row(name, injected, note=note, hit=hit), clients.turns, self.generations(),
                    faults, time.monotonic() - t_start, engine=engine)
        row.peak_mb = self.peak_mb
        self.rows.append(row)
        print(f"  {name}: {row}", file=sys.stderr, flush=True)
        return row

    # ------------------------------------------------------------------ faults
    def kill_engine(self, sig: int) -> Callable[[int], None]:
        return lambda i: self.engines[i].signal(sig, sent=self.thaw)

    def restart_engine(self, i: int) -> None:
        self.engines[i].start()

    async def hostile(self) -> str:
        from turnstile.testing.hostile import corpus

        bodies = corpus(self.args.hostile, seed=1)
        codes: dict[int, int] = {}
        sem = asyncio.Semaphore(16)
        failed: list[str] = []
        async with httpx.AsyncClient(timeout=self.args.turn_deadline_s) as c:
            async def one(raw: bytes) -> None:
                async with sem:
                    try:
                        r = await c.post(self.targets()[0] + "/v1/chat/completions",
                                         content=raw, headers={"content-type": "application/json"})
                        code, text = r.status_code, r.text[:300]
                    except httpx.HTTPError as e:
                        code, text = 0, repr(e)
                    codes[code] = codes.get(code, 0) + 1
                    if code >= 500 or code == 0:
                        failed.append(f"{code} {text} <- {raw[:300]!r}")
            await asyncio.gather(*(one(b) for b in bodies))
        self.hostile_failures = failed
        bad = sum(n for s, n in codes.items() if s >= 500 or s == 0)
        return f"{bad} of {len(bodies)} bodies got a 5xx/no answer; " + ", ".join(
            f"{s}:{n}" for s, n in sorted(codes.items()))

    async def streams(self, n: int) -> Row:
        """``n`` concurrent one-turn streams (no session, no tools), each retried with its
        request id until ``--load-deadline-s``; a plain socket client (httpx costs too much CPU
        for thousands of streams on a small machine)."""
        a = self.args
        t0 = time.monotonic()
        logs = await asyncio.gather(*(raw_stream(
            self.targets(), f"load{n}-{i}", json.dumps(
                {"model": "tiny", "max_tokens": a.load_max_tokens, "stream": True,
                 "messages": [{"role": "user", "content": f"question {i}"}]}).encode(),
            a.load_deadline_s, i) for i in range(n)))
        wall = time.monotonic() - t0
        self.note_memory()
        shed = sum(s == 429 for t in logs for s in t.statuses)
        row = judge(Row(f"{n} concurrent streams", n, note=f"{shed} x 429, retried"),
                    list(logs), self.generations(), [], wall)
        row.peak_mb, row.answered_s, row.recovered_s = self.peak_mb, float("nan"), wall
        self.rows.append(row)
        print(f"  streams {n}: {row}", file=sys.stderr, flush=True)
        return row

    async def run(self) -> None:
        a = self.args
        db = self.tmp / "gateway.sqlite3"
        gw = self.gateway("single", db=str(db))
        self.gateways = [gw]
        px = self.proxies
        await self.phase("no fault (baseline)", lambda i: None)
        await self.phase("engine SIGKILL", self.kill_engine(signal.SIGKILL), self.restart_engine,
                         on_engine=True)
        await self.phase("engine SIGTERM", self.kill_engine(signal.SIGTERM), self.restart_engine,
                         on_engine=True)
        await self.phase("engine 5xx", lambda i: px[i].set(fail_status=503),
                         lambda i: px[i].set(fail_status=0), on_engine=True)
        await self.phase("slow engine", lambda i: px[i].set(delay_s=a.delay_s),
                         lambda i: px[i].set(delay_s=0.0), on_engine=True)
        await self.phase("stalled engine",
                         lambda i: px[i].set(stall_until=time.monotonic() + a.stall_s),
                         on_engine=True)

        def restart_gateway(_: int) -> None:
            port = self.gateways[0].port
            self.gateways[0].kill()
            self.thaw()
            self.gateways[0] = GatewayProcess(self.gateways[0].config, replica_id="single",
                                              port=port).start(60)

        await self.phase("gateway SIGKILL+restart", restart_gateway)
        await self.phase("hostile bodies", None, injected=a.hostile, extra=self.hostile)
        for n in a.streams:
            await self.streams(n)
        for g in self.gateways:
            g.close()
        if a.no_redis or find_redis_server() is None:
            return
        with RedisServer() as redis:
            self.gateways = [self.gateway(f"r{i}", state=redis.url, replica_ttl_s=1.0)
                             for i in range(2)]

            def kill_replica(_: int) -> None:
                self.gateways[0].kill()
                self.gateways = self.gateways[1:]

            await self.phase("replica SIGKILL", kill_replica)
            self.gateways.append(self.gateway("r0", state=redis.url, replica_ttl_s=1.0))

            def restart_redis(_: int) -> None:
                redis.stop()
                self.thaw()
                redis.start()

            await self.phase("Redis restart", restart_redis)
            for g in self.gateways:
                g.close()

    def close(self) -> None:
        self.thaw()
        for g in self.gateways:
            g.close()
        for p in self.proxies:
            p.stop()
        for e in self.engines:
            e.stop()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CI-sized run (tens of seconds)")
    ap.add_argument("--fake", action="store_true", help="fake engines (no llama-server)")
    ap.add_argument("--policy", default="cvar+kv-affinity+ttl")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--tool-s", type=float, default=0.3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-held", type=int, default=1024)
    ap.add_argument("--fault-at-s", type=float, default=1.0)
    ap.add_argument("--heal-s", type=float, default=2.0)
    ap.add_argument("--delay-s", type=float, default=0.2)
    ap.add_argument("--stall-s", type=float, default=3.0)
    ap.add_argument("--stall-probe-s", type=float, default=0.0,
                    help="the gateway's stall probe (0: off, the default; see "
                    "GatewayConfig.stall_probe_s and docs/reliability.md)")
    ap.add_argument("--phase-s", type=float, default=90.0)
    ap.add_argument("--turn-deadline-s", type=float, default=60.0)
    ap.add_argument("--hostile", type=int, default=300)
    ap.add_argument("--streams", type=int, nargs="*", default=[500, 2000])
    ap.add_argument("--load-max-tokens", type=int, default=8)
    ap.add_argument("--load-deadline-s", type=float, default=300.0)
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="write table.md and rows.json here")
    a = ap.parse_args(argv)
    if a.smoke:
        a.sessions, a.turns, a.tool_s, a.hostile, a.streams = 6, 3, 0.15, 40, [100]
        a.heal_s, a.stall_s, a.fault_at_s, a.phase_s, a.turn_deadline_s = 1.0, 1.5, 0.3, 30, 20
        a.load_deadline_s = 30.0
    return a


def main(argv: list[str] | None = None) -> list[Row]:
    a = parse(argv)
    with tempfile.TemporaryDirectory(prefix="turnstile-chaos-") as d:
        suite = Suite(a, Path(d))
        try:
            asyncio.run(suite.run())
        finally:
            suite.close()
    print(table(suite.rows))
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "table.md").write_text(table(suite.rows) + "\n")
        (a.out / "rows.json").write_text(json.dumps(
            {"argv": sys.argv[1:] if argv is None else argv,
             "rows": [r.__dict__ for r in suite.rows],
             "hostile_failures": suite.hostile_failures}, indent=1))
    return suite.rows


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
