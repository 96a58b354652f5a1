"""What the reliability suite shares: stacks it audits, localfleet's admin API, raw stubs, episodes.

Every stack the suite starts goes through `start_stack`, which gives it distinctive secrets (an API key on
the orchestrator, a FLEET_API_KEY) and Prometheus side ports, and registers its log files, its metrics
scrapes and every agent token it hands out with the session's `Audit`, so the security module can assert
that no secret ever reached a log line, a metric or an error message.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlgate.devtools.stack import LocalStack, StackSettings, free_port
from rlgate.v1 import orchestrator_pb2_grpc, toolgateway_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
BUNDLED_TASKS = REPO / "services" / "localfleet" / "tasks"

# One set of secrets per test session, long and random so a prefix match is meaningful.
API_KEY = "rlk-" + secrets.token_urlsafe(30)
FLEET_API_KEY = "flk-" + secrets.token_urlsafe(30)
ERAS = {"modern": "mailbox", "legacy": "tracker"}  # MCP era -> localfleet environment speaking it

# Extra tasks whose verifiers misbehave (localfleet serves them with the bundled ones).
FAULTY_VERIFIERS = {
    "raises": "def verify(env, final_answer=None):\n    raise RuntimeError('verifier exploded on purpose')\n",
    "hangs": "def verify(env, final_answer=None):\n    import time\n    time.sleep(3600)\n    return 1.0\n",
}


def faulty_task_key(env_id: str, kind: str) -> str:
    return f"rel-{env_id}-verifier-{kind}"


def write_tasks_dir(directory: Path) -> Path:
    """The bundled task files plus tasks with raising and hanging verifiers for both eras."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in BUNDLED_TASKS.glob("*.json"):
        shutil.copy(path, directory / path.name)
    extra = [
        {
            "key": faulty_task_key(env_id, kind),
            "prompt": f"Reliability task ({kind} verifier).",
            "env_id": env_id,
            "version": "v1",
            "task_modality": "tool_use",
            "verifier_code": code,
            "metadata": {"reference_solution": {"tool_calls": [], "final_answer": "done"}},
        }
        for env_id in ERAS.values()
        for kind, code in FAULTY_VERIFIERS.items()
    ]
    (directory / "zz_reliability.json").write_text(json.dumps({"tasks": extra}))
    return directory


# ---------------------------------------------------------------------------------------------------------
# Audit: what the servers wrote and what they told us, for the secret scan.


@dataclass
class Audit:
    secrets: set[str] = field(default_factory=lambda: {API_KEY, FLEET_API_KEY})
    log_files: list[Path] = field(default_factory=list)
    texts: list[tuple[str, str]] = field(default_factory=list)  # (where, text): metrics scrapes, error details
    labels: dict[str, str] = field(default_factory=dict)  # secret -> what it is, when not an agent token

    def secret(self, value: str, label: str) -> None:
        """Another secret to look for (e.g. the parts of a key split by a stray byte), under `label`."""
        self.secrets.add(value)
        self.labels[value] = label

    def token(self, token: str) -> str:
        """Remember an agent token's secret: `rlg1.<session_id>.<secret>` names its session, which is no
        secret and appears in logs by design; the secret after the last dot is what must never appear."""
        if token:
            self.secrets.add(token.rpartition(".")[2] or token)
        return token

    def error(self, where: str, err: grpc.RpcError | BaseException) -> None:
        detail = err.details() if isinstance(err, grpc.RpcError) else str(err)
        self.texts.append((where, detail or ""))
        if isinstance(err, grpc.RpcError):
            # Items are (key, value) pairs: grpc's namedtuples, or grpc.aio's tuples. The stubs' item type
            # (_Metadatum) has the attributes but is no tuple.
            trailers: Iterable[tuple[str, str | bytes]] = err.trailing_metadata() or ()  # type: ignore[assignment]
            for key, value in trailers:
                self.texts.append((f"{where} trailer {key}", value if isinstance(value, str) else repr(value)))

    def add_stack(self, stack: LocalStack) -> None:
        self.log_files.extend(stack.log_path(name) for name in ("localfleet", "orchestrator", "toolgateway"))

    def leaks(self) -> list[str]:
        """'<where>: <secret kind>' for every secret (or its first 16 characters) found anywhere.

        Secrets are [A-Za-z0-9_-] strings; every 16-character window of every such run in the text is
        looked up in a set, so thousands of agent tokens scan megabytes of logs quickly."""
        prefixes = {s[:PREFIX]: s for s in self.secrets if len(s) >= PREFIX}
        found: list[str] = []

        def scan(where: str, text: str) -> None:
            for run in _SECRET_CHARS.finditer(text):
                word = run.group()
                for i in range(len(word) - PREFIX + 1):
                    secret = prefixes.get(word[i : i + PREFIX])
                    if secret is not None:
                        found.append(f"{where}: {self.labels.get(secret) or _kind(secret)} {secret[:4]}…")

        for path in self.log_files:
            try:
                scan(str(path), path.read_text(errors="replace"))
            except OSError:
                continue
        for where, text in self.texts:
            scan(where, text)
        return found

    def forged_lines(self, prefix: str) -> list[str]:
        """'<file>:<line number>: <line>' for every log line that starts with `prefix`: a message that smuggled
        a line break followed by text shaped like a log line. Lines are split as Python's str.splitlines
        does (every Unicode line break, NEL and the separators included), not only at newlines."""
        found = []
        for path in self.log_files:
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            for number, line in enumerate(text.splitlines(), 1):
                if line.startswith(prefix):
                    found.append(f"{path}:{number}: {line[:160]!r}")
        return found


PREFIX = 16
_SECRET_CHARS = re.compile(rf"[A-Za-z0-9_-]{{{PREFIX},}}")


def _kind(secret: str) -> str:
    if secret == API_KEY:
        return "API key"
    if secret == FLEET_API_KEY:
        return "FLEET_API_KEY"
    return "agent token"


# ---------------------------------------------------------------------------------------------------------
# Stacks


def start_stack(
    data_dir: Path,
    audit: Audit,
    *,
    store_url: str = "",
    api_keys: bool = True,
    orchestrator_args: Sequence[str] = (),
    gateway_args: Sequence[str] = (),
    localfleet_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> AuditedStack:
    """A LocalStack with the suite's secrets, metrics side ports, faulty-verifier tasks, short timeouts."""
    metrics = {"orchestrator": free_port(), "toolgateway": free_port()}
    tasks = write_tasks_dir(data_dir / "tasks")
    orch = [
        "--metrics-listen",
        f"127.0.0.1:{metrics['orchestrator']}",
        "--run-id",
        f"rel-{secrets.token_hex(4)}",
        *(["--api-keys", API_KEY] if api_keys else []),
        *orchestrator_args,
    ]
    gw = ["--metrics-listen", f"127.0.0.1:{metrics['toolgateway']}", *gateway_args]
    settings = StackSettings(
        data_dir=data_dir,
        store_url=store_url,
        env={"FLEET_API_KEY": FLEET_API_KEY, **(env or {})},
        localfleet_args=["--tasks-dir", str(tasks), *localfleet_args],
        orchestrator_args=orch,
        gateway_args=gw,
    )
    stack = AuditedStack(settings, audit, metrics)
    audit.add_stack(stack)
    return stack.start()  # type: ignore[return-value]


class AuditedStack(LocalStack):
    def __init__(self, settings: StackSettings, audit: Audit, metrics_ports: dict[str, int]) -> None:
        super().__init__(settings)
        self.audit = audit
        self.metrics_ports = metrics_ports
        self.admin = FleetAdmin(self.localfleet_url)

    def metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {API_KEY}")]

    def scrape_metrics(self) -> dict[str, str]:
        """Each service's /metrics text (also kept for the secret scan)."""
        out: dict[str, str] = {}
        for name, port in self.metrics_ports.items():
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0).text
            except httpx.HTTPError:
                continue
            out[name] = text
            self.audit.texts.append((f"{name} /metrics", text))
        return out

    def healthy(self) -> dict[str, bool]:
        return {
            "orchestrator": grpc_health(self.orchestrator_address),
            "toolgateway": grpc_health(self.gateway_address),
            "localfleet": self.admin.healthy(),
        }

    def stop(self, timeout: float = 30.0) -> dict[str, int | None]:
        if any(p.poll() is None for p in self.procs.values()):
            self.scrape_metrics()
        try:
            return super().stop(timeout)
        finally:
            self.admin.close()


def grpc_health(address: str, timeout: float = 5.0) -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            # types-grpcio-health-checking gives HealthStub no methods.
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)  # type: ignore[attr-defined]
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


class FleetAdmin:
    """localfleet's test admin routes and instance list (loopback HTTP)."""

    def __init__(self, base_url: str) -> None:
        self._http = httpx.Client(base_url=base_url, timeout=10.0, headers={"authorization": f"Bearer {FLEET_API_KEY}"})

    def set_faults(self, faults: dict[str, Any]) -> None:
        self._http.post("/_admin/faults", json=faults).raise_for_status()

    def clear_faults(self) -> None:
        self.set_faults({})

    def counters(self) -> dict[str, Any]:
        r = self._http.get("/_admin/counters")
        r.raise_for_status()
        return dict(r.json())

    def env_counter(self, env_id: str, name: str) -> int:
        return int(self.counters().get("by_env", {}).get(env_id, {}).get(name, 0))

    def instances(self) -> list[dict[str, Any]]:
        """Live instances (pending or running)."""
        r = self._http.get("/v1/env/instances")
        r.raise_for_status()
        return [i for i in r.json() if i.get("status") in ("pending", "running")]

    def wait_instances(self, at_most: int = 0, timeout: float = 20.0) -> int:
        """Wait until at most `at_most` instances are live; return how many are left."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                left = len(self.instances())
            except httpx.HTTPError:
                left = -1
            if 0 <= left <= at_most or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def healthy(self) -> bool:
        try:
            return self._http.get("/health", timeout=3.0).status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        self._http.close()


# ---------------------------------------------------------------------------------------------------------
# Raw stubs (bad input, security) and a small async episode driver (faults, load)


def orchestrator_stub(
    address: str, credentials: grpc.ChannelCredentials | None = None, options: Sequence[tuple[str, Any]] = ()
) -> orchestrator_pb2_grpc.OrchestratorServiceStub:
    channel = (
        grpc.secure_channel(address, credentials, options=list(options))
        if credentials
        else grpc.insecure_channel(address, options=list(options))
    )
    return orchestrator_pb2_grpc.OrchestratorServiceStub(channel)


def gateway_stub(
    address: str, credentials: grpc.ChannelCredentials | None = None, options: Sequence[tuple[str, Any]] = ()
) -> toolgateway_pb2_grpc.ToolGatewayServiceStub:
    channel = (
        grpc.secure_channel(address, credentials, options=list(options))
        if credentials
        else grpc.insecure_channel(address, options=list(options))
    )
    return toolgateway_pb2_grpc.ToolGatewayServiceStub(channel)


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def reference_solution(task: Any) -> tuple[list[tuple[str, dict[str, Any]]], str | None]:
    """(tool calls, final answer) of a TaskInfo listed with ListTasks(include_reference_solution=True)."""
    from rlgate.core.convert import parse_json_object

    if not task.reference_solution_json:
        raise ValueError(f"task {task.key!r} was listed without its reference solution")
    solution = parse_json_object(task.reference_solution_json, "reference_solution_json")
    calls = [(c["name"], dict(c.get("arguments") or {})) for c in solution.get("tool_calls") or []]
    return calls, solution.get("final_answer")


def error_reason(err: grpc.RpcError) -> str:
    """The google.rpc.ErrorInfo reason a status carries ("" without one)."""
    from google.rpc import error_details_pb2

    from rlgate.errors import rich_status_of

    status = rich_status_of(err)
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):  # False for a detail of another type
            return str(info.reason)
    return ""


def percentile(values: Iterable[float], q: float) -> float:
    data = sorted(values)
    if not data:
        return 0.0
    k = max(0, min(len(data) - 1, round(q / 100 * (len(data) - 1))))
    return data[k]


def thirds_medians(values: Sequence[float]) -> tuple[float, float]:
    """(median of the first third, median of the last third)."""
    n = max(1, len(values) // 3)
    return statistics.median(values[:n]), statistics.median(values[-n:])


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")
