"""What docs/deploy.md says about optional session pinning, shown with the installed grpcio: the
`ring_hash_experimental` policy hashing a request header keeps every call carrying the same header value on
one backend (and spreads different values), but only when grpc core's experimental switch is set; without
it every call fails. Nothing in rlgate depends on pinning."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest

from tests.deploy.cli_contract import REPO

SWITCH = "GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY"


async def probe(header: str, switch: bool) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != SWITCH}
    if switch:
        env[SWITCH] = "true"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.deploy.pinning_probe",
        header,
        cwd=REPO,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    result: dict[str, object] = json.loads(out.decode().strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("header", ["authorization", "x-rlgate-session"])
async def test_ring_hash_pins_each_header_value_to_one_backend(header: str) -> None:
    result = await probe(header, switch=True)
    assert result.get("pinned") is True, result
    assert len(result["backends"]) >= 2, f"20 keys should spread over the backends: {result}"  # type: ignore[arg-type]


async def test_ring_hash_on_a_header_fails_without_the_switch() -> None:
    result = await probe("authorization", switch=False)
    assert "error" in result, result
