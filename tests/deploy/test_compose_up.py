"""`docker compose up` for real: the image is built from deploy/Dockerfile, the default stack of
docker-compose.yml comes up healthy under a project name of its own, a reference rollout from this host
scores 1.0 on every task with no error and no session left open, the `scale` profile comes up healthy with
two replicas of each plane over Redis and serves a rollout through both orchestrators, and
`docker-compose down -v` leaves no container, network or volume of the project behind.

Images: `python:3.11-slim` and `redis:7-alpine` are used when present or pullable within a few seconds;
otherwise (no reachable container registry, as on rlgate's build machines) the stand-ins are built from
Debian's packages and kept between runs: `rlgate-python-base:3.11` (deploy/base-image/build-python-base.sh,
debootstrap) and `rlgate-redis:7` (deploy/redis/Dockerfile). RLGATE_PYTHON_IMAGE / RLGATE_REDIS_IMAGE in the
environment choose them explicitly. The rlgate image is tagged `rlgate:compose-test` and kept, so a run
whose pins did not change reuses the dependency layer.

The build trusts the CA certificates in /usr/local/share/ca-certificates/ (a TLS-intercepting proxy between
this host and the package index), or RLGATE_EXTRA_CA_CERTS when set, and pip in the build gets this host's
index settings (index-url, extra-index-url, trusted-host, timeout from pip's environment and config; local
`file:` indexes are left out, a container cannot read them).

Published ports are free ports chosen here, so a run never collides with `make up` or another run. Needs
docker, docker-compose and a running dockerd (.ci/run installs and starts them): skipped without them,
failed under CI=true. See docs/deploy.md for its time."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.cli_contract import REPO
from tests.support.ports import IN_CI, free_port, require_binary
from tests.support.wait import wait_until_sync

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

COMPOSE_FILE = REPO / "docker-compose.yml"
PYTHON_UPSTREAM, PYTHON_LOCAL = "python:3.11-slim", "rlgate-python-base:3.11"
REDIS_UPSTREAM, REDIS_LOCAL = "redis:7-alpine", "rlgate-redis:7"
RLGATE_IMAGE = "rlgate:compose-test"
HOST_CA_DIR = Path("/usr/local/share/ca-certificates")
SCALE_SERVICES = ["redis", "orchestrator-1", "orchestrator-2", "toolgateway-1", "toolgateway-2"]
PULL_TIMEOUT_S = 20
HEALTH_TIMEOUT_S = 180


def unavailable(message: str) -> None:
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


def run(
    argv: list[str],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        output = f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
        raise AssertionError(f"{shlex.join(argv)} exited {done.returncode}:\n{output}")
    return done


def image_present(name: str) -> bool:
    return run(["docker", "image", "inspect", name], timeout=60, check=False).returncode == 0


def image_id(name: str) -> str:
    return run(["docker", "image", "inspect", "-f", "{{.Id}}", name], timeout=60, check=False).stdout.strip()


def pullable(name: str) -> bool:
    """A registry that answers within PULL_TIMEOUT_S: a host without one fails at once or hangs."""
    try:
        return run(["docker", "pull", "-q", name], timeout=PULL_TIMEOUT_S, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def extra_ca_certs() -> str:
    if os.environ.get("RLGATE_EXTRA_CA_CERTS"):
        return os.environ["RLGATE_EXTRA_CA_CERTS"]
    if not HOST_CA_DIR.is_dir():
        return ""
    return "".join(p.read_text() for p in sorted(HOST_CA_DIR.rglob("*.crt")))


def pip_settings() -> dict[str, str]:
    """This host's pip index settings as PIP_* variables for the build (empty: pip's defaults)."""
    wanted = {"index-url": "PIP_INDEX_URL", "extra-index-url": "PIP_EXTRA_INDEX_URL",
              "trusted-host": "PIP_TRUSTED_HOST", "timeout": "PIP_DEFAULT_TIMEOUT",
              "default-timeout": "PIP_DEFAULT_TIMEOUT"}  # fmt: skip
    found: dict[str, str] = {}
    listed = run([sys.executable, "-m", "pip", "config", "list"], timeout=60, check=False).stdout
    # Files first, then the environment (pip's own precedence: PIP_* variables win).
    lines = sorted(listed.splitlines(), key=lambda line: line.startswith(":env:"))
    for line in lines:
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name in wanted:
            found[wanted[name]] = value.strip().strip("'\"")
    for name in set(wanted.values()):
        if os.environ.get(name):
            found[name] = os.environ[name]
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        urls = [u for u in found.get(name, "").split() if not u.startswith("file:")]
        found[name] = " ".join(urls)
    return {name: found.get(name, "") for name in set(wanted.values())}


@dataclass
class Project:
    name: str
    env: dict[str, str]
    ports: dict[str, int]
    profiles: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def compose(
        self,
        *args: str,
        timeout: float = 300,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        argv = ["docker-compose", "-f", str(COMPOSE_FILE), "-p", self.name, "--ansi", "never",
                *[a for p in self.profiles for a in ("--profile", p)], *args]  # fmt: skip
        started = time.monotonic()
        done = run(argv, timeout=timeout, env=self.env, check=check)
        if args[0] != "ps":
            self.log.append(f"{time.monotonic() - started:6.1f}s  docker-compose {' '.join(args)}")
        return done

    def docker_ids(self, kind: str) -> list[str]:
        listing = {"container": ["ps", "-a"], "network": ["network", "ls"], "volume": ["volume", "ls"]}[kind]
        done = run(["docker", *listing, "-q", "--filter", f"label=com.docker.compose.project={self.name}"], timeout=60)
        return done.stdout.split()

    def container_ids(self, *services: str) -> list[str]:
        return self.compose("ps", "-q", *services, timeout=120).stdout.split()

    def wait_healthy(self, services: list[str]) -> None:
        states: dict[str, str] = {}

        def healthy() -> bool:
            ids = self.container_ids(*services)
            if len(ids) != len(services):
                return False
            out = run(
                ["docker", "inspect", "-f", "{{.Name}} {{.State.Status}} {{.State.Health.Status}}", *ids],
                timeout=60,
            ).stdout
            states.clear()
            states.update(dict(line.split(" ", 1) for line in out.splitlines()))
            assert not any(s.startswith(("exited", "dead")) for s in states.values()), self.failure(states)
            return all(s == "running healthy" for s in states.values())

        wait_until_sync(
            healthy, HEALTH_TIMEOUT_S, f"{services} healthy", interval=2, explain=lambda: self.failure(states)
        )

    def failure(self, states: dict[str, str]) -> str:
        logs = self.compose("logs", "--no-color", "--tail", "40", timeout=120, check=False)
        return f"{states}\n{logs.stdout[-6000:]}"

    def rollout(self, orchestrators: str, tmp_path: Path) -> dict:
        summary_path, out_path = tmp_path / "summary.json", tmp_path / "traj.jsonl"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RLGATE_", "FLEET_"))}
        argv = [sys.executable, "-m", "rlgate.cli", "rollout", "--orchestrator", orchestrators, "--tasks", "all",
                # The image carries no browser (docs/deploy.md): screens are served by a derived image.
                "--modalities", "tool_use",
                "--concurrency", "8", "--policy", "reference", "--no-progress",
                "--summary-json", str(summary_path), "--out", str(out_path)]  # fmt: skip
        started = time.monotonic()
        done = run(argv, timeout=300, env=env, check=False)
        self.log.append(f"{time.monotonic() - started:6.1f}s  rlgate rollout --orchestrator {orchestrators}")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
        summary: dict[str, Any] = json.loads(summary_path.read_text())
        assert len(out_path.read_text().splitlines()) == summary["episodes"]
        return summary


def check_engine() -> None:
    for binary in ("docker", "docker-compose"):
        require_binary(binary)
    info = run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=60, check=False)
    if info.returncode != 0:
        unavailable(f"no docker engine answers (.ci/run starts dockerd): {info.stderr.strip()[-500:]}")


def python_image(log: list[str]) -> str:
    if os.environ.get("RLGATE_PYTHON_IMAGE"):
        return os.environ["RLGATE_PYTHON_IMAGE"]
    if image_present(PYTHON_UPSTREAM) or pullable(PYTHON_UPSTREAM):
        return PYTHON_UPSTREAM
    if not image_present(PYTHON_LOCAL):
        require_binary("debootstrap")
        started = time.monotonic()
        run(["bash", str(REPO / "deploy" / "base-image" / "build-python-base.sh"), PYTHON_LOCAL], timeout=900)
        log.append(f"{time.monotonic() - started:6.1f}s  build-python-base.sh")
    return PYTHON_LOCAL


def redis_image(base: str, ca_certs: str, log: list[str]) -> str:
    if os.environ.get("RLGATE_REDIS_IMAGE"):
        return os.environ["RLGATE_REDIS_IMAGE"]
    if image_present(REDIS_UPSTREAM) or pullable(REDIS_UPSTREAM):
        return REDIS_UPSTREAM
    if not image_present(REDIS_LOCAL):
        base = base if base != PYTHON_UPSTREAM else "debian:bookworm-slim"
        started = time.monotonic()
        run(["docker", "build", "--force-rm", "-q", "-f", "deploy/redis/Dockerfile", "-t", REDIS_LOCAL,
             "--build-arg", f"BASE_IMAGE={base}", "--build-arg", f"EXTRA_CA_CERTS={ca_certs}", "deploy/redis"],
            timeout=600)  # fmt: skip
        log.append(f"{time.monotonic() - started:6.1f}s  docker build deploy/redis")
    return REDIS_LOCAL


@pytest.fixture(scope="module")
def project() -> Iterator[Project]:
    check_engine()
    log: list[str] = []
    ca_certs = extra_ca_certs()
    base = python_image(log)
    redis = redis_image(base, ca_certs, log)
    ports = {name: free_port() for name in ("ORCHESTRATOR", "TOOLGATEWAY", "LOCALFLEET", "ORCHESTRATOR_1",
                                            "ORCHESTRATOR_2", "TOOLGATEWAY_1", "TOOLGATEWAY_2")}  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLGATE_", "FLEET_", "COMPOSE_", "PIP_"))}
    env.update({f"RLGATE_{name}_PORT": str(port) for name, port in ports.items()})
    env.update(pip_settings())
    env.update(
        RLGATE_IMAGE=RLGATE_IMAGE,
        RLGATE_PYTHON_IMAGE=base,
        RLGATE_REDIS_IMAGE=redis,
        RLGATE_EXTRA_CA_CERTS=ca_certs,
        RLGATE_GATEWAY_ADDRESS=f"127.0.0.1:{ports['TOOLGATEWAY']}",
    )
    proj = Project(name=f"rlgatetest{uuid.uuid4().hex[:10]}", env=env, ports=ports, log=log)

    previous = image_id(RLGATE_IMAGE)
    proj.compose("build", "--force-rm", "localfleet", timeout=1200)  # one image for every service
    current = image_id(RLGATE_IMAGE)
    assert current, f"the build did not tag {RLGATE_IMAGE}"
    if previous and previous != current:  # the superseded test image: no tag, nothing caches from it
        run(["docker", "image", "rm", previous], timeout=120, check=False)
    try:
        yield proj
    finally:
        proj.profiles = ["scale"]
        proj.compose("down", "-v", "--remove-orphans", "--timeout", "30", timeout=300, check=False)
        print("\n".join(["", f"compose project {proj.name}:", *proj.log]))


def test_default_stack_comes_up_healthy_and_scores_a_reference_rollout(project: Project, tmp_path: Path) -> None:
    project.compose("up", "-d", "--no-build", timeout=600)
    default = ["localfleet", "orchestrator", "toolgateway"]
    project.wait_healthy(default)
    for service in default:  # published on loopback only ("50051/tcp -> 127.0.0.1:PORT")
        (container,) = project.container_ids(service)
        lines = run(["docker", "port", container], timeout=60).stdout.splitlines()
        assert lines and all(line.split("->")[1].strip().startswith("127.0.0.1:") for line in lines), lines

    summary = project.rollout(f"127.0.0.1:{project.ports['ORCHESTRATOR']}", tmp_path)
    assert summary["episodes"] > 0 and summary["scored"] == summary["episodes"], summary
    assert summary["reward_mean"] == 1.0, summary
    assert summary["errors"] == 0 and summary["verifier_errors"] == 0, summary
    assert summary["sessions_left_open"] == 0, summary


def test_scale_profile_comes_up_healthy_over_redis(project: Project, tmp_path: Path) -> None:
    project.profiles = ["scale"]
    project.compose("up", "-d", "--no-build", *SCALE_SERVICES, timeout=600)
    project.wait_healthy(SCALE_SERVICES)
    orchestrators = ",".join(f"127.0.0.1:{project.ports[p]}" for p in ("ORCHESTRATOR_1", "ORCHESTRATOR_2"))
    summary = project.rollout(orchestrators, tmp_path)
    assert summary["reward_mean"] == 1.0 and summary["errors"] == 0 and summary["verifier_errors"] == 0, summary
    assert summary["sessions_left_open"] == 0, summary
    # The replicas keep their sessions in Redis, not in a file of their own.
    keys = project.compose("exec", "-T", "redis", "redis-cli", "dbsize", timeout=120).stdout.strip()
    assert int(keys) > 0, keys


def test_down_removes_every_container_network_and_volume(project: Project) -> None:
    project.profiles = ["scale"]
    ids = project.docker_ids("container")
    assert ids, "nothing of the project is running"
    mounts = run(
        ["docker", "inspect", "-f", "{{range .Mounts}}{{if .Name}}{{.Name}} {{end}}{{end}}", *ids], timeout=60
    ).stdout.split()
    assert mounts, "the services run with no volume"
    project.compose("down", "-v", "--remove-orphans", "--timeout", "30", timeout=300)
    assert project.docker_ids("container") == []
    assert project.docker_ids("network") == []
    assert project.docker_ids("volume") == []
    left = run(["docker", "volume", "ls", "-q"], timeout=60).stdout.split()
    assert not set(mounts) & set(left), f"volumes left (named or anonymous): {sorted(set(mounts) & set(left))}"
