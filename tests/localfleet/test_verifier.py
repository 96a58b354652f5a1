"""Verifier execution: the restricted unpickler, subprocess isolation, failures reported as failures."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import os
import pickle
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import httpx
import psutil
import pytest

from rlgate.localfleet.safe_unpickle import UnsafePayload, decode_verifier_args, loads_data, split_env_marker
from rlgate.runtime.child_process import Limits
from tests.support.localfleet import LocalfleetProcess
from tests.support.wait import wait_until_sync

AUTH = {"Authorization": "Bearer v-key"}


class _Exploit:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.path}",))


def _b64(obj: Any) -> str:
    return base64.b64encode(cloudpickle.dumps(obj)).decode()


# ---- the unpickler, without a server ----


def test_sdk_shaped_arguments_decode() -> None:
    payload = _b64({"args": (None, "x", {"env": "abc"}), "kwargs": {"final_answer": "42"}})
    args, kwargs = decode_verifier_args(payload)
    assert kwargs == {"final_answer": "42"}
    assert split_env_marker(args) == ("abc", ["x"])
    assert loads_data(pickle.dumps({"a": [1, 2.5, None, True, b"x", (1,)], "s": {1}})) == {
        "a": [1, 2.5, None, True, b"x", (1,)],
        "s": {1},
    }


def test_a_pickled_function_is_refused() -> None:
    with pytest.raises(UnsafePayload, match="refused global"):
        decode_verifier_args(_b64({"args": (None, lambda: 1), "kwargs": {}}))

    def named() -> int:
        return 1

    with pytest.raises(UnsafePayload, match="refused global"):
        loads_data(cloudpickle.dumps(named))
    with pytest.raises(UnsafePayload, match=r"refused global (posix|os)\.system"):
        loads_data(pickle.dumps(_Exploit("/nonexistent")))


def test_malformed_payloads_are_refused() -> None:
    with pytest.raises(UnsafePayload):
        decode_verifier_args("not base64!!")
    with pytest.raises(UnsafePayload):
        decode_verifier_args(base64.b64encode(b"\x80\x05garbage").decode())
    with pytest.raises(UnsafePayload):
        decode_verifier_args(_b64(["not", "a", "dict"]))


# ---- execution, against a real localfleet ----


@pytest.fixture(scope="module")
def lf() -> Iterator[LocalfleetProcess]:
    with LocalfleetProcess(
        environments="tests.support.localfleet:tiny_environments",
        env={"SUPER_SECRET_TOKEN": "do-not-leak"},
        extra_args=["--verifier-memory-mb", "512"],
    ) as proc:
        yield proc


@pytest.fixture
def instance(lf: LocalfleetProcess) -> Iterator[str]:
    r = httpx.post(f"{lf.base_url}/v1/env/instances", json={"env_key": "notes"}, headers=AUTH, timeout=30)
    r.raise_for_status()
    iid = r.json()["instance_id"]
    yield iid
    httpx.delete(f"{lf.base_url}/v1/env/instances/{iid}", headers=AUTH, timeout=30)


def bundle(code: str) -> str:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("requirements.txt", "fleet-python")
        zf.writestr("verifier.py", code)
    return base64.b64encode(buf.getvalue()).decode()


def execute(
    lf: LocalfleetProcess,
    instance_id: str,
    code: str,
    *,
    timeout: int = 30,
    kwargs: dict[str, Any] | None = None,
    args: str | None = None,
    bundle_b64: str | None = None,
) -> httpx.Response:
    body = {
        "key": "t",
        "sha256": "",
        "bundle": bundle_b64 or bundle(code),
        "function_name": "verify",
        "timeout": timeout,
        "args": args or _b64({"args": (None, {"env": instance_id}), "kwargs": kwargs or {}}),
        "args_array": [{"env": instance_id}],
    }
    return httpx.post(f"{lf.base_url}/v1/verifiers/execute", json=body, headers=AUTH, timeout=120)


def test_a_verifier_scores(lf: LocalfleetProcess, instance: str) -> None:
    code = (
        "def verify(env, final_answer=None):\n"
        "    env.instance.load()\n"
        "    n = len(env.db('current').table('notes').all())\n"
        "    print('notes:', n)\n"
        "    return TASK_SUCCESSFUL_SCORE if n == 50 and final_answer == 'ok' else TASK_FAILED_SCORE\n"
        "def helper():\n    return 0\n"
    )
    r = execute(lf, instance, code, kwargs={"final_answer": "ok"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["success"] is True and out["result"] == 1 and "notes: 50" in out["stdout"]
    assert out["execution_time_ms"] >= 0 and out["error"] is None
    assert execute(lf, instance, code, kwargs={"final_answer": "no"}).json()["result"] == 0


def test_a_verifier_that_raises_is_a_failure_not_a_zero(lf: LocalfleetProcess, instance: str) -> None:
    code = "def verify(env, final_answer=None):\n    print('about to fail')\n    raise ValueError('table missing')\n"
    out = execute(lf, instance, code).json()
    assert out["success"] is False and out["result"] is None
    assert out["error"]["type"] == "ValueError" and "table missing" in out["error"]["message"]
    assert "Traceback" in out["error"]["traceback"] and "about to fail" in out["stdout"]


def test_a_verifier_past_its_timeout_is_a_failure(lf: LocalfleetProcess, instance: str) -> None:
    code = "import time\ndef verify(env, final_answer=None):\n    print('sleeping')\n    time.sleep(60)\n    return 1\n"
    started = time.monotonic()
    out = execute(lf, instance, code, timeout=1).json()
    assert time.monotonic() - started < 20
    assert out["success"] is False and out["result"] is None
    assert out["error"]["type"] == "TimeoutError" and "timed out after 1s" in out["error"]["message"]
    assert "sleeping" in out["stdout"]


def test_the_loop_stays_responsive_while_verifiers_run(lf: LocalfleetProcess, instance: str) -> None:
    code = "import time\ndef verify(env, final_answer=None):\n    time.sleep(8)\n    return 1\n"
    results: list[Any] = []
    t = threading.Thread(target=lambda: results.append(execute(lf, instance, code).json()))
    t.start()
    assert lf.pid is not None
    _running_children(psutil.Process(lf.pid))
    started = time.monotonic()
    assert httpx.get(f"{lf.base_url}/health", timeout=10).status_code == 200
    assert time.monotonic() - started < 4.0  # not held for the verifier's 8 s (room for a loaded machine)
    t.join(timeout=60)
    assert results and results[0]["result"] == 1


def test_the_subprocess_is_isolated(lf: LocalfleetProcess, instance: str) -> None:
    code = (
        "import os, sqlite3\n"
        "def verify(env, final_answer=None):\n"
        "    assert 'SUPER_SECRET_TOKEN' not in os.environ, 'environment leaked'\n"
        "    conn = sqlite3.connect('current.db')\n"  # the copy in the run's own directory
        "    conn.execute('DELETE FROM notes'); conn.commit()\n"
        "    return sorted(os.environ)\n"
    )
    out = execute(lf, instance, code).json()
    assert out["success"] is True, out
    assert set(out["result"]) <= {"PATH", "HOME", "LANG", "TMPDIR", "LC_CTYPE"}
    q = httpx.post(
        f"{lf.base_url}/instances/{instance}/api/v1/env/resources/sqlite/current/query",
        json={"query": "SELECT COUNT(*) FROM notes"},
    ).json()
    assert q["rows"] == [[50]]  # the instance's database was not touched


def test_memory_is_limited(lf: LocalfleetProcess, instance: str) -> None:
    code = "def verify(env, final_answer=None):\n    blob = bytearray(2 * 1024 ** 3)\n    return len(blob)\n"
    out = execute(lf, instance, code).json()
    assert out["success"] is False and out["error"]["type"] == "MemoryError"


def test_open_files_are_limited(lf: LocalfleetProcess, instance: str) -> None:
    """The sandbox's open-files cap (the mcp provider's path: tests/unit/test_child_process.py)."""
    code = "def verify(env, final_answer=None):\n    files = [open('input.json') for _ in range({n})]\n    return 1\n"
    out = execute(lf, instance, code.format(n=Limits().open_files)).json()
    assert out["success"] is False and "Too many open files" in out["error"]["message"]
    assert execute(lf, instance, code.format(n=10)).json()["result"] == 1


def test_a_pickled_function_is_refused_over_http(lf: LocalfleetProcess, instance: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = base64.b64encode(
        pickle.dumps({"args": (None, _Exploit(str(marker)), {"env": instance}), "kwargs": {}})
    ).decode()
    r = execute(lf, instance, "def verify(env, x=None):\n    return 1\n", args=payload)
    assert r.status_code == 400 and "refused global" in r.json()["detail"]
    assert not marker.exists()
    r = execute(
        lf,
        instance,
        "def verify(env, x=None):\n    return 1\n",
        args=_b64({"args": (None, lambda: 1, {"env": instance}), "kwargs": {}}),
    )
    assert r.status_code == 400 and "refused global" in r.json()["detail"]


def test_bundle_cache_and_bad_requests(lf: LocalfleetProcess, instance: str) -> None:
    code = "def verify(env, final_answer=None):\n    return 1\n"
    b64 = bundle(code)
    sha = hashlib.sha256(base64.b64decode(b64)).hexdigest()
    assert httpx.get(f"{lf.base_url}/v1/verifiers/check", params={"sha256": sha}, headers=AUTH).json() == {
        "success": False
    }
    assert execute(lf, instance, code, bundle_b64=b64).json()["result"] == 1
    assert httpx.get(f"{lf.base_url}/v1/verifiers/check", params={"sha256": sha}, headers=AUTH).json()["success"]
    body = {"sha256": "f" * 64, "args": _b64({"args": (None, {"env": instance}), "kwargs": {}})}
    r = httpx.post(f"{lf.base_url}/v1/verifiers/execute", json=body, headers=AUTH)
    assert r.status_code == 400 and "not found" in r.json()["detail"]
    body = {"bundle": bundle(code), "args": _b64({"args": (None,), "kwargs": {}})}
    r = httpx.post(f"{lf.base_url}/v1/verifiers/execute", json=body, headers=AUTH)
    assert r.status_code == 400 and "name no instance" in r.json()["detail"]
    body = {"bundle": bundle(code), "args": _b64({"args": (None, {"env": "gone"}), "kwargs": {}})}
    assert httpx.post(f"{lf.base_url}/v1/verifiers/execute", json=body, headers=AUTH).status_code == 404


def test_manager_execute_verifier_function(lf: LocalfleetProcess, instance: str) -> None:
    url = f"{lf.base_url}/instances/{instance}/api/v1/env/execute_verifier_function"
    ok = httpx.post(
        url,
        json={
            "function_code": "def v(before, after, transcript=None):\n    return 1 if transcript == 'yes' else 0\n",
            "function_name": "v",
            "text_solution": "yes",
        },
        timeout=60,
    ).json()
    assert ok["success"] is True and ok["result"] == 1
    bad = httpx.post(
        url,
        json={"function_code": "def v(env, final_answer=None):\n    raise KeyError('x')\n", "function_name": "v"},
        timeout=60,
    ).json()
    assert bad["success"] is False and bad["error"].startswith("KeyError")


def test_a_running_verifier_dies_with_localfleet() -> None:
    with LocalfleetProcess(environments="tests.support.localfleet:tiny_environments") as proc:
        r = httpx.post(f"{proc.base_url}/v1/env/instances", json={"env_key": "notes"}, headers=AUTH, timeout=30)
        iid = r.json()["instance_id"]
        code = "import time\ndef verify(env, final_answer=None):\n    time.sleep(120)\n    return 1\n"
        threading.Thread(target=lambda: _swallow(lambda: execute(proc, iid, code)), daemon=True).start()
        assert proc.pid is not None
        children = _running_children(psutil.Process(proc.pid))
        proc.kill()
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive


def _running_children(parent: psutil.Process, within_s: float = 30.0) -> list[psutil.Process]:
    """The child processes of `parent` once it has one (a verifier running), polled within `within_s`."""
    children: list[psutil.Process] = wait_until_sync(parent.children, within_s, "a verifier subprocess started")
    return children


def _swallow(fn: Any) -> None:
    with contextlib.suppress(httpx.HTTPError):
        fn()
