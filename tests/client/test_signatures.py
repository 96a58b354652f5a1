"""The public client's surface: `Client` and `AsyncClient`, `Episode` and `AsyncEpisode` have the same methods
with the same parameters (names, kinds, defaults and annotations; a coroutine where the blocking one returns),
every parameter and return is annotated, no public method of rlgate takes **kwargs, a misspelt keyword fails
under mypy and as a TypeError before anything is sent, and a value no request can hold is an error naming
its parameter and what it should be."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys
import textwrap
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

import rlgate
from rlgate import AsyncClient, AsyncEpisode, Client, ClientSettings, Episode, EpisodeSpec, RetryPolicy
from rlgate import client as client_module
from rlgate import episode as episode_module
from rlgate import inputs as inputs_module
from rlgate.errors import error_from_rpc
from rlgate.retry import RetryState
from rlgate.v1 import orchestrator_pb2
from tests.client.scripted import ScriptedServer

PAIRS = [(Client, AsyncClient), (Episode, AsyncEpisode)]
# The async twin of a blocking name, where they differ.
ASYNC_NAME = {"__enter__": "__aenter__", "__exit__": "__aexit__"}
# Methods that are plain functions in both: they build an object and call nothing.
PLAIN_IN_BOTH = {"__init__", "episode"}
# Names the blocking classes use in annotations, and their async twins.
TWINS = {"Client": "AsyncClient", "Episode": "AsyncEpisode", "grpc.Channel": "grpc.aio.Channel"}
AWAITABLE = re.compile(r"^(?:typing\.|collections\.abc\.)?(?:Awaitable|Coroutine\[Any, Any,)\[?(.*)\]$")


def public_names(cls: type) -> list[str]:
    names = [n for n in dir(cls) if not n.startswith("_")]
    dunders = ("__init__", "__enter__", "__exit__", "__aenter__", "__aexit__")
    return sorted([*names, *(d for d in dunders if hasattr(cls, d))])


def async_twin_annotation(annotation: object) -> object:
    """A blocking method's annotation as its async twin writes it (annotations are strings here)."""
    if not isinstance(annotation, str):
        return annotation
    return re.sub(r"(?<![\w.])(grpc\.Channel|Client|Episode)\b", lambda m: TWINS[m.group(1)], annotation)


def unawaited(annotation: object) -> object:
    """`Awaitable[X]` -> `X`: an async method may spell its result either way."""
    if isinstance(annotation, str) and (match := AWAITABLE.match(annotation)):
        return match.group(1)
    return annotation


def described(sig: inspect.Signature, *, twin: bool = False) -> list[tuple[str, object, object, object]]:
    rename = async_twin_annotation if twin else (lambda a: a)
    return [(p.name, p.kind, p.default, rename(p.annotation)) for p in sig.parameters.values()]


@pytest.mark.parametrize(("sync_cls", "async_cls"), PAIRS, ids=["Client", "Episode"])
def test_async_twin_has_the_same_public_names(sync_cls: type, async_cls: type) -> None:
    assert sorted(ASYNC_NAME.get(n, n) for n in public_names(sync_cls)) == public_names(async_cls)


def method_pairs() -> list[object]:
    return [
        pytest.param(f"{sync_cls.__name__}.{name}", sync_cls, async_cls, name, id=f"{sync_cls.__name__}.{name}")
        for sync_cls, async_cls in PAIRS
        for name in public_names(sync_cls)
    ]


@pytest.mark.parametrize(("label", "sync_cls", "async_cls", "name"), method_pairs())
def test_async_twin_has_the_same_signature(label: str, sync_cls: type, async_cls: type, name: str) -> None:
    sync_attr = inspect.getattr_static(sync_cls, name)
    async_attr = inspect.getattr_static(async_cls, ASYNC_NAME.get(name, name))
    if isinstance(sync_attr, property):
        assert isinstance(async_attr, property), label
        assert sync_attr.fget is not None and async_attr.fget is not None
        sync_return = inspect.signature(sync_attr.fget).return_annotation
        assert async_twin_annotation(sync_return) == inspect.signature(async_attr.fget).return_annotation, label
        return
    if not callable(sync_attr):  # a plain attribute (none today): the same kind of value on both
        assert type(sync_attr) is type(async_attr), label
        return
    sync_fn, async_fn = getattr(sync_cls, name), getattr(async_cls, ASYNC_NAME.get(name, name))
    if sync_fn is async_fn:  # one method both inherit (the episodes' shared base): nothing to compare
        assert not inspect.iscoroutinefunction(sync_fn), label
        return
    if name in PLAIN_IN_BOTH:
        assert not inspect.iscoroutinefunction(sync_fn) and not inspect.iscoroutinefunction(async_fn), label
    else:
        assert not inspect.iscoroutinefunction(sync_fn), f"{label} blocks: it must not be a coroutine function"
        assert inspect.iscoroutinefunction(async_fn), f"the async twin of {label} must be a coroutine function"
    sync_sig, async_sig = inspect.signature(sync_fn), inspect.signature(async_fn)
    assert described(sync_sig, twin=True) == described(async_sig), label
    assert async_twin_annotation(sync_sig.return_annotation) == unawaited(async_sig.return_annotation), label


def annotation_namespace(fn: Callable[..., object]) -> dict[str, object]:
    """The globals an annotation of `fn` resolves in, with the names its module imports only for type checks."""
    namespace = {**vars(client_module), **vars(episode_module), **vars(inputs_module)}
    return {**namespace, **vars(sys.modules[fn.__module__]), **vars(rlgate)}


@pytest.mark.parametrize(("label", "sync_cls", "async_cls", "name"), method_pairs())
def test_every_parameter_and_return_is_annotated_with_types_that_exist(
    label: str, sync_cls: type, async_cls: type, name: str
) -> None:
    for cls, attr in ((sync_cls, name), (async_cls, ASYNC_NAME.get(name, name))):
        member = inspect.getattr_static(cls, attr)
        fn = member.fget if isinstance(member, property) else getattr(cls, attr)
        if not callable(fn):
            continue
        sig = inspect.signature(fn)
        missing = [p.name for p in list(sig.parameters.values())[1:] if p.annotation is inspect.Parameter.empty]
        assert not missing, f"{cls.__name__}.{attr}: parameters without a type: {missing}"
        assert sig.return_annotation is not inspect.Signature.empty, f"{cls.__name__}.{attr}: no return type"
        typing.get_type_hints(fn, globalns=annotation_namespace(fn))  # every annotation names a real type


def public_callables() -> Iterator[tuple[str, Callable[..., object]]]:
    for export in rlgate.__all__:
        value = getattr(rlgate, export)
        if typing.is_typeddict(value):  # keyword types (ResetFields): no methods of their own
            continue
        if inspect.isclass(value):
            for name in ["__init__", *(n for n in dir(value) if not n.startswith("_"))]:
                member = inspect.getattr_static(value, name, None)
                fn = member.fget if isinstance(member, property) else getattr(value, name)
                if callable(fn) and not inspect.isclass(fn):
                    yield f"{export}.{name}", fn
        elif callable(value):
            yield export, value


def test_no_public_method_takes_arbitrary_keywords() -> None:
    """**kwargs only as `Unpack[ResetFields]`: EpisodeSpec's fields, each named and typed for mypy."""
    takes_kwargs: list[str] = []
    takes_fields: list[str] = []
    for label, fn in public_callables():
        try:
            parameters = inspect.signature(fn).parameters.values()
        except ValueError:  # a builtin (Exception.__init__ of the error classes' bases) has no signature
            continue
        for p in parameters:
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                (takes_fields if p.annotation == "Unpack[ResetFields]" else takes_kwargs).append(label)
    assert takes_kwargs == [], f"these take **kwargs, so a misspelt keyword would pass silently: {takes_kwargs}"
    assert set(takes_fields) == {
        f"{cls}.{name}" for cls in ("Client", "AsyncClient") for name in ("reset", "episode")
    } | {"Episode.__init__", "AsyncEpisode.__init__"}
    labels = {label for label, _ in public_callables()}
    assert {"Client.reset", "AsyncEpisode.step", "ClientSettings.from_env", "RetryPolicy.__init__"} <= labels


# ------------------------------------------------------------------------------------- the one input type


def test_reset_parameters_are_written_once_as_episode_spec() -> None:
    """EpisodeSpec holds every ResetRequest field but the per-call request_id; ResetFields, the keyword form
    the methods take, has exactly its fields, typed alike; no method spells one of them out again."""
    spec_fields = {f.name: f.type for f in dataclasses.fields(EpisodeSpec)}
    request_fields = set(orchestrator_pb2.ResetRequest.DESCRIPTOR.fields_by_name) - {"request_id"}
    assert set(spec_fields) == request_fields
    assert typing.get_type_hints(rlgate.ResetFields) == typing.get_type_hints(EpisodeSpec)
    assert rlgate.ResetFields.__required_keys__ == frozenset()  # every keyword optional, as the spec's defaults
    takers = [(cls, name) for cls in (Client, AsyncClient) for name in ("reset", "episode")]
    for cls, name in [*takers, (Episode, "__init__"), (AsyncEpisode, "__init__")]:
        parameters = inspect.signature(getattr(cls, name)).parameters
        assert not set(parameters) & set(spec_fields), f"{cls.__name__}.{name} spells out Reset's fields"
        assert "spec" in parameters and parameters["spec"].kind is inspect.Parameter.POSITIONAL_ONLY


def test_a_spec_and_keywords_make_the_same_request(server: ScriptedServer) -> None:
    spec = EpisodeSpec(task_key="t", max_turns=4, labels={"team": "rl"}, run_id="run-1")
    with Client(server.address) as client:
        client.reset(spec, request_id="r-1")
        client.reset(task_key="t", max_turns=4, labels={"team": "rl"}, run_id="run-1", request_id="r-1")
        client.reset(spec, max_turns=9, request_id="r-1")  # a keyword replaces the spec's field
    first, second, third = (s.request for s in server.script.seen["Reset"])
    assert first == second and third.max_turns == 9 and third.run_id == "run-1"


def test_a_spec_is_frozen_and_keeps_its_own_labels() -> None:
    labels = {"team": "rl"}
    spec = EpisodeSpec(task_key="t", labels=labels)
    labels["team"] = "changed"
    assert spec.labels == {"team": "rl"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.task_key = "u"  # type: ignore[misc]
    assert spec.next_episode("s-1") == EpisodeSpec(session_id="s-1", labels={"team": "rl"})
    with pytest.raises(
        ValueError, match=r"^EpisodeSpec\(\): max_turns must be 0 \(the task's limit\) or more, not -1$"
    ):
        EpisodeSpec(task_key="t", max_turns=-1)
    with pytest.raises(TypeError, match=r"^the episode's spec must be a rlgate\.EpisodeSpec or None, not dict"):
        EpisodeSpec.of({"task_key": "t"}, {})  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- misspelt keywords


def test_a_misspelt_keyword_is_a_type_error_before_anything_is_sent(server: ScriptedServer) -> None:
    with Client(server.address) as client:
        with pytest.raises(TypeError, match="unexpected keyword argument 'task_kye'"):
            client.reset(task_kye="t")  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="unexpected keyword argument 'final_anwser'"):
            client.step("s-1", final_anwser="42")  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="unexpected keyword argument 'task_kye'"):
            client.episode(task_kye="t")  # type: ignore[call-arg]
        episode = client.episode(task_key="t")
        with pytest.raises(TypeError, match="unexpected keyword argument 'final_anwser'"):
            episode.step(final_anwser="42")  # type: ignore[call-arg]
    assert sum(server.script.count(m) for m in ("Reset", "Step", "Close")) == 0


async def test_a_misspelt_keyword_is_a_type_error_on_the_async_client_too(server: ScriptedServer) -> None:
    async with AsyncClient(server.address) as client:
        with pytest.raises(TypeError, match="unexpected keyword argument 'task_kye'"):
            await client.reset(task_kye="t")  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="unexpected keyword argument 'run'"):
            await client.close_sessions(run="r")  # type: ignore[call-arg]
    assert server.script.count("Reset") == 0 and server.script.count("CloseSessions") == 0


def test_mypy_refuses_misspelt_keywords_and_wrong_types(tmp_path: Path) -> None:
    """What the explicit signatures are for: the mistake shows before a run starts."""
    pytest.importorskip("mypy")
    snippet = tmp_path / "uses_rlgate.py"
    snippet.write_text(
        textwrap.dedent(
            """
            import rlgate
            from rlgate.v1 import common_pb2

            async def main(client: rlgate.Client, aclient: rlgate.AsyncClient) -> None:
                client.reset(task_key="t", max_turns=3, labels={"team": "rl"})
                client.list_sessions(status=common_pb2.SESSION_STATUS_ACTIVE)
                async with aclient.episode(task_key="t", tool_timeout_s=5.0) as ep:
                    await ep.step(final_answer="42")
                client.reset(task_kye="t")
                client.list_sessions(status=2)
                client.episode(task_key="t").step(final_anwser="42")
                rlgate.Episode(aclient)
            """
        )
    )
    env = {**os.environ, "MYPYPATH": str(Path(rlgate.__file__).parent.parent)}
    run = subprocess.run(
        [
            *(sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", str(tmp_path / "cache")),
            *("--follow-imports=silent", "--ignore-missing-imports", "--no-error-summary", str(snippet)),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [line for line in run.stdout.splitlines() if ": error: " in line]
    assert [int(line.split(":")[1]) for line in errors] == [10, 11, 12, 13], run.stdout + run.stderr
    assert 'Unexpected keyword argument "task_kye"' in errors[0] and 'did you mean "task_key"' in errors[0]
    assert '"status"' in errors[1] and '"SessionStatus"' in errors[1]
    assert 'Unexpected keyword argument "final_anwser"' in errors[2]
    assert '"AsyncClient"; expected "Client"' in errors[3]


# ------------------------------------------------------------------------- values no request can hold


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda c: c.reset(task_key="t", labels={"team": 1}),
            r"^EpisodeSpec\(\): labels must be a mapping of str to str, not dict \{'team': 1\}$",
        ),
        (lambda c: c.reset(task_key=3), r"^EpisodeSpec\(\): task_key must be a str, not int 3$"),
        (
            lambda c: c.reset(task_key="t", max_turns="8"),
            r"^EpisodeSpec\(\): max_turns must be an int, not str '8'$",
        ),
        (
            lambda c: c.step("s-1", tool_calls=["echo"]),
            r"^step\(\): tool_calls must be a sequence of rlgate\.v1\.ToolCallSummary, not list \['echo'\]$",
        ),
        (lambda c: c.step("s-1", final_answer=42), r"^step\(\): final_answer must be a str, not int 42$"),
        (
            lambda c: c.step("s-1", final_answer="x\ud800"),
            r"^step\(\): final_answer must be valid Unicode text: 'x\\ud800' contains '\\ud800', a lone UTF-16 "
            r"surrogate$",
        ),
        (
            lambda c: c.list_sessions(status="ACTIVE"),
            r"^list_sessions\(\): status must be a rlgate\.v1\.SessionStatus \(SESSION_STATUS_UNSPECIFIED, .*"
            r"SESSION_STATUS_ACTIVE, .*\), not str 'ACTIVE'$",
        ),
        (lambda c: c.state("s-1", trace_id=7), r"^state\(\): trace_id must be a str or None, not int 7$"),
        (
            lambda c: c.state("s-1", timeout="5"),
            r"^state\(\): timeout must be a number of seconds, or None for the client's default "
            r"\(Timeouts\.other = 30 s\), not str '5'$",
        ),
        (
            lambda c: c.call_tool(None, "echo", gateway="127.0.0.1:1"),
            r"^call_tool\(\): agent_token must be the agent_token Reset returned \(a non-empty str\), not NoneType",
        ),
        (
            lambda c: c.call_tool("", "echo", gateway="127.0.0.1:1"),
            r"^call_tool\(\): agent_token must be the agent_token Reset returned \(a non-empty str\), not str ''$",
        ),
        (
            lambda c: c.call_tool("tok", "echo", ["x"], gateway="127.0.0.1:1"),
            r"call_tool\(\): arguments of tool 'echo' must be a mapping \(a JSON object such as \{'x': 1\}\) or "
            r"None for no arguments, not list \['x'\]",
        ),
    ],
    ids=[
        "label",
        "task_key",
        "max_turns",
        "tool_calls",
        "final_answer",
        "final_answer-surrogate",
        "status",
        "trace_id",
        "timeout-type",
        "agent_token",
        "agent_token-empty",
        "arguments",
    ],
)
def test_a_value_no_request_can_hold_is_an_error_naming_the_parameter(
    server: ScriptedServer, call: Callable[[Client], object], message: str
) -> None:
    with Client(server.address) as client, pytest.raises((TypeError, ValueError, rlgate.InvalidArgument)) as info:
        call(client)
    text = info.value.message if isinstance(info.value, rlgate.RlgateError) else str(info.value)
    assert re.search(message, text), text
    assert sum(server.script.count(m) for m in ("Reset", "Step", "State", "ListSessions", "CallTool")) == 0


@pytest.mark.parametrize("seconds", [0, -1.0, float("nan"), float("inf")])
async def test_a_timeout_that_is_no_deadline_says_what_to_pass(server: ScriptedServer, seconds: float) -> None:
    async with AsyncClient(server.address) as client:
        with pytest.raises(ValueError, match=r"^step\(\): timeout must be a positive, finite number of seconds") as e:
            await client.step("s-1", assistant_text="hi", timeout=seconds)
    assert "Timeouts.step = 300 s" in str(e.value) and repr(seconds) in str(e.value)
    assert server.script.count("Step") == 0


def test_close_sessions_without_a_filter_is_refused_before_it_is_sent(server: ScriptedServer) -> None:
    with Client(server.address) as client, pytest.raises(ValueError, match=r"pass labels= and/or run_id="):
        client.close_sessions()
    assert server.script.count("CloseSessions") == 0


@pytest.mark.parametrize(
    ("addresses", "error", "message"),
    [
        ("", ValueError, r"^no address in '': expected 'host:port', 'host1:port1,host2:port2' or a list of them$"),
        (" , ", ValueError, r"^no address in ' , '"),
        (None, TypeError, r"^addresses must be 'host:port', .* not NoneType None$"),
        (["127.0.0.1:1", 50051], TypeError, r"^each address must be a 'host:port' string, not int 50051"),
    ],
)
def test_addresses_say_what_they_should_be(addresses: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        Client(addresses)  # type: ignore[arg-type]


def test_settings_of_the_wrong_type_are_named() -> None:
    with pytest.raises(TypeError, match=r"^settings must be a rlgate\.ClientSettings or None, not dict"):
        Client("127.0.0.1:1", settings={"api_key": "k"})  # type: ignore[arg-type]


def test_an_unreadable_root_certificate_file_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "missing.pem"
    monkeypatch.setenv("RLGATE_TLS_ROOT_CERTS", str(missing))
    with pytest.raises(ValueError, match=r"^RLGATE_TLS_ROOT_CERTS='.*missing\.pem' names no readable file \("):
        ClientSettings.from_env()


def test_from_env_arguments_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLGATE_API_KEY", "from-env")
    monkeypatch.setenv("RLGATE_GATEWAY", "g1:1,g2:2")
    monkeypatch.delenv("RLGATE_TLS_ROOT_CERTS", raising=False)
    assert ClientSettings.from_env().api_key == "from-env"
    settings = ClientSettings.from_env(api_key="given", gateway_addresses="g3:3", keepalive_time_s=5.0)
    assert (settings.api_key, settings.gateway_addresses, settings.keepalive_time_s) == ("given", ("g3:3",), 5.0)
    assert ClientSettings.from_env(api_key=None).api_key == "from-env"  # None: not given


def test_an_episode_used_before_reset_says_how_to_start_it() -> None:
    with Client("127.0.0.1:1") as client:
        episode = client.episode(task_key="mail-001")
        with pytest.raises(RuntimeError, match=r"^the episode \(task_key='mail-001'\) has not been reset.*reset\(\)"):
            _ = episode.session_id
        with pytest.raises(RuntimeError, match=r"\(session_id='s-9'\)"):
            client.episode(session_id="s-9").turn("<done/>")


def test_a_bad_retry_policy_names_every_bad_field() -> None:
    with pytest.raises(ValueError) as info:
        RetryPolicy(max_attempts=0, jitter=2.0, attempt_timeout=0)
    assert str(info.value) == (
        "RetryPolicy: max_attempts must be at least 1 (1: no retries), not 0; jitter must be between 0 and 1, "
        "not 2.0; attempt_timeout must be None or > 0 seconds, not 0"
    )


def test_a_spent_deadline_says_how_to_wait_longer() -> None:
    state = RetryState("Step", RetryPolicy(), timeout=0.0)
    with pytest.raises(rlgate.DeadlineExceeded) as info:
        state.attempt_timeout()
    assert info.value.message == (
        "Step: the call's deadline of 0 s ran out after 0 attempt(s); to wait longer, pass a larger timeout= or "
        "set ClientSettings.timeouts"
    )


class _BareError(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return ""


def test_a_status_without_a_message_says_so() -> None:
    error = error_from_rpc(_BareError(), context="Reset")
    assert isinstance(error, rlgate.Unavailable)
    assert str(error) == "UNAVAILABLE: Reset: no message from the server (status UNAVAILABLE)"


def test_requests_carry_what_the_keywords_say(server: ScriptedServer) -> None:
    """The explicit parameters reach the request fields of the same names."""
    summary = orchestrator_pb2.ToolCallSummary(name="echo", arguments_json="{}", request_id="c-1")
    with Client(server.address) as client:
        client.reset(env_key="mail:v1", max_turns=4, labels={"team": "rl"}, run_id="run-1", request_id="r-1")
        client.step("s-1", assistant_text="hi", tool_calls=[summary], done=True, request_id="r-2")
    (reset,) = server.script.seen["Reset"]
    assert (reset.request.env_key, reset.request.max_turns, dict(reset.request.labels)) == (
        "mail:v1",
        4,
        {"team": "rl"},
    )
    assert (reset.request.run_id, reset.request.request_id, reset.request.task_key) == ("run-1", "r-1", "")
    (step,) = server.script.seen["Step"]
    assert list(step.request.tool_calls) == [summary] and step.request.done and step.request.request_id == "r-2"
    assert not step.request.HasField("final_answer")
