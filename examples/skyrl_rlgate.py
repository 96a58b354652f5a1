"""Train an agent with SkyRL on rlgate tasks. Needs the skyrl extra: `.venv/bin/pip install -e '.[skyrl]'`.

1. Start the stack (`make up`, or your deployed orchestrator) and point at it:
       export RLGATE_ORCHESTRATOR=127.0.0.1:50051   # RLGATE_API_KEY too if the orchestrator wants one
2. Write the dataset: one row per task, env_class "rlgate"; every column except `prompt` reaches the env
   as `extras` (SkyRL hands custom envs an empty env_config), so `task_key` travels there:
       python examples/skyrl_rlgate.py prepare --out data/rlgate
3. Train with SkyRL's usual overrides (needs `pip install skyrl[fsdp]` and GPUs):
       python examples/skyrl_rlgate.py train data.train_data="['data/rlgate/train.parquet']" \\
           data.val_data="['data/rlgate/val.parquet']" environment.env_class=rlgate \\
           generator.max_turns=12 trainer.policy.model.path=Qwen/Qwen3-8B ...

The env is registered inside the Ray entrypoint task, like SkyRL's own examples, by import path
(`rlgate.adapters.skyrl:RlgateTextEnv`), so every Ray worker can build it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

try:
    from rlgate.adapters.skyrl import register
except ModuleNotFoundError as missing:  # said as one sentence, not a traceback
    sys.exit(f"{__file__} needs the skyrl extra: .venv/bin/pip install -e '.[skyrl]' (missing: {missing.name})")


def dataset_rows(orchestrator: str, api_key: str | None = None) -> list[dict[str, Any]]:
    """One SkyRL dataset row per rlgate task. The prompt is a placeholder: the env's init() replaces it
    with the task's own prompt and the tool list from Reset."""
    import rlgate

    with rlgate.Client(orchestrator, api_key=api_key) as client:
        tasks = client.list_tasks()
    return [
        {
            "prompt": [{"role": "user", "content": task.prompt}],
            "env_class": "rlgate",
            "task_key": task.key,
            "data_source": f"rlgate/{task.env_id}",
        }
        for task in tasks
    ]


def prepare(out: Path, orchestrator: str, val_every: int = 5) -> None:
    import pandas as pd

    rows = dataset_rows(orchestrator, os.environ.get("RLGATE_API_KEY"))
    out.mkdir(parents=True, exist_ok=True)
    val = rows[::val_every]
    train = [r for r in rows if r not in val]
    pd.DataFrame(train).to_parquet(out / "train.parquet")
    pd.DataFrame(val).to_parquet(out / "val.parquet")
    print(f"{len(train)} train and {len(val)} validation tasks written to {out}")


def skyrl_entrypoint(cfg: Any) -> None:
    """Runs inside Ray: register the env in this process, then train."""
    from skyrl.train.entrypoints.main_base import BasePPOExp

    register()
    BasePPOExp(cfg).run()


def train(overrides: list[str]) -> None:
    import ray
    from skyrl.train.config import SkyRLTrainConfig
    from skyrl.train.entrypoints.main_base import validate_cfg
    from skyrl.train.utils import initialize_ray

    cfg = SkyRLTrainConfig.from_cli_overrides(overrides)
    validate_cfg(cfg)
    initialize_ray(cfg)
    ray.get(ray.remote(num_cpus=1)(skyrl_entrypoint).remote(cfg))


def main(argv: list[str]) -> None:
    if argv[:1] == ["prepare"]:
        out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else Path("data/rlgate")
        prepare(out, os.environ.get("RLGATE_ORCHESTRATOR", "127.0.0.1:50051"))
    elif argv[:1] == ["train"]:
        train(argv[1:])
    else:
        print(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
