"""Probe for client-side session pinning with grpcio's `ring_hash_experimental` policy (run as a process:
grpc core reads its experimental switches from the environment once, at start-up).

    python -m tests.deploy.pinning_probe HEADER

Starts three loopback servers that answer with their name, opens one channel over all three with the
ring-hash service config hashing on HEADER, sends 5 calls for each of 20 keys and prints JSON:
{"pinned": every key always reached the same server, "backends": servers reached} or {"error": ...}.
"""

from __future__ import annotations

import json
import sys
from concurrent import futures

import grpc

CALLS_PER_KEY = 5
KEYS = 20


def service_config(header: str) -> str:
    """The channel's service config: ring hash over the resolved addresses, hashing one request header."""
    return json.dumps({"loadBalancingConfig": [{"ring_hash_experimental": {"requestHashHeader": header}}]})


def _serve(name: str) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    handler = grpc.method_handlers_generic_handler(
        "probe.Who", {"Am": grpc.unary_unary_rpc_method_handler(lambda _req, _ctx: name.encode())}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def main(header: str) -> dict[str, object]:
    servers = [_serve(name) for name in ("a", "b", "c")]
    target = "ipv4:" + ",".join(f"127.0.0.1:{port}" for _, port in servers)
    try:
        with grpc.insecure_channel(target, options=[("grpc.service_config", service_config(header))]) as channel:
            who: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary("/probe.Who/Am")
            seen: dict[str, set[bytes]] = {}
            for i in range(KEYS):
                value = f"Bearer token-{i}" if header == "authorization" else f"session-{i}"
                seen[value] = {
                    who(b"", metadata=((header, value),), timeout=5, wait_for_ready=True) for _ in range(CALLS_PER_KEY)
                }
    except grpc.RpcError as exc:
        return {"error": f"{exc.code().name}: {exc.details()}"}
    finally:
        for server, _ in servers:
            server.stop(None)
    return {
        "pinned": all(len(v) == 1 for v in seen.values()),
        "backends": sorted({b.decode() for v in seen.values() for b in v}),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
