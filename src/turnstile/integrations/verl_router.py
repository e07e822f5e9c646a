"""verl's rollout router backed by turnstile's scheduler core (``cmlfq`` or ``least-open``).

verl 0.9.1 (``verl/workers/rollout/router.py``) picks the rollout replica of every turn through a
``RequestLoadBalancer``: a class named by ``router_class`` in the YAML at
``actor_rollout_ref.rollout.router_config_path``, wrapped by ``ray.remote`` and constructed as
``cls(servers, yaml_dict)`` (``servers``: ``{server address: actor handle}``). verl's
``LLMServerClient.generate`` calls ``acquire_server(request_id, **declared fields)`` before a turn
and ``release_server(server_id, request_id)`` after it (fire and forget); the agent loop uses one
``request_id`` per trajectory, so a trajectory is a session of the core and each
acquire/release pair one of its turns.

:class:`TurnstileRouter` implements that protocol (structurally: verl's Protocol class is not
imported, and neither is Ray) over one :class:`~turnstile.core.scheduler.Scheduler` with the
policy ``eager+<routing>``: the same routing policy objects the simulator and the gateway run.

What verl tells a router, and what this one does with it:

* acquire: the trajectory's id and, when :meth:`require_acquire_fields` asks (``use_prompt_ids``,
  on by default), its ``prompt_ids`` — the turn's prompt length, and on the first turn a hash of
  the prompt that names the trajectory's prompt group (GRPO samples of one prompt share it; the
  per-prompt prefix trees of ``cmlfq`` key on it).
* release: the server and the request id. Nothing about the output, the tools or the end of the
  trajectory. The turn is finished in the core when the output length is reported
  (:meth:`report_turn`), else at the trajectory's next acquire, its end or an idle sweep.
* Tool returns and trajectory ends reach the router only through the agent-loop hook
  (:mod:`turnstile.integrations.verl_hook`), which calls :meth:`report_turn`,
  :meth:`report_tool_returns` and :meth:`end_trajectory` on this actor. Without the hook a
  trajectory ends when it idles past ``session_idle_s`` or at :meth:`clear_sticky_cache` (verl
  calls it at phase switches), and ``cmlfq`` never sees a tool return, so it never moves a
  trajectory: it is then ``least-open``.
* TP: verl gives every replica the same TP and does not pass it; ``default_tp`` and
  ``server_tp`` (per address) give the core the levels ``cmlfq`` moves trajectories between.
  With one TP there is one level, and both policies are sticky least-open-trajectories.

Config keys (the YAML beside ``router_class``; unknown keys raise): ``policy`` (a turnstile routing
name: ``cmlfq``, ``least-open``, ...), ``policy_params`` (its constructor arguments),
``default_tp``, ``server_tp``, ``use_prompt_ids``, ``session_idle_s``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from turnstile.core.actions import Release
from turnstile.core.clock import Clock, WallClock
from turnstile.core.scheduler import Scheduler
from turnstile.core.state import EngineLoad, TurnState, set_accepting
from turnstile.policies import ROUTING, PolicySet
from turnstile.workload.model import ToolCall, ToolStatus, Turn

__all__ = ["NO_SERVERS", "RouterConfig", "TurnstileRouter", "tool_return"]

log = logging.getLogger(__name__)

#: verl's FullyAsyncLLMServerClient retries on exactly this message (an empty pool mid-resize)
NO_SERVERS = "No available servers in load balancer"

_STATUSES: dict[str, ToolStatus] = {"ok": "ok", "success": "ok", "error": "error",
                                    "failure": "error", "timeout": "timeout"}


@dataclass(frozen=True)
class RouterConfig:
    """The router's part of verl's router YAML (``router_class`` itself is verl's key)."""

    policy: str = "cmlfq"
    policy_params: Mapping[str, Any] = field(default_factory=dict)
    default_tp: int = 1
    server_tp: Mapping[str, int] = field(default_factory=dict)
    use_prompt_ids: bool = True
    session_idle_s: float = 600.0

    @classmethod
    def from_yaml_dict(cls, raw: Mapping[str, Any] | None) -> RouterConfig:
        raw = dict(raw or {})
        raw.pop("router_class", None)
        known = set(cls.__dataclass_fields__)
        bad = sorted(set(raw) - known)
        if bad:
            raise ValueError(f"unknown turnstile router keys {bad}; valid: {sorted(known)}")
        cfg = cls(**raw)
        if cfg.policy not in ROUTING:
            raise ValueError(f"unknown routing policy {cfg.policy!r}; valid names: "
                             f"{', '.join(ROUTING.names())}")
        if cfg.default_tp < 1 or any(int(v) < 1 for v in cfg.server_tp.values()):
            raise ValueError("tp must be >= 1")
        return cfg

    def tp_of(self, server_id: str) -> int:
        return int(self.server_tp.get(server_id, self.default_tp))


def tool_return(name: str, result_tokens: int | None, status: str = "ok",
                duration_s: float = 0.0) -> dict[str, Any]:
    """One tool return as :meth:`TurnstileRouter.report_tool_returns` takes it (plain data: it
    crosses a Ray call)."""
    return {"name": name, "result_tokens": result_tokens, "status": status,
            "duration_s": duration_s}


def _tool_call(d: Mapping[str, Any]) -> ToolCall:
    status = _STATUSES.get(str(d.get("status", "ok")).lower(), "unknown")
    tokens = d.get("result_tokens")
    return ToolCall(str(d.get("name", "tool")), float(d.get("duration_s", 0.0) or 0.0), status,
                    None if tokens is None else int(tokens))


def prompt_key(prompt_ids: Sequence[int]) -> str:
    """A short stable name for a prompt (its token ids' hash): the trajectory's prompt group."""
    data = np.asarray(prompt_ids, dtype=np.int64).tobytes()
    return "p" + hashlib.blake2b(data, digest_size=8).hexdigest()


class _Traj:
    """What the router keeps per trajectory (request id) between verl's calls."""

    __slots__ = ("context_tokens", "inflight", "last_active_s", "pending_finish",
                 "pending_tools", "server", "turn_index")

    def __init__(self, now: float) -> None:
        self.turn_index = -1
        self.inflight = 0
        self.server: str | None = None
        #: the current turn was released by verl but not yet finished in the core
        self.pending_finish = False
        self.pending_tools: list[ToolCall] = []
        self.context_tokens = 0
        self.last_active_s = now


class TurnstileRouter:
    """A verl ``RequestLoadBalancer`` whose routing decisions come from turnstile's core.

    A plain class, as verl wants it: ``get_router_handle`` wraps it with ``ray.remote`` and
    constructs it with ``(servers, yaml_dict)``. A sync Ray actor runs one call at a time, so
    no lock is needed.
    """

    def __init__(self, servers: Mapping[str, Any], config: Mapping[str, Any] | None = None,
                 *, clock: Clock | None = None) -> None:
        self.config = RouterConfig.from_yaml_dict(config)
        self.clock: Clock = clock or WallClock()
        self._handles: dict[str, Any] = {}
        self._inflight: dict[str, int] = {}
        self._trajs: dict[str, _Traj] = {}
        self._sched: Scheduler | None = None
        self._last_sweep_s = 0.0
        self.acquires = 0
        self.overlapping = 0
        self.closed_idle = 0
        self.tool_returns_seen = 0
        self.tool_statuses: dict[str, int] = {}
        self.trajectories_ended = 0
        # one routing object for the router's life (it learns across trajectories and steps)
        cfg = self.config
        self.policies = PolicySet.from_spec(
            f"eager+{cfg.policy}", {"routing": dict(cfg.policy_params)} if cfg.policy_params
            else None)
        self.add_servers(servers)

    # ------------------------------------------------------------ verl's protocol
    def require_acquire_fields(self) -> list[str]:
        return ["prompt_ids"] if self.config.use_prompt_ids else []

    def require_release_fields(self) -> list[str]:
        return ["request_id"]

    def acquire_server(self, request_id: str, **extra: Any) -> tuple[str, Any]:
        """Route one turn of trajectory ``request_id``; returns ``(server_id, handle)``."""
        now = self.clock.now()
        self._sweep(now)
        sched = self._sched
        if sched is None or not self._handles or not sched.view.any_accepting():
            raise RuntimeError(NO_SERVERS)
        self.acquires += 1
        prompt_ids = extra.get("prompt_ids")
        t = self._trajs.get(request_id)
        if t is not None and t.inflight > 0:
            # a second turn of the same trajectory while one runs (not how verl's agent loops
            # behave): served beside it, sticky, outside the core (one turn at a time there)
            self.overlapping += 1
            sid = t.server if t.server in self._handles else min(self._inflight,
                                                                  key=self._inflight.__getitem__)
            return self._take(t, sid, now)
        if t is None:
            t = self._trajs[request_id] = _Traj(now)
            tenant = prompt_key(prompt_ids) if prompt_ids is not None and len(prompt_ids) else (
                "default")
            sched.open_session(now, request_id, tenant)
        elif t.pending_finish:
            self._finish(request_id, t, now, None)
        prompt = len(prompt_ids) if prompt_ids is not None else t.context_tokens
        ctx = min(t.context_tokens, prompt)
        turn = Turn(input_tokens=prompt - ctx, output_tokens=0, context_tokens=ctx)
        rec, actions = sched.turn_ready(now, request_id, turn,
                                        tool_returns=tuple(t.pending_tools))
        t.pending_tools = []
        t.turn_index = rec.index
        t.context_tokens = prompt
        sid = next((a.engine for a in actions if isinstance(a, Release) and a.turn is rec), None)
        if sid is None:  # eager releases every ready turn while an engine accepts
            raise RuntimeError(f"turnstile held turn {rec!r}; the router's release is eager")
        sched.turn_started(now, request_id, rec.index)
        return self._take(t, sid, now)

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        """verl finished a turn on ``server_id`` (fire and forget, no output length)."""
        now = self.clock.now()
        if self._inflight.get(server_id, 0) > 0:
            self._inflight[server_id] -= 1
        t = self._trajs.get(request_id) if request_id is not None else None
        if t is None or t.inflight == 0:
            return
        t.inflight -= 1
        t.last_active_s = now
        if t.inflight == 0 and t.turn_index >= 0:
            t.pending_finish = True  # finished in the core when the output length is known

    def add_servers(self, servers: Mapping[str, Any]) -> None:
        now = self.clock.now()
        for sid, handle in servers.items():
            self._handles[sid] = handle
            self._inflight.setdefault(sid, 0)
            if self._sched is None:
                self._sched = Scheduler(self.policies, [self._engine(sid)], forget_finished=True)
            elif sid in self._sched.view:
                set_accepting(self._sched.view[sid], True)  # re-added after a removal
                self._sched.engine_stats(now, sid, healthy=True)
            else:
                self._sched.add_engine(now, self._engine(sid))

    def remove_servers(self, server_ids: Iterable[str]) -> None:
        """Route nothing new there; turns running there finish there (their release is
        still counted in the core)."""
        for sid in server_ids:
            self._handles.pop(sid, None)
            self._inflight.pop(sid, None)
            if self._sched is not None and sid in self._sched.view:
                self._sched.drain_engine(self.clock.now(), sid)

    def get_all_servers(self) -> list[str]:
        return list(self._handles)

    def get_inflight_count(self, server_id: str) -> int:
        return self._inflight.get(server_id, 0)

    def get_total_inflight(self) -> int:
        return sum(self._inflight.values())

    def get_status(self) -> dict[str, Any]:
        routing = self.policies.routing
        stats = getattr(routing, "stats", None)
        view = self._sched.view if self._sched is not None else None
        engines = [view[eid] for eid in view] if view is not None else []
        return {
            "servers": dict(self._inflight),
            "total_inflight": self.get_total_inflight(),
            "active_servers": len(self._inflight),
            "registered_handles": list(self._handles),
            "policy": self.config.policy,
            "open_trajectories": len(self._trajs),
            "open_per_server": {e.id: e.open_sessions for e in engines},
            "tp": {e.id: e.tp for e in engines},
            "acquires": self.acquires,
            "overlapping_acquires": self.overlapping,
            "tool_returns_seen": self.tool_returns_seen,
            "tool_statuses": dict(self.tool_statuses),
            "trajectories_ended": self.trajectories_ended,
            "closed_idle": self.closed_idle,
            "routing_stats": stats() if callable(stats) else {},
        }

    def clear_sticky_cache(self) -> dict[str, Any]:
        """verl's phase switch: every trajectory with no turn in flight ends here (it learns
        from them), so the next acquires are placed afresh."""
        now = self.clock.now()
        idle = [rid for rid, t in self._trajs.items() if t.inflight == 0]
        for rid in idle:
            self._close(rid, now)
        return {"cleared_entries": len(idle), "server_loads": dict(self._inflight)}

    # ------------------------------------------------------------ the hook's reports
    def report_turn(self, request_id: str, output_tokens: int) -> None:
        """The agent loop got the turn's output (``output_tokens`` long): finish it in the core
        with its real length (what ``cmlfq``'s trees learn remaining lengths from)."""
        t = self._trajs.get(request_id)
        if t is not None and t.pending_finish:
            self._finish(request_id, t, self.clock.now(), int(output_tokens))

    def report_tool_returns(self, request_id: str, returns: Sequence[Mapping[str, Any]]) -> None:
        """The tool calls after the trajectory's last turn returned (see :func:`tool_return`);
        handed to the core with its next turn (``cmlfq`` re-decides the level there)."""
        t = self._trajs.get(request_id)
        if t is None:
            return
        calls = [_tool_call(r) for r in returns]
        t.pending_tools.extend(calls)
        self.tool_returns_seen += len(calls)
        for c in calls:
            self.tool_statuses[c.status] = self.tool_statuses.get(c.status, 0) + 1
        t.last_active_s = self.clock.now()

    def end_trajectory(self, request_id: str) -> None:
        """The agent loop finished the trajectory: close its session (the router learns)."""
        if request_id in self._trajs:
            self.trajectories_ended += 1
            self._close(request_id, self.clock.now())

    def trajectory_server(self, request_id: str) -> str | None:
        t = self._trajs.get(request_id)
        return None if t is None else t.server

    # ------------------------------------------------------------ internals
    def _engine(self, sid: str) -> EngineLoad:
        return EngineLoad(sid, tp=self.config.tp_of(sid), bucket=f"tp{self.config.tp_of(sid)}")

    def _take(self, t: _Traj, sid: str, now: float) -> tuple[str, Any]:
        t.inflight += 1
        t.server = sid
        t.last_active_s = now
        self._inflight[sid] = self._inflight.get(sid, 0) + 1
        return sid, self._handles[sid]

    def _finish(self, rid: str, t: _Traj, now: float, output_tokens: int | None) -> None:
        t.pending_finish = False
        assert self._sched is not None
        self._sched.turn_finished(now, rid, t.turn_index, output_tokens)
        if output_tokens is not None:
            t.context_tokens += output_tokens

    def _close(self, rid: str, now: float) -> None:
        t = self._trajs.pop(rid)
        sched = self._sched
        if sched is None or t.turn_index < 0:
            return
        if t.pending_finish:
            self._finish(rid, t, now, None)
        wf = sched.workflows.get(rid)
        if wf is None:
            return
        if wf.turns and wf.turns[-1].state in (TurnState.RELEASED, TurnState.RUNNING):
            # still in flight (an end reported before the release): count it finished now
            sched.turn_finished(now, rid, wf.turns[-1].index, None)
        sched.close_session(now, rid)

    def _sweep(self, now: float) -> None:
        """Close trajectories idle past ``session_idle_s`` (ends verl never reported); at most
        once a second."""
        if now - self._last_sweep_s < 1.0:
            return
        self._last_sweep_s = now
        limit = self.config.session_idle_s
        stale = [rid for rid, t in self._trajs.items()
                 if t.inflight == 0 and now - t.last_active_s > limit]
        for rid in stale:
            self.closed_idle += 1
            self._close(rid, now)
        if stale:
            log.info("turnstile router: closed %d idle trajectories", len(stale))
