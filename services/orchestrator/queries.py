"""State, ListSessions and ListTasks: what the orchestrator answers from the store and the task catalog without
changing anything."""

from __future__ import annotations

from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.orchestrator.logpages import LogPages
from rlgate.orchestrator.sessions import Sessions
from rlgate.orchestrator.tasks import TaskCatalog, decode_token, encode_token, validate_page_size
from rlgate.orchestrator.views import session_info, status_filter, task_info
from rlgate.v1 import orchestrator_pb2


class Queries:
    def __init__(self, config: OrchestratorConfig, sessions: Sessions, catalog: TaskCatalog) -> None:
        self._config = config
        self._sessions = sessions
        self._catalog = catalog
        self._log_pages = LogPages(sessions.store)

    async def state(self, request: orchestrator_pb2.StateRequest) -> orchestrator_pb2.StateResponse:
        session = await self._sessions.get(request.session_id)
        size, token = request.tool_calls_page_size, request.tool_calls_page_token
        if not request.include_tool_calls:
            LogPages.check(size, token, session.session_id, session.episode)
        count = await self._sessions.store.count_tool_calls(session.session_id, session.episode)
        response = orchestrator_pb2.StateResponse(session=session_info(session, self._sessions.task_of(session), count))
        if request.include_tool_calls:
            page = await self._log_pages.page(session.session_id, session.episode, size, token)
            response.tool_calls.extend(page.entries)
            response.next_tool_calls_page_token = page.next_token
        return response

    async def list_sessions(
        self, request: orchestrator_pb2.ListSessionsRequest
    ) -> orchestrator_pb2.ListSessionsResponse:
        size = validate_page_size(request.page_size)
        status = status_filter(request.status)
        statuses = None if status is None else frozenset({status})
        scope = f"sessions:{request.status}:{sorted(request.labels.items())}:{request.run_id}"
        cursor = decode_token(request.page_token, scope=scope) if request.page_token else ""
        page, next_cursor = await self._sessions.store.list_sessions(
            statuses=statuses, labels=dict(request.labels), run_id=request.run_id, limit=size, cursor=cursor
        )
        return orchestrator_pb2.ListSessionsResponse(
            sessions=[session_info(s, self._sessions.task_of(s)) for s in page],
            next_page_token=encode_token(next_cursor, scope=scope) if next_cursor else "",
        )

    def list_tasks(self, request: orchestrator_pb2.ListTasksRequest) -> orchestrator_pb2.ListTasksResponse:
        tasks, next_token, total = self._catalog.page(request.env_key, request.page_size, request.page_token)
        return orchestrator_pb2.ListTasksResponse(
            tasks=[
                task_info(
                    t,
                    default_max_turns=self._config.default_max_turns,
                    reference_solution=request.include_reference_solution,
                )
                for t in tasks
            ],
            next_page_token=next_token,
            total=total,
        )
