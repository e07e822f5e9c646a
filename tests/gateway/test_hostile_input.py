"""Hostile input against a real ``turnstile serve`` process over loopback sockets: a body the
JSON parser accepts but no engine can encode (lone UTF-16 surrogates) is a 400, and a client
that sends its headers or its body too slowly gets a 408 and its connection closed."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from turnstile.gateway.config import EngineConfig, GatewayConfig
from turnstile.gateway.process import GatewayProcess, config_toml
from turnstile.testing.fake_engine import FakeServer, start_fake

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def engine() -> Iterator[FakeServer]:
    eng = start_fake(ttft_s=0.0)
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def gateway(engine: FakeServer, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[GatewayProcess]:
    conf = tmp_path_factory.mktemp("hostile") / "gw.toml"
    conf.write_text(config_toml(
        {"policy": "eager", "client_header_timeout_s": HEADER_TIMEOUT_S,
         "client_body_timeout_s": BODY_TIMEOUT_S, "stats_interval_s": 0.0},
        [{"url": engine.url, "kind": "llama.cpp", "name": "e0"}]))
    with GatewayProcess(conf, name="hostile") as gw:
        yield gw


def _body(content: object, **kw: object) -> dict[str, object]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}],
            "max_tokens": 2, **kw}


def _raw_post(gw: GatewayProcess, raw: bytes) -> httpx.Response:
    """POST bytes as they are (json.dumps would never write a lone surrogate)."""
    return httpx.post(gw.url + CHAT, content=raw, timeout=10,
                      headers={"content-type": "application/json"})


def _connect(gw: GatewayProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", gw.port), timeout=HEADER_TIMEOUT_S * 8)


def _read_until_closed(s: socket.socket) -> bytes:
    """Everything the gateway sends until it closes the connection (a socket timeout — the
    connection held open — fails the test)."""
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return out
        out += chunk


def _status_and_error(raw: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"connection: close" in head.lower()
    return status, json.loads(body)["error"]


@pytest.mark.parametrize("raw", [
    rb'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "\ud800"}]}',
    rb'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "a\udfffb"}]}',
    rb'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], '
    rb'"metadata": {"\ud83d": 1}}',
    rb'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": '
    rb'[{"type": "text", "text": "\uDBFF"}]}]}',
], ids=["content", "low-surrogate", "key", "content-part"])
def test_a_lone_surrogate_is_a_400_in_openais_shape(gateway: GatewayProcess, raw: bytes
                                                     ) -> None:
    r = _raw_post(gateway, raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_unicode"
    assert "surrogate" in err["message"]
    # the gateway stays up and serves the next request
    assert httpx.post(gateway.url + CHAT, json=_body("fine"), timeout=10).status_code == 200


def test_escaped_surrogate_pairs_and_escaped_backslashes_still_pass(gateway: GatewayProcess
                                                                     ) -> None:
    # an emoji as a client with ensure_ascii writes it, and a literal "\ud800" text
    for raw in (rb'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", '
                rb'"content": "\ud83d\ude00"}]}',
                rb'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", '
                rb'"content": "\\ud800"}]}'):
        r = _raw_post(gateway, raw)
        assert r.status_code == 200, r.text


def test_a_body_shorter_than_its_content_length_gets_408(gateway: GatewayProcess) -> None:
    s = _connect(gateway)
    t0 = time.monotonic()
    s.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
              "content-length: 100\r\n\r\n{\"mod".encode())
    raw = _read_until_closed(s)
    waited = time.monotonic() - t0
    s.close()
    status, err = _status_and_error(raw)
    assert status == 408 and err["code"] == "request_timeout", raw
    assert "5 bytes arrived" in str(err["message"])
    assert BODY_TIMEOUT_S * 0.9 <= waited < BODY_TIMEOUT_S + 3


def test_a_body_dripped_byte_by_byte_is_cut_at_the_deadline(gateway: GatewayProcess) -> None:
    body = json.dumps(_body("slow")).encode()
    s = _connect(gateway)
    t0 = time.monotonic()
    s.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
              f"content-length: {len(body)}\r\n\r\n".encode())
    for b in body[:int(BODY_TIMEOUT_S / 0.1) + 5]:  # a byte every 0.1 s: never idle long
        try:
            s.sendall(bytes([b]))
        except OSError:
            break  # closed on us
        time.sleep(0.1)
    raw = _read_until_closed(s)
    s.close()
    status, _ = _status_and_error(raw)
    assert status == 408
    assert time.monotonic() - t0 < BODY_TIMEOUT_S + 3


@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"],
                         ids=["nothing", "half-headers"])
def test_slow_headers_get_408_and_the_connection_closed(gateway: GatewayProcess, sent: bytes
                                                        ) -> None:
    s = _connect(gateway)
    t0 = time.monotonic()
    s.sendall(sent)
    for _ in range(int(HEADER_TIMEOUT_S / 0.2) + 5):  # drip a header byte every 0.2 s
        try:
            s.sendall(b"x")
        except OSError:
            break
        time.sleep(0.2)
    raw = _read_until_closed(s)
    waited = time.monotonic() - t0
    s.close()
    status, err = _status_and_error(raw)
    assert status == 408 and err["code"] == "request_timeout"
    assert "headers" in str(err["message"])
    assert HEADER_TIMEOUT_S * 0.9 <= waited < HEADER_TIMEOUT_S + 3


def test_kept_alive_connections_and_slow_answers_are_not_cut(gateway: GatewayProcess,
                                                             engine: FakeServer) -> None:
    """The header timer runs only while a request's headers are awaited: a turn the engine
    answers after longer than the timeouts is served, and a kept-alive connection that waits
    between requests (under uvicorn's keep-alive) takes its next request."""
    engine.engine.ttft_s = HEADER_TIMEOUT_S + BODY_TIMEOUT_S
    try:
        with httpx.Client(base_url=gateway.url, timeout=20) as client:
            assert client.post(CHAT, json=_body("slow answer")).status_code == 200
            time.sleep(HEADER_TIMEOUT_S * 0.5)
            engine.engine.ttft_s = 0.0
            r = client.post(CHAT, json=_body("next"))
            assert r.status_code == 200
    finally:
        engine.engine.ttft_s = 0.0


def test_the_timeouts_are_checked() -> None:
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        cfg = GatewayConfig(engines=[EngineConfig("http://127.0.0.1:9")],
                            client_body_timeout_s=bad)
        with pytest.raises(ValueError, match="client_body_timeout_s"):
            cfg.validate()
