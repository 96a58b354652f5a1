"""Lets import-linter see the whole `rlgate` namespace, whose folders setuptools' `package-dir` maps onto it
(`services/toolgateway` is `rlgate.toolgateway`, `devtools` is `rlgate.devtools`, and so on).

grimp, which builds import-linter's graph, finds a root package's modules by walking the folders its import
spec lists (`submodule_search_locations`). The editable install's finder gives `rlgate` only
`clients/python/rlgate`; the mapped subpackages are found one by one at import time, so grimp would never see
them. `pyproject.toml` names this module as a contract type (`[tool.importlinter] contract_types`) only so
import-linter imports it before building the graph: importing it puts a finder first on `sys.meta_path` that
answers for `rlgate` with one folder, the link tree scripts/typecheck.py lays out for mypy
(`.mypy-tree/rlgate`: a link to each entry of the client folder and one to each mapped folder, named for its
subpackage). grimp follows the links, so every mapped folder walks as `rlgate.<name>` wherever it lives, and
nothing beside it does (a folder's parent, such as the repository's root for `devtools`, is never walked).
Nothing else is changed; `MappedLayout` is the built-in forbidden contract, unused.

The tree is the one import-linter runs in (its working directory, where it reads `pyproject.toml`):
tests/unit/test_layering.py runs it on a copy of the repository with a forbidden import added.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from typing import Any

from importlinter.contracts.forbidden import ForbiddenContract

from scripts.typecheck import link_tree


def search_locations(root: Path) -> list[str]:
    """The one folder grimp walks for `rlgate`: scripts/typecheck.py's link tree, where the client folder's
    entries and each mapped subpackage's folder sit side by side as `rlgate/<name>` (grimp follows the links).
    A mapped folder anywhere (`devtools/` at the repository's root) is seen as its subpackage, and nothing
    else in its parent folder is."""
    return [str(link_tree(root) / "rlgate")]


def rlgate_spec(root: Path) -> importlib.machinery.ModuleSpec:
    locations = search_locations(root)
    spec = importlib.util.spec_from_file_location(
        "rlgate", Path(locations[0]) / "__init__.py", submodule_search_locations=locations
    )
    assert spec is not None
    return spec


class _MappedRlgate:
    """A meta path finder that answers only for the top-level `rlgate`, with every mapped folder."""

    root = Path.cwd()

    @classmethod
    def find_spec(cls, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return rlgate_spec(cls.root) if fullname == "rlgate" else None


def install(root: Path) -> None:
    _MappedRlgate.root = root
    if _MappedRlgate not in sys.meta_path:
        sys.meta_path.insert(0, _MappedRlgate)


install(Path.cwd())

MappedLayout = ForbiddenContract
