"""Train an agent with the Tinker cookbook's RL loop on rlgate tasks. Needs the tinker extra:
`.venv/bin/pip install -e '.[tinker]'`.

    export RLGATE_ORCHESTRATOR=127.0.0.1:50051   # and RLGATE_API_KEY if needed; TINKER_API_KEY for Tinker
    python examples/tinker_rlgate.py model_name=Qwen/Qwen3-8B groups_per_batch=8 group_size=4

`RlgateDatasetBuilder` lists the orchestrator's tasks (or takes `tasks=key1,key2`), and every training batch
is a set of `RlgateEnvGroupBuilder`s: each opens its sessions lazily when the cookbook asks for the first
observation and closes every one in `cleanup()`. A verifier failure fails the rollout (use
`rollout_error_tolerance=True` to retry it) instead of counting as reward 0.
"""

from __future__ import annotations

import asyncio
import sys

try:
    import chz
    from tinker_cookbook import cli_utils, model_info
    from tinker_cookbook.rl import train

    from rlgate.adapters.tinker import RlgateDatasetBuilder
except ModuleNotFoundError as missing:  # said as one sentence, not a traceback
    sys.exit(f"{__file__} needs the tinker extra: .venv/bin/pip install -e '.[tinker]' (missing: {missing.name})")

DEFAULT_MODEL = "Qwen/Qwen3-8B"


@chz.chz
class CLIConfig:
    model_name: str = DEFAULT_MODEL
    orchestrator: str = ""  # empty: RLGATE_ORCHESTRATOR
    tasks: str = "all"
    test_tasks: str = ""
    groups_per_batch: int = 8
    group_size: int = 4
    max_turns: int = 12
    max_tokens: int = 1024
    learning_rate: float = 4e-5
    epochs: int = 1
    log_path: str = "/tmp/tinker-rlgate"
    rollout_error_tolerance: bool = True


def build_config(cli: CLIConfig) -> train.Config:
    renderer_name = model_info.get_recommended_renderer_name(cli.model_name)
    dataset = RlgateDatasetBuilder(
        renderer_name=renderer_name,
        model_name_for_tokenizer=cli.model_name,
        orchestrator=cli.orchestrator,
        tasks=cli.tasks,
        test_tasks=cli.test_tasks,
        batch_size=cli.groups_per_batch,
        group_size=cli.group_size,
        max_turns=cli.max_turns,
        epochs=cli.epochs,
        run_id="tinker-rlgate",
    )
    return train.Config(
        model_name=cli.model_name,
        recipe_name="rlgate",
        renderer_name=renderer_name,
        dataset_builder=dataset,
        learning_rate=cli.learning_rate,
        max_tokens=cli.max_tokens,
        log_path=cli.log_path,
        eval_every=0,
        rollout_error_tolerance=cli.rollout_error_tolerance,
    )


def main(cli: CLIConfig) -> None:
    config = build_config(cli)
    cli_utils.check_log_dir(config.log_path, behavior_if_exists="ask")
    asyncio.run(train.main(config))


if __name__ == "__main__":
    main(chz.entrypoint(CLIConfig, argv=sys.argv[1:]))
