"""The local stack: localfleet + orchestrator + toolgateway as three processes on loopback — or, on your own
MCP servers (`rlgate up --mcp NAME=URL`), the orchestrator (mcp provider) and the toolgateway alone. With
`gateway_workers` N the toolgateway runs as N processes on N ports (one per core: it keeps no state outside
the store), and the orchestrator hands each session one of them.

One implementation serves `rlgate up` (foreground, until Ctrl-C), the end-to-end test fixture and the
benchmarks. Each service runs as `python -m rlgate.cli <service> ...` with its own log file under
`<data_dir>/logs/`, so tests can SIGKILL and restart one service, and scan what the servers wrote.
Shutdown order matters: the orchestrator first (it closes its sessions and deletes their instances while
localfleet is still up), then the gateway, then localfleet.

`rlgate up` (`run_foreground`) also supervises: a service that exits is restarted on its port and store after
a backoff (`Supervisor`), and one that exits too often stops the stack. Its children run in sessions of their
own (so a terminal's Ctrl-C reaches only `rlgate up`, which stops them in order) and die with it even on
`kill -9` (started through `rlgate.runtime.sandbox`, which sets the parent-death signal).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rlgate.core.backoff import Backoff
from rlgate.devtools.healthcheck import EXIT_SERVING, check_grpc, check_http
from rlgate.runtime.config import setting

SERVICES = ("localfleet", "toolgateway", "orchestrator")  # start order
_PORT_VARIABLES = {
    "localfleet": "RLGATE_LOCALFLEET_PORT",
    "orchestrator": "RLGATE_ORCHESTRATOR_PORT",
    "toolgateway": "RLGATE_TOOLGATEWAY_PORT",
}


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, chosen BELOW the kernel's ephemeral range: outgoing connections
    take their local ports from that range, so a port picked there can be taken before the server binds it."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randint(10_000, low - 1) if low > 10_500 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError("no free loopback port found")


@dataclass
class UpConfig:
    """`rlgate up`: its flags and environment variables (the port variables are docker-compose's too)."""

    data_dir: str = setting(".rlgate", "RLGATE_DATA_DIR", "Store, instance databases and logs")
    orchestrator_port: int = setting(50051, "RLGATE_ORCHESTRATOR_PORT", "Orchestrator port on loopback (0 = free)")
    gateway_port: int = setting(50052, "RLGATE_TOOLGATEWAY_PORT", "Toolgateway port on loopback (0 = free)")
    localfleet_port: int = setting(
        8765, "RLGATE_LOCALFLEET_PORT", "localfleet port on loopback (0 = free; localfleet does not run with --mcp)"
    )
    mcp: list[str] = setting(  # noqa: RUF009
        [],
        "RLGATE_MCP_ENVS",
        "Your own MCP servers instead of localfleet: NAME=URL[|URL...] (episodes by env key NAME; endpoint order "
        "is precedence on tool-name collisions)",
        flag="--mcp",
        repeatable=True,
    )
    tasks: str = setting(
        "",
        "RLGATE_TASKS_FILE",
        "Task file (JSON); with --mcp: tasks of those environments, their modality and tool filters",
        flag="--tasks",
    )
    gateway_workers: int = setting(
        1,
        "RLGATE_TOOLGATEWAY_WORKERS",
        "Toolgateway processes (one per core helps once sessions number in the hundreds), on ports from the "
        "toolgateway port up; each session is handed one of them",
    )


@dataclass
class StackSettings:
    data_dir: Path
    localfleet_port: int = 0  # 0 = pick a free port
    orchestrator_port: int = 0
    gateway_port: int = 0
    store_url: str = ""  # empty: SQLite under data_dir
    mcp_envs: list[str] = field(default_factory=list)  # NAME=URL|URL: the mcp provider, no localfleet
    tasks_file: str = ""
    env: dict[str, str] = field(default_factory=dict)  # extra environment for all three (RLGATE_*, FLEET_*)
    localfleet_args: list[str] = field(default_factory=list)
    orchestrator_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    gateway_workers: int = 1  # toolgateway processes, on gateway_port, gateway_port + 1, ... (or free ports)
    # Children SIGKILLed by the kernel when this process dies (`rlgate up`). Only for a stack started and
    # restarted from one thread: Linux signals the child when the thread that started it exits.
    die_with_parent: bool = False


def _gateway_names(workers: int) -> tuple[str, ...]:
    """The toolgateway processes' names: "toolgateway", then "toolgateway-2", "toolgateway-3", ..."""
    return ("toolgateway", *(f"toolgateway-{i}" for i in range(2, workers + 1)))


class LocalStack:
    """Starts, watches and stops the three services. Use as a context manager."""

    def __init__(self, settings: StackSettings) -> None:
        self.settings = settings
        s = settings
        s.data_dir = Path(s.data_dir).resolve()
        s.data_dir.mkdir(parents=True, exist_ok=True)
        (s.data_dir / "logs").mkdir(exist_ok=True)
        if s.gateway_workers < 1:
            raise ValueError(f"gateway_workers must be at least 1, not {s.gateway_workers}")
        self.gateways = _gateway_names(s.gateway_workers)
        # On your own MCP servers there is no instance platform to run.
        services = [n for n in SERVICES if n != "localfleet"] if s.mcp_envs else list(SERVICES)
        at = services.index("toolgateway")
        self.services = (*services[:at], *self.gateways, *services[at + 1 :])
        self.ports = {
            "localfleet": (s.localfleet_port or free_port()) if "localfleet" in self.services else 0,
            "orchestrator": s.orchestrator_port or free_port(),
            **{name: (s.gateway_port + i if s.gateway_port else free_port()) for i, name in enumerate(self.gateways)},
        }
        self.store_url = s.store_url or f"sqlite:///{s.data_dir / 'store.db'}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._started_once: set[str] = set()  # a restart keeps its port (clients hold the address)
        # Polled while a service starts: True ends the wait at once (`rlgate up` told to stop meanwhile).
        self.interrupted: Callable[[], bool] = lambda: False

    # -- addresses --------------------------------------------------------------------------------------
    @property
    def localfleet_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['localfleet']}"

    @property
    def orchestrator_address(self) -> str:
        return f"127.0.0.1:{self.ports['orchestrator']}"

    @property
    def gateway_address(self) -> str:
        return f"127.0.0.1:{self.ports['toolgateway']}"

    @property
    def gateway_addresses(self) -> list[str]:
        """Every toolgateway process's address (one unless `gateway_workers` > 1)."""
        return [f"127.0.0.1:{self.ports[name]}" for name in self.gateways]

    def port_variable(self, name: str) -> str:
        """The environment variable that moves `name`'s port."""
        return _PORT_VARIABLES["toolgateway" if name in self.gateways else name]

    def taken_ports(self) -> list[str]:
        """The chosen ports another process listens on now, each as a line naming it and its variable."""
        taken = []
        for name in self.services:
            port = self.ports[name]
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of an earlier run is no owner
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    taken.append(
                        f"port {port} ({name}) is in use on 127.0.0.1: set {self.port_variable(name)} to another "
                        "port (0 picks a free one), or stop what holds it"
                    )
        return taken

    def log_path(self, name: str) -> Path:
        return self.settings.data_dir / "logs" / f"{name}.log"

    # -- processes --------------------------------------------------------------------------------------
    def _command(self, name: str) -> list[str]:
        s = self.settings
        launcher = (
            ["-m", "rlgate.runtime.sandbox", json.dumps({"parent_pid": os.getpid()})] if s.die_with_parent else []
        )
        base = [sys.executable, *launcher, "-m", "rlgate.cli", "toolgateway" if name in self.gateways else name]
        if name in self.gateways:
            return [
                *base,
                "--listen",
                f"127.0.0.1:{self.ports[name]}",
                "--store-url",
                self.store_url,
                "--orchestrator-address",  # named to a caller that sends it orchestrator methods
                self.orchestrator_address,
                *s.gateway_args,
            ]
        if name == "localfleet":
            return [
                *base,
                "--listen",
                f"127.0.0.1:{self.ports[name]}",
                "--data-dir",
                str(s.data_dir / "localfleet"),
                *s.localfleet_args,
            ]
        provider = (
            ["--provider", "mcp", "--mcp-envs", ",".join(s.mcp_envs)]
            if s.mcp_envs
            else ["--fleet-base-url", self.localfleet_url]
        )
        tasks = ["--tasks-file", str(Path(s.tasks_file).resolve())] if s.tasks_file else []
        return [
            *base,
            "--listen",
            self.orchestrator_address,
            "--store-url",
            self.store_url,
            *provider,
            *tasks,
            "--gateway-address",
            ",".join(self.gateway_addresses),  # the orchestrator hands each session one of them
            *s.orchestrator_args,
        ]

    def _environ(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RLGATE_", "FLEET_"))}
        env.setdefault("FLEET_API_KEY", "localfleet")
        env.update(self.settings.env)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start_service(self, name: str, timeout: float = 60.0) -> None:
        """Start one service and wait until it is ready (`launch`, then `await_ready`)."""
        self.launch(name)
        self.await_ready(name, timeout)

    def launch(self, name: str) -> None:
        """Start one service's process, without waiting for it."""
        log = self.log_path(name).open("ab")
        try:
            self.procs[name] = subprocess.Popen(
                self._command(name),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._environ(),
                start_new_session=True,  # Ctrl-C in `rlgate up` reaches us; we stop children in order
            )
        finally:
            log.close()

    def await_ready(self, name: str, timeout: float = 60.0) -> None:
        """Wait until a launched service is ready. A port we picked that another process took meanwhile
        (bind failure) is replaced and the service launched again."""
        setting = "gateway_port" if name in self.gateways else f"{name}_port"
        picked = not getattr(self.settings, setting)
        for attempt in range(3):
            try:
                self.wait_ready(name, timeout)
                self._started_once.add(name)
                return
            except RuntimeError:
                lost_port = any(m in self.tail(name, 80).lower() for m in ("failed to bind", "address already in use"))
                if not (picked and lost_port and attempt < 2 and name not in self._started_once):
                    raise
                self.ports[name] = free_port()
                self.launch(name)

    def ready(self, name: str) -> bool:
        if name == "localfleet":
            return check_http(f"{self.localfleet_url}/health", timeout=2.0)[0] == EXIT_SERVING
        return check_grpc(f"127.0.0.1:{self.ports[name]}", timeout=2.0)[0] == EXIT_SERVING

    def wait_ready(self, name: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        proc = self.procs[name]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; log:\n{self.tail(name)}")
            if self.interrupted():
                raise InterruptedError(f"{name}: start interrupted")
            if self.ready(name):
                return
            time.sleep(0.1)
        raise TimeoutError(f"{name} not ready after {timeout}s; log:\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path(name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self, timeout: float = 60.0) -> LocalStack:
        """Start every service. localfleet boots while the toolgateways do (neither talks to the other); the
        orchestrator, which loads its task catalog from localfleet, starts once both are ready. Every process
        is launched from this thread (`die_with_parent` signals a child when the thread that started it ends)."""
        try:
            platform = "localfleet" in self.services
            if platform:
                self.launch("localfleet")
            for name in self.gateways:
                self.start_service(name, timeout)
            if platform:
                self.await_ready("localfleet", timeout)
            self.start_service("orchestrator", timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, name: str) -> None:
        """SIGKILL one service (crash tests)."""
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def restart(self, name: str, timeout: float = 60.0) -> None:
        self.kill(name)
        self.start_service(name, timeout)

    def stop_service(self, name: str, timeout: float = 30.0) -> int | None:
        proc = self.procs.get(name)
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        return proc.returncode

    def stop(self, timeout: float = 30.0) -> dict[str, int | None]:
        """SIGTERM in reverse start order (orchestrator first), SIGKILL after `timeout`."""
        return {name: self.stop_service(name, timeout) for name in reversed(self.services)}

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def banner(self) -> str:
        # `make up` does not put the virtualenv on PATH: name its scripts by path, as they can be typed here.
        bin_dir = Path(sys.executable).parent
        activated = os.environ.get("VIRTUAL_ENV") and Path(os.environ["VIRTUAL_ENV"]) == bin_dir.parent

        def command(name: str) -> str:
            if activated:
                return name
            path = bin_dir / name
            try:
                shown = str(path.relative_to(Path.cwd()))
            except ValueError:
                shown = str(path)
            return shlex.quote(shown)

        grpcurl = command("grpcurl") if (bin_dir / "grpcurl").exists() else "grpcurl"
        if self.settings.mcp_envs:
            platform = [
                f"  mcp           {env}   (your MCP server; Reset by env key)" for env in self.settings.mcp_envs
            ]
        else:
            platform = [f"  localfleet    {self.localfleet_url}   (Fleet API; FLEET_BASE_URL)"]
        lines = [
            "rlgate local stack is up",
            *platform,
            f"  orchestrator  {self.orchestrator_address}   (Reset/Step/State/Close)",
            f"  toolgateway   {', '.join(self.gateway_addresses)}   (ListTools/CallTool, agent token)",
            f"  store         {self.store_url}",
            f"  logs          {self.settings.data_dir / 'logs'}",
            "try (in another terminal, in this directory):",
        ]
        if not self.settings.mcp_envs or self.settings.tasks_file:
            lines.append(
                f"  {command('rlgate')} rollout --orchestrator {self.orchestrator_address} --tasks all --episodes 2"
                "   (--episodes counts per task: 2 episodes of each)"
            )
        lines += [
            f"  {grpcurl} -plaintext {self.orchestrator_address} list",
            f"  {grpcurl} -plaintext -d '{{\"page_size\": 3}}' {self.orchestrator_address} "
            "rlgate.v1.OrchestratorService/ListTasks",
        ]
        if grpcurl == "grpcurl":
            lines.append("  (grpcurl: any build on PATH; `make up` installs grpcurl 1.8.6 as .venv/bin/grpcurl)")
        if not activated:
            lines.append(f"  (or `source {command('activate')}` first, then plain `rlgate ...`)")
        lines.append(
            "Ctrl-C stops everything (sessions are closed"
            + ("; your MCP servers keep running)." if self.settings.mcp_envs else ", instances deleted).")
        )
        return "\n".join(lines)


class Supervisor:
    """Restarts a stack's services that exit, on their ports and store, after a backoff; a service that
    exits more than `budget` times within `window_s` is failing for good and ends the stack."""

    def __init__(
        self,
        stack: LocalStack,
        *,
        backoff: Backoff | None = None,
        budget: int = 5,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stack = stack
        self.backoff = backoff or Backoff(0.5, 10.0)
        self.budget = budget
        self.window_s = window_s
        self.clock = clock
        self.exits: dict[str, list[float]] = {}

    def exited(self) -> list[str]:
        """The services whose process has exited."""
        return [name for name, proc in self.stack.procs.items() if proc.poll() is not None]

    def restart_delay(self, name: str) -> float | None:
        """Record an exit of `name`: the delay before its restart, or None once its budget is spent."""
        now = self.clock()
        recent = [t for t in self.exits.get(name, []) if now - t < self.window_s] + [now]
        self.exits[name] = recent
        if len(recent) > self.budget:
            return None
        return self.backoff.delay(len(recent) - 1)


class _Output:
    """`rlgate up`'s stdout and stderr: a write to a reader that is gone (a dead `| tee`, a closed terminal)
    is dropped rather than raised, so it can never keep the stack from stopping; and a stdout pipe whose
    reader went away is noticed (`reader_gone`) as a reason to stop."""

    def __init__(self) -> None:
        self.broken: set[int] = set()  # 1: stdout, 2: stderr

    def say(self, text: str, *, error: bool = False) -> None:
        stream = sys.stderr if error else sys.stdout
        which = 2 if error else 1
        if which in self.broken:
            return
        try:
            print(text, file=stream, flush=True)
        except OSError:  # BrokenPipeError, or EIO from a hung-up terminal
            self._drop(which)

    def _drop(self, which: int) -> None:
        """Point the stream at /dev/null, so neither we nor the interpreter's flush at exit write there again."""
        self.broken.add(which)
        devnull = os.open(os.devnull, os.O_WRONLY)
        with contextlib.suppress(OSError, ValueError):
            os.dup2(devnull, (sys.stdout if which == 1 else sys.stderr).fileno())
        os.close(devnull)

    def reader_gone(self) -> bool:
        """stdout is a pipe whose reading end is closed (POLLERR on the writing end)."""
        if 1 in self.broken:
            return True
        try:
            fd = sys.stdout.fileno()
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                return False
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            gone = any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0))
        except (OSError, ValueError):
            return False
        if gone:
            self._drop(1)
        return gone


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run_foreground(settings: StackSettings) -> int:
    """`rlgate up`: start, print the banner, supervise (a service that exits is restarted) until Ctrl-C,
    SIGTERM, SIGHUP, the output's reader going away or a service failing for good; then stop in order."""
    settings.die_with_parent = True
    out = _Output()
    stack = LocalStack(settings)
    taken = stack.taken_ports()
    if taken:
        out.say("rlgate up: cannot start:\n" + "\n".join(f"  {line}" for line in taken), error=True)
        return 2
    stopping: list[int] = []

    def _stop(signum: int, _frame: object) -> None:
        stopping.append(signum)

    previous = {sig: signal.signal(sig, _stop) for sig in STOP_SIGNALS}
    stack.interrupted = lambda: bool(stopping)
    code = 0
    try:
        try:
            stack.start()
        except InterruptedError:
            return 0
        except (RuntimeError, TimeoutError, OSError) as exc:
            out.say(f"rlgate up failed: {exc}", error=True)
            return 1
        if stopping:
            return 0
        out.say(stack.banner())
        code = _supervise(stack, Supervisor(stack), out, stopping)
    finally:
        out.say("stopping...")
        stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


def _supervise(stack: LocalStack, supervisor: Supervisor, out: _Output, stopping: list[int]) -> int:
    """Watch the services until a stop is asked; restart the ones that exit. 1 if one failed for good."""
    while not stopping and not out.reader_gone():
        for name in supervisor.exited():
            returncode = stack.procs[name].returncode
            delay = supervisor.restart_delay(name)
            if delay is None:
                out.say(
                    f"{name} exited with {returncode} {supervisor.budget + 1} times within "
                    f"{supervisor.window_s:.0f}s; stopping. Log:\n{stack.tail(name)}",
                    error=True,
                )
                return 1
            out.say(f"{name} exited with {returncode}; restarting in {delay:.1f}s", error=True)
            end = time.monotonic() + delay
            while not stopping and time.monotonic() < end:
                time.sleep(0.1)
            if stopping:
                return 0
            try:
                stack.start_service(name)
            except InterruptedError:
                return 0
            except (RuntimeError, TimeoutError) as exc:
                out.say(f"{name} did not come back: {str(exc).splitlines()[0].removesuffix('; log:')}", error=True)
                continue  # its exit is seen on the next pass and counts against its budget
            out.say(f"{name} restarted on port {stack.ports[name]}")
        time.sleep(0.5)
    return 0
