import asyncio
from collections import Counter

import grpc

from rlgate.v1.toolgateway_pb2_grpc import ToolGatewayServiceStub as Stub
from tests.toolgateway.conftest import make_session
from tests.toolgateway.test_call_stream import CODES, Request, open_stream, request, send

import os
CANCEL = os.environ.get("CANCEL") == "1"
OPTS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


async def test_probe(gateway, store, fleet):
    s = await make_session(store, fleet, "gw")
    n = 300
    async with grpc.aio.insecure_channel(gateway.address, options=OPTS) as ch:
        stub = Stub(ch)
        async with open_stream(stub) as stream:
            await send(stream, request(10_000, s.token, "big", {"size": 10}))
            await stream.read()
            await send(stream, *(request(i, s.token, "big", {"size": 4000}, request_id=f"b{i}") for i in range(n)))
            await asyncio.sleep(1.5)
            if CANCEL:
                await send(stream, *(Request(call_id=i, cancel=True) for i in range(n)))
            got = {}
            try:
                while len(got) < n:
                    a = await asyncio.wait_for(stream.read(), 5)
                    o = a.WhichOneof("outcome")
                    got[a.call_id] = o if o == "reply" else CODES[a.error.code].name
            except TimeoutError:
                pass
            print("answers", len(got), Counter(got.values()))
            missing = sorted(set(range(n)) - set(got))
            print("missing", len(missing), missing[:10])
            assert len(got) == n
