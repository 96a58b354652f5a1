"""`EpisodeSpec`: what starts an episode, the one place Reset's parameters are written.

`Client.reset`, `Client.episode`, their `AsyncClient` twins and `Episode` / `AsyncEpisode` take an
`EpisodeSpec` positionally, or its fields as keyword arguments (`ResetFields`, typed for the type checker
with `typing.Unpack`), or both (the keywords replace the spec's fields):

    spec = rlgate.EpisodeSpec(task_key="mail-001", max_turns=8, run_id="run-7")
    with client.episode(spec) as ep: ...
    with client.episode(task_key="mail-001", max_turns=8) as ep: ...

A field the request cannot hold is a TypeError or ValueError naming it when the spec is made, before
anything is sent. The per-call values (request_id, trace_id, timeout) are the methods' own parameters."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from rlgate.requests import build
from rlgate.settings import shown
from rlgate.v1 import orchestrator_pb2


class ResetFields(TypedDict, total=False):
    """`EpisodeSpec`'s fields as keyword arguments (the same names and types; tests/client keeps them equal).

    Args:
        task_key: see `EpisodeSpec`.
        env_key: see `EpisodeSpec`.
        session_id: see `EpisodeSpec`.
        max_turns: see `EpisodeSpec`.
        labels: see `EpisodeSpec`.
        run_id: see `EpisodeSpec`.
    """

    task_key: str
    env_key: str
    session_id: str
    max_turns: int
    labels: Mapping[str, str]
    run_id: str


@dataclass(frozen=True)
class EpisodeSpec:
    """What starts an episode: the fields of a ResetRequest a caller chooses.

    Exactly one of `task_key`, `env_key` and `session_id` names what to run (the orchestrator refuses
    `session_id` with either of the others, INVALID_ARGUMENT).

    Args:
        task_key: the task to run (see `Client.list_tasks`).
        env_key: an environment ("env_id" or "env_id:version") to run with no task: no prompt, no verifier
            (verification SKIPPED). Ignored when `task_key` is set.
        session_id: start the next episode of this existing session.
        max_turns: the episode's turn limit; 0 keeps the task's.
        labels: free-form labels (keys and values up to 63 characters) for ListSessions and CloseSessions.
        run_id: the caller's run (a training job) the session belongs to, for CloseSessions after a crash.
    """

    task_key: str = ""
    env_key: str = ""
    session_id: str = ""
    max_turns: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)
    run_id: str = ""

    def __post_init__(self) -> None:
        if self.labels is None:  # the keyword form has always taken None for "no labels"
            object.__setattr__(self, "labels", {})
        if not isinstance(self.labels, Mapping):
            raise TypeError(f"EpisodeSpec(): labels must be a mapping of str to str, not {shown(self.labels)}")
        object.__setattr__(self, "labels", dict(self.labels))  # the caller's dict may change later; ours not
        if isinstance(self.max_turns, bool):
            raise TypeError(f"EpisodeSpec(): max_turns must be an int, not {shown(self.max_turns)}")
        build(orchestrator_pb2.ResetRequest, "EpisodeSpec", **self.request_fields())  # the request's own checks
        if self.max_turns < 0:
            raise ValueError(f"EpisodeSpec(): max_turns must be 0 (the task's limit) or more, not {self.max_turns}")

    def request_fields(self) -> dict[str, Any]:
        """The ResetRequest fields this spec sets (every field but the per-call request_id)."""
        return {name: getattr(self, name) for name in _FIELD_NAMES}

    def next_episode(self, session_id: str) -> EpisodeSpec:
        """The spec of the next episode of `session_id` (labels, run id and turn limit kept).

        Args:
            session_id: the session whose next episode to start.
        """
        return dataclasses.replace(self, session_id=session_id, task_key="", env_key="")

    def subject(self) -> str:
        """What the spec runs, for messages: its task, environment or session."""
        for name in ("task_key", "env_key", "session_id"):
            if getattr(self, name):
                return f"{name}={getattr(self, name)!r}"
        return "no task_key, env_key or session_id"

    @classmethod
    def of(cls, spec: EpisodeSpec | None, fields: ResetFields) -> EpisodeSpec:
        """`spec` with `fields` in place of its own (no spec: the fields alone).

        Args:
            spec: a spec, or None.
            fields: keyword arguments naming `EpisodeSpec` fields; any other name is a TypeError.
        """
        if spec is not None and not isinstance(spec, EpisodeSpec):
            raise TypeError(f"the episode's spec must be a rlgate.EpisodeSpec or None, not {shown(spec)}")
        if spec is None:
            return cls(**fields)
        return dataclasses.replace(spec, **fields) if fields else spec


# Read once: `dataclasses.fields` walks the class's fields afresh on every call, and every Reset reads them.
_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(EpisodeSpec))
