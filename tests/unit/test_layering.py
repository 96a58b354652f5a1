"""The layering contracts (`[tool.importlinter]` in pyproject.toml) hold for the repository, and each one breaks
when a copy of the repository gains an import it forbids: `lint-imports` run as `make lint` runs it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    # PYTHONPATH: import-linter loads tests.support.import_layout (named in pyproject.toml) from the repository
    # whichever tree it checks; the tree itself is its working directory.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=tree, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_repository_keeps_every_contract() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert len(contracts) == 3 and all(f"{c['name']}" in " ".join(result.stdout.split()) for c in contracts)


def _not_python(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "__pycache__" or not (n.endswith(".py") or (Path(folder) / n).is_dir())]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's Python sources in their folders, and its pyproject.toml."""
    tree = tmp_path_factory.mktemp("layering") / "repo"
    mapping: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for folder in mapping.values():
        shutil.copytree(ROOT / folder, tree / folder, ignore=_not_python)
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


@pytest.mark.parametrize(
    ("path", "line", "contract", "chain"),
    [
        (
            "services/orchestrator/probe.py",
            "from rlgate.toolgateway import service",
            "The planes are independent",
            "rlgate.orchestrator.probe -> rlgate.toolgateway.service",
        ),
        (
            "services/toolgateway/probe.py",
            "import rlgate.orchestrator.tools",
            "The planes are independent",
            "rlgate.toolgateway.probe -> rlgate.orchestrator.tools",
        ),
        (
            "services/mcpclient/probe.py",
            "from rlgate.client import Client",
            "Services import no client code",
            "rlgate.mcpclient.probe -> rlgate.client",
        ),
        (
            "services/orchestrator/probe.py",
            "def later():\n    from rlgate.adapters import skyrl",
            "Services import no client code",
            "rlgate.orchestrator.probe -> rlgate.adapters.skyrl",
        ),
        (
            "services/store/probe.py",
            "from rlgate.toolgateway.server import run",
            "Neutral packages import no plane",
            "rlgate.store.probe -> rlgate.toolgateway.server",
        ),
        (
            "services/mcpclient/probe.py",
            "from rlgate.orchestrator import tools",
            "Neutral packages import no plane",
            "rlgate.mcpclient.probe -> rlgate.orchestrator.tools",
        ),
    ],
)
def test_a_forbidden_import_breaks_its_contract(
    pristine: Path, tmp_path: Path, path: str, line: str, contract: str, chain: str
) -> None:
    tree = tmp_path / "repo"
    shutil.copytree(pristine, tree)
    (tree / path).write_text(f'"""A module a contract forbids."""\n\n{line}\n')
    result = lint_imports(tree)
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-2000:]
    report = " ".join(result.stdout.split())
    assert "2 kept, 1 broken" in report, report[-3000:]
    broken = report.split("Broken contracts", 1)[1]
    assert contract in broken and chain in broken, broken[-3000:]
