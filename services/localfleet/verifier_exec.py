"""Verifier execution: a subprocess per run in the services' one sandbox (`runtime.child_process`: a timeout,
resource limits, a scrubbed environment), on copies of the instance's databases.

This is isolation (a verifier cannot corrupt the instance, hang localfleet, or exhaust its memory), not a
security boundary: task files are trusted code. The SDK's two verifier paths are served:
`/v1/verifiers/execute` (bundle + cloudpickled args, what `Task.verify_detailed` uses) and the manager's
`/execute_verifier_function` (what `env.verify_raw` uses). A verifier that raises or times out comes back
as `success: false` with the error and its stdout, never as a score.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import shutil
import sqlite3
import tempfile
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlgate.localfleet.counters import Counters
from rlgate.localfleet.instances import Instance, connect
from rlgate.runtime.child_process import Limits, run_child

MAX_BUNDLE_BYTES = 5 << 20
_BUNDLES_KEPT = 1000


class BadBundle(ValueError):
    pass


@dataclass
class RunOutcome:
    success: bool
    result: Any
    error: dict[str, Any] | None
    stdout: str
    elapsed_ms: int


class VerifierService:
    def __init__(self, counters: Counters, max_timeout_s: float, memory_mb: int, work_root: Path) -> None:
        self.counters = counters
        self.max_timeout_s = max_timeout_s
        self.memory_mb = memory_mb
        self.work_root = work_root
        self.bundles: dict[str, str] = {}  # sha256 of the bundle zip -> verifier.py

    # ---- bundles (/v1/verifiers/check, the `bundle` field of /execute) ----

    def has_bundle(self, sha256: str) -> bool:
        return sha256 in self.bundles

    def add_bundle(self, data: bytes) -> str:
        if len(data) > MAX_BUNDLE_BYTES:
            raise BadBundle(f"bundle exceeds {MAX_BUNDLE_BYTES} bytes")
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as zf:
                info = zf.getinfo("verifier.py")
                if info.file_size > MAX_BUNDLE_BYTES:
                    raise BadBundle("verifier.py is too large")
                code = zf.read(info).decode("utf-8")
        except (zipfile.BadZipFile, KeyError, UnicodeDecodeError) as exc:
            raise BadBundle(f"bundle must be a zip holding verifier.py: {exc}") from exc
        sha = hashlib.sha256(data).hexdigest()
        self.bundles[sha] = code
        while len(self.bundles) > _BUNDLES_KEPT:
            self.bundles.pop(next(iter(self.bundles)))
        return sha

    # ---- the two execution paths ----

    async def run_remote(
        self,
        inst: Instance,
        code: str,
        args: list[Any],
        kwargs: dict[str, Any],
        timeout_s: float | None,
        *,
        key: str | None = None,
    ) -> dict[str, Any]:
        """`VerifiersExecuteResponse` for /v1/verifiers/execute."""
        outcome = await self.run(inst, {"mode": "remote", "code": code, "args": args, "kwargs": kwargs}, timeout_s)
        return {
            "success": outcome.success,
            "result": outcome.result,
            "error": outcome.error,
            "stdout": outcome.stdout,
            "execution_time_ms": outcome.elapsed_ms,
            "execution_id": uuid.uuid4().hex,
            "key": key,
            "verifier_id": key,
            "version": 1,
            "bundle_cache_hit": False,
        }

    async def run_manager(
        self, inst: Instance, code: str, function_name: str | None, text_solution: str | None
    ) -> dict[str, Any]:
        """`ExecuteFunctionResponse` for the manager's /execute_verifier_function."""
        outcome = await self.run(
            inst,
            {"mode": "manager", "code": code, "function_name": function_name, "text_solution": text_solution},
            None,
        )
        error = None
        if outcome.error is not None:
            error = f"{outcome.error['type']}: {outcome.error['message']}"
        return {
            "success": outcome.success,
            "result": outcome.result,
            "error": error,
            "stdout": outcome.stdout,
            "message": "Verifier executed" if outcome.success else f"Verifier failed: {error}",
        }

    async def run(self, inst: Instance, payload: dict[str, Any], timeout_s: float | None) -> RunOutcome:
        self.counters.inc("verifier_runs")
        timeout = min(float(timeout_s), self.max_timeout_s) if timeout_s else self.max_timeout_s
        started = time.monotonic()
        workdir = Path(await asyncio.to_thread(self._prepare, inst, payload))
        try:
            outcome = await self._spawn(workdir, timeout)
        finally:
            await asyncio.to_thread(shutil.rmtree, workdir, True)
        outcome.elapsed_ms = int((time.monotonic() - started) * 1000)
        return outcome

    def _prepare(self, inst: Instance, payload: dict[str, Any]) -> str:
        self.work_root.mkdir(parents=True, exist_ok=True)
        workdir = tempfile.mkdtemp(prefix=f"{inst.instance_id}-", dir=self.work_root)
        for name in ("seed", "current"):  # backup API: a consistent copy even while tools write
            src = connect(inst.db_path(name), read_only=True)
            dst = sqlite3.connect(Path(workdir) / f"{name}.db")
            try:
                src.backup(dst)
            finally:
                src.close()
                dst.close()
        (Path(workdir) / "input.json").write_text(json.dumps(payload, default=_default))
        return workdir

    async def _spawn(self, workdir: Path, limit_s: float) -> RunOutcome:
        args = ["-m", "rlgate.localfleet.verifier_runner", str(workdir)]
        run = await run_child(args, workdir, limit_s, limits=Limits(memory_mb=self.memory_mb))
        if run.timed_out:
            error = {"type": "TimeoutError", "message": f"verifier timed out after {limit_s:g}s", "traceback": ""}
            return RunOutcome(False, None, error, run.stdout, 0)
        result = run.result
        if result is None:
            error = {
                "type": "VerifierCrashed",
                "message": f"verifier process ended with {run.ending()} and no result",
                "traceback": run.stderr[-4000:],
            }
            return RunOutcome(False, None, error, run.stdout, 0)
        return RunOutcome(bool(result.get("success")), result.get("result"), result.get("error"), run.stdout, 0)


def _default(value: Any) -> Any:
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise TypeError(f"cannot pass {type(value).__name__} to a verifier")
