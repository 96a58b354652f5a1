"""The default both gRPC services share for where the session store lives: a SQLite file under the data dir.

Each service declares its own settings (listen address, TLS, logging...) in its `config` module."""

from __future__ import annotations

from pathlib import Path

DEFAULT_DATA_DIR = ".rlgate"


def default_store_url(data_dir: str) -> str:
    """The embedded default: a SQLite file under the data dir."""
    path = Path(data_dir or DEFAULT_DATA_DIR).resolve() / "store.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"
