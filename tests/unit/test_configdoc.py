from pathlib import Path

from rlgate.devtools.configdoc import render

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_current() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render(), "run: python -m rlgate.devtools.configdoc docs/configuration.md"
