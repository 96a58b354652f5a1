"""What the `rlgate` CLI accepts, read from the CLI itself, for checking deployment files against it.

Nothing here is hard-coded: commands and flags come from the click group, environment variables from each
service's config dataclass (`rlgate.runtime.config.env_vars`) and from the installed fleet-python SDK's
source (the `FLEET_*` variables it reads), so a setting added to a config is accepted at once and a
setting renamed or removed makes the deployment tests fail.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path
from typing import Any

import click

from rlgate.cli import cli
from rlgate.devtools import healthcheck
from rlgate.runtime.config import env_vars, from_env, split_host_port

REPO = Path(__file__).resolve().parents[2]
SERVICE_COMMANDS = ("orchestrator", "toolgateway", "localfleet")
_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def config_class(command: str) -> type:
    """The config dataclass behind `rlgate <command>`."""
    if command == "orchestrator":
        from rlgate.orchestrator.config import OrchestratorConfig

        return OrchestratorConfig
    if command == "toolgateway":
        from rlgate.toolgateway.config import GatewayConfig

        return GatewayConfig
    if command == "localfleet":
        from rlgate.localfleet.config import LocalfleetConfig

        return LocalfleetConfig
    raise KeyError(f"not a service command: {command!r}")


@functools.cache
def sdk_env_vars() -> frozenset[str]:
    """FLEET_* variables the installed fleet-python SDK reads (found in its source)."""
    spec = importlib.util.find_spec("fleet")  # located, not imported (its import is slow and noisy)
    assert spec is not None and spec.submodule_search_locations, "fleet-python is not installed"
    found: set[str] = set()
    pattern = re.compile(r"""(?:environ(?:\.get)?\(?\[?|getenv\()\s*["'](FLEET_[A-Z0-9_]+)["']""")
    for path in Path(next(iter(spec.submodule_search_locations))).rglob("*.py"):
        found.update(pattern.findall(path.read_text(errors="replace")))
    return frozenset(found)


def accepted_env(command: str) -> set[str]:
    """Every environment variable a container running `rlgate <command>` may set meaningfully."""
    return set(env_vars(config_class(command))) | set(sdk_env_vars()) | {healthcheck.TARGET_ENV}


def all_config_env() -> set[str]:
    """The union over the three services (for the image's ENV, shared by all of them)."""
    out: set[str] = {healthcheck.TARGET_ENV}
    for command in SERVICE_COMMANDS:
        out |= set(env_vars(config_class(command)))
    return out


def parse_command(argv: list[str]) -> click.Context:
    """Parse `rlgate ARGV` exactly as the CLI would, without running it. Raises click errors."""
    if not argv:
        raise click.UsageError("empty command")
    name, *rest = argv
    group_ctx = cli.make_context("rlgate", [name], resilient_parsing=True)
    command = cli.get_command(group_ctx, name)
    if command is None:
        raise click.UsageError(f"rlgate has no command {name!r}")
    return command.make_context(name, list(rest), parent=group_ctx)


def resolve(value: Any) -> str | None:
    """A compose-style value with `${VAR:-default}` replaced by its default; None when a variable has no
    default (its value is only known at deploy time)."""
    text = str(value)
    unresolved = False

    def sub(match: re.Match[str]) -> str:
        nonlocal unresolved
        if match.group(2) is None:
            unresolved = True
            return ""
        return match.group(2)

    out = _INTERPOLATION.sub(sub, text)
    return None if unresolved else out


def check_env(command: str, env: dict[str, Any]) -> Any:
    """Every variable is one `rlgate <command>` (or the SDK, or the health check) reads, and the values the
    file fixes parse into the service's config. Returns that config."""
    unknown = sorted(set(env) - accepted_env(command))
    assert not unknown, f"{command}: environment variables the CLI does not accept: {unknown}"
    values = {k: v for k, v in ((k, resolve(v)) for k, v in env.items()) if v is not None}
    try:
        return from_env(config_class(command), values)
    except (TypeError, ValueError) as exc:
        raise AssertionError(f"{command}: a value does not parse: {exc}") from exc


def listen_port(config: Any) -> int:
    return split_host_port(str(config.listen))[1]
