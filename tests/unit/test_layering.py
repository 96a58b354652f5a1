"""The layering contracts (`[tool.importlinter]` in pyproject.toml) hold for the repository, and each one breaks
when a copy of the repository gains an import it forbids: `lint-imports` run as `make lint` runs it. The
contracts: the planes independent; the services layered (cli, devtools, the planes, mcpclient and ledger, store,
runtime, core, stubs); client code on the core; neither services nor client code importing the other; and no
cycle among rlgate's packages and modules."""

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
    assert len(contracts) == len(CONTRACTS)
    assert all(f"{c['name']}" in " ".join(result.stdout.split()) for c in contracts)
    assert {c["name"].split(":")[0] for c in contracts} == {name.split(":")[0] for name in CONTRACTS.values()}


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


PLANES = "The planes are independent"
SERVICES = "The services are layered"
CLIENT = "Client code sits on the core"
NO_CLIENT = "Services import no client code"
NO_SERVICE = "Client code imports no service"
ACYCLIC = "No cycles among rlgate's packages and modules"
# Every contract in pyproject.toml, by the start of its name: each is broken by at least one case below.
CONTRACTS = {
    "planes": PLANES,
    "services": SERVICES,
    "client": CLIENT,
    "no_client": NO_CLIENT,
    "no_service": NO_SERVICE,
    "acyclic": ACYCLIC,
}

# (file, the line added to it (a new module, or the end of an existing one), {contract broken: what it names}).
# A cycle is named by the import import-linter would remove, either of its two: "a -> b | b -> a".
# An import up the layers also closes a cycle when the layer imported already imports the importer.
CASES = [
    (
        "services/orchestrator/probe.py",
        "from rlgate.toolgateway import service",
        {PLANES: "rlgate.orchestrator.probe -> rlgate.toolgateway.service", SERVICES: "rlgate.orchestrator.probe"},
    ),
    (
        "services/toolgateway/probe.py",
        "import rlgate.orchestrator.tools",
        {PLANES: "rlgate.toolgateway.probe -> rlgate.orchestrator.tools", SERVICES: "rlgate.toolgateway.probe"},
    ),
    (
        "services/localfleet/probe.py",
        "from rlgate.orchestrator import config",
        {SERVICES: "rlgate.localfleet.probe -> rlgate.orchestrator.config"},
    ),
    (
        "services/store/probe.py",
        "from rlgate.toolgateway.server import run",
        {
            SERVICES: "rlgate.store.probe -> rlgate.toolgateway.server",
            ACYCLIC: ".store -> .toolgateway | .toolgateway -> .store",
        },
    ),
    (
        "services/mcpclient/probe.py",
        "from rlgate.orchestrator import tools",
        {
            SERVICES: "rlgate.mcpclient.probe -> rlgate.orchestrator.tools",
            ACYCLIC: ".mcpclient -> .orchestrator | .orchestrator -> .mcpclient",
        },
    ),
    (
        "services/orchestrator/probe.py",
        "def later():\n    from rlgate.devtools import stack",
        {
            # devtools reads the toolgateway's config: the orchestrator would reach the other plane through it
            PLANES: "rlgate.orchestrator.probe -> rlgate.devtools.stack",
            SERVICES: "rlgate.orchestrator.probe -> rlgate.devtools.stack",
            ACYCLIC: ".orchestrator -> .devtools | .devtools -> .orchestrator",
        },
    ),
    (
        "services/runtime/probe.py",
        "from rlgate.store import SessionStore",
        {SERVICES: "rlgate.runtime.probe -> rlgate.store", ACYCLIC: ".runtime -> .store | .store -> .runtime"},
    ),
    (
        "clients/python/rlgate/core/probe.py",
        "from rlgate.runtime import config",
        {SERVICES: "rlgate.core.probe -> rlgate.runtime.config", ACYCLIC: ".core -> .runtime | .runtime -> .core"},
    ),
    (
        "clients/python/rlgate/core/probe.py",
        "from rlgate.protocol import ToolCall",
        {CLIENT: "rlgate.core.probe -> rlgate.protocol", ACYCLIC: ".core -> .protocol | .protocol -> .core"},
    ),
    (
        "clients/python/rlgate/core/probe.py",
        "from rlgate.messages import TextPart",
        {CLIENT: "rlgate.core.probe -> rlgate.messages"},
    ),
    (
        "clients/python/rlgate/adapters/probe.py",
        "from rlgate.cli import cli",
        # the command line launches the services: client code that imported it would need the server extra
        {CLIENT: "rlgate.adapters.probe -> rlgate.cli", NO_SERVICE: "rlgate.adapters.probe -> rlgate.cli"},
    ),
    (
        "services/mcpclient/probe.py",
        "from rlgate.client import Client",
        {NO_CLIENT: "rlgate.mcpclient.probe -> rlgate.client"},
    ),
    (
        "services/orchestrator/probe.py",
        "def later():\n    from rlgate.adapters import skyrl",
        {NO_CLIENT: "rlgate.orchestrator.probe -> rlgate.adapters.skyrl"},
    ),
    (
        "services/store/probe.py",
        "from rlgate.errors import NotFound",  # the client's path to the classes: services use rlgate.core.errors
        {NO_CLIENT: "rlgate.store.probe -> rlgate.errors"},
    ),
    (
        "clients/python/rlgate/adapters/probe.py",
        "from rlgate.store import SessionStore",
        {NO_SERVICE: "rlgate.adapters.probe -> rlgate.store"},
    ),
    (
        "clients/python/rlgate/protocol.py",  # policies imports protocol: a cycle within one layer
        "from rlgate import policies",
        {ACYCLIC: ".protocol -> .policies | .policies -> .protocol"},
    ),
]


def test_every_contract_has_a_case_that_breaks_it() -> None:
    assert {contract for _, _, broken in CASES for contract in broken} == set(CONTRACTS.values())


@pytest.mark.parametrize(("path", "line", "broken"), CASES, ids=[f"{path}: {line}" for path, line, _ in CASES])
def test_a_forbidden_import_breaks_its_contract(
    pristine: Path, tmp_path: Path, path: str, line: str, broken: dict[str, str]
) -> None:
    tree = tmp_path / "repo"
    shutil.copytree(pristine, tree)
    target = tree / path
    if target.exists():
        target.write_text(target.read_text() + f"\n{line}\n")
    else:
        target.write_text(f'"""A module a contract forbids."""\n\n{line}\n')
    result = lint_imports(tree)
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-2000:]
    report = " ".join(result.stdout.split())
    assert f"{len(CONTRACTS) - len(broken)} kept, {len(broken)} broken" in report, report[-3000:]
    section = report.split("Broken contracts", 1)[1]
    for contract, chain in broken.items():
        assert contract in section, (contract, section[-3000:])
        named = section.split(contract, 1)[1]
        for other in CONTRACTS.values():  # this contract's part of the report only
            named = named.split(other, 1)[0]
        assert any(one in named for one in chain.split(" | ")), (contract, chain, section[-3000:])
