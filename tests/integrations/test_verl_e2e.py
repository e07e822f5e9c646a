"""The turnstile router inside verl 0.9.1 itself: built by verl's own ``get_router_handle`` from a
router YAML (a Ray actor constructed with ``(servers, yaml_dict)``), driven by verl's own
``LLMServerClient.generate`` (one acquire/release per turn, one request id per trajectory)
against fake CPU rollout servers (Ray actors). The hook's reports go to the same actor.

Opt-in: ``make test-verl`` (its own venv with verl; large). Where verl is not importable these
tests skip with that reason.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl", reason="verl is not installed: run `make test-verl` (its own venv)")
ray = pytest.importorskip("ray", reason="ray (a verl dependency) is not installed")

from omegaconf import OmegaConf  # noqa: E402  (after the skip: a verl dependency)

from turnstile.integrations.verl_hook import RouterReporter  # noqa: E402
from turnstile.integrations.verl_router import TurnstileRouter, tool_return  # noqa: E402

pytestmark = pytest.mark.verl

ROOT = Path(__file__).resolve().parents[2]
ROUTER_CLASS = "turnstile.integrations.verl_router.TurnstileRouter"


@pytest.fixture(scope="module")
def ray_cluster():
    src = str(ROOT / "src")
    env = {"PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env})
    yield
    ray.shutdown()


def fake_servers(names: list[str]) -> dict[str, Any]:
    from turnstile.testing.verl_fakes import FakeRolloutServer

    cls = ray.remote(num_cpus=0)(FakeRolloutServer)
    return {n: cls.remote(n) for n in names}


def router_yaml(tmp_path: Path, **cfg: Any) -> str:
    p = tmp_path / "router.yaml"
    OmegaConf.save(OmegaConf.create({"router_class": ROUTER_CLASS, **cfg}), p)
    return str(p)


def client_for(handle: Any) -> Any:
    from verl.workers.rollout.llm_server import LLMServerClient

    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "name": "vllm", "full_determinism": False}}})
    return LLMServerClient(config=config, load_balancer_handle=handle)


async def trajectory(client: Any, rid: str, num: int, outs: list[int], tool: str,
                     hook: bool = True) -> None:
    """An agent loop's trajectory: a turn per output length; ``tool`` returns after each
    turn but the last; what the turnstile hook reports, when ``hook``."""
    rep = RouterReporter(client._load_balancer)  # the handle verl gave its client
    prompt = [num, 11, 12, 13]
    for j, n in enumerate(outs):
        out = await client.generate(rid, prompt_ids=prompt, sampling_params={"max_tokens": n})
        assert len(out.token_ids) == n
        prompt = prompt + list(out.token_ids) + [9, 9]
        if hook:
            await rep.turn_done(rid, len(out.token_ids))
            if j < len(outs) - 1:
                await rep.tool_returns(rid, [tool_return(tool, 20, "ok")])
    if hook:
        await rep.trajectory_end(rid)


def served_by(servers: dict[str, Any]) -> dict[int, set[str]]:
    """Trajectory number → the servers that served its turns."""
    out: dict[int, set[str]] = {}
    for name, h in servers.items():
        for num, _ in ray.get(h.served.remote()):
            out.setdefault(num, set()).add(name)
    return out


def test_the_router_honours_verls_protocol_signatures():
    from verl.workers.rollout.router import RequestLoadBalancer

    names = [n for n, v in vars(RequestLoadBalancer).items()
             if callable(v) and not n.startswith("_")]
    assert {"acquire_server", "release_server", "require_acquire_fields",
            "require_release_fields", "add_servers", "remove_servers", "get_all_servers",
            "get_status", "clear_sticky_cache", "get_total_inflight"} <= set(names)
    for n in names:
        theirs = inspect.signature(getattr(RequestLoadBalancer, n)).parameters
        ours = inspect.signature(getattr(TurnstileRouter, n)).parameters
        for p in theirs.values():
            if p.kind is p.VAR_KEYWORD:
                assert any(q.kind is q.VAR_KEYWORD for q in ours.values()), n
            else:
                assert p.name in ours, f"{n}: no parameter {p.name!r}"
                if p.default is not p.empty:
                    assert ours[p.name].default == p.default, f"{n}: default of {p.name}"


def test_shipped_yaml_loads_through_verls_loader():
    from verl.workers.rollout.router import _load_router_yaml, _resolve_router_class

    cfg = _load_router_yaml(str(ROOT / "deploy" / "verl" / "turnstile_router.yaml"))
    assert _resolve_router_class(cfg["router_class"]) is TurnstileRouter
    r = TurnstileRouter({"a:1": None}, cfg)
    assert r.config.policy == "cmlfq" and r.require_acquire_fields() == ["prompt_ids"]


def test_least_open_through_verls_client_keeps_trajectories_sticky_and_balanced(
        ray_cluster, tmp_path):
    from verl.workers.rollout.router import get_router_handle

    servers = fake_servers(["10.0.0.1:8000", "10.0.0.2:8000"])
    handle = get_router_handle(servers, router_config_path=router_yaml(tmp_path,
                                                                        policy="least-open"))
    client = client_for(handle)

    async def main() -> None:
        await asyncio.gather(*(trajectory(client, f"traj-{i}", i, [4, 6, 3], "search")
                               for i in range(8)))

    asyncio.run(main())
    by = served_by(servers)
    assert sorted(by) == list(range(8))
    assert all(len(s) == 1 for s in by.values()), by  # every turn of a trajectory on one server
    per_server = [sum(1 for s in by.values() if name in s) for name in servers]
    assert per_server == [4, 4]
    st = ray.get(handle.get_status.remote())
    assert st["total_inflight"] == 0 and st["acquires"] == 24
    assert st["trajectories_ended"] == 8 and st["open_trajectories"] == 0
    assert st["tool_returns_seen"] == 16
    assert ray.get(handle.get_total_inflight.remote()) == 0


def test_cmlfq_through_verls_client_moves_long_trajectories_to_the_tp2_replica(
        ray_cluster, tmp_path):
    from verl.workers.rollout.router import get_router_handle

    names = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
    servers = fake_servers(names)
    path = router_yaml(tmp_path, policy="cmlfq", server_tp={names[2]: 2},
                       policy_params={"bounds": [40], "rebuild_every_done": 4, "min_obs": 2})
    handle = get_router_handle(servers, router_config_path=path)
    client = client_for(handle)

    async def main() -> None:
        for i in range(4):  # history, one trajectory at a time
            await trajectory(client, f"h{i}-long", 100 + i, [5, 30, 30, 30], "deep_search")
            await trajectory(client, f"h{i}-short", 200 + i, [5, 3], "lookup")
        await trajectory(client, "new-long", 1, [5, 30, 30], "deep_search")
        await trajectory(client, "new-short", 2, [5, 3], "lookup")

    asyncio.run(main())
    by = served_by(servers)
    assert by[1] == {names[0], names[2]} or by[1] == {names[1], names[2]}  # moved to TP 2
    assert names[2] not in by[2]
    st = ray.get(handle.get_status.remote())
    assert st["routing_stats"]["moves"] >= 1 and st["total_inflight"] == 0


def test_without_the_hook_the_phase_switch_ends_trajectories(ray_cluster, tmp_path):
    from verl.workers.rollout.router import get_router_handle

    servers = fake_servers(["10.0.0.1:8000", "10.0.0.2:8000"])
    handle = get_router_handle(servers, router_config_path=router_yaml(tmp_path, policy="cmlfq"))
    client = client_for(handle)

    async def main() -> None:
        await asyncio.gather(*(trajectory(client, f"t{i}", i, [3, 3], "x", hook=False)
                               for i in range(4)))

    asyncio.run(main())
    assert all(len(s) == 1 for s in served_by(servers).values())
    assert ray.get(handle.get_status.remote())["open_trajectories"] == 4
    cleared = ray.get(handle.clear_sticky_cache.remote())
    assert cleared["cleared_entries"] == 4
    assert ray.get(handle.get_status.remote())["open_trajectories"] == 0


def test_the_hooked_agent_loop_is_verls_tool_agent_loop():
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

    from turnstile.integrations import verl_hook

    cls = verl_hook.TurnstileToolAgentLoop
    assert issubclass(cls, ToolAgentLoop) and issubclass(cls, verl_hook.TurnstileHookMixin)
    for m in ("run", "_handle_pending_state", "_handle_generating_state", "_call_tool",
              "_handle_processing_tools_state"):
        assert hasattr(ToolAgentLoop, m), m  # what the mixin wraps still exists in verl
        assert getattr(cls, m) is getattr(verl_hook.TurnstileHookMixin, m)
    # hydra resolves the shipped agent-loop YAML's _target_ to it
    from hydra.utils import get_class

    cfg = OmegaConf.load(ROOT / "deploy" / "verl" / "agent_loop.yaml")
    assert get_class(cfg[0]["_target_"]) is cls


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CALL_OK = '<tool_call>{"name": "calc", "arguments": {"expr": "1+2"}}</tool_call>'
CALL_FAIL = '<tool_call>{"name": "calc", "arguments": {"expr": "1/0"}}</tool_call>'


def tiny_tokenizer() -> Any:
    """A byte-level BPE tokenizer with a ChatML template, trained here in milliseconds (no hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CALL_OK, CALL_FAIL, "user assistant system tool add one and two",
                             "The answer is 3."] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHATML)


def calc(expr: str) -> str:
    a, op, b = expr[0], expr[1], expr[2]
    return str(int(a) + int(b)) if op == "+" else str(int(a) // int(b))


def test_verls_tool_agent_loop_with_the_hook_reports_to_the_router(ray_cluster, tmp_path):
    """verl's real ToolAgentLoop (with the turnstile mixin) runs a trajectory: a tool call that
    works, one that fails, a final answer — tokenized by verl's Continuous Token builder, parsed
    by verl's hermes parser, the tool run by verl's FunctionTool path. The router learns each
    turn, both returns (one a failure) and the end."""
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from verl.tools.function_tool import FunctionTool
    from verl.tools.schemas import OpenAIFunctionToolSchema
    from verl.workers.rollout.router import get_router_handle

    from turnstile.integrations import verl_hook
    from turnstile.testing.verl_fakes import ScriptedRolloutServer

    tok = tiny_tokenizer()
    script = [tok.encode(t, add_special_tokens=False)
              for t in (CALL_OK, CALL_FAIL, "The answer is 3.")]
    cls = ray.remote(num_cpus=0)(ScriptedRolloutServer)
    servers = {"10.0.0.1:8000": cls.remote(script), "10.0.0.2:8000": cls.remote(script)}
    handle = get_router_handle(servers, router_config_path=router_yaml(tmp_path, policy="cmlfq"))
    config = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {
            "name": "vllm", "full_determinism": False, "prompt_length": 1024,
            "response_length": 1024,
            "multi_turn": {"max_user_turns": 4, "max_assistant_turns": 4, "max_parallel_calls": 1,
                           "max_tool_response_length": 256,
                           "tool_response_truncate_side": "right", "format": "hermes"}}},
        "data": {}})
    from verl.workers.rollout.llm_server import LLMServerClient

    client = LLMServerClient(config=config, load_balancer_handle=handle)
    schema = OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
        "name": "calc", "description": "Evaluate a one-digit expression.",
        "parameters": {"type": "object", "properties": {
            "expr": {"type": "string", "description": "e.g. 1+2"}}, "required": ["expr"]}}})
    tool = FunctionTool(name="calc", fn=calc, tool_schema=schema)

    async def main() -> Any:
        loop = verl_hook.TurnstileToolAgentLoop(
            trainer_config=DictConfigWrap(config), server_manager=client, tokenizer=tok,
            processor=None, dataset_cls=None, data_config=DictConfigWrap(config.data),
            hf_model_type=None, tools=ToolListWrap([tool]))
        return await loop.run({"temperature": 1.0},
                              raw_prompt=[{"role": "user", "content": "add one and two"}])

    out = asyncio.run(main())
    assert out.num_turns >= 5  # user + 3 assistant + 2 tool rounds
    lengths = [ray.get(h.served.remote()) for h in servers.values()]
    assert sorted(len(x) for x in lengths) == [0, 3]  # every turn on one server
    st = ray.get(handle.get_status.remote())
    assert st["acquires"] == 3 and st["total_inflight"] == 0
    assert st["tool_statuses"] == {"ok": 1, "error": 1}
    assert st["trajectories_ended"] == 1 and st["open_trajectories"] == 0
