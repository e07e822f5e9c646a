"""The start-up check tells an engine declared with the wrong kind by the endpoints only one
kind answers, and warns in one line: a real llama.cpp engine declared as vLLM, and mocked
vLLM and SGLang servers declared as llama.cpp."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from turnstile.engines.llama_server import LlamaServerProcess
from turnstile.engines.tiny_model import write_tiny_gguf
from turnstile.gateway.adapters import make_adapter
from turnstile.gateway.embedded import start_gateway
from turnstile.gateway.engine_check import check_kinds


def _mocked(kind: str, answers: dict[str, object]) -> object:
    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path in answers:
            return httpx.Response(200, json=answers[req.url.path])
        return httpx.Response(404, json={"detail": "Not Found"})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return make_adapter("http://engine:8000", kind, engine_id="e", client=client)


@pytest.mark.parametrize(("declared", "answers", "found"), [
    ("llama.cpp", {"/version": {"version": "0.11.0"}}, "vllm"),
    ("vllm", {"/get_model_info": {"model_path": "m"}, "/version": {"version": "0.5"}},
     "sglang"),
    ("vllm", {"/props": {"total_slots": 4}, "/slots": []}, "llama.cpp"),
    ("vllm", {"/version": {"version": "0.11.0"}}, None),  # as declared
    ("openai", {"/props": {"total_slots": 4}}, None),  # the generic kind is never wrong
    ("llama.cpp", {}, None),  # nothing tells
], ids=["vllm-as-llama", "sglang-as-vllm", "llama-as-vllm", "right", "generic", "unknown"])
def test_the_kind_an_engine_answers_as(declared: str, answers: dict[str, object],
                                       found: str | None, caplog: pytest.LogCaptureFixture
                                       ) -> None:
    adapter = _mocked(declared, answers)
    with caplog.at_level(logging.WARNING, logger="turnstile.gateway"):
        out = asyncio.run(check_kinds({"e": adapter}))  # type: ignore[dict-item]
    lines = [r.getMessage() for r in caplog.records]
    if found is None:
        assert out == {"e": None} and not lines
    else:
        assert len(lines) == 1 and out["e"] == lines[0]
        assert f"declared as {declared} but answers as {found}" in lines[0]
        assert f"--engine http://engine:8000,{found}" in lines[0]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory, llama_server_binary: Path
          ) -> Iterator[LlamaServerProcess]:
    model = write_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf")
    proc = LlamaServerProcess(model, n_parallel=2, ctx=1024, threads=1,
                              binary=llama_server_binary).start()
    yield proc
    proc.stop()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("declared", ["vllm", "llama.cpp"])
def test_a_real_llama_cpp_engine_declared_as_vllm_is_named(
        llama: LlamaServerProcess, declared: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="turnstile.gateway"):
        gw = start_gateway([llama.base_url], kind=declared)
    try:
        kind_lines = [r.getMessage() for r in caplog.records if "answers as" in r.getMessage()]
        eid = next(iter(gw.gateway.adapters))
        if declared == "vllm":
            assert len(kind_lines) == 1, kind_lines
            assert "declared as vllm but answers as llama.cpp (GET /props and GET /slots)" \
                in kind_lines[0]
            assert gw.gateway.engine_config[eid]["kind"] == kind_lines[0]
            metrics = httpx.get(gw.url + "/metrics").text
            assert f'turnstile_engine_config_warning{{engine="{eid}",feature="kind"}} 1.0' \
                in metrics
        else:
            assert kind_lines == [] and gw.gateway.engine_config[eid]["kind"] is None
    finally:
        gw.stop()
