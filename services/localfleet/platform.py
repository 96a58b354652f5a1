"""Everything one localfleet process holds, wired together (the routes receive this one object)."""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rlgate.localfleet.browser import BrowserManager
from rlgate.localfleet.catalog import Catalog
from rlgate.localfleet.computer import Computer
from rlgate.localfleet.config import LocalfleetConfig
from rlgate.localfleet.counters import Counters
from rlgate.localfleet.environments.base import EnvironmentSpec
from rlgate.localfleet.faults import FaultRegistry
from rlgate.localfleet.instances import Instance, InstanceRegistry
from rlgate.localfleet.mcp_mount import MCPEndpoints
from rlgate.localfleet.snapshots import Snapshots
from rlgate.localfleet.tasks_loader import load_tasks
from rlgate.localfleet.verifier_exec import VerifierService
from rlgate.localfleet.webapps import WebApps
from rlgate.runtime.config import split_host_port

log = logging.getLogger(__name__)


def load_specs(target: str = "") -> list[EnvironmentSpec]:
    """`module:function` returning specs, or the bundled `environments.all_environments()`."""
    if target:
        module_name, _, attr = target.partition(":")
        factory = getattr(importlib.import_module(module_name), attr or "all_environments")
    else:
        from rlgate.localfleet import environments

        factory = getattr(environments, "all_environments", None)
        if factory is None:
            log.warning("rlgate.localfleet.environments has no all_environments(): hosting no environments")
            return []
    return list(factory())


class Platform:
    def __init__(
        self,
        config: LocalfleetConfig,
        specs: list[EnvironmentSpec] | None = None,
        tasks: list[dict[str, Any]] | None = None,
    ) -> None:
        self.config = config
        self.public_url = (config.public_url or f"http://{config.listen}").rstrip("/")
        data_dir = Path(config.data_dir)
        self.counters = Counters()
        self.faults = FaultRegistry.from_file(config.faults)
        specs = load_specs(config.environments) if specs is None else specs
        self.catalog = Catalog(specs, data_dir / "templates")
        self.registry = InstanceRegistry(
            self.catalog, data_dir, self.faults, self.counters, config.instance_limit, config.reaper_interval_s
        )
        self.snapshots = Snapshots(data_dir)
        self.browser = BrowserManager(config)
        self.registry.on_stopped.append(self.browser.close_screen)  # a stopped instance's page goes with it
        computer = Computer(
            self.browser,
            self.public_url,
            split_host_port(config.listen)[0],
            config.screenshot_format,
            config.screenshot_quality,
        )
        self.endpoints = MCPEndpoints(
            specs, self.registry, self.faults, self.counters, _allowed_hosts(self), computer.register
        )
        self.webapps = WebApps(specs, self.registry)
        self.verifiers = VerifierService(
            self.counters, config.verifier_timeout_s, config.verifier_memory_mb, data_dir / "verifier-runs"
        )
        self.tasks = load_tasks(Path(config.tasks_dir) if config.tasks_dir else None) if tasks is None else tasks

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        await self.snapshots.clear()
        await self.registry.start()
        try:
            async with self.endpoints.running():
                yield
        finally:
            try:
                await self.registry.stop()
            finally:
                await self.browser.aclose()

    def root_url(self, inst: Instance) -> str:
        return f"{self.public_url}/instances/{inst.instance_id}/"


def _allowed_hosts(platform: Platform) -> list[str]:
    hosts = ["127.0.0.1:*", "localhost:*", "[::1]:*"]
    netloc = urlsplit(platform.public_url).netloc
    if netloc and netloc not in hosts:
        hosts.append(netloc)
    return hosts
