"""Shared test configuration. Fixtures live in tests/support/* (one module per component) and are
registered here as plugins."""

pytest_plugins = [
    "tests.support.ports",
    "tests.support.redis",
    "tests.support.localfleet",
    "tests.support.stack",
    "tests.support.store",
]
