"""Live rollouts: tool-calling trajectories against real llama.cpp engines, routed by the same
router objects as the simulator.

Two ``llama-server`` engines form two buckets (different slot counts: a many-slot throughput
engine at level 0, a few-slot latency engine at level 1). Each trajectory is a
:class:`~turnstile.rollout.workload.RolloutTrajectory` cut to a few turns. Per turn the driver
asks the router for an engine (``place``), sends the conversation so far to that engine's
OpenAI-compatible ``/v1/chat/completions`` (``cache_prompt`` on, so a sticky trajectory reuses
its slot's KV), records the real usage, then runs the turn's tool calls **for real** in a
sandbox — a calculator, file read/write in a temporary directory, sleep-for-N — and feeds each
return (``tool:size:status``) to the router. The tiny test model writes garbage, so *which* tool
runs and how it is called is decided deterministically from the trajectory spec (a failing call
in the spec becomes a call that really fails: division by zero, a missing file, a path outside
the sandbox; a timeout becomes a sleep longer than the tool timeout).

By default (``LiveConfig.via_gateway``) every turn goes through the turnstile gateway in front
of the two engines, run with the policy ``eager+hinted``: the request carries ``x-session-id``
(the trajectory id) and ``x-turnstile-engine`` (the gateway's id of the engine the router
chose), the gateway's ``hinted`` routing policy sends the turn there, and the response's
``x-turnstile-engine`` header tells which engine served it (recorded per turn as
``served_by``). With ``via_gateway=False`` (``--direct``) the engines are driven directly over
HTTP with ``httpx``.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import math
import operator
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnstile.rollout.routing import RolloutRouter
from turnstile.rollout.state import EngineInfo, PoolView, ToolResult, TrajectoryState
from turnstile.rollout.workload import RolloutSpec, RolloutTrajectory, RolloutWorkload
from turnstile.workload.model import ToolCall, ToolStatus

__all__ = [
    "LiveBucket",
    "LiveConfig",
    "LiveDriver",
    "ToolError",
    "ToolSandbox",
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
    #: send every turn through the gateway (``eager+hinted``) rather than to the engine directly
    via_gateway: bool = True


class _LiveEngine:
    def __init__(self, info: EngineInfo, base_url: str) -> None:
        self.info = info
        self.base_url = base_url
        self.requests = 0


class LiveDriver:
    """Runs trajectories through real engines with a router (asyncio; one event loop)."""

    def __init__(
        self,
        router: RolloutRouter,
        engines: Sequence[tuple[EngineInfo, str]],
        sandbox_root: Path,
        cfg: LiveConfig,
        *,
        gateway_url: str | None = None,
        gateway_ids: Mapping[str, str] | None = None,
    ) -> None:
        """``gateway_url``: send turns there, naming the router's engine through
        ``gateway_ids`` (router engine id → the gateway's engine id)."""
        self.router = router
        self.cfg = cfg
        self.engines = {info.id: _LiveEngine(info, url) for info, url in engines}
        self.gateway_url = gateway_url
        self.gateway_ids = dict(gateway_ids or {})
        if gateway_url is not None and set(self.gateway_ids) != set(self.engines):
            raise ValueError("gateway_ids must name a gateway engine for every router engine")
        self._router_ids = {g: r for r, g in self.gateway_ids.items()}
        self.pool = PoolView([info for info, _ in engines])
        self.sandbox_root = sandbox_root
        self.t0 = time.perf_counter()
        self.migrations = 0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def _spec_turns(self, tr: RolloutTrajectory) -> list[tuple[int, tuple[ToolCall, ...]]]:
        turns = tr.workflow.turns[: self.cfg.max_turns]
        out = []
        for j, t in enumerate(turns):
            n = max(2, min(self.cfg.max_tokens, math.ceil(t.output_tokens / 32)))
            out.append((n, t.tools if j < len(turns) - 1 else ()))
        return out

    def _move(self, st: TrajectoryState, eid: str) -> None:
        prev = st.engine
        if prev == eid:
            return
        if prev is not None:
            old = self.engines[prev].info
            old.open_trajectories -= 1
            old.open_tokens -= st.context_tokens
            old.open_attained_tokens -= st.attained_output_tokens
            st.migrations += 1
            self.migrations += 1
        new = self.engines[eid].info
        new.open_trajectories += 1
        new.open_tokens += st.context_tokens
        new.open_attained_tokens += st.attained_output_tokens
        st.engine = eid

    async def run_trajectory(self, client: Any, tr: RolloutTrajectory) -> dict[str, Any]:
        cfg = self.cfg
        st = TrajectoryState(tr.id, tr.prompt_id, sample=tr.sample, step=tr.step,
                             arrival_s=self.now(), prompt_tokens=0, hint=tr.hint)
        sandbox = ToolSandbox(self.sandbox_root / tr.id)
        sandbox.write_file("notes.txt", f"notes for {tr.prompt_id}: " + "lorem ipsum " * 40)
        words = max(8, tr.prompt_tokens // cfg.prompt_divisor)
        task = f"Task {tr.prompt_id}. " + " ".join(f"w{_num(tr.prompt_id, i) % 97}"
                                                   for i in range(words))
        messages: list[dict[str, str]] = [
            {"role": "system", "content": "You are a careful agent. Use tools."},
            {"role": "user", "content": task},
        ]
        path: list[str] = []
        served: list[str] = []  # the engine the gateway reports, as a router engine id
        statuses: list[str] = []
        for j, (max_tokens, tools) in enumerate(self._spec_turns(tr)):
            ready = self.now()
            eid = self.router.place(st, self.pool, ready)
            if not self.pool[eid].accepting:
                raise RuntimeError(f"router placed {tr.id} on closed engine {eid}")
            self._move(st, eid)
            eng = self.engines[eid]
            path.append(eid)
            eng.info.running += 1  # in flight at the engine (running or queued there)
            if self.gateway_url is None:
                url, headers = f"{eng.base_url}/v1/chat/completions", None
            else:
                url = f"{self.gateway_url}/v1/chat/completions"
                headers = {"x-session-id": tr.id, "x-turnstile-engine": self.gateway_ids[eid]}
            t_send = self.now()
            resp = await client.post(
                url,
                json={"model": "tiny", "messages": messages, "max_tokens": max_tokens,
                      "temperature": 0.0, "cache_prompt": True},
                headers=headers,
                timeout=cfg.request_timeout_s,
            )
            eng.info.running -= 1
            eng.requests += 1
            resp.raise_for_status()
            if self.gateway_url is not None:
                gid = resp.headers.get("x-turnstile-engine", "")
                served.append(self._router_ids.get(gid, gid))
            body = resp.json()
            usage = body.get("usage") or {}
            out_tokens = int(usage.get("completion_tokens", max_tokens))
            prompt_tokens = int(usage.get("prompt_tokens", 0))
            elapsed = self.now() - t_send
            if out_tokens > 0:  # EWMA of seconds per output token, queueing included
                eng.info.tpot_s = 0.7 * eng.info.tpot_s + 0.3 * (elapsed / out_tokens)
            st.wait_s += max(0.0, t_send - ready)
            st.turns_done += 1
            st.attained_output_tokens += out_tokens
            st.attained_prompt_tokens += prompt_tokens
            new_ctx = prompt_tokens + out_tokens
            eng.info.open_tokens += new_ctx - st.context_tokens
            eng.info.open_attained_tokens += out_tokens
            st.context_tokens = new_ctx
            self.router.on_turn_finished(st, out_tokens, self.now())
            text = body["choices"][0]["message"].get("content") or ""
            messages.append({"role": "assistant", "content": text})
            for i, call in enumerate(tools):
                tool, arg = plan_tool(call, tr.id, j, i, cfg)
                status, result, secs = await sandbox.run(tool, arg, cfg.tool_timeout_s)
                res = ToolResult(tool, status, max(1, len(result) // 4), secs)
                st.tool_keys.append(res.key)
                if status == "error":
                    st.errors += 1
                elif status == "timeout":
                    st.timeouts += 1
                statuses.append(f"{tool}:{status}" + ("" if status == call.status else "!"))
                self.router.on_tool_result(st, res, self.now())
                messages.append({"role": "user", "content": f"[{tool} {status}] {result[:400]}"})
        st.done_s = self.now()
        if st.engine is not None:
            info = self.engines[st.engine].info
            info.open_trajectories -= 1
            info.open_tokens -= st.context_tokens
            info.open_attained_tokens -= st.attained_output_tokens
        self.router.on_trajectory_done(st, st.done_s)
        rec: dict[str, Any] = {
            "id": tr.id,
            "turns": st.turns_done,
            "output_tokens": st.attained_output_tokens,
            "engines": path,
            "migrations": st.migrations,
            "tools": statuses,
            "tool_keys": list(st.tool_keys),
            "finish_s": round(st.done_s - st.arrival_s, 4),
        }
        if self.gateway_url is not None:
            rec["served_by"] = served  # per turn, from the gateway's x-turnstile-engine
        return rec

    async def run_batch(self, batch: Sequence[RolloutTrajectory]) -> dict[str, Any]:
        import httpx

        t0 = self.now()
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(limits=limits) as client:
            recs = await asyncio.gather(*(self.run_trajectory(client, t) for t in batch))
        return {"makespan_s": self.now() - t0, "trajectories": list(recs)}


#: the gateway's policy in live mode: release at once, route where the rollout router says
GATEWAY_POLICY = "eager+hinted"


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
            log(f"engine {b.name}: {p.base_url} (-np {b.n_parallel} -t {b.threads})")
            procs.append(p)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def run_live(
    cfg: LiveConfig,
    log: Callable[[str], None] = lambda m: None,
    router: RolloutRouter | None = None,
) -> dict[str, Any]:
    """Start the engines (two llama.cpp servers by default) and, with ``cfg.via_gateway``, the
    gateway in front of them (``eager+hinted``: the router's choice is the routing); run
    ``cfg.steps`` batches with ``router`` (default: ``cfg.policy`` from the registry); stop
    everything."""
    from turnstile.rollout.experiment import make_router

    if len(cfg.buckets) < 1:
        raise ValueError("need at least one engine")
    if router is None:
        router = make_router(cfg.policy)
    n_prompts = max(1, math.ceil(cfg.trajectories / cfg.samples))
    workload = RolloutWorkload(RolloutSpec(n_prompts=n_prompts, group_size=cfg.samples,
                                           seed=cfg.seed, pool_size=n_prompts * 2))
    with tempfile.TemporaryDirectory(prefix="turnstile-live-") as tmp_s:
        tmp = Path(tmp_s)
        procs = _start_engines(cfg, tmp, log)
        gw = None
        gateway: dict[str, Any] = {}
        try:
            infos = []
            for i, (b, p) in enumerate(zip(cfg.buckets, procs, strict=True)):
                info = EngineInfo(f"e{i}-{b.name}", b.name, 0, b.tp, capacity_tokens=b.ctx,
                                  idle_tpot_s=0.002, prefill_s_per_token=2e-4)
                infos.append((info, p.base_url))
            if cfg.via_gateway:
                from turnstile.gateway.embedded import start_gateway

                gw = start_gateway([p.base_url for p in procs], policy=GATEWAY_POLICY,
                                   read_timeout_s=cfg.request_timeout_s)
                # the gateway's engine ids (host:port) in the order of the URLs given
                ids = dict(zip((info.id for info, _ in infos), gw.gateway.adapters, strict=True))
                log(f"gateway {gw.url} ({GATEWAY_POLICY}): {ids}")
                driver = LiveDriver(router, infos, tmp / "sandbox", cfg, gateway_url=gw.url,
                                    gateway_ids=ids)
            else:
                driver = LiveDriver(router, infos, tmp / "sandbox", cfg)
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
                    "migrations": sum(t["migrations"] for t in trajs),
                    "per_trajectory": trajs,
                })
                if cfg.via_gateway:  # turns the gateway ran elsewhere than the router placed
                    steps[-1]["placement_mismatches"] = sum(
                        a != b for t in trajs
                        for a, b in zip(t["engines"], t["served_by"], strict=True))
                log(f"step {k}: {len(trajs)} trajectories in {res['makespan_s']:.2f} s")
            requests = {e.info.id: e.requests for e in driver.engines.values()}
            if gw is not None:
                gateway = _gateway_summary(gw, driver.gateway_ids)
        finally:
            if gw is not None:
                gw.stop()
            for p in procs:
                p.stop()
    stats = getattr(router, "stats", None)
    out: dict[str, Any] = {
        "simulated": False,
        "via_gateway": cfg.via_gateway,
        "driver": (f"through the turnstile gateway ({GATEWAY_POLICY}: x-turnstile-engine = "
                   "the router's engine) to llama-server" if cfg.via_gateway else
                   "direct HTTP to llama-server (OpenAI-compatible), not through the gateway"),
        "config": {
            "trajectories": cfg.trajectories, "policy": cfg.policy, "max_turns": cfg.max_turns,
            "max_tokens": cfg.max_tokens, "seed": cfg.seed, "steps": cfg.steps,
            "tool_timeout_s": cfg.tool_timeout_s,
            "buckets": [b.__dict__ for b in cfg.buckets],
        },
        "steps": steps,
        "requests_per_engine": requests,
        "router": stats() if callable(stats) else {},
        "router_name": getattr(router, "name", type(router).__name__),
    }
    if gateway:
        out["gateway"] = gateway
    return out


def _gateway_summary(gw: Any, ids: Mapping[str, str]) -> dict[str, Any]:
    """The gateway's own account: turns finished per engine (its metrics, as router engine
    ids) and how many turns its ``hinted`` routing followed the hint."""
    by_gateway_id = {g: r for r, g in ids.items()}
    finished: dict[str, int] = dict.fromkeys(ids, 0)
    for metric in gw.gateway.metrics.turns_finished.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                eid = sample.labels.get("engine", "")
                finished[by_gateway_id.get(eid, eid)] = int(sample.value)
    routing = gw.gateway.policies.routing
    return {
        "url": gw.url,
        "policy": GATEWAY_POLICY,
        "engine_ids": dict(ids),
        "turns_per_engine": finished,
        "hinted_turns": getattr(routing, "hinted", None),
        "fallback_turns": getattr(routing, "fell_back", None),
    }
