"""Gateway overhead: requests through the gateway versus straight to the engine, on loopback.

Targets:

* a zero-cost fake OpenAI engine (:class:`turnstile.testing.fake_engine.FakeEngine`, no delays,
  pre-serialized answers): whatever latency the gateway adds is the gateway's own;
* llama.cpp's ``llama-server`` with the tiny random-weight model (``max_tokens=1``), when the
  binary is built (``make engine``).

Each target and the gateway run as separate processes (uvicorn); the load generator is a lean
asyncio HTTP/1.1 client with keep-alive connections in this process. Measured:

* latency, closed loop with one client: P50/P99 direct and through the gateway, and the
  difference (the gateway's added latency), non-streamed and streamed (time to the last byte);
* throughput with ``--concurrency`` clients for ``--seconds``: requests/s through the gateway
  and direct, plus the gateway process's CPU time per request (its one-core capacity is the
  inverse: on a machine with few cores the load generator and the engine compete with it).

    .venv/bin/python benchmarks/gateway_overhead.py --out benchmarks/results/gateway_overhead

Prints a table and writes ``gateway_overhead.json`` to ``--out``. Goal (docs/design.md): ≤ 2 ms
added P50 and ≥ 1,000 requests/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
CHAT = "/v1/chat/completions"


# ----------------------------------------------------------------------------- servers
def serve_fake(port: int) -> None:
    import uvicorn

    from turnstile.testing.fake_engine import FakeEngine

    uvicorn.run(FakeEngine(record=False), host="127.0.0.1", port=port, log_level="warning",
                access_log=False, lifespan="off", http="h11", loop="asyncio")


def serve_gateway(port: int, engine: str, kind: str, policy: str, client: str = "hand") -> None:
    import uvicorn

    from turnstile.gateway.app import create_app
    from turnstile.gateway.config import EngineConfig, GatewayConfig

    cfg = GatewayConfig(engines=[EngineConfig(engine, kind)], policy=policy, port=port,
                        max_held=100_000)
    app = create_app(cfg)
    if client == "aiohttp":
        for a in app.gateway.adapters.values():
            a.transport.fast = AiohttpForwarder(a.base_url)  # type: ignore[assignment]
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning",
                access_log=False, lifespan="on", http="h11", loop="asyncio")


class AiohttpForwarder:
    """aiohttp's client behind the interface of the hand-written one (``post`` → a response
    with ``status``, ``content_type``, ``read``, ``iter_raw``, ``aclose``), so the gateway can
    forward through either in the same benchmark run (issue 14: keep ``transport/fast.py`` only
    if aiohttp misses the overhead goals)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self._session: Any = None

    async def post(self, path: str, content: bytes, headers: dict[str, str]) -> Any:
        import aiohttp

        from turnstile.transport.fast import BrokenResponse, ConnectFailed

        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=2, sock_read=600),
                auto_decompress=False)
        try:
            resp = await self._session.post(self.base_url + path, data=content, headers=headers)
        except aiohttp.ClientConnectorError as e:
            raise ConnectFailed(str(e)) from e
        except aiohttp.ClientError as e:
            raise BrokenResponse(str(e)) from e
        return _AiohttpResponse(resp)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class _AiohttpResponse:
    def __init__(self, resp: Any) -> None:
        self._resp = resp
        self.status = resp.status
        self.content_type = resp.headers.get("content-type", "application/json")
        self.headers = resp.headers

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        finally:
            self._resp.release()

    async def iter_raw(self) -> Any:
        async for chunk in self._resp.content.iter_any():
            yield chunk

    async def aclose(self) -> None:
        self._resp.release()


def free_port() -> int:
    from turnstile.engines.llama_server import free_port as fp

    return fp()


class Proc:
    def __init__(self, args: list[str], port: int) -> None:
        self.port = port
        fd, self.log = tempfile.mkstemp(prefix="gw-bench-", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            self.p = subprocess.Popen([sys.executable, __file__, *args], stdout=log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._wait()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _wait(self) -> None:
        from turnstile.transport.blocking import wait_ready

        got = wait_ready(self.url + "/health", timeout_s=30, process=self.p)
        if got == "exited":
            raise RuntimeError(Path(self.log).read_text()[-2000:])
        if got == "timeout":
            raise RuntimeError(f"no server on {self.port}")

    def cpu_s(self) -> float:
        from turnstile.engines.process import cpu_seconds

        return cpu_seconds(self.p.pid)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        os.unlink(self.log)


# ----------------------------------------------------------------------------- load
def request_bytes(port: int, stream: bool, max_tokens: int) -> bytes:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hello"}],
                       "max_tokens": max_tokens, "stream": stream}).encode()
    return (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


async def read_response(r: asyncio.StreamReader) -> tuple[int, bool]:
    """Read one response; returns its status and whether the connection stays open."""
    head = await r.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    low = head.lower()
    keep = b"connection: close" not in low
    i = low.find(b"content-length:")
    if i >= 0:
        await r.readexactly(int(head[i + 15 : head.index(b"\r\n", i)]))
        return status, keep
    while True:  # chunked
        size = int((await r.readuntil(b"\r\n")).split(b";")[0], 16)
        await r.readexactly(size + 2)
        if size == 0:
            return status, keep


async def _client(port: int, req: bytes, lat: list[float], stop_at: float, n: int | None
                  ) -> int:
    errors = 0
    done = 0
    w: asyncio.StreamWriter | None = None
    try:
        while time.perf_counter() < stop_at and (n is None or done < n):
            t = time.perf_counter()
            fresh = w is None
            if w is None:
                r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(req)
            try:
                status, keep = await read_response(r)
            except asyncio.IncompleteReadError as e:
                # llama-server closes the connection after a streamed answer: send again
                if fresh or e.partial:
                    raise
                w.close()
                r, w = await asyncio.open_connection("127.0.0.1", port)
                w.write(req)
                status, keep = await read_response(r)
            if status != 200:
                errors += 1
            lat.append(time.perf_counter() - t)
            done += 1
            if not keep:
                w.close()
                w = None
    finally:
        if w is not None:
            w.close()
    return errors


def run_load(port: int, *, concurrency: int, seconds: float, n: int | None = None,
             stream: bool = False, max_tokens: int = 16, warmup: int = 50) -> dict[str, Any]:
    req = request_bytes(port, stream, max_tokens)

    async def main() -> tuple[list[float], float, int]:
        warm: list[float] = []
        await _client(port, req, warm, time.perf_counter() + 10, warmup)
        lat: list[float] = []
        t0 = time.perf_counter()
        errs = await asyncio.gather(*(_client(port, req, lat, t0 + seconds, n)
                                      for _ in range(concurrency)))
        return lat, time.perf_counter() - t0, sum(errs)

    lat, wall, errors = asyncio.run(main())
    a = np.array(lat) * 1e3
    return {"requests": len(lat), "errors": errors, "wall_s": wall, "rps": len(lat) / wall,
            "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "mean_ms": float(a.mean())}


# ----------------------------------------------------------------------------- benchmark
def compare(name: str, direct: Proc, gateway: Proc, args: argparse.Namespace,
            max_tokens: int, n: int) -> list[dict[str, Any]]:
    rows = []
    for stream in (False, True):
        d = run_load(direct.port, concurrency=1, seconds=120, n=n, stream=stream,
                     max_tokens=max_tokens)
        g = run_load(gateway.port, concurrency=1, seconds=120, n=n, stream=stream,
                     max_tokens=max_tokens)
        rows.append({"target": name, "mode": "stream" if stream else "non-stream",
                     "direct": d, "gateway": g,
                     "added_p50_ms": g["p50_ms"] - d["p50_ms"],
                     "added_p99_ms": g["p99_ms"] - d["p99_ms"]})
    return rows


def throughput(direct: Proc, gateway: Proc, args: argparse.Namespace) -> dict[str, Any]:
    d = run_load(direct.port, concurrency=args.concurrency, seconds=args.seconds)
    cpu0 = gateway.cpu_s()
    g = run_load(gateway.port, concurrency=args.concurrency, seconds=args.seconds)
    cpu = gateway.cpu_s() - cpu0
    per_req_ms = 1e3 * cpu / max(g["requests"] + args.concurrency * 0, 1)
    return {"concurrency": args.concurrency, "direct": d, "gateway": g,
            "gateway_cpu_ms_per_request": per_req_ms,
            "gateway_one_core_capacity_rps": 1e3 / per_req_ms if per_req_ms > 0 else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/gateway_overhead")
    ap.add_argument("--requests", type=int, default=2000, help="latency samples per case")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--policy", default="eager", help="gateway policy spec")
    ap.add_argument("--no-llama", action="store_true", help="skip the llama.cpp target")
    ap.add_argument("--serve-fake", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--serve-gateway", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--clients", default="hand",
                    help="forwarding clients to compare side by side: hand,aiohttp")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the client comparison, interleaved (noisy shared machines)")
    args = ap.parse_args(argv)
    if args.serve_fake:
        serve_fake(args.serve_fake)
        return 0
    if args.serve_gateway:
        port, engine, kind, policy, client = args.serve_gateway
        serve_gateway(int(port), engine, kind, policy, client)
        return 0

    console = Console()
    out: dict[str, Any] = {"machine": {"python": platform.python_version(),
                                       "cpus": os.cpu_count(), "platform": platform.platform()},
                           "policy": args.policy, "latency": [], "throughput": None}
    procs: list[Proc] = []
    try:
        fake = Proc(["--serve-fake", str(p := free_port())], p)
        procs.append(fake)
        out["throughput_by_client"] = {}
        for rnd, client in enumerate(args.clients.split(",") * args.rounds):
            gw = Proc(["--serve-gateway", str(q := free_port()), fake.url, "openai",
                       args.policy, client], q)
            procs.append(gw)
            console.print(f"zero-cost target {fake.url}, gateway {gw.url} ({args.policy}, "
                          f"forwarding client: {client})")
            rows = compare("zero-cost", fake, gw, args, 16, args.requests)
            for r in rows:
                r["client"] = client
                r["round"] = rnd // len(args.clients.split(","))
            out["latency"] += rows
            t = throughput(fake, gw, args)
            t["client"] = client
            out["throughput_by_client"].setdefault(client, []).append(t)
            if out["throughput"] is None:
                out["throughput"] = t
            gw.stop()
            procs.remove(gw)
        out["load_average"] = os.getloadavg()
        if not args.no_llama:
            out["latency"] += llama_rows(args, console, procs)
    finally:
        for pr in procs:
            pr.stop()

    table = Table(title="gateway overhead on loopback (milliseconds)", header_style="bold")
    for col in ("target", "client", "mode", "P50 direct", "P50 gateway", "P50 added", "P99 direct",
                "P99 gateway", "P99 added"):
        table.add_column(col, justify="right")
    for r in out["latency"]:
        d, g = r["direct"], r["gateway"]
        table.add_row(r["target"], r.get("client", "hand"), r["mode"], f"{d['p50_ms']:.3f}",
                      f"{g['p50_ms']:.3f}",
                      f"{r['added_p50_ms']:+.3f}", f"{d['p99_ms']:.3f}", f"{g['p99_ms']:.3f}",
                      f"{r['added_p99_ms']:+.3f}")
    console.print(table)
    for client, ts in out["throughput_by_client"].items():
        for t in ts:
            console.print(
                f"throughput ({client} client), {t['concurrency']} clients: direct "
                f"{t['direct']['rps']:,.0f} req/s, through the gateway "
                f"{t['gateway']['rps']:,.0f} req/s (errors {t['gateway']['errors']}); gateway CPU "
                f"{t['gateway_cpu_ms_per_request']:.3f} ms/request → one-core capacity ≈ "
                f"{t['gateway_one_core_capacity_rps']:,.0f} req/s")
    summary = _client_summary(out)
    out["client_summary"] = summary
    for client, m in summary.items():
        console.print(f"{client}: median added P50 non-stream {m['added_p50_ms_nonstream']:.3f} "
                      f"ms, stream {m['added_p50_ms_stream']:.3f} ms; median gateway CPU "
                      f"{m['cpu_ms_per_request']:.3f} ms/request "
                      f"(one core ≈ {m['one_core_rps']:,.0f} req/s); median "
                      f"{m['rps']:,.0f} req/s through the gateway")
    console.print(f"load average {out['load_average']}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gateway_overhead.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    console.print(f"wrote {path}")
    return 0


def _client_summary(out: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Medians over the rounds, per forwarding client."""
    summary = {}
    for client, ts in out["throughput_by_client"].items():
        rows = [r for r in out["latency"] if r.get("client") == client]
        cpu = float(np.median([t["gateway_cpu_ms_per_request"] for t in ts]))
        summary[client] = {
            "added_p50_ms_nonstream": float(np.median(
                [r["added_p50_ms"] for r in rows if r["mode"] == "non-stream"])),
            "added_p50_ms_stream": float(np.median(
                [r["added_p50_ms"] for r in rows if r["mode"] == "stream"])),
            "cpu_ms_per_request": cpu,
            "one_core_rps": 1e3 / cpu if cpu > 0 else 0.0,
            "rps": float(np.median([t["gateway"]["rps"] for t in ts])),
        }
    return summary


def llama_rows(args: argparse.Namespace, console: Console, procs: list[Proc]
               ) -> list[dict[str, Any]]:
    from turnstile.engines.llama_server import LlamaServerProcess, find_llama_server
    from turnstile.engines.tiny_model import write_tiny_gguf

    binary = find_llama_server()
    if binary is None:
        console.print("llama-server not built (make engine): skipping the llama.cpp target")
        return []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_gguf(Path(tmp) / "tiny.gguf")
        with LlamaServerProcess(model, n_parallel=4, ctx=8192, threads=1,
                                binary=binary) as server:
            port = server.port
            assert port is not None
            gw = Proc(["--serve-gateway", str(q := free_port()), server.base_url, "llama.cpp",
                       args.policy, "hand"], q)
            procs.append(gw)

            class _Direct:  # llama-server is not a Proc, but compare() only needs the port
                def __init__(self, port: int) -> None:
                    self.port = port

            console.print(f"llama.cpp target {server.base_url}, gateway {gw.url}")
            rows = compare("llama.cpp", _Direct(port), gw, args, 1,  # type: ignore[arg-type]
                           max(args.requests // 4, 200))
            gw.stop()
            procs.remove(gw)
            return rows


if __name__ == "__main__":
    sys.exit(main())
