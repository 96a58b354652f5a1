"""Packaging: one distribution, folders mapped onto one namespace, a light client install."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = config["package-dir"]
    listed = set(config["packages"])
    found: set[str] = set()
    for package, folder in mapping.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join([package, *rel.parts]))
    missing = sorted(n for n in found if n not in listed)
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"


def test_importing_stubs_needs_only_grpc_and_protobuf() -> None:
    code = (
        "import sys; import rlgate, rlgate.v1.orchestrator_pb2, rlgate.v1.toolgateway_pb2_grpc;"
        "heavy = [m for m in ('mcp', 'fleet', 'redis', 'starlette', 'uvicorn', 'torch', 'httpx2') if m in sys.modules];"
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_cli_help_documents_flags_and_env_vars() -> None:
    for command, env_var in [
        ("orchestrator", "RLGATE_ORCHESTRATOR_LISTEN"),
        ("toolgateway", "RLGATE_TOOLGATEWAY_LISTEN"),
        ("localfleet", "RLGATE_LOCALFLEET_LISTEN"),
    ]:
        result = subprocess.run(
            [sys.executable, "-m", "rlgate.cli", command, "--help"], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        assert "--listen" in result.stdout and env_var in result.stdout
    result = subprocess.run(
        [sys.executable, "-m", "rlgate.cli", "up", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "--data-dir" in result.stdout
