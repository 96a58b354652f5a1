"""ToolGatewayService compliance: authentication by agent token, CallTool's results, statuses and request ids,
exact JSON, and that the gateway serves nothing but ListTools and CallTool — as
proto/rlgate/v1/toolgateway.proto documents them. Agent tokens come from the orchestrator's Reset."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from rlgate.compliance.harness import ComplianceHarness, json_pointer, same_json, skip
from rlgate.v1 import common_pb2, orchestrator_pb2, toolgateway_pb2

Kind = common_pb2.ToolErrorKind
INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
GATEWAY_SERVICE = "rlgate.v1.ToolGatewayService"
GATEWAY_METHODS = {"ListTools", "CallTool"}
UNKNOWN_TOOL = "compliance_no_such_tool"


class ToolGatewayServiceCompliance(ComplianceHarness):
    """Compliance tests of `rlgate.v1.ToolGatewayService`. Subclass it (see rlgate.compliance)."""

    def _log_entries(self, session_id: str, request_id: str) -> list[orchestrator_pb2.ToolCallLogEntry]:
        log = self.state(session_id, include_tool_calls=True).tool_calls
        return [entry for entry in log if entry.request_id == request_id]

    # -- ListTools ----------------------------------------------------------------------------------------
    def test_list_tools_serves_what_reset_returned(self) -> None:
        episode = self.reset()
        tools = self.list_tools(episode)
        assert list(tools) == list(episode.tools), "ListTools must serve exactly the specs Reset returned"
        for spec in tools:
            schema = self.json_of(spec.input_schema_json, f"{spec.name}.input_schema_json")
            assert isinstance(schema, dict) and schema.get("type") == "object", (spec.name, schema)
            for what in ("output_schema_json", "annotations_json"):
                text = getattr(spec, what)
                if text:
                    assert isinstance(self.json_of(text, f"{spec.name}.{what}"), dict), (spec.name, what)

    # -- CallTool -----------------------------------------------------------------------------------------
    def test_call_tool_returns_the_result_and_logs_it(self) -> None:
        tool = self.the_tool_call()
        episode = self.reset()
        request_id = self.new_request_id()
        response = self.call_tool(episode, tool.name, tool.arguments, request_id=request_id)
        result = response.result
        assert not response.replayed
        assert not result.is_error and result.error_kind == Kind.TOOL_ERROR_KIND_UNSPECIFIED, result
        assert result.content or result.structured_content_json, "a result carries content"
        if result.structured_content_json:
            self.json_of(result.structured_content_json, "structured_content_json")
        [entry] = self._log_entries(episode.session_id, request_id)
        assert entry.tool == tool.name and not entry.is_error, entry
        logged = self.json_of(entry.arguments_json, "ToolCallLogEntry.arguments_json")
        assert same_json(logged, dict(tool.arguments)), f"logged {logged!r}, sent {dict(tool.arguments)!r}"
        anonymous = self.call_tool(episode, tool.name, tool.arguments)  # no request_id: the log names one
        state = self.state(episode.session_id, include_tool_calls=True)
        assert state.session.tool_call_count == 2 and len(state.tool_calls) == 2, state
        assert state.tool_calls[-1].request_id not in ("", request_id), "the gateway generates a request_id"
        assert not anonymous.replayed

    def test_model_mistakes_are_results(self) -> None:
        tool = self.the_tool_call()
        episode = self.reset()
        for name in (UNKNOWN_TOOL, "t" * 128):  # 128 characters is still a well-formed name
            unknown = self.call_tool(episode, name, {}).result
            assert unknown.is_error and unknown.error_kind == Kind.TOOL_ERROR_KIND_UNKNOWN_TOOL, (name, unknown)
        spec = next(t for t in episode.tools if t.name == tool.name)
        required = self.json_of(spec.input_schema_json, "input_schema_json").get("required") or []
        if required:  # {} violates the schema: the gateway says so as a result, the tool is not called
            invalid = self.call_tool(episode, tool.name, {}).result
            assert invalid.is_error and invalid.error_kind == Kind.TOOL_ERROR_KIND_INVALID_ARGUMENTS, invalid
            assert invalid.error_message, "error_message tells the model what to fix"
            unset = (
                self.gateway(episode.gateway_address)
                .CallTool(
                    toolgateway_pb2.CallToolRequest(name=tool.name),
                    metadata=self.bearer(episode.agent_token),
                    timeout=self.rpc_timeout_s,
                )
                .result
            )
            assert unset.error_kind == Kind.TOOL_ERROR_KIND_INVALID_ARGUMENTS, f"unset arguments mean {{}}: {unset}"

    def test_malformed_call_is_invalid_argument(self) -> None:
        tool = self.the_tool_call()
        episode = self.reset()

        def call(name: str = tool.name, **kwargs: Any) -> Callable[[], object]:
            kwargs.setdefault("arguments", tool.arguments)
            return lambda: self.call_tool(episode, name, **kwargs)

        self.expect_statuses(
            [
                ("an empty name", INVALID, call(""), "name"),
                ("a name outside [A-Za-z0-9._-]", INVALID, call("no such tool!"), "name"),
                ("a name of 129 characters", INVALID, call("t" * 129), "name"),
                ("arguments_json that is an array", INVALID, call(arguments_json="[1, 2]"), "arguments_json"),
                ("arguments_json that is not JSON", INVALID, call(arguments_json="{"), "arguments_json"),
                ("a request_id of 129 characters", INVALID, call(request_id="r" * 129), "request_id"),
            ]
        )

    def test_call_tool_retry_replays(self) -> None:
        tool = self.the_tool_call()
        episode = self.reset()
        request_id = self.new_request_id()
        first = self.call_tool(episode, tool.name, tool.arguments, request_id=request_id)
        again = self.call_tool(episode, tool.name, tool.arguments, request_id=request_id)
        assert not first.replayed and again.replayed, (first.replayed, again.replayed)
        assert again.result == first.result, "a retry gets the recorded result"
        # the same arguments as a Struct are the same request (whole numbers are JSON integers)
        as_struct = self.call_tool(episode, tool.name, tool.arguments, request_id=request_id, as_struct=True)
        assert as_struct.replayed and as_struct.result == first.result, "the Struct form of the same arguments"
        assert len(self._log_entries(episode.session_id, request_id)) == 1, "the tool ran once"
        longest = self.call_tool(episode, tool.name, tool.arguments, request_id=self.new_request_id(128))
        assert not longest.replayed and not longest.result.is_error, "a request_id of 128 characters is fine"

    def test_call_tool_request_id_reused_with_other_name_or_arguments(self) -> None:
        tool = self.the_tool_call()
        episode = self.reset()
        request_id = self.new_request_id()
        first = self.call_tool(episode, tool.name, tool.arguments, request_id=request_id)
        other_arguments = {**tool.arguments, "compliance_extra": 1}
        self.expect_statuses(
            [
                (
                    "other arguments",
                    INVALID,
                    lambda: self.call_tool(episode, tool.name, other_arguments, request_id=request_id),
                    "arguments",
                ),
                (
                    "another name",
                    INVALID,
                    lambda: self.call_tool(episode, UNKNOWN_TOOL, tool.arguments, request_id=request_id),
                    "name",
                ),
            ]
        )
        again = self.call_tool(episode, tool.name, tool.arguments, request_id=request_id)
        assert again.replayed and again.result == first.result, "the refused reuses changed nothing"

    def test_request_ids_belong_to_the_session(self) -> None:
        tool = self.the_tool_call()
        request_id = self.new_request_id()
        one, two = self.reset(), self.reset()
        assert not self.call_tool(one, tool.name, tool.arguments, request_id=request_id).replayed
        assert not self.call_tool(two, tool.name, tool.arguments, request_id=request_id).replayed, (
            "the same request_id in another session is another call"
        )

    # -- exact JSON ---------------------------------------------------------------------------------------
    def _exact_call(self, as_struct: bool) -> None:
        exact = self.exact_json_call
        if exact is None:
            skip("no tool that echoes integer arguments into its structured result (exact_json_call)")
        episode = self.reset()
        request_id = self.new_request_id()
        result = self.call_tool(episode, exact.name, exact.arguments, request_id=request_id, as_struct=as_struct)
        assert not result.result.is_error, result.result
        structured = self.json_of(result.result.structured_content_json, "structured_content_json")
        for pointer, expected in exact.expect.items():
            try:
                found = json_pointer(structured, pointer)
            except KeyError:
                raise AssertionError(f"structured result has nothing at {pointer}: {structured!r}") from None
            assert same_json(found, expected), f"at {pointer}: {found!r} ({type(found).__name__}), want {expected!r}"
        [entry] = self._log_entries(episode.session_id, request_id)
        logged = self.json_of(entry.arguments_json, "ToolCallLogEntry.arguments_json")
        assert same_json(logged, dict(exact.arguments)), f"logged {logged!r}, sent {dict(exact.arguments)!r}"

    def test_exact_json_through_arguments_json(self) -> None:
        self._exact_call(as_struct=False)

    def test_whole_numbers_in_a_struct_reach_the_tool_as_integers(self) -> None:
        self._exact_call(as_struct=True)

    # -- authentication and ended episodes ----------------------------------------------------------------
    def _both_rpcs(self, episode: orchestrator_pb2.ResetResponse, token: str) -> dict[str, Callable[[], object]]:
        tool = self.the_tool_call()
        return {
            "ListTools": lambda: self.list_tools(episode, token=token),
            "CallTool": lambda: self.call_tool(episode, tool.name, tool.arguments, token=token),
        }

    def test_unknown_credentials_are_unauthenticated(self) -> None:
        episode = self.reset()
        credentials = {"no token": "", "a token never issued": "compliance-never-issued"}
        if self.api_key:
            credentials["the orchestrator's API key"] = self.api_key  # an API key reaches no tool
        self.expect_statuses(
            (f"{rpc} with {what}", UNAUTHENTICATED, call, None)
            for what, token in credentials.items()
            for rpc, call in self._both_rpcs(episode, token).items()
        )

    def _expect_ended(self, episode: orchestrator_pb2.ResetResponse, mentions: str | None, why: str) -> None:
        for rpc, call in self._both_rpcs(episode, episode.agent_token).items():
            self.expect_status(PRECONDITION, call, mentions=mentions, what=f"{rpc} after {why}")

    def test_token_of_a_closed_session(self) -> None:
        episode = self.reset()
        self.close(episode.session_id)
        self._expect_ended(episode, "closed", "Close")

    def test_token_of_a_done_episode(self) -> None:
        episode = self.reset()
        self.step(episode.session_id, final_answer="compliance")
        self._expect_ended(episode, "done", "the episode is done")

    def test_token_of_a_superseded_episode(self) -> None:
        episode = self.reset()
        following = self.reset(session_id=episode.session_id)
        self._expect_ended(episode, "reset", "a later Reset")
        assert self.list_tools(following) == list(following.tools)

    # -- the plane split ----------------------------------------------------------------------------------
    def test_gateway_serves_only_list_tools_and_call_tool(self) -> None:
        episode = self.reset()
        channel = self.gateway_raw_channel(episode.gateway_address)
        agent = self.bearer(episode.agent_token)
        orchestration = [m.name for m in orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"].methods]
        paths = [f"/rlgate.v1.OrchestratorService/{m}" for m in orchestration]
        paths += [f"/{GATEWAY_SERVICE}/{m}" for m in orchestration]  # no orchestration RPC under another name
        failures = []
        for path in paths:
            try:
                probe: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(path)
                probe(b"", metadata=agent, timeout=self.rpc_timeout_s)
                failures.append(f"{path}: answered OK")
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                    failures.append(f"{path}: {err.code().name}, not UNIMPLEMENTED")
        assert not failures, "the gateway serves orchestration methods:\n" + "\n".join(failures)
        self._check_reflection(channel)

    def _check_reflection(self, channel: grpc.Channel) -> None:
        """Through server reflection, when the server and this host have it: the gateway's only application
        service is ToolGatewayService, with exactly ListTools and CallTool, both unary."""
        try:
            from google.protobuf import descriptor_pb2
            from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
        except ImportError:
            return  # grpcio-reflection is not installed here: the method probes above stand alone
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)

        def ask(**fields: Any) -> Any:
            request = reflection_pb2.ServerReflectionRequest(**fields)
            # types-grpcio-reflection types the method as binascii.Incomplete (a wrong import), not callable.
            replies = stub.ServerReflectionInfo(iter([request]), timeout=self.rpc_timeout_s)  # type: ignore[operator]
            return next(iter(replies))

        try:
            listed = ask(list_services="")
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                return  # the server offers no reflection
            raise
        services = {s.name for s in listed.list_services_response.service}
        application = {s for s in services if not s.startswith("grpc.")}  # health, reflection
        assert application == {GATEWAY_SERVICE}, f"the gateway must serve only {GATEWAY_SERVICE}: {sorted(services)}"
        files = ask(file_containing_symbol=GATEWAY_SERVICE).file_descriptor_response.file_descriptor_proto
        methods = None
        for raw in files:
            proto = descriptor_pb2.FileDescriptorProto.FromString(raw)
            for service in proto.service:
                if f"{proto.package}.{service.name}" == GATEWAY_SERVICE:
                    methods = {m.name: (m.client_streaming, m.server_streaming) for m in service.method}
        assert methods is not None, f"reflection does not describe {GATEWAY_SERVICE}"
        assert set(methods) == GATEWAY_METHODS, f"{GATEWAY_SERVICE} must have exactly {GATEWAY_METHODS}: {methods}"
        assert all(kinds == (False, False) for kinds in methods.values()), f"both RPCs are unary: {methods}"
