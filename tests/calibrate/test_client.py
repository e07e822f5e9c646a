"""The streaming client against canned engine answers (llama.cpp and vLLM wire formats)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from turnstile.calibrate.client import EngineRequestError, discover, stream_completion

Handler = Callable[[str, dict[str, Any] | None], tuple[int, str, list[bytes]]]


class FakeEngine:
    """A loopback HTTP server answering from ``handler(path, body) -> (status, type, parts)``;
    parts are written (and flushed) one by one, a little apart, like streamed tokens."""

    def __init__(self, handler: Handler, gap_s: float = 0.002) -> None:
        self.requests: list[tuple[str, dict[str, Any] | None]] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, body: dict[str, Any] | None) -> None:
                outer.requests.append((self.path, body))
                status, ctype, parts = handler(self.path, body)
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    for part in parts:
                        self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                        self.wfile.flush()
                        time.sleep(gap_s)
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client closed the stream early (should_stop): what it may do

            def do_GET(self) -> None:
                self._answer(None)

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length", "0"))
                self._answer(json.loads(self.rfile.read(n)))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def sse(*chunks: dict[str, Any] | str) -> list[bytes]:
    return [
        f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n".encode() for c in chunks
    ]


def llamacpp_openai(n: int, prompt: int) -> list[bytes]:
    """llama-server's /v1/completions stream: one chunk per token, then an empty finish chunk
    carrying usage and timings (as recorded from llama.cpp b1-0c1e570)."""
    tok = [{"choices": [{"text": "x", "index": 0, "logprobs": None, "finish_reason": None}],
            "object": "text_completion"} for _ in range(n)]
    last = {"choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
            "usage": {"completion_tokens": n, "prompt_tokens": prompt,
                      "total_tokens": n + prompt, "prompt_tokens_details": {"cached_tokens": 3}},
            "timings": {"cache_n": 3, "prompt_n": prompt - 3, "prompt_ms": 12.5,
                        "predicted_n": n, "predicted_ms": 40.0}}
    return sse(*tok, last, "[DONE]")


def llamacpp_native(n: int, prompt: int) -> list[bytes]:
    """llama-server's /completion stream with return_tokens."""
    tok = [{"index": 0, "content": "x", "tokens": [100 + i], "stop": False} for i in range(n)]
    last = {"index": 0, "content": "", "tokens": [], "stop": True, "tokens_predicted": n,
            "tokens_evaluated": prompt, "tokens_cached": prompt + n - 1, "stop_type": "limit",
            "timings": {"cache_n": 2, "prompt_n": prompt - 2, "prompt_ms": 5.0}}
    return sse(*tok, last)


def vllm(n: int, prompt: int, ids: bool) -> list[bytes]:
    """vLLM's /v1/completions stream: the last token rides with finish_reason, usage comes in a
    final chunk without choices."""
    out: list[dict[str, Any]] = []
    for i in range(n):
        choice: dict[str, Any] = {"index": 0, "text": "y", "logprobs": None,
                                  "finish_reason": "length" if i == n - 1 else None,
                                  "stop_reason": None}
        if ids:
            choice["token_ids"] = [500 + i]
        out.append({"id": "cmpl-1", "object": "text_completion", "model": "m",
                    "choices": [choice], "usage": None})
    out.append({"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [],
                "usage": {"prompt_tokens": prompt, "completion_tokens": n,
                          "total_tokens": prompt + n}})
    return sse(*out, "[DONE]")


@pytest.fixture
def engine() -> Iterator[Callable[[Handler], FakeEngine]]:
    made: list[FakeEngine] = []

    def make(handler: Handler) -> FakeEngine:
        e = FakeEngine(handler)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def test_llamacpp_openai_stream(engine: Callable[[Handler], FakeEngine]) -> None:
    e = engine(lambda p, b: (200, "text/event-stream", llamacpp_openai(5, 9)))
    res = stream_completion(e.url, list(range(9)), 5)
    assert res.completion_tokens == 5 and len(res.token_times) == 5
    assert res.token_times == sorted(res.token_times) and res.token_times[0] > res.send_s
    assert res.cached_tokens == 3 and res.timings and res.timings["prompt_ms"] == 12.5
    assert res.finish_reason == "length"
    path, body = e.requests[0]
    assert path == "/v1/completions"
    assert body is not None and body["prompt"] == list(range(9)) and body["stream"] is True
    assert body["ignore_eos"] is True and body["max_tokens"] == 5


def test_llamacpp_native_stream_returns_ids(engine: Callable[[Handler], FakeEngine]) -> None:
    e = engine(lambda p, b: (200, "text/event-stream", llamacpp_native(4, 7)))
    res = stream_completion(e.url, [1] * 7, 4, api="llamacpp", return_ids=True)
    assert res.output_ids == [100, 101, 102, 103]
    assert res.completion_tokens == 4 and len(res.token_times) == 4
    assert res.cached_tokens == 2 and res.prompt_tokens == 7
    path, body = e.requests[0]
    assert path == "/completion" and body is not None and body["return_tokens"] is True


@pytest.mark.parametrize("ids", [False, True])
def test_vllm_stream(engine: Callable[[Handler], FakeEngine], ids: bool) -> None:
    e = engine(lambda p, b: (200, "text/event-stream", vllm(6, 11, ids)))
    res = stream_completion(e.url + "/v1", [2] * 11, 6, return_ids=True)
    assert res.completion_tokens == 6 and len(res.token_times) == 6
    assert len(set(res.token_times)) == 6  # the finish chunk carried the last token
    assert res.output_ids == ([500 + i for i in range(6)] if ids else None)
    assert res.cached_tokens is None and res.timings is None


def test_early_stop_and_token_callback(engine: Callable[[Handler], FakeEngine]) -> None:
    e = engine(lambda p, b: (200, "text/event-stream", llamacpp_openai(50, 4)))
    seen: list[int] = []
    res = stream_completion(e.url, [1, 2, 3, 4], 50, on_token=lambda n, t: seen.append(n),
                            should_stop=lambda: bool(seen) and seen[-1] >= 5)
    assert res.finish_reason == "client_stop"
    assert res.completion_tokens == 5 and seen[:5] == [1, 2, 3, 4, 5]


def test_http_error_is_raised(engine: Callable[[Handler], FakeEngine]) -> None:
    e = engine(lambda p, b: (400, "application/json", [b'{"error": "context overflow"}']))
    with pytest.raises(EngineRequestError, match="400"):
        stream_completion(e.url, [1], 1)


def test_discover_llamacpp(engine: Callable[[Handler], FakeEngine]) -> None:
    def handler(path: str, body: Any) -> tuple[int, str, list[bytes]]:
        if path == "/v1/models":
            doc: dict[str, Any] = {
                "data": [{"id": "tiny", "owned_by": "llamacpp", "meta": {"n_vocab": 323}}]
            }
        elif path == "/props":
            doc = {"total_slots": 4, "default_generation_settings": {"n_ctx": 2048},
                   "model_path": "/m.gguf"}
        else:
            return 404, "text/plain", [b"no"]
        return 200, "application/json", [json.dumps(doc).encode()]

    info = discover(engine(handler).url)
    assert (info.kind, info.model, info.n_parallel, info.ctx_per_seq) == ("llama.cpp", "tiny", 4,
                                                                          2048)
    assert info.kv_tokens == 8192 and info.n_vocab == 323 and info.api == "llamacpp"


def test_discover_vllm(engine: Callable[[Handler], FakeEngine]) -> None:
    metrics = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",gpu_memory_utilization="0.9",'
        'num_cpu_blocks="0",num_gpu_blocks="30000"} 1.0\n'
    )

    def handler(path: str, body: Any) -> tuple[int, str, list[bytes]]:
        if path == "/v1/models":
            doc: Any = {"data": [{"id": "Qwen/Qwen3-0.6B", "owned_by": "vllm",
                                  "max_model_len": 4096}]}
        elif path == "/version":
            doc = {"version": "0.11.0"}
        elif path == "/metrics":
            return 200, "text/plain", [metrics.encode()]
        else:
            return 404, "text/plain", [b"no"]
        return 200, "application/json", [json.dumps(doc).encode()]

    info = discover(engine(handler).url)
    assert (info.kind, info.model, info.ctx_per_seq) == ("vllm", "Qwen/Qwen3-0.6B", 4096)
    assert info.kv_tokens == 480000 and info.n_parallel is None and info.api == "openai"
    assert info.extra["version"] == "0.11.0"


def test_discover_fails_without_a_model_list(engine: Callable[[Handler], FakeEngine]) -> None:
    e = engine(lambda p, b: (404, "text/plain", [b"nothing here"]))
    with pytest.raises(EngineRequestError):
        discover(e.url)


def test_token_replay_through_the_one_closed_loop(engine: Callable[[Handler], FakeEngine]
                                                  ) -> None:
    """The fidelity replay (token-id sessions on the shared closed loop): each turn's prompt is
    the previous prompt plus the generated ids plus new ids; the next turn waits for the tool;
    workflows are pinned round-robin; a failed turn stops its workflow."""
    from turnstile.calibrate.replay import replay_workflows
    from turnstile.workload.model import ToolCall, Turn, Workflow

    e = engine(lambda p, b: (200, "text/event-stream",
                             llamacpp_native(b["n_predict"], len(b["prompt"]))))
    bad = engine(lambda p, b: (500, "application/json", [b'{"error": "boom"}']))
    wfs = [Workflow(f"w{k}", 0.01 * k, (
        Turn(input_tokens=6, output_tokens=3, tools=(ToolCall("bash", 0.05),)),
        Turn(input_tokens=4, output_tokens=2, context_tokens=9),
    )) for k in range(3)]
    run = replay_workflows(wfs, [e.url, bad.url], apis=["llamacpp", "llamacpp"])
    assert run.errors == ["w1#0: " + run.turns[2].error]  # w1 went to the failing engine
    done = [t for t in run.turns if t.error is None]
    assert [(t.workflow, t.index, t.engine) for t in done] == [
        ("w0", 0, 0), ("w0", 1, 0), ("w2", 0, 0), ("w2", 1, 0)]
    prompts = [b["prompt"] for path, b in e.requests if path == "/completion"]
    firsts = [p for p in prompts if len(p) == 6]
    seconds = [p for p in prompts if len(p) == 13]
    assert len(firsts) == 2 and len(seconds) == 2
    for second in seconds:
        assert second[:6] in firsts
        assert second[6:9] == [100, 101, 102]  # the ids the engine generated
    w0 = [t for t in done if t.workflow == "w0"]
    assert w0[1].ready_s >= w0[0].finished_s + 0.05
    recs = {r.id: r for r in run.records}
    assert recs["w0"].done and not recs["w1"].done
