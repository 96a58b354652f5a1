"""Run mypy over the whole project the one way `make lint` and the tests do: `python scripts/typecheck.py [PATH...]`.

`pyproject.toml`'s `package-dir` maps folders onto the `rlgate` namespace (`services/store` is `rlgate.store`,
and so on). The editable install resolves that at import time through setuptools' finder, which mypy cannot
follow, so mypy is given a tree where the namespace is laid out as Python sees it: `.mypy-tree/rlgate/` holds a
symlink to every entry of the client folder and one to each mapped subpackage's folder. The tree is brought in
line with `pyproject.toml` and the client folder on every run (a new module is seen at once), then mypy checks
the package there (`rlgate`: `mypy_path` names the tree) and the top-level folders that import it, with
`[tool.mypy]`'s settings. Paths in mypy's report are the files' own (`services/store/base.py`, not the link).

PATHs are checked with the project (tests/unit/test_typecheck.py passes a probe file this way).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ".mypy-tree"  # [tool.mypy] mypy_path; ignored by git
CACHES = ".mypy_cache"
# Checked as themselves (module names from the repository root, explicit_package_bases).
FOLDERS = ["tests", "bench", "examples", "scripts"]


def package_dirs(root: Path) -> dict[str, Path]:
    """The mapped subpackages (`store` -> services/store), and "" -> the client folder `rlgate` is."""
    mapping: dict[str, str] = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    folders: dict[str, Path] = {}
    for package, folder in mapping.items():
        name = package.removeprefix("rlgate").removeprefix(".")
        if package != "rlgate" and (not package.startswith("rlgate.") or "." in name):
            raise SystemExit(f"typecheck: package-dir maps {package}; only rlgate and rlgate.<name> are laid out")
        folders[name] = root / folder
    return folders


def link_tree(root: Path) -> Path:
    """Make `root/.mypy-tree/rlgate` match the layout; returns the tree. Safe to run alongside another run."""
    folders = package_dirs(root)
    client = folders.pop("")
    wanted = {p.name: p for p in client.iterdir() if p.name != "__pycache__"}
    for name, folder in folders.items():
        if name in wanted:
            raise SystemExit(f"typecheck: rlgate.{name} is both {wanted[name]} and the mapped {folder}")
        wanted[name] = folder
    package = root / TREE / "rlgate"
    package.mkdir(parents=True, exist_ok=True)
    # Relative links: the tree stays right in a copy of the repository.
    targets = {name: os.path.relpath(path, package) for name, path in wanted.items()}
    for link in package.iterdir():
        if link.name not in targets or os.readlink(link) != targets[link.name]:
            link.unlink(missing_ok=True)
    for name, target in targets.items():
        with contextlib.suppress(FileExistsError):  # already right (kept above), or made by a concurrent run
            (package / name).symlink_to(target, target_is_directory=wanted[name].is_dir())
    return root / TREE


def cache_dir(root: Path) -> str:
    """A cache per `[tool.mypy]` table: mypy keeps some results across a change of per-module options (a
    package's imports followed or ignored) that it should redo. Caches of other tables are removed."""
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["mypy"]
    key = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    name = f"typecheck-{key}"
    for old in (root / CACHES).glob("typecheck-*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return f"{CACHES}/{name}"


def report_line(line: str, tree: Path) -> str:
    """A path in the tree as the file's own path (relative to the repository)."""
    match = re.match(rf"{re.escape(TREE)}/([^:]+)", line)
    if not match:
        return line
    real = (tree / match.group(1)).resolve()
    return str(real.relative_to(ROOT) if real.is_relative_to(ROOT) else real) + line[match.end() :]


def main(argv: list[str]) -> int:
    paths = [str(Path(a).resolve()) if os.path.exists(a) else a for a in argv]
    os.chdir(ROOT)  # mypy_path, the folders and module names are relative to the repository
    tree = link_tree(ROOT)
    command = [sys.executable, "-m", "mypy", "--cache-dir", cache_dir(ROOT), f"{TREE}/rlgate", *FOLDERS, *paths]
    run = subprocess.run(command, capture_output=True, text=True)
    sys.stdout.write("".join(report_line(line, tree) + "\n" for line in run.stdout.splitlines()))
    sys.stderr.write(run.stderr)
    return run.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
