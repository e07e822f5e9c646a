"""The Envoy ext_proc stream of the endpoint-picker protocol (Gateway API Inference Extension,
``docs/proposals/004-endpoint-picker-protocol``), served with ``grpc.aio``.

One gRPC stream per HTTP request. Envoy's filter is configured (``deploy/envoy.yaml``,
:mod:`.envoy`) to send request headers, the whole request body (**full-duplex streamed** or
**buffered**, as ``protocol_config`` in the first message says), response headers and the
**streamed** response body:

* request headers: the identity (session, tenant, parent, hints) is read from them as ``serve``
  reads it (:mod:`turnstile.gateway.identity`). A request with no body (``GET /v1/models``) is
  routed to any ready endpoint right there. Otherwise, buffered: answered at once (CONTINUE);
  full-duplex: the answer waits for the body (Envoy sends it without waiting) and carries the
  destination, and the body follows as one streamed chunk (one round trip, not two);
* request body: the turn becomes READY in the scheduler. The answer waits until the release
  policy releases it — that wait *is* release control — then sets
  ``x-gateway-destination-endpoint: ip:port,fallback,…`` and the same value under the
  ``envoy.lb`` dynamic metadata namespace, and replaces the body when the engine's adapter added
  fields (llama.cpp ``id_slot``). Admission sheds with an ``ImmediateResponse`` 429 +
  ``Retry-After``; no ready endpoint (in the ``x-gateway-destination-endpoint-subset`` given as
  ``envoy.lb.subset_hint`` filter metadata or as a request header) is a 503;
* response headers and body chunks: passed on unchanged, reported to the scheduler (first token,
  usage, finish); the stream's end without a complete response is a client that went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from turnstile.epp.picker import SERVED_HEADER, Exchange, Picker, is_scheduled
from turnstile.gateway.identity import Identity, read_body, request_identity
from turnstile.gateway.protocol import GatewayError, error_body

__all__ = ["DEST_HEADER", "LB_NAMESPACE", "SUBSET_HEADER", "SUBSET_NAMESPACE", "ExtProc"]

log = logging.getLogger("turnstile.epp")

DEST_HEADER = "x-gateway-destination-endpoint"
SUBSET_HEADER = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
#: names a routed request to the observing filter (``watch=observe``)
REQUEST_ID_HEADER = b"x-turnstile-request-id"
WATCH_GRACE_S = 10.0


def _headers(msg: pb.HttpHeaders) -> list[tuple[bytes, bytes]]:
    out = []
    for h in msg.headers.headers:
        out.append((h.key.lower().encode("latin-1"), h.raw_value or h.value.encode("latin-1")))
    return out


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode("latin-1")),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def _subset(req: pb.ProcessingRequest, headers: list[tuple[bytes, bytes]]) -> set[str] | None:
    """The endpoints the data plane allows (filter metadata first, then a request header)."""
    md = req.metadata_context.filter_metadata
    if SUBSET_NAMESPACE in md:
        v = md[SUBSET_NAMESPACE].fields.get(SUBSET_HEADER)
        if v is not None:
            if v.HasField("list_value"):
                return {x.string_value.strip() for x in v.list_value.values}
            return {x.strip() for x in v.string_value.split(",") if x.strip()}
    for k, val in headers:
        if k == SUBSET_HEADER.encode():
            return {x.strip() for x in val.decode("latin-1").split(",") if x.strip()}
    return None


def _status_of(headers: list[tuple[bytes, bytes]]) -> tuple[int, str | None]:
    status, served = 0, None
    for k, v in headers:
        if k == b":status":
            with contextlib.suppress(ValueError):
                status = int(v)
        elif k == SERVED_HEADER.encode():
            served = v.decode("latin-1").strip() or None
    return status, served


def _served_metadata(req: pb.ProcessingRequest) -> str | None:
    """The endpoint that served, as the protocol has the data plane say it: the
    ``x-gateway-destination-endpoint-served`` entry of the ``envoy.lb`` metadata."""
    md = req.metadata_context.filter_metadata
    if LB_NAMESPACE in md:
        v = md[LB_NAMESPACE].fields.get(SERVED_HEADER)
        if v is not None and v.string_value:
            return v.string_value.strip()
    return None


def immediate(status: int, message: str, type_: str, code: str | None = None,
              headers: list[tuple[bytes, bytes]] | None = None) -> pb.ProcessingResponse:
    """An answer to the client from the picker itself (429, 503, 400, 404)."""
    mut = pb.HeaderMutation(set_headers=[_header("content-type", "application/json")]
                            + [_header(k.decode(), v.decode()) for k, v in headers or ()])
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=mut,
        body=error_body(message, type_, code), details=f"turnstile_epp_{status}"))


def routed(dest: str, *, body: bytes | None = None, phase: str = "request_body",
           extra: list[tuple[str, str]] = ()) -> pb.ProcessingResponse:
    """Continue to ``dest`` (``ip:port[,fallback…]``): the header and the envoy.lb metadata
    (``extra``: more request headers to set). ``body``: the rewritten body — its length in the
    headers, and the body itself in a ``request_body`` answer (in a ``request_headers`` answer,
    full-duplex mode, the caller sends it as a streamed chunk)."""
    sets = [_header(DEST_HEADER, dest), *(_header(k, v) for k, v in extra)]
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=sets))
    if body is not None:
        if phase == "request_body":
            common.body_mutation.body = body
        common.header_mutation.set_headers.append(_header("content-length", str(len(body))))
    md = struct_pb2.Struct()
    md.get_or_create_struct(LB_NAMESPACE)[DEST_HEADER] = dest
    if phase == "request_headers":
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common),
                                     dynamic_metadata=md)
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common),
                                 dynamic_metadata=md)


def _streamed(chunk: bytes, end: bool) -> pb.ProcessingResponse:
    """A request body chunk passed on in ``FULL_DUPLEX_STREAMED`` mode (there Envoy forwards
    only what the picker sends back)."""
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
            body=chunk, end_of_stream=end)))))


_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_CONTINUE_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_CONTINUE_RESP_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_CONTINUE_RESP_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse())
_CONTINUE_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())


class ExtProc(pb_grpc.ExternalProcessorServicer):
    """``envoy.service.ext_proc.v3.ExternalProcessor`` over a :class:`Picker`."""

    def __init__(self, picker: Picker, metrics: Any = None, *, observe: bool = False) -> None:
        self.picker = picker
        self.metrics = metrics
        #: the response is reported by a second, observability-mode filter (``watch=observe``)
        #: that names the request with ``x-turnstile-request-id``; the routing filter's stream
        #: ends after its answer
        self.observe = observe

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        ex: Exchange | None = None
        ident: Identity | None = None
        headers: list[tuple[bytes, bytes]] = []
        method = path = ""
        subset: set[str] | None = None
        scheduled = False
        complete = False
        #: Envoy's request body mode is FULL_DUPLEX_STREAMED: the body comes without waiting for
        #: the headers' answer, which then waits for the whole body (one round trip, not two)
        duplex = False
        answered = False
        chunks: list[bytes] = []
        try:
            async for req in request_iterator:
                kind = req.WhichOneof("request")
                if kind == "request_headers":
                    headers = _headers(req.request_headers)
                    watched = None
                    for k, v in headers:
                        if k == b":method":
                            method = v.decode("latin-1")
                        elif k == b":path":
                            path = v.decode("latin-1")
                        elif k == REQUEST_ID_HEADER:
                            watched = v.decode("latin-1")
                    if watched is not None:  # the observing filter's stream: no answers
                        await self._watch(watched, request_iterator)
                        return
                    subset = _subset(req, headers)
                    scheduled = is_scheduled(method, path)
                    duplex = req.protocol_config.request_body_mode == _FULL_DUPLEX
                    if not scheduled or req.request_headers.end_of_stream:
                        yield self._unscheduled(subset, "request_headers")
                        scheduled, answered = False, True
                    else:
                        ident = request_identity(headers)
                        if not duplex:
                            yield _CONTINUE_HEADERS
                elif kind == "request_body" and duplex:
                    b = req.request_body
                    if answered:  # not scheduled, or already routed: pass the body on
                        yield _streamed(b.body, b.end_of_stream)
                        continue
                    chunks.append(b.body)
                    if not b.end_of_stream:
                        continue
                    ex, answers = await self._route_duplex(ident, path, b"".join(chunks),
                                                           subset, req)
                    chunks, answered = [], True
                    for a in answers:
                        yield a
                    if ex is None:
                        return
                elif kind == "request_body":
                    if not scheduled or ex is not None:
                        yield _CONTINUE_BODY
                        continue
                    assert ident is not None
                    if subset is None:  # the hint may come with the body's message
                        subset = _subset(req, [])
                    t0 = time.perf_counter()
                    ex, answer, _ = await self._route(ident, path.split("?", 1)[0],
                                                      req.request_body.body, subset)
                    if self.metrics is not None:
                        self.metrics.decision(time.perf_counter() - t0, answer)
                    yield answer
                    if ex is None:
                        return
                elif kind == "response_headers":
                    if ex is None:
                        yield _CONTINUE_RESP_HEADERS
                        continue
                    status, served = _status_of(_headers(req.response_headers))
                    ex.response_headers(status, _served_metadata(req) or served)
                    if req.response_headers.end_of_stream:
                        ex.response_body(b"", True, self.picker)
                        complete = True
                    yield _response_headers(ex)
                elif kind == "response_body":
                    if ex is not None:
                        b = req.response_body
                        ex.response_body(b.body, b.end_of_stream, self.picker)
                        complete = complete or b.end_of_stream
                    yield _CONTINUE_RESP_BODY
                    if complete:  # nothing more to decide: close the stream now
                        return
                elif kind == "request_trailers":
                    if duplex and not answered:  # the body ended with trailers
                        ex, answers = await self._route_duplex(ident, path, b"".join(chunks),
                                                               subset, req, end=False)
                        chunks, answered = [], True
                        for a in answers:
                            yield a
                        if ex is None:
                            return
                    yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
                elif kind == "response_trailers":
                    if ex is not None:
                        ex.response_body(b"", True, self.picker)
                        complete = True
                    yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
        finally:
            if ex is not None:
                await self._close(ex, complete)

    async def _route_duplex(self, ident: Identity | None, path: str, raw: bytes,
                            subset: set[str] | None, req: pb.ProcessingRequest, *,
                            end: bool = True
                            ) -> tuple[Exchange | None, tuple[pb.ProcessingResponse, ...]]:
        """:meth:`_route` for ``FULL_DUPLEX_STREAMED``: the headers' answer and the body."""
        assert ident is not None
        if subset is None:
            subset = _subset(req, [])
        t0 = time.perf_counter()
        ex, answer, body = await self._route(ident, path.split("?", 1)[0], raw, subset,
                                             phase="request_headers")
        if self.metrics is not None:
            self.metrics.decision(time.perf_counter() - t0, answer)
        if ex is None:
            return None, (answer,)
        # the destination rides on the headers' answer (Envoy sent the body without waiting
        # for it); the body follows as one streamed chunk
        return ex, (answer, _streamed(raw if body is None else body, end))

    def _unscheduled(self, subset: set[str] | None, phase: str) -> pb.ProcessingResponse:
        dest = self.picker.any_endpoint(subset)
        if dest is None:
            return immediate(503, "no ready endpoint", "upstream_error", "no_endpoint")
        return routed(dest, phase=phase)

    async def _route(self, ident: Identity, path: str, raw: bytes, subset: set[str] | None,
                     phase: str = "request_body"
                     ) -> tuple[Exchange | None, pb.ProcessingResponse, bytes | None]:
        """Schedule one request: wait for its release, answer with its destination (in
        ``phase``'s answer; the body the engine's adapter rewrote, if it did, is in it and
        returned)."""
        try:
            body = json.loads(raw) if raw else None
        except (ValueError, UnicodeDecodeError) as e:
            return None, immediate(400, f"request body is not valid JSON: {e}",
                                   "invalid_request_error", "invalid_json"), None
        if not isinstance(body, dict):
            return None, immediate(400, "request body must be a JSON object",
                                   "invalid_request_error", "invalid_json"), None
        read_body(ident, body)
        try:
            ex = self.picker.submit(ident, path, body, subset)
        except GatewayError as e:
            return None, _error(e), None
        assert ex.task is not None
        try:
            await asyncio.wait([ex.route, ex.task], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the client (or Envoy) went away while it was held
            ex.finish(False)
            ex.task.cancel()
            raise
        if not ex.route.done():
            ex.route.cancel()
            exc = ex.task.exception()
            if isinstance(exc, GatewayError):
                return None, _error(exc), None
            log.error("scheduling failed", exc_info=exc)
            return None, immediate(500, f"picker error: {exc}", "server_error"), None
        r = ex.route.result()
        dest = ",".join([r.endpoint, *r.fallbacks])
        extra: list[tuple[str, str]] = []
        p = ex.pending
        if self.observe and p is not None:
            rec = p.rec
            hold_ms = 0.0 if rec is None else max(rec.released_s - rec.ready_s, 0.0) * 1e3
            extra = [(REQUEST_ID_HEADER.decode(), ex.request_id),
                     ("x-turnstile-session-id", p.session.id),
                     ("x-turnstile-engine", r.engine),
                     ("x-turnstile-hold-ms", f"{hold_ms:.3f}")]
        return ex, routed(dest, body=r.body, phase=phase, extra=extra), r.body

    async def _watch(self, request_id: str, requests: AsyncIterator[pb.ProcessingRequest]
                     ) -> None:
        """The observing filter's stream of one routed request: its response events."""
        ex = self.picker.routes.exchanges.get(request_id)
        if ex is not None:
            ex.watched = True
        complete = False
        try:
            async for req in requests:
                if ex is None:
                    continue
                kind = req.WhichOneof("request")
                if kind == "response_headers":
                    status, served = _status_of(_headers(req.response_headers))
                    ex.response_headers(status, _served_metadata(req) or served)
                    if req.response_headers.end_of_stream:
                        ex.response_body(b"", True, self.picker)
                        complete = True
                elif kind == "response_body":
                    b = req.response_body
                    ex.response_body(b.body, b.end_of_stream, self.picker)
                    complete = complete or b.end_of_stream
                if complete:  # close the stream now, not after Envoy's deferred close
                    return
        finally:
            if ex is not None:
                ex.finish(complete)

    async def _close(self, ex: Exchange, complete: bool) -> None:
        """The stream is over: a response that never completed is a client that went away."""
        if self.observe and ex.route.done() and not complete:
            # the observing filter reports the response; should it never come (a config
            # without it), the turn is closed after WATCH_GRACE_S as answered
            asyncio.get_running_loop().call_later(WATCH_GRACE_S, _unwatched, ex)
            return
        ex.finish(complete)
        task = ex.task
        if task is None:
            return
        if not complete and not task.done() and not ex.route.done():
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.shield(task)


def _response_headers(ex: Exchange) -> pb.ProcessingResponse:
    """What ``serve`` tells its clients, added to the engine's response headers."""
    p = ex.pending
    if p is None:
        return _CONTINUE_RESP_HEADERS
    rec = p.rec
    hold_ms = 0.0 if rec is None else max(rec.released_s - rec.ready_s, 0.0) * 1e3
    sets = [_header("x-session-id", p.session.id), _header("x-turnstile-engine", p.engine),
            _header("x-turnstile-hold-ms", f"{hold_ms:.3f}")]
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse(
        response=pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=sets))))


def _unwatched(ex: Exchange) -> None:
    if not ex.watched and not ex.done.done():
        log.warning("no response report for request %s (is the observing ext_proc filter "
                    "configured?): closed as answered", ex.request_id)
        ex.finish(True)


def _error(e: GatewayError) -> pb.ProcessingResponse:
    return immediate(e.status, e.message, e.type, e.code, e.headers)
