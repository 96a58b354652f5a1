"""Every client-side setting, and the one module that reads them from the environment.

- `ClientSettings`: what a `Client` / `AsyncClient` needs besides its addresses (credentials, TLS, channel
  options, retries, deadlines), with `Timeouts`.
- `RunSettings`: what the code around a client reads: an episode's tool-call bound, the adapters' and
  `rlgate rollout`'s orchestrator address and run id, the openai policy's key, the CLI's debug switch.

Each field that has an environment variable names it in its metadata (`env`), with a one-line `help`;
`rlgate.settingsdoc` renders docs/client.md's settings reference from them (a test keeps the two equal), so no
variable is read, or documented, anywhere else. `split_addresses` parses an address list."""

from __future__ import annotations

import dataclasses
import math
import os
import reprlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc

from rlgate.retry import RetryPolicy

ENV_ORCHESTRATOR = "RLGATE_ORCHESTRATOR"
ENV_API_KEY = "RLGATE_API_KEY"
ENV_GATEWAY = "RLGATE_GATEWAY"
ENV_ROOT_CERTS = "RLGATE_TLS_ROOT_CERTS"
ENV_TOOL_TIMEOUT = "RLGATE_TOOL_TIMEOUT_S"
ENV_ON_VERIFIER_ERROR = "RLGATE_ON_VERIFIER_ERROR"
ENV_RUN_ID = "RLGATE_TRAINING_RUN_ID"
ENV_OPENAI_API_KEY = "OPENAI_API_KEY"
ENV_DEBUG = "RLGATE_DEBUG"


def shown(value: object) -> str:
    """A value as an error message shows it: its type and a bounded repr.

    Args:
        value: what a caller passed or a variable held.
    """
    return f"{type(value).__name__} {reprlib.repr(value)}"


def _meta(help: str, env: str | None = None, *, secret: bool = False) -> dict[str, Any]:
    return {"help": help, "env": env, "secret": secret}


def split_addresses(addresses: str | Iterable[str]) -> tuple[str, ...]:
    """`"a:1,b:2"` or `["a:1", "b:2"]` -> `("a:1", "b:2")`; blanks are dropped, at least one must remain.

    Args:
        addresses: one "host:port", several joined by commas, or an iterable of them.
    """
    if isinstance(addresses, str):
        items: list[object] = list(addresses.split(","))
    elif isinstance(addresses, Iterable):
        items = list(addresses)
    else:
        raise TypeError(
            f"addresses must be 'host:port', 'host1:port1,host2:port2' or an iterable of 'host:port' strings, "
            f"not {shown(addresses)}"
        )
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"each address must be a 'host:port' string, not {shown(item)} (in {addresses!r})")
    out = tuple(a.strip() for a in items if isinstance(a, str) and a.strip())
    if not out:
        raise ValueError(
            f"no address in {addresses!r}: expected 'host:port', 'host1:port1,host2:port2' or a list of them"
        )
    return out


def _seconds(raw: object, source: str) -> float:
    """A positive, finite number of seconds from a number or its text; ValueError naming `source` otherwise."""
    try:
        seconds = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{source} must be a positive, finite number of seconds, not {raw!r}")
    return seconds


@dataclass(frozen=True)
class Timeouts:
    """Default deadline of each logical call (all attempts and backoff included), in seconds.

    A call's own `timeout=` replaces its default; `ClientSettings.timeouts` sets them for a client.

    Args:
        reset: Reset's deadline (provisioning may queue behind an instance limit).
        step: Step's deadline (the final step runs the verifier).
        call_tool: CallTool's deadline.
        other: every other call's deadline.
    """

    reset: float = 600.0
    step: float = 300.0
    call_tool: float = 120.0
    other: float = 30.0


@dataclass(frozen=True)
class ClientSettings:
    """Everything a client needs besides its addresses. Immutable and picklable (adapters ship it).

    `ClientSettings()` reads nothing; `ClientSettings.from_env()` reads the variables the fields name.

    Args:
        api_key: the orchestrator's API key (sent as a Bearer token).
        tls: dial with TLS (the system roots unless `root_certificates` is given).
        root_certificates: PEM root certificates for TLS.
        tls_server_name: the name to check the server's certificate against, when it is not the address's.
        gateway_addresses: gateway addresses to use instead of the one Reset returns (a load-balanced name).
        keepalive_time_s: seconds between HTTP/2 keepalive pings.
        keepalive_timeout_s: seconds a keepalive ping may go unanswered before the connection is dropped.
        max_send_message_bytes: the largest message a client sends.
        max_receive_message_bytes: the largest message a client accepts.
        retry: how calls are retried (`rlgate.retry`).
        timeouts: each call's default deadline.
    """

    api_key: str | None = field(
        default=None, metadata=_meta("API key of the orchestrator (sent as a Bearer token)", ENV_API_KEY, secret=True)
    )
    tls: bool = field(default=False, metadata=_meta("Dial with TLS (the system roots unless root_certificates)"))
    root_certificates: bytes | None = field(
        default=None,
        metadata=_meta("PEM root certificates for TLS; the variable names a PEM file and turns TLS on", ENV_ROOT_CERTS),
    )
    tls_server_name: str | None = field(
        default=None, metadata=_meta("Server name the certificate is checked against, when not the address's")
    )
    gateway_addresses: tuple[str, ...] = field(
        default=(),
        metadata=_meta(
            "Toolgateway addresses (`host:port,...`) serving every gateway call instead of the one Reset returns",
            ENV_GATEWAY,
        ),
    )
    keepalive_time_s: float = field(default=30.0, metadata=_meta("Seconds between HTTP/2 keepalive pings"))
    keepalive_timeout_s: float = field(
        default=10.0, metadata=_meta("Seconds a keepalive ping may go unanswered before the connection is dropped")
    )
    max_send_message_bytes: int = field(default=16 * 1024 * 1024, metadata=_meta("Largest message a client sends"))
    max_receive_message_bytes: int = field(default=64 * 1024 * 1024, metadata=_meta("Largest message a client accepts"))
    retry: RetryPolicy = field(
        default_factory=RetryPolicy, metadata=_meta("Retry policy of every call (`rlgate.RetryPolicy`)")
    )
    timeouts: Timeouts = field(
        default_factory=Timeouts, metadata=_meta("Default deadline of each call, in seconds (`rlgate.Timeouts`)")
    )

    @classmethod
    def from_env(
        cls,
        *,
        api_key: str | None = None,
        tls: bool | None = None,
        root_certificates: bytes | None = None,
        tls_server_name: str | None = None,
        gateway_addresses: str | Iterable[str] | None = None,
        keepalive_time_s: float | None = None,
        keepalive_timeout_s: float | None = None,
        max_send_message_bytes: int | None = None,
        max_receive_message_bytes: int | None = None,
        retry: RetryPolicy | None = None,
        timeouts: Timeouts | None = None,
    ) -> ClientSettings:
        """Settings from RLGATE_API_KEY, RLGATE_GATEWAY and RLGATE_TLS_ROOT_CERTS (a PEM file path).

        Each argument that is not None overrides what the environment says (a trainer's flag beats the
        variable).

        Args:
            api_key: see the class.
            tls: see the class.
            root_certificates: see the class.
            tls_server_name: see the class.
            gateway_addresses: see the class; a comma-separated string or an iterable.
            keepalive_time_s: see the class.
            keepalive_timeout_s: see the class.
            max_send_message_bytes: see the class.
            max_receive_message_bytes: see the class.
            retry: see the class.
            timeouts: see the class.
        """
        values: dict[str, Any] = {}
        if read_env(ENV_API_KEY):
            values["api_key"] = read_env(ENV_API_KEY)
        gateways = read_env(ENV_GATEWAY)
        if gateways:
            values["gateway_addresses"] = split_addresses(gateways)
        certs = read_env(ENV_ROOT_CERTS)
        if certs:
            try:
                with open(certs, "rb") as fh:
                    values["root_certificates"] = fh.read()
            except OSError as exc:
                raise ValueError(
                    f"{ENV_ROOT_CERTS}={certs!r} names no readable file ({exc.strerror or exc}): set it to the "
                    "path of a PEM file of root certificates, or unset it to use the system roots"
                ) from exc
            values["tls"] = True
        overrides = {
            "api_key": api_key,
            "tls": tls,
            "root_certificates": root_certificates,
            "tls_server_name": tls_server_name,
            "gateway_addresses": None if gateway_addresses is None else split_addresses(gateway_addresses),
            "keepalive_time_s": keepalive_time_s,
            "keepalive_timeout_s": keepalive_timeout_s,
            "max_send_message_bytes": max_send_message_bytes,
            "max_receive_message_bytes": max_receive_message_bytes,
            "retry": retry,
            "timeouts": timeouts,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def channel_options(self) -> list[tuple[str, Any]]:
        """The gRPC channel arguments every channel of a client is made with."""
        options: list[tuple[str, Any]] = [
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.max_send_message_length", self.max_send_message_bytes),
            ("grpc.max_receive_message_length", self.max_receive_message_bytes),
            # Our own retry loop decides (with request ids); gRPC's transparent retries stay on.
            ("grpc.enable_retries", 1),
            # A DNS name with several addresses (a Kubernetes headless Service) spreads calls over all pods.
            ("grpc.lb_policy_name", "round_robin"),
            # By default gRPC shares connections, and their reconnect backoff, between every channel of the
            # process to one address: a client made after a server restarted on that address would inherit
            # an old channel's "connection refused" for up to a second without trying to connect.
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return options

    def credentials(self) -> grpc.ChannelCredentials | None:
        """TLS channel credentials, or None for a plaintext channel (neither `tls` nor root certificates)."""
        if not self.tls and self.root_certificates is None:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.root_certificates)


OnVerifierError = Literal["raise", "zero"]


@dataclass(frozen=True)
class RunSettings:
    """What the code around a client reads from the environment: episodes, adapters, `rlgate rollout`, CLI.

    A value given in code (an adapter's extras, a CLI flag, a constructor argument) beats the variable.

    Args:
        orchestrator: the orchestrator's addresses, for the adapters and `rlgate rollout`.
        tool_timeout_s: seconds one tool call of `Episode.turn` may take (None: the client's call_tool
            deadline).
        on_verifier_error: what the SkyRL adapter does when the verifier gives no score.
        training_run_id: the run id the adapters tag their sessions with, for CloseSessions.
        openai_api_key: the key the `openai` policy sends.
        debug: the CLI shows a traceback instead of a one-line error.
    """

    orchestrator: str = field(
        default="",
        metadata=_meta(
            "Orchestrator addresses (`host:port,...`) of the adapters and `rlgate rollout`", ENV_ORCHESTRATOR
        ),
    )
    tool_timeout_s: float | None = field(
        default=None,
        metadata=_meta(
            "Seconds one tool call of `Episode.turn` may take before the model sees an error "
            "(unset: the client's `Timeouts.call_tool`)",
            ENV_TOOL_TIMEOUT,
        ),
    )
    on_verifier_error: OnVerifierError = field(
        default="raise",
        metadata=_meta(
            "SkyRL adapter, when the verifier gives no score: `raise` (VerifierError) or `zero` (reward 0)",
            ENV_ON_VERIFIER_ERROR,
        ),
    )
    training_run_id: str = field(
        default="",
        metadata=_meta("Run id the adapters tag their sessions with (for CloseSessions after a crash)", ENV_RUN_ID),
    )
    openai_api_key: str | None = field(
        default=None, metadata=_meta("Key the `openai` policy sends", ENV_OPENAI_API_KEY, secret=True)
    )
    debug: bool = field(
        default=False,
        metadata=_meta("Any value: the CLI shows a traceback instead of a one-line error", ENV_DEBUG),
    )

    def __post_init__(self) -> None:
        if self.on_verifier_error not in ("raise", "zero"):
            raise ValueError(f"on_verifier_error must be 'raise' or 'zero', not {self.on_verifier_error!r}")

    @classmethod
    def from_env(cls) -> RunSettings:
        """The settings the environment's variables give (an unset or empty variable: the default).

        Raises:
            ValueError: a variable's value is not one its setting takes, naming the variable.
        """
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = read_env(f.metadata["env"])
            if raw is not None:
                values[f.name] = _PARSE.get(f.name, str)(raw)
        return cls(**values)


def _verifier_mode(raw: str) -> str:
    if raw not in ("raise", "zero"):
        raise ValueError(f"${ENV_ON_VERIFIER_ERROR} must be 'raise' or 'zero', not {raw!r}")
    return raw


_PARSE: dict[str, Callable[[str], Any]] = {
    "tool_timeout_s": lambda raw: _seconds(raw, f"${ENV_TOOL_TIMEOUT}"),
    "on_verifier_error": _verifier_mode,
    "debug": bool,  # any value but empty turns it on
}


def _documented() -> set[str]:
    return {f.metadata["env"] for cls in (ClientSettings, RunSettings) for f in dataclasses.fields(cls)} - {None}


def read_env(variable: str) -> str | None:
    """The value of a client-side environment variable (None when unset or empty): the one place they are read.

    Args:
        variable: a variable some field of `ClientSettings` or `RunSettings` names (and so the settings
            table documents); any other is a ValueError, so no undocumented variable is read.
    """
    if variable not in _documented():
        raise ValueError(f"{variable} is not a client setting: add it to rlgate.settings (and so to docs/client.md)")
    return os.environ.get(variable) or None


def tool_timeout_setting(value: float | str | None = None) -> float | None:
    """The per-tool-call timeout in seconds: `value`, else $RLGATE_TOOL_TIMEOUT_S, else None.

    None: the client's call_tool timeout applies. Strings are read as numbers (adapters' settings come from
    dataset rows and the environment). Only this variable is read: another setting's bad value does not
    stop an episode.

    Args:
        value: the timeout given in code, or None (or "") for the variable's.

    Raises:
        ValueError: for anything but a positive finite number.
    """
    if value in (None, ""):
        raw = read_env(ENV_TOOL_TIMEOUT)
        return None if raw is None else _PARSE["tool_timeout_s"](raw)
    return _seconds(
        value, f"tool timeout tool_timeout_s (None: ${ENV_TOOL_TIMEOUT}, else the client's Timeouts.call_tool)"
    )
