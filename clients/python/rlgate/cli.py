"""The `rlgate` command. Service commands import their packages lazily, so the client-only install
(`pip install rlgate`) keeps a working `rlgate --help` and `rlgate rollout`."""

from __future__ import annotations

from typing import Any

import click

from rlgate.rollout import rollout_command
from rlgate.runtime.config import click_options
from rlgate.settings import ENV_DEBUG, read_env


class _OneLineErrors(click.Group):
    """Every command ends with one line and an exit status, never a traceback: an exception a command did
    not turn into a click error is reported as `Error: <type>: <message>` (exit 1). RLGATE_DEBUG=1 keeps the
    traceback for debugging."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):  # click reports these itself
            raise
        except Exception as exc:
            if read_env(ENV_DEBUG):
                raise
            message = " ".join(str(exc).split()) or "(no message)"
            raise click.ClickException(f"{type(exc).__name__}: {message}") from exc


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="rlgate")
def cli() -> None:
    """rlgate: the network layer between RL trainers and task environments."""


def _service_commands() -> None:
    from rlgate.localfleet.config import LocalfleetConfig
    from rlgate.orchestrator.config import OrchestratorConfig
    from rlgate.toolgateway.config import GatewayConfig

    @cli.command("orchestrator")
    @click_options(OrchestratorConfig)
    def orchestrator(config: OrchestratorConfig) -> None:
        """Run the orchestration plane (Reset/Step/State/Close) as a gRPC server."""
        from rlgate.orchestrator.server import run

        run(config)

    @cli.command("toolgateway")
    @click_options(GatewayConfig)
    def toolgateway(config: GatewayConfig) -> None:
        """Run the agent plane (ListTools/CallTool over MCP) as a gRPC server."""
        from rlgate.toolgateway.server import run

        run(config)

    @cli.command("localfleet")
    @click_options(LocalfleetConfig)
    def localfleet(config: LocalfleetConfig) -> None:
        """Run localfleet, an offline Fleet the fleet-python SDK can drive (HTTP)."""
        from rlgate.localfleet.server import run

        run(config)

    from rlgate.devtools.stack import UpConfig

    @cli.command("up")
    @click_options(UpConfig)
    def up(config: UpConfig) -> None:
        """Run the stack locally on loopback: localfleet + orchestrator + toolgateway (embedded defaults), or with
        --mcp NAME=URL the orchestrator and toolgateway on your own MCP servers (no localfleet)."""
        from pathlib import Path

        from rlgate.devtools.stack import StackSettings, run_foreground

        if config.mcp:
            _check_mcp_setup(config.mcp, config.tasks)
        raise SystemExit(
            run_foreground(
                StackSettings(
                    data_dir=Path(config.data_dir),
                    localfleet_port=config.localfleet_port,
                    orchestrator_port=config.orchestrator_port,
                    gateway_port=config.gateway_port,
                    mcp_envs=config.mcp,
                    tasks_file=config.tasks,
                    gateway_workers=config.gateway_workers,
                )
            )
        )


def _check_mcp_setup(mcp: list[str], tasks_file: str) -> None:
    """`rlgate up --mcp`: the endpoints and the task file as the orchestrator will read them, checked before
    anything starts, each problem as one line."""
    import asyncio
    from pathlib import Path

    from rlgate.orchestrator.providers.base import ProviderError
    from rlgate.orchestrator.providers.mcp import McpProvider, parse_mcp_envs

    try:
        provider = McpProvider(parse_mcp_envs(mcp))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--mcp' / RLGATE_MCP_ENVS") from None
    if not tasks_file:
        return
    try:
        text = Path(tasks_file).read_text(encoding="utf-8")
        asyncio.run(provider.parse_task_file(text))
    except (OSError, ValueError, ProviderError) as exc:
        raise click.BadParameter(str(exc), param_hint="'--tasks' / RLGATE_TASKS_FILE") from None


_service_commands()
cli.add_command(rollout_command)


@cli.command("healthcheck")
@click.argument("target", required=False, default="")
@click.option("--service", default="", help="gRPC health service name ('' = the whole server)")
@click.option("--timeout", type=float, default=3.0, show_default=True, help="Seconds before giving up")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing")
def healthcheck(target: str, service: str, timeout: float, quiet: bool) -> None:
    """Exit 0 when TARGET (HOST:PORT, grpc.health.v1; or http://HOST:PORT/health) is serving.

    Without TARGET: $RLGATE_HEALTHCHECK_TARGET, else the service this container runs. Exit 1: not serving;
    2: unreachable."""
    from rlgate.devtools.healthcheck import healthcheck as run_healthcheck

    raise SystemExit(run_healthcheck(target, service, timeout, quiet))


@cli.command("version")
def version() -> None:
    """Print rlgate's version and the SQLite library the session store runs on (server extra only)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as distribution_version

    try:
        click.echo(f"rlgate {distribution_version('rlgate')}")
    except PackageNotFoundError:
        click.echo("rlgate (not installed as a distribution)")
    try:
        import apsw

        from rlgate.store.sqlite import MIN_SQLITE_VERSION, sqlite_library_version
    except ImportError:
        click.echo("session store: not installed (client-only install; the servers need pip install 'rlgate[server]')")
        return
    sqlite = sqlite_library_version()
    line = f"session store: SQLite {sqlite} (apsw {apsw.apswversion()})"
    if tuple(int(p) for p in sqlite.split(".")[:3] if p.isdigit()) < MIN_SQLITE_VERSION:
        line += f": TOO OLD, the store refuses to open before {'.'.join(map(str, MIN_SQLITE_VERSION))}"
    click.echo(line)


def main() -> None:
    """The `rlgate` console script."""
    cli()


if __name__ == "__main__":
    main()
