"""Runs of the runner for tests: a composed config, the CLI in a subprocess or in this process,
a refusal's one line, and a tiny local model folder."""

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from harness.run import run
from kvcore.errors import ConfigError
from tests.conftest import PROJECT, STORIES

ST = ["model=stories260k", "task.max_tokens=40"]


def cfg_for(*overrides):
    with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def cli(*args, module="harness", env=None, timeout=300):
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "WANDB_MODE": "offline", **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=PROJECT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def cli_here(monkeypatch, *args, env=None, entry=None) -> tuple[int, str, str]:
    """`python -m harness *args` run in this process (`harness.__main__.cli`, what the module
    and the console script call; or another command's `entry`): exit status, stdout, stderr.

    For commands refused before anything loads, where a subprocess would spend its seconds
    importing torch and transformers; `cli` above keeps the real process for what only a
    process shows (signals, interpreter start). With tracebacks asked for, the error propagates
    as the CLI raises it. The environment, signal handlers and Hydra's run config (which
    in-process runs read) that the CLI sets are put back. Hydra's job logging is left off
    (`hydra/job_logging=none`): its `dictConfig` closes every logging handler of the process,
    the test runner's included."""
    from hydra.core.hydra_config import HydraConfig

    from harness.__main__ import cli

    monkeypatch.setattr(sys, "argv", ["harness", *args, "hydra/job_logging=none"])
    for key, value in {"HYDRA_FULL_ERROR": "0", "WANDB_MODE": "offline", **(env or {})}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("KVH_FULL_ERROR", raising=False)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    hydra_run = HydraConfig.instance().cfg
    out, err, status = io.StringIO(), io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            (entry or cli)()
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        HydraConfig.instance().cfg = hydra_run
    return status, out.getvalue(), err.getvalue()


def refused(tmp_path, *overrides) -> str:
    """The one-line ConfigError for these overrides (before weights), nothing written."""
    root = tmp_path / "results"
    given = any(o.startswith("runner.results_root=") for o in overrides)
    with pytest.raises(ConfigError) as err:
        run(cfg_for(*overrides, *([] if given else [f"runner.results_root={root}"])))
    assert "\n" not in str(err.value)
    assert not root.exists(), "a refused run created folders"
    return str(err.value)


def model_folder(root: Path, name: str, tokenizer: bool = True, **config) -> Path:
    """A tiny Llama saved to `root/name` (stories260K's tokenizer when `tokenizer`), its
    config.json then edited with `config`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = root / name
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=256)).save_pretrained(folder)
    if tokenizer:
        for f in STORIES.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, folder / f.name)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder
