"""OrchestratorService compliance: the statuses, retries, lifecycle and authentication that
proto/rlgate/v1/orchestrator.proto documents, checked over the wire."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import grpc

from rlgate.compliance.harness import ComplianceHarness, skip
from rlgate.core.convert import json_text
from rlgate.v1 import common_pb2, orchestrator_pb2

Status = common_pb2.SessionStatus
Verification = common_pb2.VerificationStatus
Done = orchestrator_pb2.DoneReason
NOT_FOUND = grpc.StatusCode.NOT_FOUND
INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
UNKNOWN_SESSION = "compliance-no-such-session"
TOO_LONG_ID = "r" * 129  # request_id and run_id are at most 128 characters
TOO_LONG_LABEL = "k" * 64  # label keys and values are at most 63


def _empty_requests() -> dict[str, Any]:
    """Every OrchestratorService method with a request that carries nothing."""
    return {
        "Reset": orchestrator_pb2.ResetRequest(),
        "Step": orchestrator_pb2.StepRequest(),
        "State": orchestrator_pb2.StateRequest(),
        "Close": orchestrator_pb2.CloseRequest(),
        "CloseSessions": orchestrator_pb2.CloseSessionsRequest(),
        "ListTasks": orchestrator_pb2.ListTasksRequest(),
        "ListSessions": orchestrator_pb2.ListSessionsRequest(),
        "Fork": orchestrator_pb2.ForkRequest(),
    }


class OrchestratorServiceCompliance(ComplianceHarness):
    """Compliance tests of `rlgate.v1.OrchestratorService`. Subclass it (see rlgate.compliance)."""

    def _check_final_verdict(
        self, step: orchestrator_pb2.StepResponse, status: common_pb2.SessionStatus = Status.SESSION_STATUS_DONE
    ) -> None:
        assert step.done and step.status == status, step
        assert step.verification.status != Verification.VERIFICATION_STATUS_UNSPECIFIED, step
        # reward is set exactly when the verifier produced a score
        assert step.HasField("reward") == (step.verification.status == Verification.VERIFICATION_STATUS_OK), step

    # -- Reset --------------------------------------------------------------------------------------------
    def test_reset_starts_an_episode(self) -> None:
        tool = self.the_tool_call()
        run_id = self.new_request_id()
        episode = self.reset(run_id=run_id, labels={"compliance": "start"})
        assert episode.session_id and episode.agent_token and episode.gateway_address, episode
        assert episode.episode == 1
        assert episode.task.key == self.task_key
        assert episode.prompt == episode.task.prompt
        assert [(m.role, m.content) for m in episode.messages if m.role == "user"][:1] == [("user", episode.prompt)]
        assert episode.max_turns > 0
        assert episode.instance.env_key == f"{episode.task.env_id}:{episode.task.version}", episode.instance
        names = [t.name for t in episode.tools]
        assert tool.name in names, f"{tool.name!r} is not among the tools Reset returned: {names}"
        assert len(set(names)) == len(names), f"tool names must be unique: {names}"
        for spec in episode.tools:
            schema = self.json_of(spec.input_schema_json, f"{spec.name}.input_schema_json")
            assert isinstance(schema, dict) and schema.get("type") == "object", (spec.name, schema)
        session = self.state(episode.session_id).session
        assert session.status == Status.SESSION_STATUS_ACTIVE
        assert (session.episode, session.turn, session.task.key) == (1, 0, self.task_key)
        assert (session.run_id, dict(session.labels)) == (run_id, {"compliance": "start"})
        assert session.instance == episode.instance and session.max_turns == episode.max_turns
        assert session.expires_at.ToNanoseconds() > session.created_at.ToNanoseconds() > 0

    def test_reset_never_carries_a_reference_solution(self) -> None:
        episode = self.reset()
        state = self.state(episode.session_id).session
        for where, task in (("ResetResponse.task", episode.task), ("State's SessionInfo.task", state.task)):
            assert task.reference_solution_json == "", f"{where} carries a reference solution"
            if task.metadata_json:
                metadata = self.json_of(task.metadata_json, f"{where}.metadata_json")
                assert isinstance(metadata, dict), f"{where}.metadata_json must be a JSON object"
                assert "reference_solution" not in metadata, f"{where}.metadata_json carries the reference solution"

    def _all_tasks(self, include_reference_solution: bool) -> list[common_pb2.TaskInfo]:
        tasks: list[common_pb2.TaskInfo] = []
        token = ""
        for _ in range(1000):  # bounded: a server whose page tokens never end fails instead of hanging
            page = self.orchestrator.ListTasks(
                orchestrator_pb2.ListTasksRequest(
                    page_size=1000, page_token=token, include_reference_solution=include_reference_solution
                ),
                metadata=self.orchestrator_metadata,
                timeout=self.rpc_timeout_s,
            )
            tasks.extend(page.tasks)
            token = page.next_page_token
            if not token:
                return tasks
        raise AssertionError("ListTasks kept returning a next_page_token")

    def test_list_tasks_gives_reference_solutions_only_on_request(self) -> None:
        plain = self._all_tasks(include_reference_solution=False)
        assert self.task_key in [t.key for t in plain], f"ListTasks does not list {self.task_key!r}"
        for task in plain:
            assert task.reference_solution_json == "", f"{task.key}: a reference solution nobody asked for"
            if task.metadata_json:
                metadata = self.json_of(task.metadata_json, f"{task.key}.metadata_json")
                assert "reference_solution" not in metadata, f"{task.key}: metadata carries the reference solution"
        asked = self._all_tasks(include_reference_solution=True)
        assert [t.key for t in asked] == [t.key for t in plain]
        for task in asked:
            if task.reference_solution_json:
                solution = self.json_of(task.reference_solution_json, f"{task.key}.reference_solution_json")
                assert isinstance(solution, dict), f"{task.key}: a reference solution is a JSON object"

    def test_list_tasks_pages_in_key_order(self) -> None:
        first = self.orchestrator.ListTasks(
            orchestrator_pb2.ListTasksRequest(page_size=1),
            metadata=self.orchestrator_metadata,
            timeout=self.rpc_timeout_s,
        )
        assert len(first.tasks) == 1 and first.total >= 1, first
        if first.total == 1:
            assert first.next_page_token == ""
            return
        assert first.next_page_token, "a page short of total needs a next_page_token"
        second = self.orchestrator.ListTasks(
            orchestrator_pb2.ListTasksRequest(page_size=1, page_token=first.next_page_token),
            metadata=self.orchestrator_metadata,
            timeout=self.rpc_timeout_s,
        )
        assert len(second.tasks) == 1 and second.tasks[0].key > first.tasks[0].key, (first, second)
        env_id = first.tasks[0].env_id
        of_env = self.orchestrator.ListTasks(
            orchestrator_pb2.ListTasksRequest(env_key=env_id, page_size=1000),
            metadata=self.orchestrator_metadata,
            timeout=self.rpc_timeout_s,
        )
        assert of_env.tasks and {t.env_id for t in of_env.tasks} == {env_id}, f"ListTasks(env_key={env_id!r})"
        assert of_env.total == len(of_env.tasks) <= first.total

    def test_reset_takes_fields_up_to_their_limits(self) -> None:
        at_limit = self.reset(
            task_key=self.task_key,
            env_key="compliance-ignored",  # ignored when task_key is set
            request_id=self.new_request_id(128),
            run_id="u" * 128,
            labels={"k" * 63: "v" * 63},
        )
        assert at_limit.task.key == self.task_key
        if at_limit.task.max_turns > 0:
            assert at_limit.max_turns == at_limit.task.max_turns, "max_turns 0 uses the task's default"

    def test_reset_of_unknown_names_is_not_found(self) -> None:
        unknown = {
            "task_key": orchestrator_pb2.ResetRequest(task_key="compliance-no-such-task"),
            "env_key": orchestrator_pb2.ResetRequest(env_key="compliance-no-such-env"),
            "session_id": orchestrator_pb2.ResetRequest(session_id=UNKNOWN_SESSION),
        }
        self.expect_statuses(
            (f"Reset with an unknown {name}", NOT_FOUND, self._call("Reset", request), None)
            for name, request in unknown.items()
        )

    def test_malformed_reset_is_invalid_argument(self) -> None:
        episode = self.reset()

        def reset(**fields: Any) -> Callable[[], object]:
            fields.setdefault("task_key", self.task_key)
            fields.setdefault("request_id", self.new_request_id())
            return self._call("Reset", orchestrator_pb2.ResetRequest(**fields))

        self.expect_statuses(
            [
                ("session_id with task_key", INVALID, reset(session_id=episode.session_id), ("session_id", "task_key")),
                ("request_id of 129 characters", INVALID, reset(request_id=TOO_LONG_ID), "request_id"),
                ("run_id of 129 characters", INVALID, reset(run_id=TOO_LONG_ID), "run_id"),
                ("a label key of 64 characters", INVALID, reset(labels={TOO_LONG_LABEL: "v"}), "labels"),
                ("a label value of 64 characters", INVALID, reset(labels={"k": TOO_LONG_LABEL}), "labels"),
                ("negative max_turns", INVALID, reset(max_turns=-1), "max_turns"),
            ]
        )

    def test_reset_retry_returns_the_same_session(self) -> None:
        request_id = self.new_request_id()
        first = self.reset(request_id=request_id)
        again = self.reset(request_id=request_id)
        assert (again.session_id, again.episode) == (first.session_id, first.episode)
        assert again.instance == first.instance, "a retry provisions nothing new"
        assert again.agent_token and again.agent_token != first.agent_token, "a retry mints a fresh agent token"
        assert self.list_tools(again), "the retry's agent token works"
        # only the latest reply's token acts: the first is revoked
        self.expect_status(PRECONDITION, lambda: self.list_tools(first), what="the first Reset's token after a retry")

    def test_reset_request_id_reused_with_other_parameters(self) -> None:
        request_id = self.new_request_id()
        first = self.reset(request_id=request_id)
        self.expect_statuses(
            [
                (
                    "other max_turns",
                    INVALID,
                    lambda: self.reset(request_id=request_id, max_turns=first.max_turns + 1),
                    "max_turns",
                ),
                (
                    "other labels",
                    INVALID,
                    lambda: self.reset(request_id=request_id, labels={"compliance": "other"}),
                    "labels",
                ),
                (
                    "other run_id",
                    INVALID,
                    lambda: self.reset(request_id=request_id, run_id="compliance-other-run"),
                    "run_id",
                ),
            ]
        )
        # the refused reuse did nothing: the first token still works, no episode started
        assert self.list_tools(first), "the original agent token still works"
        session = self.state(first.session_id).session
        assert (session.status, session.episode) == (Status.SESSION_STATUS_ACTIVE, 1)

    def test_request_ids_are_scoped_to_the_api_key(self) -> None:
        if not (self.api_key and self.other_api_key):
            skip("needs two accepted API keys (api_key and other_api_key)")
        request_id = self.new_request_id()
        first = self.reset(request_id=request_id)
        other_key = self.bearer(self.other_api_key)
        other = self.reset(request_id=request_id, max_turns=first.max_turns + 1, metadata=other_key)
        assert other.session_id != first.session_id, "another caller's request_id is another request"
        assert self.list_tools(first), "the first caller's token is never touched"
        step_id = self.new_request_id()
        assert self.step(first.session_id, request_id=step_id, assistant_text="a").turn == 1
        by_other = self.orchestrator.Step(
            orchestrator_pb2.StepRequest(session_id=first.session_id, request_id=step_id, assistant_text="a"),
            metadata=other_key,
            timeout=self.rpc_timeout_s,
        )
        assert by_other.turn == 2, "another caller's Step request_id is another turn, not a replay"

    def test_next_episode_on_the_same_session(self) -> None:
        first = self.reset()
        self.step(first.session_id, assistant_text="first turn")
        request_id = self.new_request_id()
        second = self.reset(session_id=first.session_id, request_id=request_id)
        assert (second.session_id, second.episode) == (first.session_id, 2)
        retried = self.reset(session_id=first.session_id, request_id=request_id)
        assert (retried.session_id, retried.episode) == (first.session_id, 2), "a retry starts no third episode"
        second = retried  # only the latest reply's token acts
        assert second.agent_token != first.agent_token
        session = self.state(first.session_id).session
        assert (session.status, session.episode, session.turn) == (Status.SESSION_STATUS_ACTIVE, 2, 0)
        assert second.task.reference_solution_json == "", "a Reset never carries a reference solution"
        assert self.list_tools(second), "the new episode's token works"
        self.expect_status(PRECONDITION, lambda: self.list_tools(first), what="the previous episode's token")

    def test_env_only_session_has_no_task_and_no_verifier(self) -> None:
        task = self.reset().task
        episode = self.reset(env_key=f"{task.env_id}:{task.version}")
        assert (episode.task.key, episode.prompt) == ("", ""), episode.task
        assert episode.tools, "an env-only session still has the environment's tools"
        step = self.step(episode.session_id, done=True)
        assert step.verification.status == Verification.VERIFICATION_STATUS_SKIPPED, step
        assert not step.HasField("reward"), "no verifier, no reward"

    # -- Step ---------------------------------------------------------------------------------------------
    def test_step_counts_turns_and_ends_on_a_final_answer(self) -> None:
        episode = self.reset()
        turn = self.step(episode.session_id, assistant_text="thinking")
        assert (turn.turn, turn.done, turn.truncated) == (1, False, False), turn
        assert turn.status == Status.SESSION_STATUS_ACTIVE and turn.done_reason == Done.DONE_REASON_UNSPECIFIED
        assert not turn.HasField("reward")
        final = self.step(episode.session_id, assistant_text="done", final_answer="compliance")
        assert (final.turn, final.truncated, final.done_reason) == (2, False, Done.DONE_REASON_FINAL_ANSWER), final
        self._check_final_verdict(final)
        session = self.state(episode.session_id).session
        assert (session.status, session.turn, session.done_reason) == (
            Status.SESSION_STATUS_DONE,
            2,
            Done.DONE_REASON_FINAL_ANSWER,
        )

    def test_step_done_signal_ends_the_episode(self) -> None:
        episode = self.reset()
        step = self.step(episode.session_id, done=True)
        assert (step.turn, step.truncated, step.done_reason) == (1, False, Done.DONE_REASON_AGENT_DONE), step
        self._check_final_verdict(step)

    def test_step_truncates_at_max_turns(self) -> None:
        episode = self.reset(max_turns=1)
        assert episode.max_turns == 1
        step = self.step(episode.session_id, assistant_text="no answer")
        assert (step.turn, step.truncated, step.done_reason) == (1, True, Done.DONE_REASON_MAX_TURNS), step
        self._check_final_verdict(step)

    def test_step_after_done_is_failed_precondition(self) -> None:
        episode = self.reset()
        self.step(episode.session_id, done=True)
        self.expect_status(PRECONDITION, lambda: self.step(episode.session_id, assistant_text="more"))
        following = self.reset(session_id=episode.session_id)  # a done session takes its next episode
        assert (following.episode, self.step(following.session_id, assistant_text="again").turn) == (2, 1)

    def test_step_close_when_done_closes_with_the_ending(self) -> None:
        episode = self.reset()
        going = self.step(episode.session_id, assistant_text="still going", close_when_done=True)
        assert (going.done, going.status) == (False, Status.SESSION_STATUS_ACTIVE), "a turn that ends nothing"
        request_id = self.new_request_id()
        final = self.step(episode.session_id, request_id=request_id, final_answer="compliance", close_when_done=True)
        assert (final.turn, final.done_reason) == (2, Done.DONE_REASON_FINAL_ANSWER), final
        self._check_final_verdict(final, Status.SESSION_STATUS_CLOSED)  # scored first, then closed
        again = self.step(episode.session_id, request_id=request_id, final_answer="compliance", close_when_done=True)
        assert again == final, "a repeat replays the recorded answer"
        session = self.state(episode.session_id).session
        assert (session.status, session.turn, session.done_reason) == (
            Status.SESSION_STATUS_CLOSED,
            2,
            Done.DONE_REASON_FINAL_ANSWER,
        )
        assert session.verification == final.verification
        closed = self.close(episode.session_id)
        assert (closed.already_closed, closed.status) == (True, Status.SESSION_STATUS_CLOSED), closed
        self.expect_statuses(
            [
                (
                    "the request_id again without close_when_done (other contents)",
                    INVALID,
                    lambda: self.step(episode.session_id, request_id=request_id, final_answer="compliance"),
                    "close_when_done",
                ),
                (
                    "a next episode of the closed session",
                    PRECONDITION,
                    lambda: self.reset(session_id=episode.session_id),
                    None,
                ),
            ]
        )
        self.expect_status(
            PRECONDITION,
            lambda: self.list_tools(episode),
            mentions="closed",
            what="the agent token of a session its last Step closed",
        )

    def test_step_close_when_done_at_the_turn_limit(self) -> None:
        episode = self.reset(max_turns=1)
        step = self.step(episode.session_id, assistant_text="no answer", close_when_done=True)
        assert (step.truncated, step.done_reason) == (True, Done.DONE_REASON_MAX_TURNS), step
        self._check_final_verdict(step, Status.SESSION_STATUS_CLOSED)

    def test_step_never_executes_tools(self) -> None:
        tool = self.the_tool_call()
        episode = self.reset()
        request_id = self.new_request_id()
        summary = orchestrator_pb2.ToolCallSummary(name=tool.name, request_id=request_id)
        summary.arguments_json = json_text(dict(tool.arguments))
        self.step(episode.session_id, assistant_text="reporting a call", tool_calls=[summary])
        state = self.state(episode.session_id, include_tool_calls=True)
        assert state.session.tool_call_count == 0 and not state.tool_calls, "Step ran a tool"

    def test_step_retry_replays(self) -> None:
        episode = self.reset()
        request_id = self.new_request_id()
        first = self.step(episode.session_id, request_id=request_id, assistant_text="once")
        assert self.step(episode.session_id, request_id=request_id, assistant_text="once") == first
        assert self.state(episode.session_id).session.turn == 1, "a replayed Step counts no turn"
        final_id = self.new_request_id()
        final = self.step(episode.session_id, request_id=final_id, final_answer="compliance")
        assert final.turn == 2
        # a retry of the turn that ended the episode replays it (not FAILED_PRECONDITION)
        assert self.step(episode.session_id, request_id=final_id, final_answer="compliance") == final

    def test_step_request_id_reused_with_other_contents(self) -> None:
        episode = self.reset()
        other = self.reset()
        request_id = self.new_request_id()
        self.step(episode.session_id, request_id=request_id, assistant_text="a")
        self.expect_statuses(
            [
                (
                    "other assistant_text",
                    INVALID,
                    lambda: self.step(episode.session_id, request_id=request_id, assistant_text="b"),
                    "assistant_text",
                ),
                (
                    "a final_answer added",
                    INVALID,
                    lambda: self.step(episode.session_id, request_id=request_id, assistant_text="a", final_answer="x"),
                    "final_answer",
                ),
                (
                    "another session",
                    INVALID,
                    lambda: self.step(other.session_id, request_id=request_id, assistant_text="a"),
                    "session_id",
                ),
            ]
        )
        assert self.state(episode.session_id).session.turn == 1
        assert self.state(other.session_id).session.turn == 0, "the refused reuse did nothing"

    def test_malformed_step_is_invalid_argument(self) -> None:
        episode = self.reset()
        tool = self.the_tool_call()

        def step_with(summary: orchestrator_pb2.ToolCallSummary) -> Callable[[], object]:
            return lambda: self.step(episode.session_id, tool_calls=[summary])

        self.expect_statuses(
            [
                (
                    "a tool call without a name",
                    INVALID,
                    step_with(orchestrator_pb2.ToolCallSummary(arguments_json="{}")),
                    "tool_calls",
                ),
                (
                    "arguments_json that is not an object",
                    INVALID,
                    step_with(orchestrator_pb2.ToolCallSummary(name=tool.name, arguments_json="[1, 2]")),
                    "tool_calls",
                ),
                (
                    "arguments_json that is not JSON",
                    INVALID,
                    step_with(orchestrator_pb2.ToolCallSummary(name=tool.name, arguments_json="{")),
                    "tool_calls",
                ),
                (
                    "request_id of 129 characters",
                    INVALID,
                    lambda: self.step(episode.session_id, request_id=TOO_LONG_ID),
                    "request_id",
                ),
            ]
        )
        assert self.state(episode.session_id).session.turn == 0, "a refused Step counts no turn"

    # -- unknown sessions, Close, CloseSessions ------------------------------------------------------------
    def test_unknown_session_is_not_found(self) -> None:
        self.expect_statuses(
            (f"{method} of an unknown session", NOT_FOUND, self._call(method, request), None)
            for method, request in {
                "Step": orchestrator_pb2.StepRequest(session_id=UNKNOWN_SESSION, request_id=self.new_request_id()),
                "State": orchestrator_pb2.StateRequest(session_id=UNKNOWN_SESSION),
                "Close": orchestrator_pb2.CloseRequest(session_id=UNKNOWN_SESSION),
            }.items()
        )

    def test_close_is_idempotent(self) -> None:
        episode = self.reset()
        closed = self.close(episode.session_id)
        assert (closed.already_closed, closed.status) == (False, Status.SESSION_STATUS_CLOSED), closed
        again = self.close(episode.session_id)
        assert (again.already_closed, again.status) == (True, Status.SESSION_STATUS_CLOSED), again
        assert self.state(episode.session_id).session.status == Status.SESSION_STATUS_CLOSED

    def test_closed_session_is_failed_precondition(self) -> None:
        episode = self.reset()
        self.close(episode.session_id)
        self.expect_statuses(
            [
                (
                    "Step of a closed session",
                    PRECONDITION,
                    lambda: self.step(episode.session_id, assistant_text="x"),
                    None,
                ),
                ("Reset of a closed session", PRECONDITION, lambda: self.reset(session_id=episode.session_id), None),
            ]
        )
        self.expect_status(
            PRECONDITION,
            lambda: self.list_tools(episode),
            mentions="closed",
            what="the agent token of a closed session",
        )

    def test_close_sessions_by_run_id_and_labels(self) -> None:
        self.expect_status(
            INVALID,
            self._call("CloseSessions", orchestrator_pb2.CloseSessionsRequest()),
            what="CloseSessions without a filter",
        )
        run_id = self.new_request_id()
        label = {"compliance-run": run_id[-32:]}
        kept = self.reset(run_id=run_id)
        closed = self.reset(run_id=run_id, labels=label)
        listed = self.orchestrator.ListSessions(
            orchestrator_pb2.ListSessionsRequest(run_id=run_id),
            metadata=self.orchestrator_metadata,
            timeout=self.rpc_timeout_s,
        )
        assert [s.session_id for s in listed.sessions] == [closed.session_id, kept.session_id], "newest first"
        response = self.orchestrator.CloseSessions(
            orchestrator_pb2.CloseSessionsRequest(run_id=run_id, labels=label),
            metadata=self.orchestrator_metadata,
            timeout=self.rpc_timeout_s,
        )
        assert list(response.session_ids) == [closed.session_id], "filters combine with AND"
        assert self.state(closed.session_id).session.status == Status.SESSION_STATUS_CLOSED
        repeat = self.orchestrator.CloseSessions(
            orchestrator_pb2.CloseSessionsRequest(run_id=run_id, labels=label),
            metadata=self.orchestrator_metadata,
            timeout=self.rpc_timeout_s,
        )
        assert not repeat.session_ids, "only sessions this call closed are listed"
        assert self.state(kept.session_id).session.status == Status.SESSION_STATUS_ACTIVE
        active = self.orchestrator.ListSessions(
            orchestrator_pb2.ListSessionsRequest(run_id=run_id, status=Status.SESSION_STATUS_ACTIVE),
            metadata=self.orchestrator_metadata,
            timeout=self.rpc_timeout_s,
        )
        assert [s.session_id for s in active.sessions] == [kept.session_id], "ListSessions filters by status"
        self.expect_status(
            PRECONDITION, lambda: self.list_tools(closed), what="a token of a session CloseSessions closed"
        )

    def test_malformed_paging_is_invalid_argument(self) -> None:
        self.expect_statuses(
            (f"{method} {what}", INVALID, self._call(method, request), field)
            for method, cls in (
                ("ListTasks", orchestrator_pb2.ListTasksRequest),
                ("ListSessions", orchestrator_pb2.ListSessionsRequest),
            )
            for what, request, field in (
                ("page_size -1", cls(page_size=-1), "page_size"),
                ("page_size 1001", cls(page_size=1001), "page_size"),
                ("a page_token it never issued", cls(page_token="compliance-not-a-token"), "page_token"),
            )
        )

    # -- State's pages of the tool-call log ---------------------------------------------------------------
    def _state_page(self, session_id: str, size: int = 0, token: str = "") -> orchestrator_pb2.StateResponse:
        response: orchestrator_pb2.StateResponse = self.orchestrator.State(
            orchestrator_pb2.StateRequest(
                session_id=session_id,
                include_tool_calls=True,
                tool_calls_page_size=size,
                tool_calls_page_token=token,
            ),
            metadata=self.orchestrator_metadata,
            timeout=self.rpc_timeout_s,
        )
        return response

    def _logged_calls(self, episode: orchestrator_pb2.ResetResponse, count: int) -> list[str]:
        """Make `count` calls of the tool call through the gateway; their request ids, in order."""
        tool = self.the_tool_call()
        ids = [self.new_request_id() for _ in range(count)]
        for request_id in ids:
            self.call_tool(episode, tool.name, tool.arguments, request_id=request_id)
        return ids

    def _walk(self, session_id: str, size: int, token: str = "") -> list[orchestrator_pb2.ToolCallLogEntry]:
        entries: list[orchestrator_pb2.ToolCallLogEntry] = []
        for _ in range(1000):  # bounded: a server whose page tokens never end fails instead of hanging
            page = self._state_page(session_id, size, token)
            assert 1 <= len(page.tool_calls) <= size, f"a page of size {size} held {len(page.tool_calls)} entries"
            entries.extend(page.tool_calls)
            token = page.next_tool_calls_page_token
            if not token:
                return entries
        raise AssertionError("State kept returning a next_tool_calls_page_token")

    def test_state_pages_the_tool_call_log(self) -> None:
        episode = self.reset()
        ids = self._logged_calls(episode, 7)
        whole = self._state_page(episode.session_id)
        assert [e.request_id for e in whole.tool_calls] == ids, "the default page (100) holds the 7 calls in order"
        assert whole.next_tool_calls_page_token == "" and whole.session.tool_call_count == 7
        for size in (1, 2, 3, 7):
            walked = [e.request_id for e in self._walk(episode.session_id, size)]
            assert walked == ids, f"pages of {size}: {walked} (want every call once, oldest first)"
        bare = self.state(episode.session_id)
        assert not bare.tool_calls and bare.next_tool_calls_page_token == "", "entries nobody asked for"

    def test_a_state_page_token_continues_its_episode(self) -> None:
        first = self.reset()
        ids = self._logged_calls(first, 3)
        page = self._state_page(first.session_id, 1)
        assert [e.request_id for e in page.tool_calls] == ids[:1] and page.next_tool_calls_page_token
        second = self.reset(session_id=first.session_id)
        later = self._logged_calls(second, 1)
        rest = self._walk(first.session_id, 1, page.next_tool_calls_page_token)
        assert [(e.episode, e.request_id) for e in rest] == [(1, i) for i in ids[1:]], "the token's episode"
        assert [e.request_id for e in self._walk(first.session_id, 100)] == later, "no token: the current episode"

    def test_malformed_state_paging_is_invalid_argument(self) -> None:
        mine = self.reset()
        other = self.reset()
        self._logged_calls(other, 2)
        foreign = self._state_page(other.session_id, 1).next_tool_calls_page_token
        assert foreign, "a page of 1 of 2 calls needs a next_tool_calls_page_token"

        def state(**fields: Any) -> Callable[[], object]:
            request = orchestrator_pb2.StateRequest(session_id=mine.session_id, include_tool_calls=True, **fields)
            return self._call("State", request)

        self.expect_statuses(
            (what, INVALID, state(**fields), field)
            for what, fields, field in (
                ("tool_calls_page_size -1", {"tool_calls_page_size": -1}, "tool_calls_page_size"),
                ("tool_calls_page_size 1001", {"tool_calls_page_size": 1001}, "tool_calls_page_size"),
                (
                    "a tool_calls_page_token it never issued",
                    {"tool_calls_page_token": "compliance-not-a-token"},
                    "tool_calls_page_token",
                ),
                (
                    "a tool_calls_page_token of another session",
                    {"tool_calls_page_token": foreign},
                    "tool_calls_page_token",
                ),
            )
        )

    # -- expiry -------------------------------------------------------------------------------------------
    def test_expired_session(self) -> None:
        channel = self.expiring_orchestrator_channel()
        if channel is None:
            skip("no orchestrator with a short session TTL (expiring_orchestrator_channel)")
        stub = self.new_orchestrator_stub(channel)
        episode = self.reset(stub=stub)
        session = self.wait_for_status(
            episode.session_id, [Status.SESSION_STATUS_EXPIRED], self.expiry_timeout_s, stub=stub
        )
        assert session.status == Status.SESSION_STATUS_EXPIRED
        closed = self.close(episode.session_id, stub=stub)
        assert (closed.already_closed, closed.status) == (True, Status.SESSION_STATUS_EXPIRED), closed
        self.expect_status(
            PRECONDITION,
            lambda: stub.Step(
                orchestrator_pb2.StepRequest(session_id=episode.session_id, assistant_text="late"),
                metadata=self.orchestrator_metadata,
                timeout=self.rpc_timeout_s,
            ),
            what="Step of an expired session",
        )
        self.expect_status(
            PRECONDITION,
            lambda: self.reset(stub=stub, session_id=episode.session_id),
            what="Reset of an expired session",
        )
        self.expect_status(
            PRECONDITION,
            lambda: self.list_tools(episode),
            mentions="expire",
            what="the agent token of an expired session",
        )

    # -- Fork ---------------------------------------------------------------------------------------------
    FORK_RUN = "compliance-fork-run"

    def _forkable(self) -> tuple[orchestrator_pb2.ResetResponse, orchestrator_pb2.ForkResponse, str]:
        """A source one turn in (with the tool call made), forked into 2: (source, fork, its request_id);
        skips when the server's provider cannot fork (FAILED_PRECONDITION saying so)."""
        tool = self.the_tool_call()
        source = self.reset(labels={"compliance": "fork"}, run_id=self.FORK_RUN)
        assert not self.call_tool(source, tool.name, tool.arguments).result.is_error
        self.step(source.session_id, assistant_text="first turn")
        request_id = self.new_request_id()
        try:
            forked = self.fork(source.session_id, 2, request_id=request_id)
        except grpc.RpcError as err:
            if err.code() == PRECONDITION and "fork" in (err.details() or "").lower():
                skip(f"the server cannot fork this episode: {err.details()}")
            raise
        return source, forked, request_id

    def test_fork_branches_share_the_episode(self) -> None:
        source, forked, _ = self._forkable()
        assert forked.parent_session_id == source.session_id and forked.turn == 1, forked
        assert forked.mechanism in (
            orchestrator_pb2.FORK_MECHANISM_SNAPSHOT,
            orchestrator_pb2.FORK_MECHANISM_REPLAY,
        ), forked
        assert [b.branch_index for b in forked.branches] == [0, 1]
        source_log = [c.tool for c in self.state(source.session_id, include_tool_calls=True).tool_calls]
        for branch in forked.branches:
            assert branch.session_id not in ("", source.session_id) and branch.agent_token, branch
            assert (branch.episode, branch.turn, branch.max_turns) == (1, 1, source.max_turns), branch
            state = self.state(branch.session_id, include_tool_calls=True)
            info = state.session
            assert info.status == Status.SESSION_STATUS_ACTIVE and info.task.key == self.task_key
            assert (info.parent_session_id, info.branch_index) == (source.session_id, branch.branch_index)
            assert info.labels["compliance"] == "fork" and info.run_id == self.FORK_RUN
            assert [c.tool for c in state.tool_calls] == source_log, "a branch has the source's tool-call log"
            assert self.list_tools(branch), "a branch's agent token works"
        assert self.list_tools(source), "the source goes on unchanged"
        session = self.state(source.session_id).session
        assert (session.status, session.turn) == (Status.SESSION_STATUS_ACTIVE, 1)
        assert self.step(forked.branches[0].session_id, done=True).turn == 2, "a branch counts from the task's start"
        assert self.state(forked.branches[1].session_id).session.turn == 1, "branches are independent"

    def test_fork_retry_returns_the_same_branches(self) -> None:
        source, forked, request_id = self._forkable()
        again = self.fork(source.session_id, 2, request_id=request_id)
        assert [b.session_id for b in again.branches] == [b.session_id for b in forked.branches]
        for first, retried in zip(forked.branches, again.branches, strict=True):
            assert retried.agent_token and retried.agent_token != first.agent_token
            assert self.list_tools(retried), "the retry's agent token works"
            self.expect_status(PRECONDITION, functools.partial(self.list_tools, first), what="a first Fork's token")
        self.expect_status(
            INVALID,
            lambda: self.fork(source.session_id, 3, request_id=request_id),
            field="count",
            what="a Fork request_id reused with another count",
        )

    def test_fork_refusals(self) -> None:
        source = self.reset()
        ended = self.reset()
        self.step(ended.session_id, done=True)
        closed = self.reset()
        self.close(closed.session_id)
        self.expect_statuses(
            [
                ("count 0", INVALID, lambda: self.fork(source.session_id, 0), "count"),
                ("count -1", INVALID, lambda: self.fork(source.session_id, -1), "count"),
                ("count past any maximum", INVALID, lambda: self.fork(source.session_id, 1_000_000), "count"),
                ("an unknown session", NOT_FOUND, lambda: self.fork(UNKNOWN_SESSION, 1), None),
                ("a done source", PRECONDITION, lambda: self.fork(ended.session_id, 1), None),
                ("a closed source", PRECONDITION, lambda: self.fork(closed.session_id, 1), None),
            ]
        )

    # -- authentication and the plane split ---------------------------------------------------------------
    def _call(self, method: str, request: Any, metadata: Any = None) -> Callable[[], object]:
        rpc = getattr(self.orchestrator, method)
        md = self.orchestrator_metadata if metadata is None else metadata
        return lambda: rpc(request, metadata=md, timeout=self.rpc_timeout_s)

    def test_every_rpc_needs_an_api_key(self) -> None:
        if not self.api_key:
            skip("the orchestrator under test requires no API key (api_key is None)")
        self.expect_statuses(
            (f"{method} {what}", UNAUTHENTICATED, self._call(method, request, metadata), None)
            for method, request in _empty_requests().items()
            for what, metadata in (
                ("without credentials", ()),
                ("with a key it never accepted", self.bearer("compliance-wrong-key")),
            )
        )

    def test_an_agent_token_reaches_no_orchestration_rpc(self) -> None:
        if not self.api_key:
            skip("without API keys the orchestration plane admits every caller; the split needs keys configured")
        episode = self.reset()
        agent = self.bearer(episode.agent_token)
        requests = _empty_requests()
        requests["State"] = orchestrator_pb2.StateRequest(session_id=episode.session_id)
        requests["Close"] = orchestrator_pb2.CloseRequest(session_id=episode.session_id)
        requests["Step"] = orchestrator_pb2.StepRequest(session_id=episode.session_id, done=True)
        requests["Reset"] = orchestrator_pb2.ResetRequest(session_id=episode.session_id)
        self.expect_statuses(
            (f"{method} with the agent token", UNAUTHENTICATED, self._call(method, request, agent), None)
            for method, request in requests.items()
        )
        assert self.state(episode.session_id).session.status == Status.SESSION_STATUS_ACTIVE
