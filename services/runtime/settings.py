"""Settings shared by both gRPC services (listen address, store, TLS, logging)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_DATA_DIR = ".rlgate"


def default_store_url(data_dir: str) -> str:
    """The embedded default: a SQLite file under the data dir."""
    path = Path(data_dir or DEFAULT_DATA_DIR).resolve() / "store.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"
