"""A log line is one line: what agents and upstreams write cannot forge another. A URL that leaves the
process (a log line, an error status, a tool spec an agent sees) carries no userinfo or query."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import time
from collections.abc import Iterator

import mcp_types as mt
import pytest

from rlgate.core.errors import Unavailable
from rlgate.core.redact import public_url, redact_urls
from rlgate.mcpclient.catalog import union_tools
from rlgate.runtime.logs import one_line, setup_logging


@contextlib.contextmanager
def logged(monkeypatch: pytest.MonkeyPatch, json_format: bool = False) -> Iterator[io.StringIO]:
    """What the services' logging writes while the block runs (it is set back to WARNING after)."""
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    setup_logging("INFO", json_format=json_format)
    try:
        yield stream
    finally:
        setup_logging("WARNING")


def test_one_line_escapes_control_characters() -> None:
    assert one_line("a\nb\rc\x1b[31md\u2028e\tf") == "a\\nb\\rc\\x1b[31md\\u2028e\tf"
    assert one_line("plain text ünïcode") == "plain text ünïcode"


@pytest.mark.parametrize("json_format", [False, True])
def test_a_newline_in_a_tool_name_cannot_forge_a_log_line(json_format: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    with logged(monkeypatch, json_format) as stream:
        logging.getLogger("rlgate.test").warning("unknown tool %r", "x\n2026-01-01 INFO forged line")
        logging.getLogger("rlgate.test").warning("tool %s", "y\r\nERROR forged")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines
    if json_format:
        assert [json.loads(line)["level"] for line in lines] == ["WARNING", "WARNING"]


def test_nel_and_other_c1_controls_are_escaped() -> None:
    assert one_line("a\x85b\x9bc") == "a\\x85b\\x9bc"
    assert len(one_line("x\x85INFO forged").splitlines()) == 1


def test_grpcio_never_logs_a_metadata_value_it_cannot_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    with logged(monkeypatch) as stream:
        logging.getLogger("grpc._cython.cygrpc").error("Invalid encoding on %s", b"Bearer sk-secret-key\xff")
    text = stream.getvalue()
    assert "sk-secret-key" not in text and "Invalid encoding on a metadata value" in text


SECRET_URL = "https://agent:s3cret-pass@fleet.example/instances/i-1/mcp?token=s3cret-token#frag"


def test_a_url_is_shown_without_what_may_carry_a_key() -> None:
    assert public_url(SECRET_URL) == "https://fleet.example/instances/i-1/mcp?…"
    assert public_url("http://127.0.0.1:8080/mcp") == "http://127.0.0.1:8080/mcp"  # nothing to take out
    text = f"connect to {SECRET_URL}: refused; then 'http://u:p@h/x?k=v'."
    assert redact_urls(text) == "connect to https://fleet.example/instances/i-1/mcp?…: refused; then 'http://h/x?…'."
    assert redact_urls("no url here: a?b=c") == "no url here: a?b=c"


def test_redacting_costs_time_linear_in_the_text() -> None:
    """Messages carry what upstreams wrote: no text makes the URL pattern backtrack over it."""
    for text in ("a." * 200_000 + "://x", "http://" + "u" * 200_000 + " tail", ("http://" + "x" * 600) * 300):
        started = time.perf_counter()
        redact_urls(text)
        assert (
            time.perf_counter() - started < 10.0
        )  # generous (a loaded machine): a linear scan is far below it; backtracking, minutes


@pytest.mark.parametrize("json_format", [False, True])
def test_a_url_in_a_log_line_or_traceback_carries_no_key(json_format: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    with logged(monkeypatch, json_format) as stream:
        log = logging.getLogger("rlgate.test")
        log.warning("endpoint %s unreachable", SECRET_URL)
        try:
            raise ConnectionError(f"cannot connect to {SECRET_URL}")
        except ConnectionError:
            log.exception("listing failed")
    text = stream.getvalue()
    shown = text if not json_format else "".join(json.loads(line)["msg"] + json.loads(line).get("exc", "")
                                                 for line in text.splitlines())  # fmt: skip
    assert "s3cret" not in text and shown.count("https://fleet.example/instances/i-1/mcp?…") == 2, text


def test_an_error_status_carries_no_key() -> None:
    error = Unavailable(f"no MCP handshake with {SECRET_URL}", metadata={"endpoint": SECRET_URL})
    status = error.to_status()
    assert "s3cret" not in status.message and "s3cret" not in str(status.details), status


def test_an_agent_sees_endpoints_without_keys() -> None:
    spec = union_tools([(SECRET_URL, [mt.Tool(name="t", input_schema={"type": "object"})])]).specs()[0]
    assert spec.endpoint == "https://fleet.example/instances/i-1/mcp?…"
    routed = union_tools([(SECRET_URL, [mt.Tool(name="t", input_schema={"type": "object"})])]).get("t")
    assert routed is not None and routed.endpoint == SECRET_URL  # routing keeps the URL whole
