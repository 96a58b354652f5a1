"""The image's build stage without a container engine: copy exactly the files `.dockerignore` lets into the
build context, build the wheel from them the way `pip install '.[server]'` does (offline, no build
isolation), install it (not editable) into a scratch directory and run the installed package: every
service's server module imports, localfleet finds its bundled tasks, and `rlgate healthcheck` runs.
What this cannot show (no engine here): the base image, the network install of the dependencies, the
user and the HEALTHCHECK at run time (see docs/deploy.md)."""

from __future__ import annotations

import asyncio
import fnmatch
import os
import shutil
import sys
from pathlib import Path

from tests.deploy.cli_contract import REPO
from tests.support.ports import free_port

DOCKERIGNORE = REPO / ".dockerignore"
SKIP_DIRS = {".git", ".venv", ".tools", "node_modules", ".mypy_cache", ".ruff_cache", ".pytest_cache"}


def dockerignore_rules() -> list[tuple[bool, str]]:
    """(exclude?, pattern) in file order; `!pattern` re-includes."""
    rules = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            rules.append((not line.startswith("!"), line.lstrip("!").rstrip("/")))
    return rules


def excluded(relative: str, rules: list[tuple[bool, str]]) -> bool:
    """Docker's rule: the last pattern matching the path (or one of its parent directories) decides.
    Python's fnmatch lets `*` cross `/`, which is what `**` means to Docker; enough for this file."""
    parts = relative.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    verdict = False
    for exclude, pattern in rules:
        if any(fnmatch.fnmatchcase(c, pattern) for c in candidates):
            verdict = exclude
    return verdict


def build_context(destination: Path) -> list[str]:
    rules = dockerignore_rules()
    copied = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        for name in files:
            source = Path(root) / name
            relative = source.relative_to(REPO).as_posix()
            if not excluded(relative, rules):
                target = destination / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
                copied.append(relative)
    return copied


def test_dockerignore_keeps_what_the_dockerfile_copies_and_nothing_else() -> None:
    rules = dockerignore_rules()
    for needed in (
        "pyproject.toml",
        "constraints.txt",
        "README.md",
        "clients/python/rlgate/cli.py",
        "devtools/healthcheck.py",
        "services/localfleet/tasks_loader.py",
    ):
        assert not excluded(needed, rules), needed
        assert (REPO / needed).exists(), f"{needed} is missing: the image build would fail at COPY"
    for dropped in (
        ".venv/bin/python",
        "tests/conftest.py",
        ".git/HEAD",
        "bench/results.json",
        "services/runtime/__pycache__/config.cpython-311.pyc",
        "docs/deploy.md",
        ".rlgate/store.db",
    ):
        assert excluded(dropped, rules), dropped


async def run(*argv: str, cwd: Path, env: dict[str, str] | None = None, limit: float = 300) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), limit)
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


async def test_the_build_context_installs_a_complete_package(tmp_path: Path) -> None:
    context, wheels, target = tmp_path / "context", tmp_path / "wheels", tmp_path / "installed"
    copied = await asyncio.to_thread(build_context, context)
    assert "pyproject.toml" in copied and not any(p.startswith("tests/") for p in copied)
    code, out = await run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--disable-pip-version-check",
        "-q",
        ".",
        "-w",
        str(wheels),
        cwd=context,
    )
    assert code == 0, out
    (wheel,) = wheels.glob("rlgate-*.whl")
    code, out = await run(
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-index",
        "-q",
        "--disable-pip-version-check",
        "--target",
        str(target),
        str(wheel),
        cwd=tmp_path,
    )
    assert code == 0, out

    # The installed copy, not the editable checkout: PYTHONPATH comes before the venv's editable finder.
    env = {**os.environ, "PYTHONPATH": str(target)}
    probe = (
        "import rlgate, rlgate.cli, rlgate.v1.orchestrator_pb2, rlgate.devtools.healthcheck\n"
        "import rlgate.orchestrator.server, rlgate.toolgateway.server, rlgate.localfleet.server\n"
        "import rlgate.store.sqlite, rlgate.store.redis\n"
        "from rlgate.localfleet.tasks_loader import load_tasks\n"
        "assert rlgate.__file__.startswith(" + repr(str(target)) + "), rlgate.__file__\n"
        "assert load_tasks(), 'no bundled tasks in the wheel'\n"
        "print('ok', len(load_tasks()))\n"
    )
    code, out = await run(sys.executable, "-c", probe, cwd=tmp_path, env=env)
    assert code == 0 and out.startswith("ok"), out
    for command in ("orchestrator", "toolgateway", "localfleet"):
        code, out = await run(sys.executable, "-m", "rlgate.cli", command, "--help", cwd=tmp_path, env=env)
        assert code == 0 and "--listen" in out, out
    code, out = await run(
        sys.executable,
        "-m",
        "rlgate.cli",
        "healthcheck",
        f"127.0.0.1:{free_port()}",
        "--timeout",
        "2",
        cwd=tmp_path,
        env=env,
    )
    assert code == 2, out  # nothing listens there: "unreachable"
