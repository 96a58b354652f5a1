"""A log line is one line: what agents and upstreams write cannot forge another."""

from __future__ import annotations

import io
import json
import logging

import pytest

from rlgate.runtime.logs import one_line, setup_logging


def test_one_line_escapes_control_characters() -> None:
    assert one_line("a\nb\rc\x1b[31md\u2028e\tf") == "a\\nb\\rc\\x1b[31md\\u2028e\tf"
    assert one_line("plain text ünïcode") == "plain text ünïcode"


@pytest.mark.parametrize("json_format", [False, True])
def test_a_newline_in_a_tool_name_cannot_forge_a_log_line(json_format: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    setup_logging("INFO", json_format=json_format)
    try:
        logging.getLogger("rlgate.test").warning("unknown tool %r", "x\n2026-01-01 INFO forged line")
        logging.getLogger("rlgate.test").warning("tool %s", "y\r\nERROR forged")
    finally:
        setup_logging("WARNING")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines
    if json_format:
        assert [json.loads(line)["level"] for line in lines] == ["WARNING", "WARNING"]


def test_nel_and_other_c1_controls_are_escaped() -> None:
    assert one_line("a\x85b\x9bc") == "a\\x85b\\x9bc"
    assert len(one_line("x\x85INFO forged").splitlines()) == 1


def test_grpcio_never_logs_a_metadata_value_it_cannot_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    setup_logging("INFO")
    try:
        logging.getLogger("grpc._cython.cygrpc").error("Invalid encoding on %s", b"Bearer sk-secret-key\xff")
    finally:
        setup_logging("WARNING")
    text = stream.getvalue()
    assert "sk-secret-key" not in text and "Invalid encoding on a metadata value" in text
