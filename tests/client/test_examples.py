"""The examples stay importable and wired to the adapters (they are imported, not run: training needs
GPUs / a Tinker key)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"rlgate_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # chz resolves annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_skyrl_example_registers_the_env() -> None:
    import skyrl_gym

    module = _load("skyrl_rlgate")
    module.register()
    assert skyrl_gym.spec("rlgate").entry_point == "rlgate.adapters.skyrl:RlgateTextEnv"
    assert callable(module.skyrl_entrypoint) and callable(module.prepare) and callable(module.dataset_rows)


def test_tinker_example_wires_the_dataset_builder_into_the_rl_loop() -> None:
    from tinker_cookbook.rl import train

    from rlgate.adapters.tinker import RlgateDatasetBuilder

    module = _load("tinker_rlgate")
    config = module.build_config(module.CLIConfig(model_name="Qwen/Qwen3-8B", orchestrator="127.0.0.1:1", group_size=2))
    assert isinstance(config, train.Config)
    assert isinstance(config.dataset_builder, RlgateDatasetBuilder)
    assert config.dataset_builder.group_size == 2 and config.dataset_builder.orchestrator == "127.0.0.1:1"


def test_an_example_without_its_extra_says_which_to_install() -> None:
    import subprocess

    for name, blocked, extra in (
        ("skyrl_rlgate", "skyrl_gym", "skyrl"),
        ("tinker_rlgate", "tinker_cookbook", "tinker"),
    ):
        code = (
            f"import runpy, sys; sys.modules[{blocked!r}] = None; sys.argv = ['x']; "
            f"runpy.run_path({str(EXAMPLES / f'{name}.py')!r}, run_name='__main__')"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert done.returncode == 1, done.stderr
        assert f"needs the {extra} extra: .venv/bin/pip install -e '.[{extra}]'" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr, done.stderr
