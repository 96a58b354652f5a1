"""Render docs/configuration.md from the config dataclasses (`python -m rlgate.devtools.configdoc`).

A test compares the committed file with this output, so the reference never drifts from the code."""

from __future__ import annotations

import sys
from pathlib import Path

from rlgate.runtime.config import _flag_name, fields_of


def _configs() -> list[tuple[str, type]]:
    from rlgate.devtools.stack import UpConfig
    from rlgate.localfleet.config import LocalfleetConfig
    from rlgate.orchestrator.config import OrchestratorConfig
    from rlgate.toolgateway.config import GatewayConfig

    return [
        ("rlgate orchestrator", OrchestratorConfig),
        ("rlgate toolgateway", GatewayConfig),
        ("rlgate localfleet", LocalfleetConfig),
        ("rlgate up", UpConfig),
    ]


def render() -> str:
    lines = [
        "# Configuration",
        "",
        "Generated from the config dataclasses by `python -m rlgate.devtools.configdoc docs/configuration.md`;",
        "a test fails when this file and the code disagree. Precedence: flag > environment variable > default.",
        "Secrets are never logged (start-up logs show `***`). An MCP endpoint URL may carry a key in its userinfo",
        "or query: wherever one leaves a process (log lines, error statuses, the tool specs an agent sees, spans)",
        "it is shown without them, a removed query as `?…` (`rlgate.core.redact`); routing uses it whole.",
        "",
    ]
    for command, cls in _configs():
        lines += [f"## `{command}`", "", "| flag | environment variable | default | meaning |", "|---|---|---|---|"]
        for f, _kind in fields_of(cls):
            default = f.default if not callable(f.default_factory) else f.default_factory()
            shown = "(secret)" if f.metadata["secret"] else f"`{default}`" if default not in ("", []) else "(empty)"
            meaning = f.metadata["help"].replace("|", "\\|")  # a pipe in the text would end the table cell
            lines.append(f"| `{_flag_name(f)}` | `{f.metadata['env']}` | {shown} | {meaning} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    text = render()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(text)
    else:
        print(text)
