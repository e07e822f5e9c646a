"""Live rollouts: tool-calling trajectories against real llama.cpp engines, scheduled by the
turnstile gateway running the same routing policy object class as the simulator (``cmlfq`` by
default).

Two ``llama-server`` engines form two buckets (different slot counts and TP labels: a many-slot
throughput engine at level 0, a few-slot latency engine at level 1). The driver starts them and a
gateway in front of them (``turnstile serve`` in a subprocess, configured with the policy
``eager+<routing>`` and each engine's ``tp`` and ``bucket``); the gateway's scheduler core routes
every turn. Each trajectory is a :class:`~turnstile.rollout.workload.RolloutTrajectory` cut to a
few turns. Per turn the driver sends the conversation so far (``x-session-id``: the trajectory,
``x-tenant-id``: its prompt) to the gateway's ``/v1/chat/completions`` (``cache_prompt`` on, so a
trajectory that stays reuses its slot's KV), records the real usage and which engine served it
(the response's ``x-turnstile-engine``), then runs the turn's tool calls **for real** in a
sandbox — a calculator, file read/write in a temporary directory, sleep-for-N — and reports each
return in the next request as an OpenAI ``tool`` message (name, result; ``Error:`` /
``Timeout:`` results mark failures), which the gateway turns into C-MLFQ's
``tool:size:status`` codes. The tiny test model writes garbage, so *which* tool runs and how it
is called is decided deterministically from the trajectory spec (a failing call in the spec
becomes a call that really fails: division by zero, a missing file, a path outside the sandbox;
a timeout becomes a sleep longer than the tool timeout).
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import itertools
import json
import math
import operator
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from turnstile.rollout.workload import RolloutSpec, RolloutTrajectory, RolloutWorkload
from turnstile.workload.model import ToolCall, ToolStatus

if TYPE_CHECKING:
    from turnstile.transport.client import HttpTransport

__all__ = [
    "LiveBucket",
    "LiveConfig",
    "LiveDriver",
    "ToolError",
    "ToolSandbox",
    "gateway_toml",
    "plan_tool",
    "run_live",
]


class ToolError(Exception):
    """A tool call failed (its status is ``error``)."""


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def _calc(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _calc(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _calc(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _calc(node.left), _calc(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ToolError("exponent too large")
        return _BINOPS[type(node.op)](left, right)
    raise ToolError(f"unsupported expression element {type(node).__name__}")


class ToolSandbox:
    """Small deterministic tools confined to one directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        if not name or "/" in name or "\\" in name or name.startswith("."):
            raise ToolError(f"path {name!r} is outside the sandbox")
        return self.root / name

    def calculator(self, expr: str) -> str:
        try:
            tree = ast.parse(expr, mode="eval")
            return repr(_calc(tree))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except SyntaxError as e:
            raise ToolError(f"syntax error: {e.msg}") from None

    def write_file(self, name: str, text: str) -> str:
        p = self._path(name)
        p.write_text(text, encoding="utf-8")
        return f"wrote {len(text)} characters to {name}"

    def read_file(self, name: str) -> str:
        p = self._path(name)
        if not p.is_file():
            raise ToolError(f"no such file: {name}")
        return p.read_text(encoding="utf-8")

    async def sleep(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return f"slept {seconds:.3f} s"

    async def run(self, tool: str, arg: str, timeout_s: float) -> tuple[ToolStatus, str, float]:
        """Run one call; returns (status, result text, seconds)."""
        t0 = time.perf_counter()
        try:
            if tool == "sleep":
                text = await asyncio.wait_for(self.sleep(float(arg)), timeout_s)
            elif tool == "calculator":
                text = self.calculator(arg)
            elif tool == "read_file":
                text = self.read_file(arg)
            elif tool == "write_file":
                name, _, body = arg.partition("\n")
                text = self.write_file(name, body)
            else:
                raise ToolError(f"unknown tool {tool!r}")
            status: ToolStatus = "ok"
        except TimeoutError:
            status, text = "timeout", f"{tool} timed out after {timeout_s:.3f} s"
        except (ToolError, OSError, ValueError) as e:
            status, text = "error", f"{tool} failed: {e}"
        return status, text, time.perf_counter() - t0


def _num(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=4).digest(), "little")


def plan_tool(call: ToolCall, traj_id: str, turn: int, index: int, cfg: LiveConfig
              ) -> tuple[str, str]:
    """The real call (tool, argument) standing for a spec call: deterministic, and failing or
    timing out exactly when the spec call does."""
    a, b, c = (_num(traj_id, turn, index, k) % 997 + 1 for k in range(3))
    if call.status == "timeout":
        return "sleep", f"{cfg.tool_timeout_s * 4:.3f}"
    fail = call.status == "error"
    name = call.name
    if name in ("Read", "Grep", "Glob"):
        return "read_file", f"missing-{turn}-{index}.txt" if fail else "notes.txt"
    if name in ("Write", "Edit", "TodoWrite"):
        target = "../escape.txt" if fail else f"out-{turn}-{index}.txt"
        return "write_file", f"{target}\n" + " ".join(str(a * k) for k in range(1, b % 24 + 2))
    if not fail and call.duration_s >= 1.0:
        secs = min(call.duration_s * cfg.sleep_scale, cfg.max_sleep_s)
        return "sleep", f"{secs:.3f}"
    return "calculator", f"{a} / 0" if fail else f"{a} * {b} + {c}"


@dataclass(frozen=True)
class LiveBucket:
    """One engine: its level's TP label (orders the levels), slots and threads."""

    name: str
    tp: int
    n_parallel: int
    threads: int = 1
    ctx: int = 8192


@dataclass
class LiveConfig:
    trajectories: int = 8
    policy: str = "cmlfq"
    max_turns: int = 4
    max_tokens: int = 16
    seed: int = 0
    model_path: Path | None = None
    steps: int = 1
    samples: int = 2
    tool_timeout_s: float = 0.3
    #: spec tool seconds → real sleep seconds, and the cap
    sleep_scale: float = 0.01
    max_sleep_s: float = 0.2
    request_timeout_s: float = 60.0
    buckets: tuple[LiveBucket, ...] = (
        LiveBucket("throughput", tp=1, n_parallel=4),
        LiveBucket("latency", tp=2, n_parallel=1),
    )
    #: how a trajectory's first prompt is scaled down (tokens of the spec / this)
    prompt_divisor: int = 200
    #: constructor arguments of the gateway's routing policy (TOML-able values)
    routing_params: dict[str, Any] = field(default_factory=dict)
    #: the gateway closes a trajectory's session this long after its last turn (the router
    #: learns from it then); the driver waits this long between steps
    session_idle_s: float = 1.0


class LiveDriver:
    """Runs trajectories through the gateway (asyncio; one event loop). The gateway routes."""

    def __init__(self, gateway_url: str, sandbox_root: Path, cfg: LiveConfig) -> None:
        self.gateway_url = gateway_url
        self.cfg = cfg
        self.sandbox_root = sandbox_root
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def _spec_turns(self, tr: RolloutTrajectory) -> list[tuple[int, tuple[ToolCall, ...]]]:
        turns = tr.workflow.turns[: self.cfg.max_turns]
        out = []
        for j, t in enumerate(turns):
            n = max(2, min(self.cfg.max_tokens, math.ceil(t.output_tokens / 32)))
            out.append((n, t.tools if j < len(turns) - 1 else ()))
        return out

    async def run_trajectory(self, transport: HttpTransport, tr: RolloutTrajectory
                             ) -> dict[str, Any]:
        cfg = self.cfg
        t_start = self.now()
        sandbox = ToolSandbox(self.sandbox_root / tr.id)
        sandbox.write_file("notes.txt", f"notes for {tr.prompt_id}: " + "lorem ipsum " * 40)
        words = max(8, tr.prompt_tokens // cfg.prompt_divisor)
        task = f"Task {tr.prompt_id}. " + " ".join(f"w{_num(tr.prompt_id, i) % 97}"
                                                   for i in range(words))
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a careful agent. Use tools."},
            {"role": "user", "content": task},
        ]
        headers = {"x-session-id": tr.id, "x-tenant-id": tr.prompt_id}
        served: list[str] = []  # the engine the gateway reports for each turn
        statuses: list[str] = []
        output_tokens = 0
        for j, (max_tokens, tools) in enumerate(self._spec_turns(tr)):
            resp = await transport.post(
                "/v1/chat/completions",
                json.dumps({"model": "tiny", "messages": messages, "max_tokens": max_tokens,
                            "temperature": 0.0, "cache_prompt": True}).encode(),
                headers,
            )
            data = await resp.read()
            if resp.status >= 400:
                raise RuntimeError(f"{tr.id} turn {j}: the gateway answered HTTP {resp.status}: "
                                   f"{data[:200]!r}")
            served.append(resp.headers.get("x-turnstile-engine", ""))
            body = json.loads(data)
            usage = body.get("usage") or {}
            output_tokens += int(usage.get("completion_tokens", max_tokens))
            text = body["choices"][0]["message"].get("content") or ""
            messages.append({"role": "assistant", "content": text})
            for i, call in enumerate(tools):
                tool, arg = plan_tool(call, tr.id, j, i, cfg)
                status, result, _ = await sandbox.run(tool, arg, cfg.tool_timeout_s)
                statuses.append(f"{tool}:{status}" + ("" if status == call.status else "!"))
                prefix = {"error": "Error: ", "timeout": "Timeout: "}.get(status, "")
                messages.append({"role": "tool", "name": tool,
                                 "content": prefix + result[:400]})
        moves = sum(a != b for a, b in itertools.pairwise(served))
        return {
            "id": tr.id,
            "turns": len(served),
            "output_tokens": output_tokens,
            "served_by": served,
            "moves": moves,
            "tools": statuses,
            "finish_s": round(self.now() - t_start, 4),
        }

    async def run_batch(self, batch: Sequence[RolloutTrajectory]) -> dict[str, Any]:
        from turnstile.transport.client import HttpTransport  # httpx: the gateway extra

        t0 = self.now()
        transport = HttpTransport(self.gateway_url, headers={"content-type": "application/json"},
                                  read_timeout_s=self.cfg.request_timeout_s, max_keepalive=64)
        try:
            recs = await asyncio.gather(*(self.run_trajectory(transport, t) for t in batch))
        finally:
            await transport.aclose()
        return {"makespan_s": self.now() - t0, "trajectories": list(recs)}


def _engine_name(i: int, b: LiveBucket) -> str:
    return f"e{i}-{b.name}"


def gateway_toml(cfg: LiveConfig, engine_urls: Sequence[str], port: int) -> str:
    """The gateway's config: the policy ``eager+<routing>``, and every engine with its TP and
    bucket (what the bucket router groups by)."""
    from turnstile.gateway.process import config_toml

    return config_toml(
        {"host": "127.0.0.1", "port": port, "policy": "eager+" + cfg.policy,
         "read_timeout_s": float(cfg.request_timeout_s), "stats_interval_s": 0.0,
         "session_idle_s": float(cfg.session_idle_s)},
        [{"url": url, "kind": "llama.cpp", "name": _engine_name(i, b), "tp": b.tp,
          "bucket": b.name}
         for i, (b, url) in enumerate(zip(cfg.buckets, engine_urls, strict=True))],
        policy_params={"routing": cfg.routing_params} if cfg.routing_params else None)


def _start_engines(cfg: LiveConfig, tmp: Path, log: Callable[[str], None]) -> list[Any]:
    from turnstile.engines.llama_server import LlamaServerProcess, require_llama_server
    from turnstile.engines.tiny_model import write_tiny_gguf

    binary = require_llama_server()
    model = cfg.model_path or write_tiny_gguf(tmp / "tiny.gguf")
    procs = []
    try:
        for b in cfg.buckets:
            p = LlamaServerProcess(model, n_parallel=b.n_parallel, ctx=b.ctx, threads=b.threads,
                                   binary=binary)
            p.start()
            log(f"engine {b.name}: {p.base_url} (-np {b.n_parallel} -t {b.threads}, tp {b.tp})")
            procs.append(p)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _turns_per_engine(metrics_text: str) -> dict[str, int]:
    """The gateway's own tally: ``turnstile_gateway_turns_finished_total`` per engine."""
    out: dict[str, int] = {}
    for line in metrics_text.splitlines():
        if line.startswith("turnstile_gateway_turns_finished_total{"):
            labels, _, value = line.rpartition(" ")
            for part in labels[labels.index("{") + 1: -1].split(","):
                k, _, v = part.partition("=")
                if k == "engine":
                    out[v.strip('"')] = int(float(value))
    return out


def run_live(cfg: LiveConfig, log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Start the engines (two llama.cpp servers by default) and the gateway in front of them
    (policy ``eager+<cfg.policy>``, engine TP and bucket from ``cfg.buckets``); run
    ``cfg.steps`` batches through it; stop everything. Real engines: nothing is simulated."""
    from turnstile.gateway.process import GatewayProcess
    from turnstile.policies import ROUTING
    from turnstile.transport.blocking import get as http_get

    if len(cfg.buckets) < 1:
        raise ValueError("need at least one engine")
    if cfg.policy not in ROUTING:
        ROUTING.create(cfg.policy)  # raises with the valid names
    n_prompts = max(1, math.ceil(cfg.trajectories / cfg.samples))
    workload = RolloutWorkload(RolloutSpec(n_prompts=n_prompts, group_size=cfg.samples,
                                           seed=cfg.seed, pool_size=n_prompts * 2))
    with tempfile.TemporaryDirectory(prefix="turnstile-live-") as tmp_s:
        tmp = Path(tmp_s)
        procs = _start_engines(cfg, tmp, log)
        gw: GatewayProcess | None = None
        try:
            port = _free_port()
            conf = tmp / "gateway.toml"
            conf.write_text(gateway_toml(cfg, [p.base_url for p in procs], port),
                            encoding="utf-8")
            gw = GatewayProcess(conf, port=port, log=tmp / "gateway.log").start(timeout_s=20)
            url = gw.url
            log(f"gateway {url} (eager+{cfg.policy})")
            driver = LiveDriver(url, tmp / "sandbox", cfg)
            steps = []
            for k in range(cfg.steps):
                batch = workload.batch(k)[: cfg.trajectories]
                res = asyncio.run(driver.run_batch(batch))
                trajs = res["trajectories"]
                steps.append({
                    "step": k,
                    "trajectories": len(batch),
                    "completed": sum(1 for t in trajs if t["turns"] > 0),
                    "makespan_s": round(res["makespan_s"], 4),
                    "turns": sum(t["turns"] for t in trajs),
                    "tool_calls": sum(len(t["tools"]) for t in trajs),
                    "tool_errors": sum(1 for t in trajs for s in t["tools"] if ":error" in s),
                    "tool_timeouts": sum(1 for t in trajs for s in t["tools"] if ":timeout" in s),
                    "moves": sum(t["moves"] for t in trajs),
                    "per_trajectory": trajs,
                })
                log(f"step {k}: {len(trajs)} trajectories in {res['makespan_s']:.2f} s")
                # let the gateway close the sessions (the router learns from finished ones)
                time.sleep(cfg.session_idle_s + 0.6)
            turns = _turns_per_engine((http_get(f"{url}/metrics", timeout=5.0) or b"").decode())
        finally:
            if gw is not None:
                gw.stop()
            for p in procs:
                p.stop()
    served: dict[str, int] = {}
    for s in steps:
        for t in s["per_trajectory"]:
            for e in t["served_by"]:
                served[e] = served.get(e, 0) + 1
    return {
        "simulated": False,
        "driver": (f"through the turnstile gateway (eager+{cfg.policy}: the gateway's scheduler "
                   "core routes every turn) to llama-server"),
        "config": {
            "trajectories": cfg.trajectories, "policy": cfg.policy, "max_turns": cfg.max_turns,
            "max_tokens": cfg.max_tokens, "seed": cfg.seed, "steps": cfg.steps,
            "tool_timeout_s": cfg.tool_timeout_s, "routing_params": dict(cfg.routing_params),
            "buckets": [b.__dict__ for b in cfg.buckets],
        },
        "steps": steps,
        "turns_per_engine": served,
        "gateway_turns_per_engine": turns,
    }
