"""The agent-loop hook: tells the turnstile router (:mod:`.verl_router`) what verl does not —
each turn's output length, each tool return, and the end of each trajectory.

verl's ``LLMServerClient`` calls the router only at the start and end of a turn, with the
trajectory's ``request_id``. Its ``ToolAgentLoop`` knows the rest. :class:`TurnstileHookMixin`
wraps four of that loop's methods and reports, on the same router actor
(``server_manager._load_balancer``, the handle verl gave the client):

* after each generation: ``report_turn(request_id, output_tokens)``;
* after each tool round: ``report_tool_returns(request_id, [{name, result_tokens, status,
  duration_s}, ...])`` — a result verl's loop writes as an error (``Error executing tool``,
  ``Unknown function``, ``Invalid JSON``) is a failure, one that says it timed out a timeout;
  sizes are characters / 4, as the gateway counts them;
* when ``run`` returns or raises: ``end_trajectory(request_id)``.

Each report is awaited (small, and the next acquire then sees it). Reports go from the same
process as the client's acquire/release calls, so the actor gets them in order. Against a router
without these methods (verl's default balancer) the hook logs once and stops reporting.

``TurnstileToolAgentLoop`` is verl's ``ToolAgentLoop`` with the mixin, built on first use (this
module imports verl only then). Register it in the YAML at
``actor_rollout_ref.rollout.agent.agent_loop_config_path``::

    - name: turnstile_tool_agent
      _target_: turnstile.integrations.verl_hook.TurnstileToolAgentLoop

and set ``agent_name: turnstile_tool_agent`` in the dataset (or the rollout's default agent).
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from typing import Any

__all__ = ["RouterReporter", "TurnstileHookMixin", "classify_tool_text"]

log = logging.getLogger(__name__)

_ERROR_PREFIXES = ("Error executing tool", "Unknown function", "Invalid JSON", "Error:")


def classify_tool_text(text: str) -> str:
    """A tool return's status from the text verl's loop put in the tool message."""
    if text.startswith(_ERROR_PREFIXES):
        return "error"
    head = text[:200].lower()
    if head.startswith("timeout") or "timed out" in head:
        return "timeout"
    return "ok"


class RouterReporter:
    """Calls the router's report methods through a Ray actor handle (or on a plain router
    object, in tests); awaits each. Turns itself off against a router without them."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.enabled = handle is not None

    async def _call(self, method: str, *args: Any) -> None:
        if not self.enabled:
            return
        try:
            fn = getattr(self.handle, method)
            out = fn.remote(*args) if hasattr(fn, "remote") else fn(*args)
            if inspect.isawaitable(out):
                await out
        except AttributeError:
            self.enabled = False
            log.warning("the rollout router has no %s(): not a turnstile router; the turnstile "
                        "hook stops reporting", method)

    async def turn_done(self, request_id: str, output_tokens: int) -> None:
        await self._call("report_turn", request_id, int(output_tokens))

    async def tool_returns(self, request_id: str, returns: list[dict[str, Any]]) -> None:
        if returns:
            await self._call("report_tool_returns", request_id, returns)

    async def trajectory_end(self, request_id: str) -> None:
        await self._call("end_trajectory", request_id)


class TurnstileHookMixin:
    """Put before verl's ``ToolAgentLoop`` in the bases (see the module docstring). Uses only
    the loop's ``server_manager``, its ``AgentData`` (``request_id``, ``response_ids``) and the
    ``ToolResponse.text`` that ``_call_tool`` returns."""

    _ts_reporter: RouterReporter | None = None
    _ts_request_id: str | None = None
    _ts_returns: list[dict[str, Any]] | None = None

    def _ts(self) -> RouterReporter:
        if self._ts_reporter is None:
            manager = getattr(self, "server_manager", None)
            self._ts_reporter = RouterReporter(getattr(manager, "_load_balancer", None))
        return self._ts_reporter

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        try:
            return await super().run(sampling_params, **kwargs)  # type: ignore[misc]
        finally:
            if self._ts_request_id is not None:
                await self._ts().trajectory_end(self._ts_request_id)

    async def _handle_pending_state(self, agent_data: Any, *args: Any, **kwargs: Any) -> Any:
        self._ts_request_id = agent_data.request_id
        return await super()._handle_pending_state(agent_data, *args, **kwargs)  # type: ignore[misc]

    async def _handle_generating_state(self, agent_data: Any, *args: Any, **kwargs: Any) -> Any:
        state = await super()._handle_generating_state(  # type: ignore[misc]
            agent_data, *args, **kwargs)
        self._ts_request_id = agent_data.request_id
        await self._ts().turn_done(agent_data.request_id, len(agent_data.response_ids or ()))
        return state

    async def _call_tool(self, tool_call: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = await super()._call_tool(tool_call, *args, **kwargs)  # type: ignore[misc]
        text = getattr(out[0], "text", None) or ""
        if self._ts_returns is None:
            self._ts_returns = []
        self._ts_returns.append({
            "name": str(getattr(tool_call, "name", "tool")),
            "result_tokens": math.ceil(len(text) / 4),
            "status": classify_tool_text(text),
            "duration_s": time.perf_counter() - t0,
        })
        return out

    async def _handle_processing_tools_state(self, agent_data: Any, *args: Any,
                                             **kwargs: Any) -> Any:
        self._ts_returns = []
        try:
            return await super()._handle_processing_tools_state(  # type: ignore[misc]
                agent_data, *args, **kwargs)
        finally:
            returns, self._ts_returns = self._ts_returns or [], None
            await self._ts().tool_returns(agent_data.request_id, returns)


_built: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    """``TurnstileToolAgentLoop``: built (importing verl) the first time it is asked for."""
    if name != "TurnstileToolAgentLoop":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _built:
        from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

        cls = type(name, (TurnstileHookMixin, ToolAgentLoop), {
            "__module__": __name__,
            "__doc__": "verl's ToolAgentLoop reporting to the turnstile router.",
        })
        _built[name] = cls
    return _built[name]
