"""mypy sees rlgate's whole namespace, the folders `package-dir` maps onto it included: a call into the
project with wrong arguments fails `make lint` (scripts/typecheck.py), naming the line, where before every
`rlgate.*` import was `Any` and anything passed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import tomllib
import uuid
from pathlib import Path

import pytest

from scripts import typecheck

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent(
    """
    import rlgate
    import rlgate.store
    from rlgate.runtime.deadline import Deadline


    async def main() -> None:
        await rlgate.store.open_store(1, 2, 3, 4, 5, 6)
        rlgate.Client("localhost:50051", api_kye="k")
        Deadline("soon")
        rlgate.Client("localhost:50051", api_key="k").close()
    """
)


@pytest.mark.slow  # a whole mypy run, slow without its cache
def test_the_make_lint_run_refuses_wrong_calls_into_the_project(tmp_path: Path) -> None:
    # A new module name each run: mypy's cache would otherwise replay a same-named module's errors under
    # the path it had last time.
    probe = tmp_path / f"probe_{uuid.uuid4().hex}.py"
    probe.write_text(PROBE)
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "typecheck.py"), str(probe)],
        cwd=tmp_path,  # the script runs from the repository wherever it is started
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = run.stdout + run.stderr
    errors = [line for line in run.stdout.splitlines() if ": error: " in line]
    # Only the probe's lines: the project itself is clean, run the same way (tests/unit/test_lint.py).
    outside = [line for line in errors if not line.startswith(str(probe.resolve()))]
    assert not outside, "\n".join(outside)
    assert run.returncode == 1, output
    by_line: dict[int, list[str]] = {}
    for line in errors:
        by_line.setdefault(int(line.split(":")[1]), []).append(line)
    assert sorted(by_line) == [8, 9, 10], output
    assert 'Too many arguments for "open_store"' in " ".join(by_line[8])
    assert 'Unexpected keyword argument "api_kye"' in " ".join(by_line[9])
    assert 'incompatible type "str"; expected "float"' in " ".join(by_line[10])


def test_the_tree_follows_pyproject_and_the_client_folder() -> None:
    tree = typecheck.link_tree(ROOT) / "rlgate"
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in mapping.items():
        if package != "rlgate":
            assert (tree / package.removeprefix("rlgate.")).resolve() == (ROOT / folder).resolve()
    client = ROOT / mapping["rlgate"]
    assert {p.name for p in client.iterdir() if p.name != "__pycache__"} <= {p.name for p in tree.iterdir()}
    assert all(not os.path.isabs(os.readlink(link)) for link in tree.iterdir())  # right in a copy too


def test_report_lines_name_the_files_own_paths() -> None:
    tree = typecheck.link_tree(ROOT)
    line = f"{typecheck.TREE}/rlgate/store/base.py:3: error: boom  [misc]"
    assert typecheck.report_line(line, tree) == "services/store/base.py:3: error: boom  [misc]"
    assert typecheck.report_line("tests/x.py:1: error: y", tree) == "tests/x.py:1: error: y"


def test_make_lint_runs_the_script() -> None:
    recipe = re.search(r"^lint:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert recipe is not None and "scripts/typecheck.py" in recipe.group(1)
