"""docker-compose.yml and deploy/Dockerfile against the CLI: every command, flag, port and variable in them
is one `rlgate` accepts, and `docker-compose config` validates the file, statically and in seconds; the
image is built and the stacks are started in test_compose_up.py (see docs/deploy.md)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from typing import Any

import pytest
import yaml

from tests.deploy.cli_contract import (
    REPO,
    SERVICE_COMMANDS,
    all_config_env,
    check_env,
    listen_port,
    parse_command,
    resolve,
)
from tests.support.ports import require_binary

COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "deploy" / "Dockerfile"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict) and data.get("services"), "docker-compose.yml has no services"
    return data


def rlgate_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Services that run the rlgate image (as opposed to redis)."""
    return {
        name: svc for name, svc in compose["services"].items() if str(svc.get("image", "")).startswith("${RLGATE_IMAGE")
    }


def in_profile(svc: dict[str, Any], profile: str | None) -> bool:
    return profile in svc.get("profiles", []) if profile else not svc.get("profiles")


def published(svc: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(host ip, host port, container port) of each `ports:` entry (short syntax), `${VAR:-default}` resolved
    to its default."""
    out = []
    for entry in svc.get("ports", []):
        match = re.fullmatch(r"(?P<ip>[^:]+):(?P<host>\d+):(?P<container>\d+)(/tcp)?", str(resolve(entry)))
        assert match, f"port {entry!r} must be IP:HOST:CONTAINER (published on an explicit address)"
        out.append((match["ip"], int(match["host"]), int(match["container"])))
    return out


def test_every_rlgate_service_runs_a_cli_command_with_accepted_settings(compose: dict[str, Any]) -> None:
    services = rlgate_services(compose)
    assert {svc["command"][0] for svc in services.values()} == set(SERVICE_COMMANDS)
    for name, svc in services.items():
        command = svc["command"]
        ctx = parse_command(command)  # unknown subcommand or flag -> click error
        assert ctx.command.name in SERVICE_COMMANDS, name
        config = check_env(command[0], svc.get("environment", {}))
        port = listen_port(config)
        assert str(config.listen).startswith("0.0.0.0:"), f"{name}: must listen on all interfaces in a container"
        ports = published(svc)
        assert ports, f"{name}: publishes no port"
        for ip, _host, container in ports:
            assert ip == "127.0.0.1", f"{name}: ports are published on loopback by default"
            assert container == port, f"{name}: publishes {container} but listens on {port}"


def test_health_checks_use_the_cli_and_the_listen_port(compose: dict[str, Any]) -> None:
    for name, svc in rlgate_services(compose).items():
        test = svc["healthcheck"]["test"]
        assert test[:3] == ["CMD", "rlgate", "healthcheck"], f"{name}: health check must be `rlgate healthcheck`"
        ctx = parse_command(test[2:])
        port = listen_port(check_env(svc["command"][0], svc.get("environment", {})))
        target = ctx.params["target"]
        if svc["command"][0] == "localfleet":
            assert target == f"http://127.0.0.1:{port}/health", name
        else:
            assert target == f"127.0.0.1:{port}", name


def test_default_stack_shares_one_sqlite_store_on_a_named_volume(compose: dict[str, Any]) -> None:
    default = {n: s for n, s in rlgate_services(compose).items() if in_profile(s, None)}
    assert sorted(s["command"][0] for s in default.values()) == sorted(SERVICE_COMMANDS)
    planes = [s for s in default.values() if s["command"][0] in ("orchestrator", "toolgateway")]
    urls = {check_env(s["command"][0], s["environment"]).store_url for s in planes}
    assert len(urls) == 1, f"orchestrator and gateway must share one store, got {urls}"
    url = urls.pop()
    assert url.startswith("sqlite:////"), url
    db_path = url[len("sqlite:///") :]
    for svc in planes:
        mounts = [str(v).split(":") for v in svc["volumes"]]
        assert any(
            src in compose["volumes"] and db_path.startswith(dst.rstrip("/") + "/") for src, dst, *_ in mounts
        ), f"{db_path} is not on a named volume in {svc['volumes']}"


def test_scale_profile_runs_two_replicas_of_each_plane_over_redis(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    assert redis.get("profiles") == ["scale"]
    args = redis["command"]
    assert args[args.index("--appendonly") + 1] == "yes", "redis must persist with append-only files"
    assert any(str(v).endswith(":/data") for v in redis["volumes"])
    scale = {n: s for n, s in rlgate_services(compose).items() if in_profile(s, "scale")}
    by_command: dict[str, list[Any]] = {}
    for svc in scale.values():
        by_command.setdefault(svc["command"][0], []).append(check_env(svc["command"][0], svc["environment"]))
    assert len(by_command.get("orchestrator", [])) == 2 and len(by_command.get("toolgateway", [])) == 2
    for configs in by_command.values():
        assert all(c.store_url.startswith("redis://redis:") for c in configs)
    orchestrators = by_command["orchestrator"]
    assert len({c.run_id for c in orchestrators}) == 1, "replicas share one run id (reconciled under a lease)"
    assert {c.shutdown_mode for c in orchestrators} == {"handoff"}, "a stopping replica must not close the run"
    host_ports = [p[1] for s in compose["services"].values() for p in published(s) if "ports" in s]
    assert len(host_ports) == len(set(host_ports)), "two services publish the same host port"
    gateway_hosts = {
        f"127.0.0.1:{p[1]}" for s in scale.values() if s["command"][0] == "toolgateway" for p in published(s)
    }
    assert {c.gateway_address for c in orchestrators} == gateway_hosts, "each gateway replica is handed out"


def test_orchestrator_listening_on_all_interfaces_is_authenticated_or_explicitly_insecure(
    compose: dict[str, Any],
) -> None:
    for name, svc in rlgate_services(compose).items():
        if svc["command"][0] != "orchestrator":
            continue
        config = check_env("orchestrator", svc["environment"])
        assert config.api_keys or config.insecure, f"{name} would refuse to start"


@pytest.mark.parametrize("profile", [None, "scale"])
def test_docker_compose_config_validates(profile: str | None) -> None:
    binary = require_binary("docker-compose")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLGATE_", "FLEET_", "COMPOSE_"))}
    argv = [binary, "-f", str(COMPOSE), *(["--profile", profile] if profile else []), "config", "-q"]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    # The resolved file starts what the profile promises.
    argv = [binary, "-f", str(COMPOSE), *(["--profile", profile] if profile else []), "config", "--services"]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    names = set(done.stdout.split())
    assert {"localfleet", "orchestrator", "toolgateway"} <= names
    if profile == "scale":
        assert {"redis", "orchestrator-1", "orchestrator-2", "toolgateway-1", "toolgateway-2"} <= names


# ---- the image ---------------------------------------------------------------------------------------
def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_dockerfile_is_one_slim_non_root_image_with_the_server_extra() -> None:
    ins = dockerfile_instructions()
    args = {k: v for k, v in (a.split("=", 1) for kw, a in ins if kw == "ARG" and "=" in a)}
    bases = [a.split()[0].replace("${PYTHON_IMAGE}", args.get("PYTHON_IMAGE", "")) for kw, a in ins if kw == "FROM"]
    assert bases and all(b == "python:3.11-slim" for b in bases), bases
    users = [a for kw, a in ins if kw == "USER"]
    assert users and users[-1].split(":")[0] not in {"0", "root"}, "the runtime stage must not run as root"
    runs = " ".join(a for kw, a in ins if kw == "RUN")
    assert re.search(r"pip install -c constraints\.txt '\.\[server\]'", runs), "installs only the server extra"
    assert not re.search(r"\[[^\]]*(dev|skyrl|tinker)", runs), "no trainer or dev extras in the image"
    entry = [a for kw, a in ins if kw == "ENTRYPOINT"]
    assert entry and yaml.safe_load(entry[-1]) == ["rlgate"]


def test_dockerfile_env_and_healthcheck_are_ones_the_cli_accepts() -> None:
    ins = dockerfile_instructions()
    env_names: set[str] = set()
    for kw, a in ins:
        if kw == "ENV":
            env_names |= {token.split("=", 1)[0] for token in shlex.split(a) if "=" in token}
    ours = {n for n in env_names if n.startswith(("RLGATE_", "FLEET_"))}
    assert ours, "the image configures the services through their environment variables"
    assert ours <= all_config_env(), f"unknown to the CLI: {sorted(ours - all_config_env())}"
    health = [a for kw, a in ins if kw == "HEALTHCHECK"]
    assert len(health) == 1
    cmd = yaml.safe_load(health[0].split("CMD", 1)[1].strip())
    assert cmd[:2] == ["rlgate", "healthcheck"]
    parse_command(cmd[1:])


def test_compose_values_resolve_only_through_documented_defaults(compose: dict[str, Any]) -> None:
    # Interpolations without a default would make `docker compose up` depend on the caller's shell.
    for name, svc in compose["services"].items():
        for key, value in (svc.get("environment") or {}).items():
            assert resolve(value) is not None, f"{name}.{key}: ${{VAR}} without a default"
