"""A bare grpc.aio unary echo server: the limit an orchestrator Step is compared with.

Run as `python -m bench.echo_server`; it binds 127.0.0.1 on a free port, prints the port on stdout and
serves until SIGTERM. No interceptors, no health service, no (de)serialization: the request bytes go back.
It runs on the services' event loop (`rlgate.runtime.eventloop`), so the comparison is of the work alone.
"""

from __future__ import annotations

import asyncio
import signal

import grpc

from rlgate.runtime import eventloop

METHOD = "/bench.Echo/Echo"


def _identity(data: bytes) -> bytes:
    return data


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


class _Handler(grpc.GenericRpcHandler):
    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if handler_call_details.method == METHOD:
            return grpc.unary_unary_rpc_method_handler(
                _echo, request_deserializer=_identity, response_serializer=_identity
            )
        return None


async def serve() -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_Handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)


if __name__ == "__main__":
    eventloop.run(serve())
