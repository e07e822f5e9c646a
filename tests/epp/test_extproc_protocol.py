"""The endpoint-picker protocol spoken to the picker directly (a gRPC client in Envoy's place):
the destination in the header *and* the ``envoy.lb`` dynamic metadata, the subset hint as filter
metadata, the served endpoint as ``envoy.lb`` metadata, the 503 and 429 ImmediateResponses."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")
pb = pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc  # noqa: E402
from google.protobuf import struct_pb2  # noqa: E402

from turnstile.testing.epp import PickerThread, start_picker  # noqa: E402
from turnstile.testing.fake_engine import FakeServer, chat_body, start_fake  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _headers(**kv: str) -> Any:
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k.replace("_", "-").lstrip("-") if not k.startswith("_")
                             else ":" + k[1:], raw_value=v.encode()) for k, v in kv.items()]))


class Stream:
    """One ext_proc stream: send a message, read the picker's answer."""

    def __init__(self, picker: PickerThread) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{picker.grpc_port}")
        self.out: queue.Queue[Any] = queue.Queue()
        self.answers = pb_grpc.ExternalProcessorStub(self.channel).Process(self._requests())

    def _requests(self) -> Iterator[Any]:
        while True:
            msg = self.out.get()
            if msg is None:
                return
            yield msg

    def send(self, msg: Any) -> Any:
        self.out.put(msg)
        return next(self.answers)

    def push(self, msg: Any) -> None:
        """Send without waiting for an answer (full-duplex mode)."""
        self.out.put(msg)

    def read(self) -> Any:
        return next(self.answers)

    def close(self) -> None:
        self.out.put(None)
        self.channel.close()


@pytest.fixture
def fakes() -> Iterator[list[FakeServer]]:
    made = [start_fake(), start_fake()]
    yield made
    for f in made:
        f.stop()


def _ep(f: FakeServer) -> str:
    return f.url.removeprefix("http://")


def test_destination_in_header_and_metadata_and_the_subset_hint(fakes: list[FakeServer]
                                                                ) -> None:
    pk = start_picker([_ep(f) for f in fakes], fallbacks=1)
    s = Stream(pk)
    try:
        a = s.send(pb.ProcessingRequest(request_headers=_headers(
            _method="POST", _path="/v1/chat/completions", x_session_id="s1")))
        assert a.WhichOneof("response") == "request_headers"
        only = _ep(fakes[1])
        md = struct_pb2.Struct()
        md.get_or_create_struct("envoy.lb.subset_hint")[
            "x-gateway-destination-endpoint-subset"] = [only]
        a = s.send(pb.ProcessingRequest(
            request_body=pb.HttpBody(body=json.dumps(chat_body()).encode(), end_of_stream=True),
            metadata_context=base_pb2.Metadata(filter_metadata={
                "envoy.lb.subset_hint": md["envoy.lb.subset_hint"]})))
        sets = {h.header.key: h.header.raw_value.decode()
                for h in a.request_body.response.header_mutation.set_headers}
        dest = sets["x-gateway-destination-endpoint"]
        assert dest.split(",")[0] == only  # the subset was obeyed
        assert a.dynamic_metadata.fields["envoy.lb"].struct_value.fields[
            "x-gateway-destination-endpoint"].string_value == dest  # the same in both
        # the body the engine gets carries the llama.cpp adapter's fields
        body = json.loads(a.request_body.response.body_mutation.body)
        assert body["cache_prompt"] is True and "id_slot" in body
        assert int(sets["content-length"]) == len(a.request_body.response.body_mutation.body)
        # the data plane says, as the protocol has it, that the fallback served
        served = struct_pb2.Struct()
        served.get_or_create_struct("envoy.lb")["x-gateway-destination-endpoint-served"] = \
            _ep(fakes[0])
        a = s.send(pb.ProcessingRequest(
            response_headers=_headers(_status="200", content_type="application/json"),
            metadata_context=base_pb2.Metadata(filter_metadata={
                "envoy.lb": served["envoy.lb"]})))
        heads = {h.header.key: h.header.raw_value.decode()
                 for h in a.response_headers.response.header_mutation.set_headers}
        assert heads["x-session-id"] == "s1"
        resp = {"choices": [{"message": {"content": "xx"}}],
                "usage": {"prompt_tokens": 8, "completion_tokens": 2}}
        s.send(pb.ProcessingRequest(response_body=pb.HttpBody(
            body=json.dumps(resp).encode(), end_of_stream=True)))
        picker = pk.picker
        assert not picker.engine_up[only]  # it was picked, another served: marked down
        assert picker.sessions["s1"].last_engine == _ep(fakes[0])
    finally:
        s.close()
        pk.stop()


def test_full_duplex_request_body_one_round_trip(fakes: list[FakeServer]) -> None:
    """Envoy's FULL_DUPLEX_STREAMED request mode (``envoy_config``'s default): the headers and
    the body's chunks come without waiting for answers; the picker answers the headers with the
    destination once the whole body is in, then sends the (rewritten) body back as a streamed
    chunk; a request with no body is answered on its headers."""
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

    duplex = pb.ProtocolConfiguration(
        request_body_mode=processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED)
    pk = start_picker([_ep(f) for f in fakes])
    s = Stream(pk)
    try:
        s.push(pb.ProcessingRequest(request_headers=_headers(
            _method="POST", _path="/v1/chat/completions", x_session_id="d1"),
            protocol_config=duplex))
        raw = json.dumps(chat_body()).encode()
        s.push(pb.ProcessingRequest(request_body=pb.HttpBody(body=raw[:10])))
        s.push(pb.ProcessingRequest(request_body=pb.HttpBody(body=raw[10:], end_of_stream=True)))
        head = s.read()
        assert head.WhichOneof("response") == "request_headers"
        sets = {h.header.key: h.header.raw_value.decode()
                for h in head.request_headers.response.header_mutation.set_headers}
        dest = sets["x-gateway-destination-endpoint"]
        assert dest in {_ep(f) for f in fakes}
        assert head.dynamic_metadata.fields["envoy.lb"].struct_value.fields[
            "x-gateway-destination-endpoint"].string_value == dest
        body = s.read()
        chunk = body.request_body.response.body_mutation.streamed_response
        assert chunk.end_of_stream
        sent = json.loads(chunk.body)  # the whole body, with the llama.cpp adapter's fields
        assert sent["messages"] == chat_body()["messages"] and "id_slot" in sent
        assert int(sets["content-length"]) == len(chunk.body)
        a = s.send(pb.ProcessingRequest(response_headers=_headers(_status="200")))
        assert a.WhichOneof("response") == "response_headers"
        resp = {"choices": [{"message": {"content": "xx"}}],
                "usage": {"prompt_tokens": 8, "completion_tokens": 2}}
        s.send(pb.ProcessingRequest(response_body=pb.HttpBody(
            body=json.dumps(resp).encode(), end_of_stream=True)))
        assert pk.picker.sessions["d1"].last_engine == dest
    finally:
        s.close()
    s = Stream(pk)
    try:
        a = s.send(pb.ProcessingRequest(request_headers=pb.HttpHeaders(
            headers=_headers(_method="GET", _path="/v1/models").headers, end_of_stream=True),
            protocol_config=duplex))
        assert a.request_headers.response.header_mutation.set_headers[0].header.key == \
            "x-gateway-destination-endpoint"
    finally:
        s.close()
        pk.stop()


def test_503_for_an_empty_subset_and_429_when_full(fakes: list[FakeServer]) -> None:
    pk = start_picker([_ep(fakes[0])], policy="fcfs-workflow", max_held=1,
                      policy_params={"release": {"max_inflight_per_engine": 1}})
    streams: list[Stream] = []
    try:
        def open_request(sid: str, **headers: str) -> Stream:
            s = Stream(pk)
            streams.append(s)
            s.send(pb.ProcessingRequest(request_headers=_headers(
                _method="POST", _path="/v1/chat/completions", x_session_id=sid, **headers)))
            return s

        s = open_request("a", x_gateway_destination_endpoint_subset="10.0.0.1:1")
        a = s.send(pb.ProcessingRequest(request_body=pb.HttpBody(
            body=json.dumps(chat_body()).encode(), end_of_stream=True)))
        assert a.immediate_response.status.code == 503
        # one turn runs (never answered here), one is held, the next is shed
        first = open_request("b")
        first.send(pb.ProcessingRequest(request_body=pb.HttpBody(
            body=json.dumps(chat_body()).encode(), end_of_stream=True)))
        held = open_request("c")
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.append(held.send(pb.ProcessingRequest(
            request_body=pb.HttpBody(body=json.dumps(chat_body()).encode(),
                                     end_of_stream=True)))), daemon=True)
        t.start()
        t.join(0.5)
        assert not got  # held: no answer yet
        shed = open_request("d")
        a = shed.send(pb.ProcessingRequest(request_body=pb.HttpBody(
            body=json.dumps(chat_body()).encode(), end_of_stream=True)))
        assert a.immediate_response.status.code == 429
        retry = {h.header.key: h.header.raw_value.decode()
                 for h in a.immediate_response.headers.set_headers}
        assert retry["retry-after"] == "1"
        # the running turn ends: the held one is answered with its destination
        first.send(pb.ProcessingRequest(response_headers=_headers(_status="200")))
        first.send(pb.ProcessingRequest(response_body=pb.HttpBody(
            body=b'{"usage": {"completion_tokens": 1}}', end_of_stream=True)))
        t.join(10)
        assert got and got[0].request_body.response.header_mutation.set_headers
    finally:
        for s in streams:
            s.close()
        pk.stop()
