"""`rlgate version`: rlgate's version always; the SQLite library the store runs on when the server extra is
installed, and a plain "not installed" in a client-only install (no apsw)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version as distribution_version

import apsw
import pytest
from click.testing import CliRunner

from rlgate.cli import cli
from rlgate.store import sqlite as sqlite_store


def test_version_names_rlgate_and_the_store_library() -> None:
    result = CliRunner().invoke(cli, ["version"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        f"rlgate {distribution_version('rlgate')}",
        f"session store: SQLite {apsw.sqlite_lib_version()} (apsw {apsw.apswversion()})",
    ]


def test_version_flags_a_library_the_store_would_refuse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sqlite_store, "sqlite_library_version", lambda: "3.40.1")
    result = CliRunner().invoke(cli, ["version"])
    assert result.exit_code == 0 and "SQLite 3.40.1" in result.output and "TOO OLD" in result.output


def test_version_without_the_server_extra() -> None:
    """A fresh interpreter where apsw cannot be imported, as in `pip install rlgate` (the client alone)."""
    code = (
        "import sys; sys.modules['apsw'] = None\n"  # `import apsw` now raises ImportError
        "from rlgate.cli import main; sys.argv = ['rlgate', 'version']; main()"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"rlgate {distribution_version('rlgate')}",
        "session store: not installed (client-only install; the servers need pip install 'rlgate[server]')",
    ]
