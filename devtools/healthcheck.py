"""Health-check entry point for containers and scripts.

    python -m rlgate.devtools.healthcheck HOST:PORT [--service NAME] [--timeout S]   # grpc.health.v1
    python -m rlgate.devtools.healthcheck http://HOST:PORT/health [--timeout S]      # localfleet (HTTP)
    python -m rlgate.devtools.healthcheck                                            # target from the environment

Exit status: 0 when the target reports SERVING (HTTP: 2xx), 1 when it answers anything else, 2 when it
cannot be reached in time. Without a target, `RLGATE_HEALTHCHECK_TARGET` is used, else the target is derived
from the service this container runs (PID 1's `rlgate <service>` command line and that service's config,
read from the environment like the service itself reads it), so one image `HEALTHCHECK` fits all three
commands. A check process is short-lived and alone: blocking I/O is fine here. It needs only the base
install (grpcio, protobuf): `rlgate healthcheck` also serves trainers probing a stack from a client-only
install.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from google.protobuf.message import Message

EXIT_SERVING = 0
EXIT_NOT_SERVING = 1
EXIT_UNREACHABLE = 2

TARGET_ENV = "RLGATE_HEALTHCHECK_TARGET"
_SERVICES = ("orchestrator", "toolgateway", "localfleet")


_HEALTH_CHECK = "/grpc.health.v1.Health/Check"
_SERVING_STATUS = ("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")


def _health_messages() -> tuple[type[Message], type[Message]]:
    """grpc.health.v1's HealthCheckRequest / HealthCheckResponse, built from their definition in the
    published health.proto. The generated stubs (grpcio-health-checking) belong to the server extra; the probe
    must work in a client-only install with grpcio and protobuf alone. A private pool keeps these apart from
    the stubs' own registration when both are loaded."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="rlgate/healthcheck_probe.proto", package="grpc.health.v1")
    file.syntax = "proto3"
    request = file.message_type.add(name="HealthCheckRequest")
    request.field.add(name="service", number=1, type=proto.TYPE_STRING, label=proto.LABEL_OPTIONAL)
    response = file.message_type.add(name="HealthCheckResponse")
    status = response.enum_type.add(name="ServingStatus")
    for number, name in enumerate(_SERVING_STATUS):
        status.value.add(name=name, number=number)
    response.field.add(
        name="status",
        number=1,
        type=proto.TYPE_ENUM,
        label=proto.LABEL_OPTIONAL,
        type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus",
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return (
        message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest")),
        message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse")),
    )


def check_grpc(target: str, service: str = "", timeout: float = 3.0) -> tuple[int, str]:
    """Ask grpc.health.v1 Check on a plaintext channel; (exit code, message)."""
    import grpc

    request_class, response_class = _health_messages()
    with grpc.insecure_channel(target) as channel:
        check = channel.unary_unary(
            _HEALTH_CHECK,
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        try:
            reply = check(request_class(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code()
            detail = f"{code.name}: {exc.details()}"
            if code == grpc.StatusCode.NOT_FOUND:  # the server answered: it does not know that service
                return EXIT_NOT_SERVING, detail
            return EXIT_UNREACHABLE, detail
    # The class is built at run time (no attributes known statically); an unset proto3 enum is 0.
    number = next((int(value) for field, value in reply.ListFields() if field.name == "status"), 0)
    status = _SERVING_STATUS[number] if 0 <= number < len(_SERVING_STATUS) else str(number)
    return (EXIT_SERVING if status == "SERVING" else EXIT_NOT_SERVING), status


def check_http(url: str, timeout: float = 3.0) -> tuple[int, str]:
    """GET the URL; 2xx is healthy."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return EXIT_SERVING, f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return EXIT_NOT_SERVING, f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return EXIT_UNREACHABLE, f"unreachable: {exc}"


def _local_target(listen: str) -> str:
    """The loopback address for a listen address (0.0.0.0 / [::] are not dialable)."""
    from rlgate.runtime.config import split_host_port

    host, port = split_host_port(listen)
    if host in {"", "0.0.0.0", "::"}:
        host = "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def target_for_command(argv: list[str], environ: dict[str, str]) -> str:
    """Health target of a `rlgate <service> ...` command line, given the environment it runs with."""
    from rlgate.runtime.config import from_env

    service = next((a for a in argv if a in _SERVICES), None)
    if service is None:
        raise ValueError(f"no rlgate service in command line {argv!r}")
    if service == "orchestrator":
        from rlgate.orchestrator.config import OrchestratorConfig

        cfg: object = from_env(OrchestratorConfig, environ)
    elif service == "toolgateway":
        from rlgate.toolgateway.config import GatewayConfig

        cfg = from_env(GatewayConfig, environ)
    else:
        from rlgate.localfleet.config import LocalfleetConfig

        cfg = from_env(LocalfleetConfig, environ)
    listen = _flag_value(argv, "--listen") or str(cfg.listen)  # type: ignore[attr-defined]
    address = _local_target(listen)
    return f"http://{address}/health" if service == "localfleet" else address


def default_target() -> str:
    """RLGATE_HEALTHCHECK_TARGET, else the target of the service PID 1 runs (the container's command)."""
    if os.environ.get(TARGET_ENV):
        return os.environ[TARGET_ENV]
    argv = Path("/proc/1/cmdline").read_bytes().decode(errors="replace").split("\0")
    return target_for_command([a for a in argv if a], dict(os.environ))


def run_check(target: str, service: str = "", timeout: float = 3.0) -> tuple[int, str]:
    if target.startswith(("http://", "https://")):
        return check_http(target, timeout)
    return check_grpc(target, service, timeout)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlgate healthcheck",
        description="Exit 0 when a gRPC server reports SERVING (grpc.health.v1) or an HTTP URL answers 2xx.",
    )
    parser.add_argument(
        "target",
        nargs="?",
        default="",
        help=f"HOST:PORT (gRPC) or http://HOST:PORT/health; default ${TARGET_ENV} or the service this container runs",
    )
    parser.add_argument("--service", default="", help="gRPC health service name ('' = the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds before giving up (default 3)")
    parser.add_argument("--quiet", "-q", action="store_true", help="print nothing")
    return parser


def healthcheck(target: str = "", service: str = "", timeout: float = 3.0, quiet: bool = False) -> int:
    """Run one check and report it; returns the exit status (see the module docstring)."""
    if timeout <= 0:
        print("--timeout must be positive", file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        target = target or default_target()
    except Exception as exc:  # any failure to find a target means "not healthy", never a traceback
        print(f"no health-check target: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    code, message = run_check(target, service, timeout)
    if not quiet:
        print(f"{target}: {message}", file=sys.stdout if code == EXIT_SERVING else sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return healthcheck(args.target, args.service, args.timeout, args.quiet)


if __name__ == "__main__":
    sys.exit(main())
