"""rlgate.orchestrator: the orchestration plane (Reset/Step/State/Close) — see docs/orchestrator.md.

Entry points: `rlgate.orchestrator.server.start_orchestrator(config, store=None)` (in-process) and
`rlgate.orchestrator.server.run(config)` (the `rlgate orchestrator` command)."""
