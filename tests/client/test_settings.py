"""Every client-side setting is read in rlgate.settings and documented by docs/client.md's generated table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import rlgate
from rlgate.settings import RunSettings, read_env, tool_timeout_setting
from rlgate.settingsdoc import TABLE_END, TABLE_START, render_table, with_table

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(rlgate.__file__).parent


def test_the_settings_table_in_docs_is_current() -> None:
    committed = (ROOT / "docs" / "client.md").read_text()
    assert committed == with_table(committed), "run: python -m rlgate.settingsdoc docs/client.md"
    between = committed[committed.index(TABLE_START) + len(TABLE_START) : committed.index(TABLE_END)]
    assert between == f"\n{render_table()}"


def test_only_rlgate_settings_reads_the_environment() -> None:
    readers = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if "v1" not in path.parts and re.search(r"os\.environ|os\.getenv", path.read_text())
    ]
    assert readers == ["settings.py"]


def test_every_variable_the_package_names_is_in_the_table() -> None:
    table = render_table()
    named = set()
    for path in PACKAGE.rglob("*.py"):
        if "compliance" not in path.parts:
            named |= set(re.findall(r'"((?:RLGATE|OPENAI)_[A-Z_]+)"', path.read_text()))
    # Not client settings: rollout's click option reads OPENAI_BASE_URL itself; the container probe's variable
    # is the services' (docs/deploy.md).
    assert {v for v in named if f"`{v}`" not in table} <= {"OPENAI_BASE_URL", "RLGATE_HEALTHCHECK_TARGET"}


def test_an_undocumented_variable_is_not_read() -> None:
    with pytest.raises(ValueError, match=r"^RLGATE_NOPE is not a client setting"):
        read_env("RLGATE_NOPE")


def test_run_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RLGATE_ORCHESTRATOR", "RLGATE_TOOL_TIMEOUT_S", "RLGATE_ON_VERIFIER_ERROR", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RLGATE_DEBUG", "1")
    monkeypatch.setenv("RLGATE_TRAINING_RUN_ID", "run-7")
    assert RunSettings.from_env() == RunSettings(training_run_id="run-7", debug=True)
    monkeypatch.setenv("RLGATE_TOOL_TIMEOUT_S", "2.5")
    monkeypatch.setenv("RLGATE_ON_VERIFIER_ERROR", "zero")
    settings = RunSettings.from_env()
    assert (settings.tool_timeout_s, settings.on_verifier_error) == (2.5, "zero")
    monkeypatch.setenv("RLGATE_ON_VERIFIER_ERROR", "ignore")
    with pytest.raises(ValueError, match=r"^\$RLGATE_ON_VERIFIER_ERROR must be 'raise' or 'zero', not 'ignore'$"):
        RunSettings.from_env()
    # One setting's bad value does not stop an episode that reads another.
    assert tool_timeout_setting() == 2.5
