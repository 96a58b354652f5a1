"""A real grpc.aio server on 127.0.0.1 (port 0) whose OrchestratorService / ToolGatewayService answers
follow a per-method script: a status code to abort with, a delay, or a response. It runs on its own
event loop in a thread, so blocking clients in the test thread can call it too.

CallTool and Step are also served over their streams (CallToolStream, StepStream, through the servers' own
`runtime.multiplex`) from the same script, so AsyncClient's calls follow it whichever way they travel; a
streamed call is recorded under its unary method with the metadata the unary call would have carried.
With `streams=False` the stream methods are UNIMPLEMENTED, as on a server that predates them.

What the script records for the stream tests: `Seen.streamed` (which way a call came), the handlers cancelled
per method, the cancel requests each stream carried, and how many streams were opened and ended."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.rpc import status_pb2

from rlgate.runtime.multiplex import Multiplexer, StreamedMethod, call_status
from rlgate.v1 import (
    common_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    toolgateway_pb2,
    toolgateway_pb2_grpc,
)


@dataclass
class Sleep:
    """Answer after `seconds` (longer than a client's attempt timeout -> DEADLINE_EXCEEDED there)."""

    seconds: float
    then: Any = None


@dataclass
class Rich:
    """End the call with `code` and a google.rpc.Status carrying `details` (google.protobuf.Any messages):
    unary as the grpc-status-details-bin trailer, streamed as the CallStatus details."""

    code: grpc.StatusCode
    message: str
    details: list[Any] = field(default_factory=list)


@dataclass
class Seen:
    request: Any
    metadata: dict[str, str]
    streamed: bool = False  # came over CallToolStream / StepStream rather than the unary RPC


@dataclass
class Script:
    # method -> queue of steps; an exhausted queue answers with the default response.
    steps: dict[str, list[Any]] = field(default_factory=lambda: defaultdict(list))
    seen: dict[str, list[Seen]] = field(default_factory=lambda: defaultdict(list))
    defaults: dict[str, Callable[[Any], Any]] = field(default_factory=dict)
    # method -> handlers cancelled (by a cancel request, a deadline, or the call / stream going away)
    cancelled: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # method -> call_ids of the cancel requests its streams carried
    cancels: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    # method -> streams opened / ended (the stream handler returned or was cancelled)
    streams_opened: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    streams_ended: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # seconds added to each streamed call's own timeout: the client's deadline then passes first, so its
    # cancel request (not the server's deadline) is what ends a call that overruns
    deadline_slack: float = 0.0

    def push(self, method: str, *steps: Any) -> None:
        self.steps[method].extend(steps)

    def count(self, method: str) -> int:
        return len(self.seen[method])


def default_responses(gateway_address: str) -> dict[str, Callable[[Any], Any]]:
    def reset(req: orchestrator_pb2.ResetRequest) -> orchestrator_pb2.ResetResponse:
        return orchestrator_pb2.ResetResponse(
            session_id="s-1",
            episode=1,
            prompt="do it",
            messages=[common_pb2.ChatMessage(role="user", content="do it")],
            tools=[common_pb2.ToolSpec(name="echo", description="echo back")],
            agent_token="agent-token",
            gateway_address=gateway_address,
            task=common_pb2.TaskInfo(key=req.task_key or "t", env_id="demo", version="v1"),
            max_turns=req.max_turns or 5,
            modality="tool_use",
        )

    def step(req: orchestrator_pb2.StepRequest) -> orchestrator_pb2.StepResponse:
        done = req.HasField("final_answer") or req.done
        response = orchestrator_pb2.StepResponse(turn=1, done=done)
        if done:
            response.reward = 1.0
            response.verification.status = common_pb2.VERIFICATION_STATUS_OK
            response.done_reason = orchestrator_pb2.DONE_REASON_FINAL_ANSWER
        return response

    def call_tool(req: toolgateway_pb2.CallToolRequest) -> toolgateway_pb2.CallToolResponse:
        text = common_pb2.TextContent(text=f"{req.name} ok")
        return toolgateway_pb2.CallToolResponse(
            result=common_pb2.ToolResult(content=[common_pb2.ContentBlock(text=text)])
        )

    return {
        "Reset": reset,
        "Step": step,
        "State": lambda req: orchestrator_pb2.StateResponse(
            session=orchestrator_pb2.SessionInfo(session_id=req.session_id)
        ),
        "Close": lambda req: orchestrator_pb2.CloseResponse(status=common_pb2.SESSION_STATUS_CLOSED),
        "CloseSessions": lambda req: orchestrator_pb2.CloseSessionsResponse(session_ids=["s-lost"]),
        "ListTasks": lambda req: orchestrator_pb2.ListTasksResponse(),
        "ListSessions": lambda req: orchestrator_pb2.ListSessionsResponse(),
        "ListTools": lambda req: toolgateway_pb2.ListToolsResponse(tools=[common_pb2.ToolSpec(name="echo")]),
        "CallTool": call_tool,
    }


class _ScriptedStatus(Exception):
    def __init__(self, code: grpc.StatusCode, message: str = "", details: list[Any] | None = None) -> None:
        super().__init__(message or f"scripted {code.name}")
        self.code = code
        self.details = list(details or [])

    def rich_trailer(self) -> tuple[tuple[str, bytes], ...]:
        if not self.details:
            return ()
        status = status_pb2.Status(code=self.code.value[0], message=str(self), details=self.details)
        return (("grpc-status-details-bin", status.SerializeToString()),)


class _Handler:
    def __init__(self, script: Script) -> None:
        self.script = script

    async def answer(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await self.run(method, request, {k: str(v) for k, v in context.invocation_metadata()})
        except _ScriptedStatus as exc:
            await context.abort(exc.code, str(exc), trailing_metadata=exc.rich_trailer())

    async def run(self, method: str, request: Any, metadata: dict[str, str], streamed: bool = False) -> Any:
        self.script.seen[method].append(Seen(request, metadata, streamed))
        queue = self.script.steps[method]
        step = queue.pop(0) if queue else None
        if isinstance(step, Sleep):
            try:
                await asyncio.sleep(step.seconds)
            except asyncio.CancelledError:
                self.script.cancelled[method] += 1
                raise
            step = step.then
        if isinstance(step, grpc.StatusCode):
            raise _ScriptedStatus(step)
        if isinstance(step, Rich):
            raise _ScriptedStatus(step.code, step.message, step.details)
        if step is None:
            return self.script.defaults[method](request)
        return step(request) if callable(step) else step

    def stream(self, method: str, payload: str, response: type) -> Any:
        """A stream method serving `method`'s script (one Multiplexer per stream: it knows its metadata)."""

        async def serve(_self: Any, requests: Any, context: grpc.aio.ServicerContext) -> None:
            shared = {k: str(v) for k, v in context.invocation_metadata()}

            async def handle(envelope: Any, _left: float | None) -> Any:
                metadata = dict(shared)
                if envelope.trace_id:
                    metadata["x-rlgate-trace-id"] = envelope.trace_id
                if getattr(envelope, "token", ""):  # StepStream requests carry none
                    metadata["authorization"] = f"Bearer {envelope.token}"
                return await self.run(method, getattr(envelope, payload), metadata, streamed=True)

            def known(exc: Exception) -> common_pb2.CallStatus | None:
                return call_status(exc.code, str(exc), exc.details) if isinstance(exc, _ScriptedStatus) else None

            async def recorded(requests: Any) -> Any:
                async for envelope in requests:
                    if envelope.cancel:
                        self.script.cancels[method].append(envelope.call_id)
                    elif self.script.deadline_slack and envelope.HasField("timeout"):
                        slack = int(self.script.deadline_slack * 1e9)
                        envelope.timeout.FromNanoseconds(envelope.timeout.ToNanoseconds() + slack)
                    yield envelope

            self.script.streams_opened[method] += 1
            try:
                await Multiplexer(StreamedMethod(method, response, handle, known)).serve(recorded(requests), context)
            finally:
                self.script.streams_ended[method] += 1

        return serve


def _servicer(base: type, handler: _Handler, methods: list[str], streams: dict[str, Any]) -> Any:
    def make(method: str) -> Any:
        async def rpc(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await handler.answer(method, request, context)

        return rpc

    return type("Scripted" + base.__name__, (base,), {**{m: make(m) for m in methods}, **streams})()


class ScriptedServer:
    """Both services on one port, on a private event loop in a daemon thread."""

    def __init__(self, streams: bool = True, port: int = 0) -> None:
        self.script = Script()
        self.streams = streams
        self.port = port  # 0: any free port
        self._loop = asyncio.new_event_loop()
        self._server: grpc.aio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, credentials: grpc.ServerCredentials | None = None) -> ScriptedServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(credentials), self._loop).result(10)
        self.script.defaults = default_responses(self.address)
        return self

    async def _start(self, credentials: grpc.ServerCredentials | None) -> None:
        handler = _Handler(self.script)
        server = grpc.aio.server()
        step_stream = {"StepStream": handler.stream("Step", "step", orchestrator_pb2.StepStreamResponse)}
        call_stream = {"CallToolStream": handler.stream("CallTool", "call", toolgateway_pb2.CallToolStreamResponse)}
        orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(
            _servicer(
                orchestrator_pb2_grpc.OrchestratorServiceServicer,
                handler,
                ["Reset", "Step", "State", "Close", "CloseSessions", "ListTasks", "ListSessions"],
                step_stream if self.streams else {},
            ),
            server,
        )
        toolgateway_pb2_grpc.add_ToolGatewayServiceServicer_to_server(
            _servicer(toolgateway_pb2_grpc.ToolGatewayServiceServicer, handler, ["ListTools", "CallTool"],
                      call_stream if self.streams else {}),
            server,
        )
        if credentials is None:
            self.port = server.add_insecure_port(f"127.0.0.1:{self.port}")
        else:
            self.port = server.add_secure_port(f"127.0.0.1:{self.port}", credentials)
        await server.start()
        self._server = server

    def stop(self) -> None:
        """Stop the server (grace 0: calls in flight are cancelled) and its loop; a second stop is a no-op."""
        if self._loop.is_closed():
            return
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
