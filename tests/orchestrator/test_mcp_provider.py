"""The mcp provider (your own MCP servers): endpoints checked at start, task files with per-environment
settings, allow / deny filters per environment and per task in Reset and ListTools, Reset's tool list
following its endpoints, a wrong endpoint answered FAILED_PRECONDITION at once, transient failures retried
briefly, verifier code run in a subprocess with the final answer and the tool-call log.

The orchestrator and the toolgateway run in-process on one SQLite store; the upstream is an in-process MCP
server whose tool list a test may change. The third-party server end to end: tests/e2e/test_own_mcp.py."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import mcp_types as mt
import pytest
from google.rpc import error_details_pb2
from mcp.server import Server

from rlgate.core.convert import parse_json_object
from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.providers.base import EnvNotFound
from rlgate.orchestrator.providers.mcp import McpProvider, merge_filters, parse_mcp_envs
from rlgate.orchestrator.server import OrchestratorHandle, start_orchestrator
from rlgate.runtime.config import SettingError
from rlgate.store import SessionStore
from rlgate.toolgateway.config import GatewayConfig
from rlgate.toolgateway.server import start_gateway
from rlgate.v1 import (
    common_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    toolgateway_pb2,
    toolgateway_pb2_grpc,
)
from tests.support.ports import free_port
from tests.support.statuses import detail
from tests.support.wait import wait_until
from tests.toolgateway.upstreams import serve_mcp

TOOLS = ("add", "mul", "secret_token", "computer")


def tool(name: str) -> mt.Tool:
    return mt.Tool(name=name, description=f"the {name} tool", input_schema={"type": "object"})


def mutable_server(names: list[str]) -> Server[Any]:
    """Lists the tools named in `names` at the time of the request (a test may change it)."""

    async def list_tools(_ctx: Any, _params: mt.PaginatedRequestParams | None) -> mt.ListToolsResult:
        return mt.ListToolsResult(tools=[tool(n) for n in names])

    async def call_tool(_ctx: Any, params: mt.CallToolRequestParams) -> mt.CallToolResult:
        return mt.CallToolResult(content=[mt.TextContent(text=f"{params.name} ran")])

    return Server("mutable", on_list_tools=list_tools, on_call_tool=call_tool)


@dataclass
class Upstream:
    url: str
    names: list[str]


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    names = list(TOOLS)
    async with serve_mcp(mutable_server(names)) as url:
        yield Upstream(url, names)


@dataclass
class Planes:
    orchestrator: orchestrator_pb2_grpc.OrchestratorServiceStub
    gateway: toolgateway_pb2_grpc.ToolGatewayServiceStub

    async def reset(self, **fields: Any) -> orchestrator_pb2.ResetResponse:
        response: orchestrator_pb2.ResetResponse = await self.orchestrator.Reset(
            orchestrator_pb2.ResetRequest(**fields), timeout=30
        )
        return response

    async def listed(self, reset: orchestrator_pb2.ResetResponse) -> list[str]:
        """The tool names the gateway's ListTools gives the session's agent."""
        answer = await self.gateway.ListTools(
            toolgateway_pb2.ListToolsRequest(), metadata=[("authorization", f"Bearer {reset.agent_token}")], timeout=30
        )
        return [t.name for t in answer.tools]

    async def call(self, reset: orchestrator_pb2.ResetResponse, name: str, arguments: dict[str, Any]) -> None:
        answer = await self.gateway.CallTool(
            toolgateway_pb2.CallToolRequest(name=name, arguments_json=json.dumps(arguments)),
            metadata=[("authorization", f"Bearer {reset.agent_token}")],
            timeout=30,
        )
        assert not answer.result.is_error, answer.result

    async def finish(self, reset: orchestrator_pb2.ResetResponse, answer: str) -> orchestrator_pb2.StepResponse:
        response: orchestrator_pb2.StepResponse = await self.orchestrator.Step(
            orchestrator_pb2.StepRequest(session_id=reset.session_id, final_answer=answer), timeout=60
        )
        return response


@pytest.fixture
async def planes(store: SessionStore, tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """`await start(mcp_envs, tasks_file_object, **config)`: an mcp-provider orchestrator and a gateway."""
    handles: list[OrchestratorHandle] = []
    channels: list[grpc.aio.Channel] = []
    gateway = await start_gateway(GatewayConfig(listen="127.0.0.1:0", owner_ttl_s=2.0, drain_s=1.0), store)

    async def start(mcp_envs: str, tasks: Any = None, **overrides: Any) -> Planes:
        tasks_file = ""
        if tasks is not None:
            path = tmp_path / f"tasks{len(handles)}.json"
            path.write_text(json.dumps(tasks))
            tasks_file = str(path)
        config = OrchestratorConfig(
            listen="127.0.0.1:0",
            provider="mcp",
            mcp_envs=mcp_envs,
            tasks_file=tasks_file,
            run_id=f"mcp-{len(handles)}",
            gateway_address=gateway.address,
            verify_timeout_s=overrides.pop("verify_timeout_s", 20.0),
            tools_timeout_s=overrides.pop("tools_timeout_s", 10.0),
            **overrides,
        )
        handle = await start_orchestrator(config, store)
        handles.append(handle)
        orch_channel = grpc.aio.insecure_channel(handle.address)
        gw_channel = grpc.aio.insecure_channel(gateway.address)
        channels.extend([orch_channel, gw_channel])
        return Planes(
            orchestrator_pb2_grpc.OrchestratorServiceStub(orch_channel),
            toolgateway_pb2_grpc.ToolGatewayServiceStub(gw_channel),
        )

    yield start
    for channel in channels:
        await channel.close()
    for handle in handles:
        await handle.stop()
    await gateway.stop(grace=0)


def error_info(err: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    return detail(err, error_details_pb2.ErrorInfo)


# -- endpoints and task files, checked at start ------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("calc=localhost:9000/mcp", "is not an http(s) URL"),
        ("calc=ftp://127.0.0.1:9000/mcp", "is not an http(s) URL"),
        ("calc=http://127.0.0.1:9000", "has no path"),
        ("calc=http://127.0.0.1:9000/", "has no path"),
        ("calc=http://127.0.0.1:port/mcp", "is not a URL"),
        ("calc=http://[::1/mcp", "is not a URL"),
        ("calc", "want NAME=URL"),
        ("=http://127.0.0.1:9000/mcp", "want NAME=URL"),
        ("calc=http://127.0.0.1:9000/mcp,calc=http://127.0.0.1:9001/mcp", "defined twice"),
    ],
)
def test_a_mistyped_endpoint_is_refused_at_start(spec: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)) as err:
        parse_mcp_envs(spec)
    assert "\n" not in str(err.value)
    with pytest.raises(SettingError, match=re.escape(says)):
        OrchestratorConfig(provider="mcp", mcp_envs=spec)


def test_endpoints_keep_their_order() -> None:
    assert parse_mcp_envs(["a=http://h:1/mcp|https://h:2/x/mcp", "b=http://h:3/mcp, c=http://h:4/mcp"]) == {
        "a": ["http://h:1/mcp", "https://h:2/x/mcp"],
        "b": ["http://h:3/mcp"],
        "c": ["http://h:4/mcp"],
    }


async def test_task_file_environments_filters_and_answer_keys() -> None:
    provider = McpProvider(parse_mcp_envs("calc=http://127.0.0.1:1/mcp,plain=http://127.0.0.1:2/mcp"))
    text = json.dumps(
        {
            "envs": {"calc": {"modality": "all", "tool_filter": {"allow": ["a*", "m*"], "deny": ["secret_*"]}}},
            "tasks": [
                {"key": "t1", "env": "calc", "prompt": "p", "expected_answer": "7", "metadata": {"hint": 1}},
                {"key": "t2", "env": "calc", "prompt": "p", "modality": "tool_use", "tool_filter": {"allow": ["mul"]}},
                {"key": "t3", "env": "plain", "prompt": "p", "tool_filter": {"deny": ["add"]}},
            ],
        }
    )
    t1, t2, t3 = await provider.parse_task_file(text)
    assert (t1.modality, t1.expected_answer, t1.metadata) == ("all", "7", {"hint": 1})  # no answer key in metadata
    assert t2.modality == "tool_use"  # the task's own modality wins over its environment's
    assert provider.session_filter("calc", t1) == {"modality": "all", "allow": ["a*", "m*"], "deny": ["secret_*"]}
    assert provider.session_filter("calc", t2) == {"modality": "tool_use", "allow": ["mul"], "deny": ["secret_*"]}
    assert provider.session_filter("plain", t3) == {"modality": "tool_use", "deny": ["add"]}
    assert provider.session_filter("calc", None) == {"modality": "all", "allow": ["a*", "m*"], "deny": ["secret_*"]}
    assert merge_filters({"deny": ["x"]}, {"deny": ["x", "y"]}) == {"deny": ["x", "y"]}
    assert provider.can_verify(t1) and not provider.can_verify(t3) and not provider.wants_tool_calls(t1)

    with pytest.raises(EnvNotFound, match="nowhere"):  # a task of an environment with no endpoints
        await provider.parse_task_file(json.dumps([{"key": "k", "env": "nowhere", "prompt": "p"}]))
    for bad, says in [
        ({"envs": {"calc": {"modality": "telepathy"}}, "tasks": []}, "is not one of"),
        ({"envs": {"calc": {"tool_filter": {"allow": "add"}}}, "tasks": []}, "must be a list"),
        ({"envs": {"calc": {"tools": []}}, "tasks": []}, "envs.calc must be an object"),
        ({"task": []}, "unknown top-level key"),
        ([{"key": "k", "env": "calc", "prompt": "p", "mcp_endpoints": ["127.0.0.1:1/mcp"]}], "not an http"),
    ]:
        with pytest.raises(ValueError, match=re.escape(says)):
            await provider.parse_task_file(json.dumps(bad))


# -- Reset and ListTools -------------------------------------------------------------------------------------


async def test_filters_per_environment_and_per_task_in_reset_and_list_tools(
    planes: Callable[..., Any], upstream: Upstream
) -> None:
    tasks = {
        "envs": {"calc": {"tool_filter": {"deny": ["secret_*"]}}, "screen": {"modality": "all"}},
        "tasks": [
            {"key": "only-mul", "env": "calc", "prompt": "p", "tool_filter": {"allow": ["mul", "secret_token"]}},
            {"key": "no-add", "env": "calc", "prompt": "p", "tool_filter": {"deny": ["add"]}},
            {"key": "raw", "env": "plain", "prompt": "p"},
        ],
    }
    url = upstream.url
    p = await planes(f"calc={url},plain={url},screen={url}", tasks)
    cases = [
        ({"env_key": "calc"}, ["add", "mul"]),  # the environment's deny; modality tool_use hides `computer`
        ({"task_key": "only-mul"}, ["mul"]),  # the task's allow replaces the environment's; its deny still applies
        ({"task_key": "no-add"}, ["mul"]),  # both deny lists
        ({"task_key": "raw"}, ["add", "mul", "secret_token"]),
        ({"env_key": "screen"}, list(TOOLS)),  # modality "all": the filter off, `computer` included
    ]
    for fields, names in cases:
        reset = await p.reset(**fields)
        assert [t.name for t in reset.tools] == names, fields
        assert await p.listed(reset) == names, fields
        assert all(t.endpoint == url for t in reset.tools)


async def test_reset_tool_list_follows_the_endpoint(planes: Callable[..., Any], upstream: Upstream) -> None:
    p = await planes(f"calc={upstream.url}", tools_refresh_s=0.2)
    first = await p.reset(env_key="calc")
    assert [t.name for t in first.tools] == ["add", "mul", "secret_token"]
    upstream.names.append("div")
    upstream.names.remove("add")

    async def relisted() -> bool:
        return [t.name for t in (await p.reset(env_key="calc")).tools] == ["mul", "secret_token", "div"]

    # The cached list is discovered again once it is older than tools_refresh_s.
    await wait_until(relisted, 30, "Reset listing the endpoint's new tools")


async def test_a_key_in_an_endpoint_url_reaches_no_tool_spec(planes: Callable[..., Any], upstream: Upstream) -> None:
    """An endpoint URL may carry a key (userinfo, query): Reset's and ListTools' specs name the endpoint
    without it, while calls still go to the URL whole."""
    keyed = upstream.url + "?key=s3cret"
    p = await planes(f"calc={keyed}")
    reset = await p.reset(env_key="calc")
    assert {t.endpoint for t in reset.tools} == {upstream.url + "?…"}
    listed = await p.gateway.ListTools(
        toolgateway_pb2.ListToolsRequest(), metadata=[("authorization", f"Bearer {reset.agent_token}")], timeout=30
    )
    assert {t.endpoint for t in listed.tools} == {upstream.url + "?…"}
    await p.call(reset, "add", {"a": 1, "b": 2})


async def test_a_wrong_endpoint_fails_reset_at_once_naming_it(planes: Callable[..., Any], upstream: Upstream) -> None:
    closed = f"http://127.0.0.1:{free_port()}/mcp"  # nothing listens there
    typo = upstream.url.replace("/mcp", "/mpc")
    unknown_host = "http://no-such-host.invalid:8931/mcp"
    p = await planes(f"down={closed},typo={typo},dns={unknown_host},mixed={upstream.url}|{closed}")
    for env, url, reason in [
        ("down", closed, "MCP_ENDPOINT_UNREACHABLE"),
        ("typo", typo, "MCP_ENDPOINT_NOT_FOUND"),
        ("dns", unknown_host, "MCP_ENDPOINT_UNREACHABLE"),
        ("mixed", closed, "MCP_ENDPOINT_UNREACHABLE"),  # one wrong endpoint of several is still said
    ]:
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await p.reset(env_key=env)
        elapsed = time.monotonic() - started
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value
        assert url in (err.value.details() or ""), err.value.details()
        info = error_info(err.value)
        assert (info.reason, info.metadata["endpoint"]) == (reason, url)
        assert elapsed < 5.0, (env, elapsed)  # at once: not the 10 s discovery timeout
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await p.reset(env_key="elsewhere")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.fixture
def failing_http() -> Iterator[tuple[str, list[str]]]:
    """An HTTP server answering every request 503 (a transient failure); yields its URL and the paths asked."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            asked.append(self.path)
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/mcp", asked
    finally:
        server.shutdown()
        server.server_close()


async def test_transient_failures_are_retried_briefly_then_unavailable(
    planes: Callable[..., Any], failing_http: tuple[str, list[str]]
) -> None:
    url, asked = failing_http
    p = await planes(f"busy={url}")
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await p.reset(env_key="busy")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert url in (err.value.details() or "") and "3 attempt" in (err.value.details() or "")
    assert error_info(err.value).reason == "TOOLS_UNAVAILABLE"
    assert time.monotonic() - started < 8.0  # briefly: well inside the 10 s discovery timeout
    assert len(asked) >= 3  # one handshake request per attempt at least


# -- scoring ---------------------------------------------------------------------------------------------------

CHECKED = """
def verify(env, final_answer=None, tool_calls=()):
    muls = [c for c in tool_calls if c["tool"] == "mul" and c["arguments"] == {"a": 6, "b": 7}]
    print("mul calls:", len(muls), "env:", env.env_key, env.task_key, env.expected_answer)
    return {"score": 1.0 if muls and final_answer == "42" else 0.25}
"""


async def test_verifier_code_gets_the_answer_and_the_tool_call_log(
    planes: Callable[..., Any], upstream: Upstream
) -> None:
    tasks = [
        {"key": "checked", "env": "calc", "prompt": "6*7?", "verifier_code": CHECKED, "expected_answer": "42"},
        {"key": "raises", "env": "calc", "prompt": "p", "verifier_code": "def verify(env):\n    raise KeyError('x')\n"},
        {
            "key": "hangs",
            "env": "calc",
            "prompt": "p",
            "verifier_code": "import time\ndef v(env):\n    time.sleep(60)\n",
        },
        {"key": "keyed", "env": "calc", "prompt": "p", "metadata": {"expected_answer": ["Forty-Two", "42"]}},
        {"key": "free", "env": "calc", "prompt": "p"},
    ]
    p = await planes(f"calc={upstream.url}", tasks, verify_timeout_s=1.5)
    reset = await p.reset(task_key="checked")
    await p.call(reset, "mul", {"a": 6, "b": 7})
    step = await p.finish(reset, "42")
    assert (step.verification.status, step.reward) == (common_pb2.VERIFICATION_STATUS_OK, 1.0), step
    assert "mul calls: 1 env: calc checked 42" in step.verification.stdout

    unused = await p.reset(task_key="checked")
    step = await p.finish(unused, "42")  # no tool call in this episode's log
    assert step.reward == 0.25

    step = await p.finish(await p.reset(task_key="raises"), "x")
    assert step.verification.status == common_pb2.VERIFICATION_STATUS_ERROR and not step.HasField("reward")
    assert "KeyError" in step.verification.message

    started = time.monotonic()
    step = await p.finish(await p.reset(task_key="hangs"), "x")
    assert step.verification.status == common_pb2.VERIFICATION_STATUS_TIMEOUT and not step.HasField("reward")
    assert time.monotonic() - started < 10

    keyed = await p.reset(task_key="keyed")
    assert "expected_answer" not in parse_json_object(keyed.task.metadata_json, "metadata")  # never shown
    assert (await p.finish(keyed, "  forty-two \n")).reward == 1.0  # case and whitespace normalised; any of a list
    assert (await p.finish(await p.reset(task_key="keyed"), "41")).reward == 0.0

    step = await p.finish(await p.reset(task_key="free"), "anything")
    assert step.verification.status == common_pb2.VERIFICATION_STATUS_SKIPPED


async def test_the_mcp_provider_cannot_fork_and_says_why(planes: Callable[..., Any], upstream: Upstream) -> None:
    p = await planes(f"calc={upstream.url}")
    reset = await p.reset(env_key="calc")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await p.orchestrator.Fork(orchestrator_pb2.ForkRequest(session_id=reset.session_id, count=2), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(err.value).reason == "FORK_UNSUPPORTED"
    assert "share their environment's endpoints" in (err.value.details() or "")
