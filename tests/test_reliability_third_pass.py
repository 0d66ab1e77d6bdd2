"""Reliability, third pass: every knob checked before the weights load (`+` keys too),
finite numbers, options that do not apply refused, inactive methods never certified, one line
instead of a traceback, bounded memory and signals, and nothing of a user's destroyed.

Grouped by kind: folders, accepted wrongly, tracebacks, unclear, memory and signals,
model naming. Most cases are refused before any weights load (the `no_weights` fixture)."""

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from harness import check, models
from harness.run import run
from kvcore.errors import ConfigError
from tests.conftest import DATA, PROJECT, STORIES, need_shared
from tests.harness.test_report_check import fake_run


@pytest.fixture(autouse=True)
def shared():
    need_shared(STORIES)
    need_shared(DATA)


@pytest.fixture
def no_weights(monkeypatch):
    """Loading weights fails the test: the error must come before."""
    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the bad input was refused")

    monkeypatch.setattr(models, "load_model", refuse)


def cfg(*overrides):
    with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
        return compose("config", list(overrides))


def cli(*args, module="harness", env=None, timeout=300):
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "WANDB_MODE": "offline", **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=PROJECT, env=env,
                          capture_output=True, text=True, timeout=timeout)


ST = ["model=stories260k", "task.max_tokens=40"]


def refused(tmp_path, *overrides) -> str:
    """The one-line ConfigError for these overrides (before weights), nothing written."""
    root = tmp_path / "results"
    given = any(o.startswith("runner.results_root=") for o in overrides)
    with pytest.raises(ConfigError) as err:
        run(cfg(*overrides, *([] if given else [f"runner.results_root={root}"])))
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


# --- A user's folder destroyed --------------------------------------------------------------

def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_staging_cleanup_spares_a_users_folder_named_like_one(tmp_path):
    from harness.results import STAGING_MARK, RunFolder

    pid = _dead_pid()
    users = tmp_path / f".backup.partial-{pid}-important"  # named like a staging folder
    users.mkdir()
    (users / "thesis.tex").write_text("years of work")
    ours = tmp_path / f".old.partial-{pid}-x1y2"  # a killed run's staging, with its mark
    ours.mkdir()
    (ours / STAGING_MARK).write_text(json.dumps({"harness": "kv-harness", "pid": pid,
                                                 "start": None}))
    folder = RunFolder(tmp_path / "newrun")
    folder.abandon()
    assert (users / "thesis.tex").read_text() == "years of work"
    assert not ours.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [users.name]


def test_sweep_into_a_users_folder_is_refused(tmp_path):
    users = tmp_path / "mine"
    users.mkdir()
    (users / "multirun.yaml").write_text("my own notes\n")
    proc = cli("-m", *ST, "method=full,h2o", f"runner.results_root={tmp_path / 'r'}",
               f"hydra.sweep.dir={users}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "is a non-empty folder that is not a sweep of this harness" in proc.stderr
    assert (users / "multirun.yaml").read_text() == "my own notes\n"
    assert sorted(p.name for p in users.iterdir()) == ["multirun.yaml"]
    assert not (tmp_path / "r").exists()


def test_a_failing_run_leaves_no_empty_result_folders(tmp_path, monkeypatch):
    from tasks.perplexity import Perplexity

    root = tmp_path / "results"
    monkeypatch.setattr(Perplexity, "evaluate", lambda self, engine: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        run(cfg(*ST, f"runner.results_root={root}"))
    assert not root.exists()
    monkeypatch.undo()

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(ConfigError, match="nothing was written"):
        run(cfg(*ST, f"runner.results_root={root}"))
    assert not root.exists()


def test_output_dir_inside_another_run_is_refused(tmp_path, no_weights):
    outer = fake_run(tmp_path / "r", "full", 50.0, 100.0)
    message = refused(tmp_path, *ST, f"runner.output_dir={outer / 'inner'}")
    assert f"is inside the run folder {outer}" in message
    message = refused(tmp_path, *ST, f"runner.output_dir={outer / 'a' / 'b'}")
    assert "inside the run folder" in message
    assert sorted(p.name for p in outer.iterdir()) == ["metrics.json"]


def test_refused_sweep_leaves_no_sweep_folder(tmp_path):
    root = tmp_path / "r"
    proc = cli("-m", *ST, "model=stories260k,hf", "model.path=/x", f"runner.results_root={root}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "model.path is not a key of model=hf" in proc.stderr
    assert not root.exists(), sorted(map(str, root.rglob("*")))


# --- Accepted as if fine --------------------------------------------------------------------

@pytest.mark.parametrize("override, expect", [
    ("+runner.foo=1", "runner.foo is not a key of runner=default"),
    ("+runner.foo=null", "runner.foo is not a key of runner=default"),
    ("++runner.foo=1", "runner.foo is not a key of runner=default"),
    ("++runner.batchsize=2", "the closest allowed name is runner.batch_size"),
    ("+model.foo=1", "model.foo is not a key of model=stories260k"),
    ("+model.pth=/x", "the closest allowed name is model.path"),
    ("+foo=1", "foo is not a config group"),
    ("+hardware.foo=1", "hardware.foo is not a key of hardware=none"),
    ("+logger.foo=1", "logger.foo is not a key of logger=none"),
    ("+method.foo=null", "method.foo is not a hyperparameter of method=full"),
])
def test_added_keys_are_checked_against_the_schema(override, expect, tmp_path, no_weights):
    assert expect in refused(tmp_path, *ST, override)


def test_hydras_struct_hint_names_the_closest_key_not_plus():
    from harness.__main__ import one_line

    with pytest.raises(Exception) as err:
        cfg("runner.batchsize=2")
    line = one_line(err.value)
    assert "the closest allowed name is runner.batch_size" in line and "+runner" not in line


def test_sweep_with_an_added_unknown_key_is_refused_before_any_member(tmp_path):
    root = tmp_path / "r"
    proc = cli("-m", *ST, "+runner.foo=1,2", f"runner.results_root={root}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "runner.foo is not a key of runner" in proc.stderr
    assert not root.exists()


@pytest.mark.parametrize("overrides, expect", [
    (["method=infinigen", "method.alpha=nan"], "method.alpha=nan must be a finite number"),
    (["method=infinigen", "method.alpha=inf"], "method.alpha=inf must be a finite number"),
    (["method=razor_attention", "method.compression_ratio=inf"], "method.compression_ratio=inf"),
    (["runner.kv_layout=paged", "runner.kv_device_limit_mib=nan"],
     "runner.kv_device_limit_mib=nan must be a finite number"),
    (["task=ruler", "runner.kv_layout=paged", "runner.kv_device_limit_mib=inf"],
     "runner.kv_device_limit_mib=inf must be a finite number"),
    (["hardware=h200_sxm", "hardware.link_gb_per_s=nan"], "hardware.link_gb_per_s=nan"),
    (["hardware=h200_sxm", "hardware.link_gb_per_s=-1"], "hardware.link_gb_per_s=-1 must be > 0"),
    (["hardware=pcie4_a100", "hardware.device_memory_gib=0"], "device_memory_gib=0 must be > 0"),
])
def test_non_finite_numbers_are_refused(overrides, expect, tmp_path, no_weights):
    base = ST if "task=ruler" not in overrides else ["model=stories260k"]
    assert expect in refused(tmp_path, *base, *overrides)


def test_every_float_knob_of_every_method_refuses_nan_and_inf():
    """From the dataclass annotations, for every method alike (lm-eval's model_args too)."""
    from kvcore.typecheck import _wants, field_types
    from methods import available_methods, build_method, method_class

    checked = 0
    for name in available_methods():
        for key, tp in field_types(method_class(name)).items():
            if not _wants(tp, float):
                continue
            for value in (float("nan"), float("inf"), float("-inf")):
                with pytest.raises(ConfigError, match=f"method.{key}=.* must be a finite number"):
                    build_method(name, **{key: value})
            checked += 1
    assert checked >= 20


@pytest.mark.parametrize("config, expect", [
    ({"max_position_embeddings": 0}, "max_position_embeddings=0 must be a positive integer"),
    ({"hidden_size": -32}, "hidden_size=-32 must be a positive integer"),
    ({"num_hidden_layers": 0}, "num_hidden_layers=0"),
    ({"num_attention_heads": 0}, "num_attention_heads=0"),
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of "
                                 "num_key_value_heads=3"),
    ({"max_position_embeddings": 1}, "leaves nothing to score"),
])
def test_a_config_that_cannot_describe_a_model_is_refused(config, expect, tmp_path, no_weights):
    folder = model_folder(tmp_path, "m", **config)
    assert expect in refused(tmp_path, "model=hf", f"model.name_or_path={folder}",
                             "model.dtype=float32")


@pytest.mark.parametrize("overrides, expect", [
    (["task.mode=chunked", "task.block_tokens=128"], "task.block_tokens=128 applies to "
                                                     "task.mode=streaming only"),
    (["task.window_tokens=128"], "task.window_tokens=128 applies to task.mode=chunked only"),
    (["task.limit=3"], "task.limit=3 applies to task.mode=chunked only"),
    (["runner.kv_block_tokens=32"], "runner.kv_block_tokens=32 applies to runner.kv_layout=paged"),
    (["task.dataset=wikitext2", f"task.path={STORIES / 'config.json'}"],
     "use it with task.dataset=text_file"),
    (["task.dataset=essays", "task.data_dir=/tmp"], "task.data_dir=/tmp: no essays at"),
    (["task=ruler", "task.data_dir=/tmp"], "task.data_dir=/tmp: no essays at"),
    (["task=ruler", "task.haystack=repeat", "task.data_dir=/tmp"], "is not read with "
                                                                   "task.haystack=repeat"),
    (["runner.output_dir=''"], "runner.output_dir='' is empty"),
    (["runner.results_root=''"], "runner.results_root='' is empty"),
    (["model.path=''"], "model.path='' is empty"),
    (["runner.overwrite=true"], "runner.overwrite=true applies to runner.output_dir only"),
    (["runner.diagnostics_every_steps=4"], "applies with runner.diagnostics=true only"),
])
def test_options_that_do_not_apply_are_refused(overrides, expect, tmp_path, no_weights):
    base = ST if "task=ruler" not in overrides else ["model=stories260k"]
    assert expect in refused(tmp_path, *base, *overrides)


def test_a_method_that_acts_after_the_only_chunk_is_refused(tmp_path, no_weights):
    """Chunked perplexity windows that fit one prefill chunk are scored before H2O compresses
    them (runner.prefill=chunked): its ppl equals full's, yet it held less (reported active).
    Under dense prefill (one compression at the prompt's end) it never acts at all."""
    base = ["model=stories260k", "method=h2o", "task.mode=chunked", "task.window_tokens=256",
            "task.max_tokens=512"]
    message = refused(tmp_path, *base, "runner.prefill=chunked")
    assert "every scored logit comes before the method acts" in message
    assert "would never act" in refused(tmp_path, *base)


def test_lm_eval_records_and_flags_an_inactive_method(capsys):
    from harness.lm_eval import __main__ as lm_main
    from harness.lm_eval.model import ACTIVITY, KVHarnessLM

    lm = KVHarnessLM(model="stories260k", method="kivi", device="cpu")  # residual > the text
    try:
        lm.score([1, 2, 3, 4], [5, 6])
        info = lm.get_model_info()
    finally:
        lm.close()
    assert info["kvharness_method_active"] is False and info["kvharness_inactive_reason"]
    lm_main.flag_inactive()
    assert "INACTIVE: method=kivi did not act" in capsys.readouterr().err
    ACTIVITY.clear()


def test_check_never_certifies_an_inactive_run(tmp_path):
    folder = fake_run(tmp_path, "h2o", 50.0, 100.0, budget=0.5)
    metrics = json.loads((folder / "metrics.json").read_text())
    metrics["kv"].update(method_active=False, inactive_reason="held the full cache")
    (folder / "metrics.json").write_text(json.dumps(metrics))
    gate = tmp_path / "gate.yaml"
    gate.write_text("thresholds:\n  - {model: stories260k, method: h2o, task: perplexity, "
                    "metric: accuracy.ppl, max: 60}\n")
    results = check.check([metrics], check.load_thresholds(gate))
    assert results[0]["ok"] is False and results[0]["why"].startswith("not comparable")
    assert check.main([str(tmp_path), "--against", str(gate)]) == 1


# --- Tracebacks instead of one line ---------------------------------------------------------

def test_huge_thread_count_is_one_line(tmp_path, no_weights):
    assert "runner.threads=100000000000 is more than this machine's" in refused(
        tmp_path, *ST, "runner.threads=100000000000")


@pytest.mark.parametrize("seed", ["-1", "4294967296", "99999999999999999999"])
def test_a_seed_numpy_cannot_take_is_one_line(seed, tmp_path, no_weights):
    """numpy's legacy seeding raised ValueError after the weights loaded."""
    assert "must be an integer in [0, 2**32 - 1]" in refused(tmp_path, *ST, f"runner.seed={seed}")


def test_tokenizer_larger_than_the_embedding_is_refused_before_the_run(tmp_path, no_weights):
    folder = model_folder(tmp_path, "small_vocab", vocab_size=100)
    message = refused(tmp_path, "model=hf", f"model.name_or_path={folder}", "model.dtype=float32")
    assert "has 512 tokens but the model's embedding has 100 rows" in message


def test_read_only_sweep_root_and_report_out_are_one_line(tmp_path, monkeypatch, capsys):
    from harness import report, results, sweep

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(ConfigError, match="runner.results_root=/ro: cannot create the sweep "
                                          "folder .*Read-only file system"):
        sweep.claim_sweep_dir(Path("/ro/_sweeps/20260101-000000"), "runner.results_root=/ro")
    monkeypatch.undo()
    fake_run(tmp_path / "runs", "full", 50.0, 100.0)
    monkeypatch.setattr(results.tempfile, "mkstemp", read_only)
    assert report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "Read-only file system" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("overrides, env, expect", [
    (["logger.mode=foo"], {}, "logger.mode='foo'; allowed: online, offline, disabled"),
    (["logger.entity=5"], {}, "logger.entity=5 must be a non-empty string"),
    (["logger.group=[a,b]"], {}, "logger.group=['a', 'b'] must be a non-empty string"),
    (["logger.project=team/proj"], {}, "logger.project='team/proj': a W&B project name"),
    ([], {"WANDB_MODE": "bogus"}, "WANDB_MODE='bogus'"),
    (["logger.mode=online"], {"WANDB_MODE": None}, "no W&B credentials are set up"),
])
def test_wandb_options_are_checked_before_the_weights(overrides, env, expect, tmp_path,
                                                      monkeypatch, no_weights):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    assert expect in refused(tmp_path, *ST, "logger=wandb", *overrides)


class _BrokenStream:
    """A log file on a full disk."""

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failing_mirror_costs_the_mirror_not_the_result(tmp_path, monkeypatch, capfd):
    """W&B's own log handler on a full disk printed a traceback per record (30,000 lines) and
    the run's result was lost with the mirror."""
    import wandb

    def init(**kwargs):
        log = logging.getLogger("wandb.kvh-test")
        log.addHandler(logging.StreamHandler(_BrokenStream()))
        for i in range(50):
            log.warning("record %d", i)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(wandb, "init", init)
    out = run(cfg(*ST, "logger=wandb", "logger.mode=offline", f"runner.results_root={tmp_path}"))
    metrics = json.loads((out / "metrics.json").read_text())
    assert "logger" not in metrics and not (out / "wandb").exists()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Logging error" not in err
    assert "warning: logger=wandb: the mirror failed (OSError" in err


def test_lm_eval_batch_size_in_model_args(monkeypatch):
    from harness.lm_eval.model import KVHarnessLM, merge_cli_options

    cli_defaults = {"batch_size": 1, "max_batch_size": None, "device": "cpu"}
    lm = KVHarnessLM.create_from_arg_string("model=stories260k,batch_size=2", cli_defaults)
    try:
        assert lm.batch_size == 2
    finally:
        lm.close()
    with pytest.raises(ConfigError, match="batch_size=0: allowed: a positive integer"):
        KVHarnessLM.create_from_arg_obj({"model": "stories260k", "batch_size": 0}, cli_defaults)
    with pytest.raises(ConfigError, match="batch_size is given twice"):
        merge_cli_options({"batch_size": 2}, {"batch_size": 4})


def test_lm_eval_unknown_task_name_is_one_line(monkeypatch, capsys):
    """lm-eval 0.4.13 raises a bare ValueError for an unknown --tasks name (its
    EvaluatorConfig.process_tasks; indexing every lm-eval task takes a minute, so raised here)."""
    from harness.lm_eval import __main__ as lm_main

    def cli_evaluate():
        raise ValueError("Tasks not found: nosuchtask")

    monkeypatch.setattr(lm_main, "cli_evaluate", cli_evaluate)
    with pytest.raises(SystemExit) as exit_:
        lm_main.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "error: lm-eval: Tasks not found: nosuchtask" in err and "Traceback" not in err


def test_cache_dir_that_is_a_file_or_read_only(tmp_path, monkeypatch, no_weights):
    from harness import results

    a_file = tmp_path / "cache"
    a_file.write_text("not a folder")
    monkeypatch.setenv("KVH_CACHE_DIR", str(a_file))
    with pytest.raises(ConfigError, match=f"KVH_CACHE_DIR={a_file}: .* is a file, not a folder"):
        models.resolve_model({"name": "smollm2_135m", "device": "cpu"})
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path / "ro"))

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(results.tempfile, "mkstemp", read_only)
    with pytest.raises(ConfigError, match="KVH_CACHE_DIR=.*Read-only file system"):
        models.resolve_model({"name": "smollm2_135m", "device": "cpu"})


def test_a_users_folder_where_a_model_would_be_converted_is_left_alone(tmp_path):
    folder = tmp_path / "smollm2-135m-instruct-q4_1"
    folder.mkdir()
    (folder / "mine.txt").write_text("not a converted model")
    with pytest.raises(ConfigError, match="is not a model this harness converted"):
        models.ensure_gguf_converted(models.smollm2_gguf_path(), folder, "SmolLM2")
    assert (folder / "mine.txt").read_text() == "not a converted model"


def test_throughput_benchmark_refuses_zero_batches(monkeypatch, capsys):
    import runpy

    monkeypatch.setattr(sys, "argv", ["throughput.py", "--batches", "0"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(PROJECT / "benchmarks" / "throughput.py"), run_name="__main__")
    assert exit_.value.code == 2
    assert "--batches 0: each must be a positive integer" in capsys.readouterr().err


# --- Unclear --------------------------------------------------------------------------------

def test_hydra_full_error_and_debug_show_tracebacks(tmp_path):
    root = f"runner.results_root={tmp_path}"
    runner_error = cli(*ST, "method=kivi", "method.k_bits=3", root, env={"HYDRA_FULL_ERROR": "1"})
    assert runner_error.returncode != 0 and "Traceback" in runner_error.stderr
    hydra_error = cli(*ST, "runner.batchsize=2", "runner.debug=True", root)
    assert hydra_error.returncode != 0 and "Traceback" in hydra_error.stderr


def test_mismatched_weights_are_one_line_without_transformers_table(tmp_path, capfd):
    folder = model_folder(tmp_path, "mismatch", vocab_size=600)  # weights hold 512 rows
    with pytest.raises(ConfigError) as err:
        run(cfg("model=hf", f"model.name_or_path={folder}", "model.dtype=float32",
                "task.max_tokens=40", f"runner.results_root={tmp_path / 'r'}"))
    message = str(err.value)
    assert "do not match its config.json" in message and "mismatched" in message
    assert "ignore_mismatched_sizes" not in message
    printed = capfd.readouterr()
    assert "LOAD REPORT" not in printed.out + printed.err


def test_corrupt_bin_weights_message(tmp_path):
    folder = model_folder(tmp_path, "corrupt_bin")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"garbage, not a checkpoint" * 10)
    with pytest.raises(ConfigError) as err:
        run(cfg("model=hf", f"model.name_or_path={folder}", "model.dtype=float32",
                "task.max_tokens=40", f"runner.results_root={tmp_path / 'r'}"))
    assert "not a PyTorch checkpoint" in str(err.value) and "weights_only" not in str(err.value)


ENTRY = {"model": "stories260k", "method": "h2o", "task": "perplexity",
         "metric": "accuracy.ppl", "max": 60}


@pytest.mark.parametrize("typo, expect", [
    ({"method": "h20"}, "method='h20' is unknown (did you mean 'h2o'?)"),
    ({"task": "perplexty"}, "task='perplexty' is unknown (did you mean 'perplexity'?)"),
    ({"metric": "acuracy.ppl"}, "metric='acuracy.ppl' must be <section>.<key>"),
    ({"metric": "accuracy.pplx"}, "metric='accuracy.pplx' is in no run under"),
    ({"model": "storie260k"}, "model='storie260k' has no run under"),
    ({"hyperparameters": {"budget_ratoi": 0.2}}, "did you mean 'budget_ratio'?"),
    ({"ratio_to_method": "ful"}, "ratio_to_method='ful' is unknown"),
])
def test_typos_in_a_thresholds_file_are_bad_input(typo, expect, tmp_path, capsys):
    fake_run(tmp_path / "runs", "h2o", 50.0, 100.0, budget=0.2)
    gate = tmp_path / "gate.yaml"
    gate.write_text(json.dumps({"thresholds": [{**ENTRY, **typo}]}))  # JSON is YAML
    assert check.main([str(tmp_path / "runs"), "--against", str(gate)]) == 2
    err = capsys.readouterr().err
    assert expect in err and len(err.strip().splitlines()) == 1


def test_messages_name_the_key_the_user_set(tmp_path, no_weights):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    message = refused(tmp_path, *ST, f"runner.results_root={a_file}/sub")
    assert message.startswith(f"runner.results_root={a_file}/sub: cannot write under")


@pytest.mark.parametrize("target", ["loop", "gone/away"])
def test_a_results_root_link_leading_nowhere_is_refused_before_the_weights(target, tmp_path,
                                                                           no_weights):
    """A symlink loop (or a dangling link) does not `exist()`: the writability check walked past
    it to its folder, and the run was lost at its end (ELOOP) after the weights and the work."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / target if target != "loop" else link)
    message = refused(tmp_path, *ST, f"runner.results_root={link}")
    assert message.startswith(f"runner.results_root={link}: cannot write under")
    assert "is a link that leads nowhere" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]


def test_check_of_only_corrupt_runs_is_bad_input(tmp_path, capsys):
    bad = tmp_path / "runs" / "bad"
    bad.mkdir(parents=True)
    (bad / "metrics.json").write_text("{not json")
    gate = tmp_path / "gate.yaml"
    gate.write_text(json.dumps({"thresholds": [ENTRY]}))
    assert check.main([str(tmp_path / "runs"), "--against", str(gate)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no runs to check under")
    assert "none valid; skipped " in err[0] and "not valid JSON" in err[0]


def test_check_against_a_folder_says_so(tmp_path, capsys):
    fake_run(tmp_path / "runs", "full", 50.0, 100.0)
    assert check.main([str(tmp_path / "runs"), "--against", str(tmp_path)]) == 2
    assert f"--against {tmp_path} is a folder" in capsys.readouterr().err


def test_longbench_hub_fallback_offline_is_one_line(tmp_path, monkeypatch, caplog):
    """Without network, huggingface_hub logged a warning per retry (12 lines, half a minute)
    before the task's one ConfigError line."""
    import huggingface_hub

    from tasks import build_task

    def download(*a, **k):
        logging.getLogger("huggingface_hub.utils._http").warning(
            "'[Errno -2] Name or service not known' thrown while requesting HEAD ...")
        logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    task = build_task("longbench", datasets=["qasper"], data_dir=str(tmp_path / "nope"))
    level = logging.getLogger("huggingface_hub").level
    with caplog.at_level(logging.DEBUG), pytest.raises(ConfigError, match="hub download"):
        task.check_data()
    assert not [r for r in caplog.records if r.name.startswith("huggingface_hub")]
    assert logging.getLogger("huggingface_hub").level == level  # restored


def test_unquoted_tilde_gets_a_hint_to_quote_it():
    from harness.__main__ import one_line

    with pytest.raises(Exception) as err:
        cfg("task.path=~/x")
    assert "(quote the value: task.path='~/x')" in one_line(err.value)


# --- Bounded memory and signals -------------------------------------------------------------

def test_a_block_beyond_the_models_positions_is_refused(tmp_path, no_weights):
    message = refused(tmp_path, *ST, "runner.kv_layout=paged", "runner.kv_block_tokens=100000000")
    assert "larger than the model's max positions (512)" in message


def test_a_first_block_that_cannot_fit_is_refused_with_the_estimate(tmp_path, monkeypatch,
                                                                    no_weights):
    from kvcore import guards

    monkeypatch.setattr(guards, "available_bytes", lambda device: 1000)
    message = refused(tmp_path, *ST, "runner.kv_layout=paged", "runner.kv_block_tokens=512")
    assert "one block per layer and sequence needs" in message and "is available" in message


def test_memory_guard_estimates_every_kv_allocation_first(monkeypatch):
    from kvcore import guards
    from kvcore.offload import Tier, TransferLedger
    from kvcore.paged import BlockPool
    from kvcore.storage import ContiguousRows, TokenMajorRows

    monkeypatch.setattr(guards, "GUARD_MIN_BYTES", 0)
    monkeypatch.setattr(guards, "available_bytes", lambda device: 100_000)
    small, big = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 2000, 8)  # (B, H, T, D)
    ContiguousRows().append(small)  # a 256-row buffer: 16 KiB fit
    for make in (ContiguousRows, TokenMajorRows):  # 3072 rows: 192 KiB do not
        with pytest.raises(guards.MemoryLimit, match=r"would need 192.0 KiB but 97.7 KiB of "
                                                     "cpu memory is available"):
            make().append(big)
    pool = BlockPool(block_tokens=4)
    pool.allocate(10, small)
    with pytest.raises(guards.MemoryLimit, match="paged KV pool growing to 1010 blocks"):
        pool.allocate(1000, small)
    tier = Tier(torch.device("cpu"), TransferLedger(num_layers=1), offload=True)
    with pytest.raises(guards.MemoryLimit, match="host-tier KV buffer"):
        tier.host_tensor((1, 2, 2000, 8), torch.float32)


def test_a_batch_that_outgrows_memory_stops_in_one_line(tmp_path, monkeypatch):
    """Each sequence's buffer (768 rows: 96 KiB per layer) is checked against the memory
    available when it is allocated (live: earlier buffers count), here a fixed 48 KiB."""
    from kvcore import guards

    monkeypatch.setattr(guards, "GUARD_MIN_BYTES", 0)
    monkeypatch.setattr(guards, "available_bytes", lambda device: 50_000)
    # the task's own estimate before the run would refuse it first: the guard at allocation
    # time is what is checked here
    monkeypatch.setattr("tasks.ruler.size_reason", lambda *a, **k: None)
    with pytest.raises(guards.MemoryLimit, match="is available"):
        run(cfg("model=stories260k", "task=ruler", "task.lengths=[480]",
                "task.subtasks=[niah_single]", "task.samples_per_cell=2", "task.depths=[50]",
                "runner.batch_size=2", "task.max_new_tokens=8",
                f"runner.results_root={tmp_path / 'r'}"))
    assert not (tmp_path / "r").exists()


def test_a_stop_requested_by_a_signal_takes_effect_at_the_next_write():
    """A KeyboardInterrupt raised inside a finalizer is dropped by Python; the request the
    handler recorded is raised again by the next storage write (prefill chunk, decode step)."""
    from kvcore import guards
    from kvcore.paged import PagedKV
    from kvcore.storage import ContiguousRows

    rows, paged = ContiguousRows(), PagedKV(4).rows(0, "k")
    guards.request_stop()
    try:
        for storage in (rows, paged):
            with pytest.raises(KeyboardInterrupt):
                storage.append(torch.zeros(1, 2, 3, 8))
    finally:
        guards.clear_stop()
    rows.append(torch.zeros(1, 2, 3, 8))
    assert rows.length == 3


def test_sigterm_during_a_long_prefill_leaves_nothing(tmp_path):
    # SmolLM2 fed one token per forward: a 512-token window takes many seconds on CPU, so the
    # signal lands inside the prefill, after the weights are loaded
    env = dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "harness", "model=smollm2_135m",
                             "method=full", "task.mode=chunked", "task.window_tokens=512",
                             "task.max_tokens=512", "runner.prefill_chunk_tokens=1",
                             f"runner.results_root={tmp_path}"], cwd=PROJECT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, seen = time.time() + 120, ""
    while time.time() < deadline:  # until the weights are loaded: the prefill is running
        line = proc.stdout.readline()
        seen += line
        if ("Loading weights" in line and "100%" in line) or not line:
            break
    time.sleep(2.0)
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, seen + rest
    assert not list(tmp_path.rglob("*")), "an interrupted run left files or folders"


# --- A model named by what it is ------------------------------------------------------------

def _gguf(path: Path, **meta) -> Path:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        if isinstance(value, int):
            writer.add_uint32(f"general.{key}", value)
        else:
            writer.add_string(f"general.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("stem, meta, label", [
    ("model-fee85397", {"name": "Qwen2.5 Coder 0.5B Instruct", "file_type": 3},
     "Qwen2.5-Coder-0.5B-Instruct-Q4_1"),
    ("ggml-model-q4_0", {"basename": "qwen2.5-coder", "size_label": "0.5B",
                         "finetune": "instruct", "file_type": 2},
     "qwen2.5-coder-0.5B-instruct-Q4_0"),
    ("SmolLM2-135M-Instruct.Q4_1", {"name": "Smollm2 135M 8k"}, "SmolLM2-135M-Instruct.Q4_1"),
    ("model", {}, "model"),  # nothing better known: the stem
])
def test_gguf_models_are_named_from_their_metadata(stem, meta, label, tmp_path):
    path = _gguf(tmp_path / f"{stem}.gguf", **meta)
    spec = models.resolve_model({"name": "hf", "gguf_file": str(path),
                                 "cache_dir": str(tmp_path / "cache")})
    assert spec.extra["label"] == label
    assert not (tmp_path / "cache").exists()  # resolving converts (and creates) nothing


def test_parameters_count_tied_embeddings_once():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         tie_word_embeddings=False))
    untied = sum(p.numel() for p in model.parameters())
    assert models.parameter_count(model) == untied  # two different matrices
    with torch.no_grad():  # an output embedding stored as a copy of the input one (GGUF)
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    assert models.parameter_count(model) == untied - 64 * 16
