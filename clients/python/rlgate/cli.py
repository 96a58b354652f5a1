"""The `rlgate` command. Service commands import their packages lazily, so the client-only install
(`pip install rlgate`) keeps a working `rlgate --help` and `rlgate rollout`."""

from __future__ import annotations

import click

from rlgate.runtime.config import click_options


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
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


_service_commands()


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
