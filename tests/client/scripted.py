"""A real grpc.aio server on 127.0.0.1 (port 0) whose OrchestratorService / ToolGatewayService answers
follow a per-method script: a status code to abort with, a google.rpc.Status to end with, a delay, or a
response. It runs on its own event loop in a thread, so blocking clients in the test thread can call it too.
The script records every request with its metadata, and the handlers cancelled per method."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.rpc import status_pb2

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
    """End the call with this google.rpc.Status (code, message and details, as the services' errors do):
    the status code and message, and the status itself as the grpc-status-details-bin trailer."""

    status: status_pb2.Status


@dataclass
class Seen:
    request: Any
    metadata: dict[str, str]


@dataclass
class Script:
    # method -> queue of steps; an exhausted queue answers with the default response.
    steps: dict[str, list[Any]] = field(default_factory=lambda: defaultdict(list))
    seen: dict[str, list[Seen]] = field(default_factory=lambda: defaultdict(list))
    defaults: dict[str, Callable[[Any], Any]] = field(default_factory=dict)
    # method -> handlers cancelled (by a deadline or the call going away)
    cancelled: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def push(self, method: str, *steps: Any) -> None:
        self.steps[method].extend(steps)

    def count(self, method: str) -> int:
        return len(self.seen[method])


ECHO_SCHEMA = '{"type":"object","properties":{"x":{"type":"integer","default":3}}}'


def default_responses(gateway_address: str) -> dict[str, Callable[[Any], Any]]:
    def reset(req: orchestrator_pb2.ResetRequest) -> orchestrator_pb2.ResetResponse:
        return orchestrator_pb2.ResetResponse(
            session_id="s-1",
            episode=1,
            prompt="do it",
            messages=[common_pb2.ChatMessage(role="user", content="do it")],
            tools=[common_pb2.ToolSpec(name="echo", description="echo back", input_schema_json=ECHO_SCHEMA)],
            agent_token="agent-token",
            gateway_address=gateway_address,
            task=common_pb2.TaskInfo(key=req.task_key or "t", env_id="demo", version="v1"),
            max_turns=req.max_turns or 5,
            modality="tool_use",
            instance=orchestrator_pb2.InstanceInfo(provider="fleet", instance_id="i-1", env_key="demo:v1"),
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


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class _ScriptedStatus(Exception):
    def __init__(self, code: grpc.StatusCode, message: str = "", rich: status_pb2.Status | None = None) -> None:
        super().__init__(message or f"scripted {code.name}")
        self.code = code
        self.rich = rich

    def rich_trailer(self) -> tuple[tuple[str, bytes], ...]:
        return () if self.rich is None else (("grpc-status-details-bin", self.rich.SerializeToString()),)


class _Handler:
    def __init__(self, script: Script) -> None:
        self.script = script

    async def answer(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await self.run(method, request, {k: str(v) for k, v in context.invocation_metadata() or ()})
        except _ScriptedStatus as exc:
            await context.abort(exc.code, str(exc), trailing_metadata=exc.rich_trailer())

    async def run(self, method: str, request: Any, metadata: dict[str, str]) -> Any:
        self.script.seen[method].append(Seen(request, metadata))
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
            raise _ScriptedStatus(_CODES[step.status.code], step.status.message, step.status)
        if step is None:
            return self.script.defaults[method](request)
        return step(request) if callable(step) else step


def _servicer(base: type, handler: _Handler, methods: list[str]) -> Any:
    def make(method: str) -> Any:
        async def rpc(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await handler.answer(method, request, context)

        return rpc

    return type("Scripted" + base.__name__, (base,), {m: make(m) for m in methods})()


class ScriptedServer:
    """Both services on one port, on a private event loop in a daemon thread."""

    def __init__(self, port: int = 0) -> None:
        self.script = Script()
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
        orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(
            _servicer(
                orchestrator_pb2_grpc.OrchestratorServiceServicer,
                handler,
                ["Reset", "Step", "State", "Close", "CloseSessions", "ListTasks", "ListSessions"],
            ),
            server,
        )
        toolgateway_pb2_grpc.add_ToolGatewayServiceServicer_to_server(
            _servicer(toolgateway_pb2_grpc.ToolGatewayServiceServicer, handler, ["ListTools", "CallTool"]),
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


def close_when_done(server: ScriptedServer) -> None:
    """Make `server`'s Steps answer as rlgate's do for `close_when_done`: an ending that asked for it closes
    the session (status CLOSED); the others as before."""
    answer = server.script.defaults["Step"]

    def step(req: orchestrator_pb2.StepRequest) -> orchestrator_pb2.StepResponse:
        response: orchestrator_pb2.StepResponse = answer(req)
        if response.done:
            closed = req.close_when_done
            response.status = common_pb2.SESSION_STATUS_CLOSED if closed else common_pb2.SESSION_STATUS_DONE
        return response

    server.script.defaults["Step"] = step
