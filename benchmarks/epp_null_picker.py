"""A null endpoint picker: the ext_proc protocol with no scheduler, for the floor of the picker's
overhead in Python gRPC (``benchmarks/epp_overhead.py --floor``).

It answers every message as ``turnstile epp`` does on its transport path (the destination header
and ``envoy.lb`` metadata on the request body, or on the headers in full-duplex mode; CONTINUE
on every response event) but decides nothing: the difference between it and ``turnstile epp``
behind the same Envoy is the picker's own Python work (identity, JSON, scheduler, the response
bookkeeping); the difference between it and Envoy alone is what Envoy's ext_proc and Python gRPC
cost per request. ``--server aio`` is ``grpc.aio`` (as ``turnstile epp``), ``aio-uvloop`` the
same on uvloop's event loop, ``--server sync`` the thread-pool server.

    python benchmarks/epp_null_picker.py --port 9002 --dest 127.0.0.1:8000 --server aio
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from turnstile.epp.extproc import _FULL_DUPLEX, _streamed, routed

_CONT = {
    "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
    "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
    "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
}


def answers(dest: str) -> Any:
    """A generator-based state machine: ``send(request)`` gives the answers to send."""
    duplex = False
    chunks: list[bytes] = []
    out: list[pb.ProcessingResponse] = []
    while True:
        req = yield out
        out = []
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            duplex = req.protocol_config.request_body_mode == _FULL_DUPLEX
            if req.request_headers.end_of_stream:
                out = [routed(dest, phase="request_headers")]
            elif not duplex:
                out = [_CONT[kind]]
        elif kind == "request_body" and duplex:
            chunks.append(req.request_body.body)
            if req.request_body.end_of_stream:
                out = [routed(dest, phase="request_headers"), _streamed(b"".join(chunks), True)]
        elif kind == "request_body":
            out = [routed(dest)]
        else:
            out = [_CONT[kind]]


class AioNull(pb_grpc.ExternalProcessorServicer):
    def __init__(self, dest: str) -> None:
        self.dest = dest

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: Any) -> AsyncIterator[pb.ProcessingResponse]:
        sm = answers(self.dest)
        next(sm)
        async for req in request_iterator:
            for a in sm.send(req):
                yield a


class SyncNull(pb_grpc.ExternalProcessorServicer):
    def __init__(self, dest: str) -> None:
        self.dest = dest

    def Process(self, request_iterator: Iterator[pb.ProcessingRequest],  # type: ignore[override]
                context: Any) -> Iterator[pb.ProcessingResponse]:
        sm = answers(self.dest)
        next(sm)
        for req in request_iterator:
            yield from sm.send(req)


async def _serve_aio(port: int, dest: str) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(AioNull(dest), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dest", required=True)
    ap.add_argument("--server", choices=("aio", "aio-uvloop", "sync"), default="aio")
    args = ap.parse_args()
    if args.server == "aio-uvloop":
        import uvloop

        uvloop.run(_serve_aio(args.port, args.dest))
        return
    if args.server == "aio":
        asyncio.run(_serve_aio(args.port, args.dest))
        return
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    pb_grpc.add_ExternalProcessorServicer_to_server(SyncNull(args.dest), server)
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    server.wait_for_termination()


if __name__ == "__main__":
    main()
