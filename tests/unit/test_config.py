"""Typed configuration: flags > env vars > defaults, secrets redacted."""

from __future__ import annotations

import click
from click.testing import CliRunner

from rlgate.orchestrator.config import OrchestratorConfig
from rlgate.runtime.config import click_options, env_vars, from_env, redacted, split_host_port


def test_from_env_parses_types() -> None:
    config = from_env(
        OrchestratorConfig,
        {
            "RLGATE_MAX_SESSIONS": "7",
            "RLGATE_INSECURE": "true",
            "RLGATE_API_KEYS": "a, b",
            "RLGATE_SESSION_TTL_S": "1.5",
        },
    )
    assert config.max_sessions == 7 and config.insecure is True
    assert config.api_keys == ["a", "b"] and config.session_ttl_s == 1.5
    assert from_env(OrchestratorConfig, {}).max_sessions == OrchestratorConfig().max_sessions


def test_flag_beats_env_beats_default() -> None:
    seen: list[OrchestratorConfig] = []

    @click.command()
    @click_options(OrchestratorConfig)
    def cmd(config: OrchestratorConfig) -> None:
        seen.append(config)

    runner = CliRunner()
    assert runner.invoke(cmd, [], env={"RLGATE_MAX_SESSIONS": "5"}).exit_code == 0
    assert runner.invoke(cmd, ["--max-sessions", "9"], env={"RLGATE_MAX_SESSIONS": "5"}).exit_code == 0
    assert runner.invoke(cmd, ["--api-keys", "k1,k2", "--insecure"]).exit_code == 0
    assert [c.max_sessions for c in seen] == [5, 9, OrchestratorConfig().max_sessions]
    assert seen[2].api_keys == ["k1", "k2"] and seen[2].insecure is True
    bad = runner.invoke(cmd, ["--max-sessions", "many"])
    assert bad.exit_code != 0 and "max-sessions" in bad.output


def test_secrets_are_redacted_in_logs_and_help() -> None:
    config = OrchestratorConfig(api_keys=["sekret"], fleet_api_key="fleet-sekret")
    shown = str(redacted(config))
    assert "sekret" not in shown and "***" in shown

    @click.command()
    @click_options(OrchestratorConfig)
    def cmd(config: OrchestratorConfig) -> None:
        pass

    assert "localfleet" not in CliRunner().invoke(cmd, ["--help"]).output.split("FLEET_API_KEY")[1][:40]


def test_env_var_map_and_addresses() -> None:
    assert env_vars(OrchestratorConfig)["RLGATE_ORCHESTRATOR_LISTEN"] == "listen"
    assert split_host_port("[::1]:50051") == ("::1", 50051)
    assert split_host_port("127.0.0.1:0") == ("127.0.0.1", 0)
