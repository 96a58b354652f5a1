import asyncio, collections, logging, sys, time
logging.basicConfig(level=logging.DEBUG, format="%(name)s %(message)s")
logging.getLogger("asyncio").setLevel(logging.WARNING)
from rlgate import AsyncClient, ClientSettings, RetryPolicy
from rlgate.errors import DeadlineExceeded
from tests.client.scripted import ScriptedServer, Sleep

async def main():
    out = collections.Counter()
    for i in range(10):
        srv = ScriptedServer().start()
        srv.script.push("CallTool", Sleep(30))
        async with AsyncClient(srv.address, settings=ClientSettings(gateway_addresses=(srv.address,))) as c:
            try:
                await c.call_tool("t", "a", timeout=0.3)
            except DeadlineExceeded:
                pass
            t0 = time.monotonic()
            try:
                await c.call_tool("t", "b", timeout=2)
                out["ok"] += 1
            except Exception as e:
                out[type(e).__name__] += 1
                print("seen", srv.script.count("CallTool"), "cancels", dict(srv.script.cancels), "cancelled", dict(srv.script.cancelled), "ended", dict(srv.script.streams_ended))
        srv.stop()
    print(out)
asyncio.run(main())
