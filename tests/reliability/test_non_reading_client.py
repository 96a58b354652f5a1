"""A client that never reads its replies, against the real gateway (a stack on 127.0.0.1, started like the
rest of the suite's): a raw HTTP/2 connection (`h2`) opens STREAMS streams of valid ListTools requests with a
valid agent token, for a session whose listing is TOOLS tools (a reply of ~0.8 MB), and never sends a
WINDOW_UPDATE. The gateway may send it 64 KiB in all (the connection's initial flow-control window); every
other byte of every reply it holds, for as long as the connection lives.

What bounds that is per connection: the reply budget (`REPLY_BUDGET_BYTES` of replies unread; past it new
streams are refused RESOURCE_EXHAUSTED before any work), plus the replies of streams admitted together before
any of theirs existed (at most the stream limit, `MAX_STREAMS_PER_CONNECTION`); for up to the connection's
age (5 min, then 3 min of grace), or until the client goes, or stops answering the server's keepalive pings
(a ping after 60 s, 20 s to answer it).

The gateway's RSS (psutil: before, sampled peak, after) goes to the figures file and docs/reliability.md.
Asserted: a generous bound per held reply; the replies held within the budget (and, in the full set, the
streams past it refused); a well-behaved client is served meanwhile; once the client goes its connection is
dropped, and ATTACKS attacks in a row each reuse the memory the first one freed instead of adding to it (no
later peak past the first by a quarter of its growth: replies kept past their stream's end would add up
attack after attack); in the full set, a client gone silent (it stops reading the socket) is dropped by the
server's keepalive.

Not asserted: how far the RSS falls once the client goes. The freed replies go back to glibc's main arena,
and what it returns to the system depends on where the last live allocation lies in the heap, which varies
from run to run (see docs/reliability.md). That the replies are freed is shown on the Python objects
themselves, allocator aside: `tests/unit/test_reply_budget.py` (tracemalloc).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import psutil
import pytest

from rlgate.runtime.grpc_server import MAX_STREAMS_PER_CONNECTION
from rlgate.runtime.interceptors import REPLY_BUDGET_BYTES
from rlgate.v1 import orchestrator_pb2, orchestrator_pb2_grpc, toolgateway_pb2, toolgateway_pb2_grpc
from tests.reliability.conftest import FULL, Figures
from tests.reliability.harness import Audit, AuditedStack, bearer, start_stack
from tests.reliability.test_hostile import Hostile, PeakRss, hostile_server

TOOLS = 5_000  # the session's listing: a ListTools reply of ~0.8 MB
STREAMS = 1_000 if FULL else 100  # at most MAX_STREAMS_PER_CONNECTION on one connection
WINDOW = 65_535  # the connection's initial flow-control window: all a non-reading client can be sent
BURST_BYTES = 64 * 2**20  # past the budget: replies of streams admitted together, before any of theirs existed
HELD_PER_REPLY = 6.0  # the gateway's growth per held reply, in reply sizes (the message, its bytes, the transport's)
ANSWERED_S = 240.0 if FULL else 60.0  # every stream answered (the gateway builds each reply)
SERVED_S = 5.0  # a well-behaved client's ListTools while the attack holds
SETTLE_S = 10.0  # after the client goes, the gateway's RSS is read this much later (a figure: it is flat by then)
ATTACKS = 3  # in a row, on the same gateway: a leak adds up, memory reused does not
SILENT_DROP_S = 240.0  # keepalive: a ping after 60 s, answered within 20 s, or the connection is dropped
pytestmark = pytest.mark.timeout(1200 if FULL else 300)


@dataclass
class Gateway:
    stack: AuditedStack
    token: str
    reply_bytes: int  # one ListTools reply, serialized

    @property
    def process(self) -> psutil.Process:
        return psutil.Process(self.stack.procs["toolgateway"].pid)

    def rss_mb(self) -> float:
        return float(self.process.memory_info().rss) / 2**20

    def holds(self, client: NonReadingClient) -> bool:
        """The gateway still has the client's TCP connection open."""
        return any(
            c.raddr and c.raddr.port == client.port and c.status == psutil.CONN_ESTABLISHED
            for c in self.process.net_connections(kind="tcp")
        )

    def list_tools_s(self) -> float:
        """A well-behaved client's ListTools (its own connection): seconds it took."""
        started = time.monotonic()
        with grpc.insecure_channel(self.stack.gateway_address) as channel:
            stub = toolgateway_pb2_grpc.ToolGatewayServiceStub(channel)
            stub.ListTools(toolgateway_pb2.ListToolsRequest(), timeout=SERVED_S * 4, metadata=bearer(self.token))
        return time.monotonic() - started


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, audit: Audit) -> Iterator[Gateway]:
    data = tmp_path_factory.mktemp("non-reading")
    with hostile_server(data / "hostile-mcp.log", ["--tools", str(TOOLS)]) as upstream:
        stack = stack_on(data, audit, upstream)
        try:
            orch = orchestrator_pb2_grpc.OrchestratorServiceStub(grpc.insecure_channel(stack.orchestrator_address))
            reset = orch.Reset(orchestrator_pb2.ResetRequest(task_key="non-reading"), timeout=60.0,
                               metadata=stack.metadata())  # fmt: skip
            token = audit.token(reset.agent_token)
            with grpc.insecure_channel(stack.gateway_address) as channel:
                listed = toolgateway_pb2_grpc.ToolGatewayServiceStub(channel).ListTools(
                    toolgateway_pb2.ListToolsRequest(), timeout=60.0, metadata=bearer(token)
                )
            assert len(listed.tools) == TOOLS
            yield Gateway(stack, token, listed.ByteSize())
        finally:
            stack.stop()


def stack_on(data: Path, audit: Audit, upstream: Hostile) -> AuditedStack:
    tasks = {"tasks": [{"key": "non-reading", "prompt": "Hold on.", "env_id": "non-reading", "version": "v1",
                        "mcp_endpoints": [upstream.url("modern", "many-tools", "call")]}]}  # fmt: skip
    (data / "tasks.json").write_text(json.dumps(tasks))
    return start_stack(
        data / "stack", audit, orchestrator_args=["--provider", "mcp", "--tasks-file", str(data / "tasks.json")]
    )


class NonReadingClient:
    """One raw HTTP/2 connection that sends requests and answers SETTINGS and PING frames (h2 does that), but
    never acknowledges a byte of DATA: the peer's flow-control windows never open again."""

    def __init__(self, address: str, token: str) -> None:
        host, port = address.rsplit(":", 1)
        self.address = address
        self.token = token
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.sock = socket.create_connection((host, int(port)), timeout=10.0)
        self.port = int(self.sock.getsockname()[1])
        self.conn.initiate_connection()
        self.sock.sendall(self.conn.data_to_send())
        self.answered = 0  # streams whose response headers came: the gateway built their reply
        self.received = 0  # DATA bytes the gateway got out
        self.refused = 0  # streams answered RESOURCE_EXHAUSTED at once (the connection's reply budget)
        self.closed_by_server = False

    def list_tools(self, streams: int) -> None:
        message = toolgateway_pb2.ListToolsRequest().SerializeToString()
        framed = b"\x00" + len(message).to_bytes(4, "big") + message  # a gRPC message, uncompressed
        headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", self.address.encode()),
                   (b":path", b"/rlgate.v1.ToolGatewayService/ListTools"), (b"content-type", b"application/grpc"),
                   (b"te", b"trailers"), (b"authorization", f"Bearer {self.token}".encode())]  # fmt: skip
        for _ in range(streams):
            stream = self.conn.get_next_available_stream_id()
            self.conn.send_headers(stream, headers)
            self.conn.send_data(stream, framed, end_stream=True)
        self.sock.sendall(self.conn.data_to_send())

    def pump(self, seconds: float) -> None:
        """Read frames for `seconds` (bounded waits), answering what h2 answers by itself."""
        deadline = time.monotonic() + seconds
        while not self.closed_by_server and time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, min(0.2, deadline - time.monotonic())))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                self.closed_by_server = True
                break
            if not data:
                self.closed_by_server = True
                break
            for event in self.conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    self.answered += 1
                    if (b"grpc-status", b"8") in event.headers:  # trailers only: refused, nothing held
                        self.refused += 1
                elif isinstance(event, h2.events.DataReceived):
                    self.received += event.flow_controlled_length  # never acknowledged
            if out := self.conn.data_to_send():
                self.sock.sendall(out)

    def close(self) -> None:
        self.sock.close()


@dataclass
class Attack:
    streams: int
    reply_bytes: int
    answered: int = 0
    refused: int = 0  # answered RESOURCE_EXHAUSTED at once: the connection was at its reply budget
    received: int = 0
    answered_s: float = 0.0
    served_s: float = 0.0  # a well-behaved client's ListTools meanwhile
    dropped: bool = False  # the gateway closed its side once the client went
    before_mb: float = 0.0
    peak_mb: float = 0.0
    after_mb: float = 0.0  # SETTLE_S after the client went (what the allocator kept varies: not asserted)

    @property
    def held(self) -> int:
        return self.answered - self.refused

    @property
    def growth_mb(self) -> float:
        return self.peak_mb - self.before_mb


def attack(gw: Gateway) -> Attack:
    """STREAMS ListTools on one connection that never reads, held until every one is answered and a
    well-behaved client has been served; then the client goes."""
    result = Attack(STREAMS, gw.reply_bytes)
    with PeakRss({"toolgateway": gw.process.pid}) as rss:
        client = NonReadingClient(gw.stack.gateway_address, gw.token)
        started = time.monotonic()
        try:
            client.list_tools(STREAMS)
            while client.answered < STREAMS and time.monotonic() - started < ANSWERED_S:
                client.pump(1.0)
            result.answered_s = round(time.monotonic() - started, 2)
            result.served_s = round(gw.list_tools_s(), 3)
            client.pump(1.0)  # the peak, held
            result.answered, result.refused, result.received = client.answered, client.refused, client.received
            assert gw.holds(client)
        finally:
            client.close()
    time.sleep(SETTLE_S)
    result.dropped = not gw.holds(client)
    result.before_mb, result.peak_mb = round(rss.before["toolgateway"], 1), round(rss.peak["toolgateway"], 1)
    result.after_mb = round(gw.rss_mb(), 1)
    return result


def test_a_client_that_never_reads(gateway: Gateway, figures: Figures) -> None:
    """ATTACKS times in a row: what the gateway holds for the client, that others are served meanwhile, and that
    it lets go once the client goes (each later attack finds the memory the first one freed)."""
    assert STREAMS <= MAX_STREAMS_PER_CONNECTION
    attacks = [attack(gateway) for _ in range(ATTACKS)]
    first = attacks[0]
    figures.record("non_reading_client", "list_tools", {
        "tools": TOOLS, "reply_bytes": gateway.reply_bytes, "attacks": [asdict(a) for a in attacks],
        "budget_bytes": REPLY_BUDGET_BYTES,
        "per_held_stream_mb": [round((a.peak_mb - first.before_mb) / a.held, 2) for a in attacks],
    })  # fmt: skip
    reply_mb = gateway.reply_bytes / 2**20
    for a in attacks:
        assert a.answered == STREAMS and a.received <= WINDOW, a  # every reply built, only a window sent
        assert a.dropped, a
        assert a.served_s < SERVED_S, a
        assert a.held * gateway.reply_bytes < REPLY_BUDGET_BYTES + BURST_BYTES, a  # the budget held
        if STREAMS * gateway.reply_bytes > REPLY_BUDGET_BYTES + BURST_BYTES:
            assert a.refused > 0, a
        assert a.growth_mb < a.held * reply_mb * HELD_PER_REPLY + 64, (a, reply_mb)
    # Once the client has gone the memory is the gateway's again: each later attack reuses it instead of adding
    # to it. Replies (or streams) kept past the client would add their size to every later peak.
    for later in attacks[1:]:
        assert later.peak_mb < first.peak_mb + first.growth_mb / 4, attacks


@pytest.mark.skipif(not FULL, reason="waits for the server's keepalive (about 2 min): full set only")
def test_a_client_gone_silent_is_dropped(gateway: Gateway, figures: Figures) -> None:
    """The same streams, then the client stops reading the socket altogether (no PING answered, the socket's
    buffer full): the server's keepalive drops the connection, and the replies it held with it."""
    client = NonReadingClient(gateway.stack.gateway_address, gateway.token)
    try:
        client.list_tools(STREAMS)
        started = time.monotonic()
        while client.answered < STREAMS and time.monotonic() - started < ANSWERED_S:
            client.pump(1.0)
        held_mb = gateway.rss_mb()
        silent = time.monotonic()
        while gateway.holds(client) and time.monotonic() - silent < SILENT_DROP_S:
            time.sleep(1.0)
        dropped_s = time.monotonic() - silent
        dropped = not gateway.holds(client)
    finally:
        client.close()
    time.sleep(SETTLE_S)
    figures.record("non_reading_client", "silent", {
        "streams": STREAMS, "answered": client.answered, "held_mb": round(held_mb, 1),
        "dropped_after_s": round(dropped_s, 1), "after_mb": round(gateway.rss_mb(), 1),
    })  # fmt: skip
    assert client.answered == STREAMS and dropped, (client.answered, dropped_s)
    assert gateway.list_tools_s() < SERVED_S
