"""localfleet configuration: every flag of `rlgate localfleet` and its environment variable."""

from __future__ import annotations

from dataclasses import dataclass

from rlgate.runtime.config import setting


@dataclass
class LocalfleetConfig:
    listen: str = setting("127.0.0.1:8765", "RLGATE_LOCALFLEET_LISTEN", "HTTP listen address HOST:PORT")
    data_dir: str = setting(".rlgate/localfleet", "RLGATE_LOCALFLEET_DATA_DIR",
                            "Directory for instance databases")
    faults: str = setting("", "RLGATE_LOCALFLEET_FAULTS", "Fault-injection file (JSON), off when empty")
    instance_limit: int = setting(1000, "RLGATE_LOCALFLEET_INSTANCE_LIMIT", "Running instances allowed")
    public_url: str = setting("", "RLGATE_LOCALFLEET_PUBLIC_URL",
                              "Base URL instances advertise (empty: http://LISTEN)")
    verifier_timeout_s: float = setting(30.0, "RLGATE_LOCALFLEET_VERIFIER_TIMEOUT_S",
                                        "Verifier subprocess timeout")
    log_level: str = setting("INFO", "RLGATE_LOG_LEVEL", "Log level")
