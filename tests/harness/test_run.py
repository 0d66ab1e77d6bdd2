"""The runner end to end: results on disk, and clear errors before any weights load."""

import json
import os
import subprocess
import sys

import pytest

from kvcore.errors import ConfigError
from harness.run import run
from tests.conftest import PROJECT, STORIES, need_shared
from tests.helpers.runs import cfg_for


def test_stories_run_writes_complete_results(tmp_path):
    need_shared(STORIES)
    out = run(cfg_for("model=stories260k", "task.max_tokens=300", "task.dataset=pg19",
                      f"runner.results_root={tmp_path}"))
    assert out.parent == tmp_path / "perplexity" / "stories260k" / "full"
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("accuracy", "speed", "memory", "kv", "model", "method", "task", "env", "protocol"):
        assert key in metrics
    assert metrics["accuracy"]["tokens_scored"] == 299
    assert metrics["kv"]["tokens_per_layer"] == [299.0] * 5
    assert metrics["speed"]["decode_steps"] == 299
    assert metrics["env"]["versions"]["transformers"] == "5.24.0"
    assert metrics["env"]["git"]["commit"] is None or len(metrics["env"]["git"]["commit"]) == 40
    assert (out / "config.yaml").is_file() and (out / "samples.jsonl").is_file()
    assert not [p for p in tmp_path.rglob(".*partial*")]


@pytest.mark.parametrize("overrides, message", [
    (["runner.prefill_chunk_tokens=0"], "runner.prefill_chunk_tokens=0 must be a positive integer"),
    (["runner.batch_size=2"], "runner.batch_size=2"),
    (["runner.attn_impl=flash"], "runner.attn_impl='flash'; allowed: sdpa, eager"),
    (["task.mode=sliding"], "task.mode='sliding'; allowed: chunked, streaming"),
    (["task.dataset=wikitext103"], "task.dataset='wikitext103'"),
    (["model.dtype=float8"], "model.dtype='float8'; allowed"),
    (["model.device=tpu"], "model.device='tpu'; allowed: auto, cpu, cuda"),
    (["model=hf"], "model=hf needs model.name_or_path"),
    (["model=hf", "model.name_or_path=/nonexistent/model"], "no such folder"),
    (["model=stories260k", "task.max_tokens=600"], "longer than the model's max positions (512)"),
    (["model=stories260k", "task.mode=chunked", "task.window_tokens=1024"],
     "task.window_tokens=1024 is longer than the model's max positions"),
    (["model=stories260k", "task.dataset=text_file"], "task.dataset=text_file needs task.path"),
])
def test_config_errors_name_the_key_before_weights(overrides, message, no_weight_loading, tmp_path):
    if any("stories260k" in o for o in overrides):
        need_shared(STORIES)
    with pytest.raises(ConfigError) as err:
        run(cfg_for(*overrides, f"runner.results_root={tmp_path}"))
    assert message in str(err.value)
    assert not any(tmp_path.iterdir())


def test_cuda_requested_without_cuda(no_weight_loading):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        run(cfg_for("model.device=cuda"))


def _cli(*args):
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=PROJECT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, expect", [
    (["method=nosuch"], "Could not find 'method/nosuch'"),
    (["task=nosuch"], "Could not find 'task/nosuch'"),
    (["method.budgte_ratio=0.2"], "budgte_ratio"),
    (["runner.prefill_chunk_tokens=-5"], "error: runner.prefill_chunk_tokens=-5 must be a positive"),
])
def test_cli_errors_exit_nonzero_with_one_message(args, expect, tmp_path):
    proc = _cli(*args, f"runner.results_root={tmp_path}")
    assert proc.returncode != 0
    assert expect in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())
