"""localfleet configuration: every flag of `rlgate localfleet` and its environment variable."""

from __future__ import annotations

from dataclasses import dataclass

from rlgate.runtime.config import setting


@dataclass
class LocalfleetConfig:
    listen: str = setting("127.0.0.1:8765", "RLGATE_LOCALFLEET_LISTEN", "HTTP listen address HOST:PORT")
    data_dir: str = setting(".rlgate/localfleet", "RLGATE_LOCALFLEET_DATA_DIR", "Directory for instance databases")
    faults: str = setting("", "RLGATE_LOCALFLEET_FAULTS", "Fault-injection file (JSON), off when empty")
    instance_limit: int = setting(1000, "RLGATE_LOCALFLEET_INSTANCE_LIMIT", "Running instances allowed")
    public_url: str = setting("", "RLGATE_LOCALFLEET_PUBLIC_URL", "Base URL instances advertise (empty: http://LISTEN)")
    verifier_timeout_s: float = setting(
        30.0,
        "RLGATE_LOCALFLEET_VERIFIER_TIMEOUT_S",
        "Verifier subprocess timeout (upper bound; a request may ask for less)",
    )
    verifier_memory_mb: int = setting(
        1024, "RLGATE_LOCALFLEET_VERIFIER_MEMORY_MB", "Address-space limit of a verifier subprocess (MiB)"
    )
    reaper_interval_s: float = setting(
        1.0, "RLGATE_LOCALFLEET_REAPER_INTERVAL_S", "How often expired instances (ttl, missed heartbeats) are stopped"
    )
    environments: str = setting(
        "",
        "RLGATE_LOCALFLEET_ENVIRONMENTS",
        "MODULE:FUNCTION returning the EnvironmentSpecs to host (empty: the bundled ones)",
    )
    tasks_dir: str = setting(
        "",
        "RLGATE_LOCALFLEET_TASKS_DIR",
        "Directory of task JSON files (empty: the bundled tasks); task files are trusted code",
    )
    log_level: str = setting("INFO", "RLGATE_LOG_LEVEL", "Log level")
