"""The SQLite library under the store: its version, checked against the WAL-reset bug, and the error
that names a corrupt file and where its recovery is explained."""

from __future__ import annotations

import os

import apsw

from rlgate.store.models import StoreCorrupt, StoreError

MIN_SQLITE_VERSION = (3, 51, 3)  # the first release without the WAL-reset bug (see the module's docstring)
RECOVERY_DOC = 'docs/operations.md, "Recovering a store"'


def sqlite_library_version() -> str:
    """The version of the SQLite library the store runs on (apsw's bundled one), e.g. "3.54.1"."""
    return str(apsw.sqlite_lib_version())


def check_sqlite_library() -> str:
    """The library's version; StoreError if it still has the WAL-reset bug (older than MIN_SQLITE_VERSION)."""
    version = sqlite_library_version()
    numbers = tuple(int(part) for part in version.split(".")[:3] if part.isdigit())
    if numbers < MIN_SQLITE_VERSION:
        wanted = ".".join(map(str, MIN_SQLITE_VERSION))
        raise StoreError(
            f"the SQLite store needs SQLite {wanted} or later, but apsw {apsw.apswversion()} runs SQLite {version}, "
            "which has the WAL-reset corruption bug (https://sqlite.org/wal.html#walresetbug); "
            f"install rlgate's server extra with its constraints (apsw>={wanted}.0)"
        )
    return version


def corrupt_error(path: str, detail: str) -> StoreCorrupt:
    """The StoreCorrupt for the database at `path`: names the file and where recovery is explained."""
    where = path if path == ":memory:" else os.path.abspath(path)
    return StoreCorrupt(
        f"sqlite store {where} is corrupt ({detail}); rlgate will not run on it. Stop every service using it, "
        f"back it up, then recover it or start a new one: see {RECOVERY_DOC}"
    )
