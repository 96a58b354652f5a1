"""`python -m rlgate.localfleet [flags]` == `rlgate localfleet [flags]` (same command, same flags)."""

from __future__ import annotations

from rlgate.cli import cli

if __name__ == "__main__":
    cli(args=["localfleet", *__import__("sys").argv[1:]], prog_name="python -m rlgate.localfleet")
