"""localfleet's environments: each an `EnvironmentSpec` (see base.py), looked up by `env_id:version` or `env_id`."""

from __future__ import annotations

from rlgate.localfleet.environments import booking, mailbox, tracker
from rlgate.localfleet.environments.base import EnvironmentSpec

_ALL: tuple[EnvironmentSpec, ...] = (mailbox.SPEC, tracker.SPEC, booking.SPEC)


def all_environments() -> list[EnvironmentSpec]:
    """Every environment localfleet hosts, in a stable order."""
    return list(_ALL)


def get_environment(env_key_or_id: str) -> EnvironmentSpec:
    """The environment named `env_id:version`, or the only version of `env_id`. KeyError if unknown."""
    for spec in _ALL:
        if env_key_or_id in (spec.env_key, spec.env_id):
            return spec
    known = ", ".join(spec.env_key for spec in _ALL)
    raise KeyError(f"unknown environment '{env_key_or_id}'; known: {known}")


__all__ = ["EnvironmentSpec", "all_environments", "get_environment"]
