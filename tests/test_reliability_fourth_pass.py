"""Reliability, fourth pass: the side files a method reads checked like its knobs (and recorded
in metrics.json), an empty path never read as "not given", sizes refused before they allocate,
a model named by what it is, non-finite models and results caught, hints and impossible
combinations, third-party errors naming the input, and `harness.check` / `harness.report` edges.

Most cases are refused before any weights load (the `no_weights` fixture)."""

import errno
import hashlib
import json
import logging
import math

import pytest
import torch

from kvcore.errors import ConfigError
from methods import _sidefiles as sidefiles
from methods import build_method
from methods.base import ModelInfo
from tests.conftest import DATA, STORIES, need_shared
from tests.test_reliability_third_pass import ST, cfg, model_folder, no_weights, refused  # noqa: F401

INFO = ModelInfo(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_positions=512,
                 rope_theta=10000.0)


def one_reason(method, info=INFO) -> str:
    reasons = method.validate(info, {"batch_size": 1})
    assert reasons, "accepted"
    assert all("\n" not in r for r in reasons)
    return "; ".join(reasons)


# --- Side files -----------------------------------------------------------------------------

@pytest.fixture
def binary(tmp_path):
    path = tmp_path / "calib.bin"
    path.write_bytes(bytes(range(256)) * 8)
    return path


@pytest.mark.parametrize("name", ["infinigen", "kvquant"])
def test_a_binary_calibration_text_is_one_line_before_the_weights(name, binary):
    reason = one_reason(build_method(name, calibration_path=str(binary)))
    assert f"method.calibration_path={binary}: a binary file" in reason
    latin = binary.with_name("latin1.txt")
    latin.write_bytes("caf\xe9 ".encode("latin-1") * 200)
    reason = one_reason(build_method(name, calibration_path=str(latin)))
    assert "not UTF-8 text (byte 0xe9 at offset 3)" in reason


def duo_pattern(folder, gates, config='{"sink_size": 64, "recent_size": 256}'):
    folder.mkdir(exist_ok=True)
    (folder / "full_attention_heads.tsv").write_text(
        "\n".join("\t".join(repr(float(g)) for g in row) for row in gates) + "\n")
    if config is not None:
        (folder / "config.json").write_text(config)
    return folder


@pytest.mark.parametrize("gates, config, expect", [
    ([[0.2, 0.9], [0.1, 0.5]], "{not json", "config.json: not valid JSON"),
    ([[0.2, 0.9], [0.1, 0.5]], "[64, 256]", "config.json: a JSON list, expected an object"),
    ([[0.2, 0.9], [0.1, 0.5]], '{"sink_size": -4}', "sink_size=-4; allowed: an integer >= 0"),
    ([[0.2, float("nan")], [0.1, 0.5]], None, "the gate of layer 0 KV head 1 is nan"),
    ([[0.2, 0.9], [3.0, 0.5]], None, "the gate of layer 1 KV head 0 is 3.0; allowed: finite "
                                     "gates in [0, 1]"),
])
def test_duo_attention_pattern_checked_like_a_knob(gates, config, expect, tmp_path):
    folder = duo_pattern(tmp_path / "pattern", gates, config)
    reason = one_reason(build_method("duo_attention", pattern_path=str(folder)))
    assert expect in reason and "method.pattern_path=" in reason


def head_scores(path, value_of):
    table = {f"{l}-{h}": value_of(l, h) for l in range(2) for h in range(4)}
    path.write_text(json.dumps(table) + "\n")
    return path


@pytest.mark.parametrize("value_of, expect", [
    (lambda l, h: [float("nan"), 0.5], "score 0 of head (0, 0) is nan"),
    (lambda l, h: [float("inf")], "score 0 of head (0, 0) is inf"),
    (lambda l, h: [1e308, 1e308], "a head's mean score overflows"),
    (lambda l, h: [-0.5], "every head's score is <= 0"),
])
def test_headkv_scores_checked_like_a_knob(value_of, expect, tmp_path):
    path = head_scores(tmp_path / "scores.json", value_of)
    reason = one_reason(build_method("headkv", budget_tokens=16, head_scores_path=str(path)))
    assert f"method.head_scores_path={path}" in reason and expect in reason


@pytest.mark.parametrize("name, key", [("headkv", "head_scores_path"),
                                       ("duo_attention", "pattern_path"),
                                       ("infinigen", "calibration_path"),
                                       ("kvquant", "calibration_path"),
                                       ("kvquant", "cache_dir")])
def test_an_empty_path_is_refused_not_read_as_not_given(name, key):
    knobs = {"budget_tokens": 16} if name == "headkv" else {}
    reason = one_reason(build_method(name, **knobs, **{key: ""}))
    assert f"method.{key}='' is empty; give a file or folder, or null" in reason


def test_a_cache_on_a_full_disk_costs_the_cache_not_the_run(tmp_path, monkeypatch, caplog):
    from methods import _infinigen_prep

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    t = torch.zeros(2, 2)
    with caplog.at_level(logging.WARNING):
        _infinigen_prep._save(tmp_path / "c" / "art.pt", t, t, t)
    assert "cannot write the cache" in caplog.text and "No space left on device" in caplog.text
    assert list((tmp_path / "c").iterdir()) == []  # no temporary file left behind


def test_side_files_read_are_recorded_with_their_hash(tmp_path):
    path = head_scores(tmp_path / "scores.json", lambda l, h: [0.1 * (l + h + 1)])
    sidefiles.reset()
    build_method("headkv", budget_tokens=16, head_scores_path=str(path)).validate(INFO, {})
    (entry,) = sidefiles.read()
    assert entry == {"key": "method.head_scores_path", "path": str(path.resolve()),
                     "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                     "bytes": path.stat().st_size}
    sidefiles.reset()
    assert sidefiles.read() == []


def test_a_run_records_the_side_files_it_read(tmp_path):
    from harness.run import run

    need_shared(STORIES)
    table = {f"{l}-{h}": [0.1 * (l + h + 1)] for l in range(5) for h in range(8)}
    path = tmp_path / "scores.json"
    path.write_text(json.dumps(table))
    out = run(cfg(*ST, "task.prefill_tokens=16", "method=headkv", "method.budget_tokens=8",
                  f"method.head_scores_path={path}", f"runner.output_dir={tmp_path / 'o'}"))
    metrics = json.loads((out / "metrics.json").read_text())
    files = metrics["method"]["side_files"]
    assert [f["key"] for f in files] == ["method.head_scores_path"]
    assert files[0]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


# --- Sizes estimated before they allocate ----------------------------------------------------

HUGE_MODEL = ModelInfo(num_layers=5, num_heads=8, num_kv_heads=4, head_dim=8,
                       max_positions=10**12, rope_theta=10000.0)  # claims 10^12 positions


@pytest.fixture
def eight_gib(monkeypatch):
    """The machine has 8 GiB available, whatever this one has (the estimates are compared)."""
    from kvcore import guards

    monkeypatch.setattr(guards, "available_bytes", lambda device: 8 * 2**30)


@pytest.mark.parametrize("task, options, expect", [
    ("ruler", {"lengths": [100_000_000]}, "task.lengths=[100000000]: the KV cache of the longest "
                                          "sample would need 119.21 GiB but 8.00 GiB"),
    ("ruler", {"samples_per_cell": 1_000_000_000}, "task.samples_per_cell=1000000000: "
                                                   "10000000000 prompts built would need"),
    ("multiturn", {"context_tokens": 100_000_000}, "task.context_tokens=100000000: the "
                                                    "conversation's KV cache and its text"),
])
def test_task_sizes_are_estimated_not_bounded_by_max_positions(task, options, expect, eight_gib):
    from tasks import build_task

    reasons = build_task(task, **options).validate(HUGE_MODEL, build_method("full"))
    assert any(expect in r for r in reasons), reasons


def test_quest_page_size_is_estimated_before_the_weights(eight_gib):
    reason = one_reason(build_method("quest", budget_tokens=64, page_size=1_000_000_000),
                        HUGE_MODEL)
    assert "method.page_size=1000000000: one padded page of keys per layer" in reason


def test_a_ruler_sample_count_is_estimated_without_building_the_cells(eight_gib, monkeypatch):
    from tasks import build_task
    from tasks.ruler import Ruler

    monkeypatch.setattr(Ruler, "cells", lambda self: pytest.fail("cells() were built"))
    task = build_task("ruler", samples_per_cell=10**12)
    assert task.validate(HUGE_MODEL, build_method("full"))


# --- A model named by what it is -------------------------------------------------------------

def test_a_named_model_from_another_folder_is_refused(tmp_path, no_weights):
    need_shared(STORIES)
    other = model_folder(tmp_path, "other")
    message = refused(tmp_path, *ST, f"model.path={other}")
    assert f"model=stories260k model.path={other} holds another model" in message
    assert f"model=hf model.name_or_path={other}" in message


def test_a_copy_of_the_named_model_keeps_its_name(tmp_path):
    import shutil

    from harness import models

    need_shared(STORIES)
    copy = tmp_path / "stories_copy"
    shutil.copytree(STORIES, copy)
    spec = models.resolve_model({"name": "stories260k", "path": str(copy), "device": "cpu"})
    assert models.identify(spec, models.load_config(spec)).name == "stories260k"


# --- Non-finite models -----------------------------------------------------------------------

def test_a_nan_in_the_model_config_is_refused_before_the_weights(tmp_path, no_weights):
    need_shared(STORIES)
    folder = model_folder(tmp_path, "nan_eps", rms_norm_eps=float("nan"))
    message = refused(tmp_path, "model=hf", f"model.name_or_path={folder}", "task.max_tokens=40")
    assert "rms_norm_eps=nan must be a finite number" in message


def test_nan_weights_are_refused_not_written_as_ppl_nan(tmp_path):
    from safetensors.torch import load_file, save_file

    from harness.run import run

    need_shared(STORIES)
    folder = model_folder(tmp_path, "nan_weights")
    weights = load_file(folder / "model.safetensors")
    name = next(k for k in weights if k.endswith("q_proj.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    root = tmp_path / "results"
    with pytest.raises(ConfigError, match=f"{name} holds 1 NaN or infinite value"):
        run(cfg("model=hf", f"model.name_or_path={folder}", "task.max_tokens=40",
                f"runner.results_root={root}"))
    assert not root.exists()


def test_an_unknown_rope_type_names_the_config_not_the_weights(tmp_path, no_weights):
    need_shared(STORIES)
    folder = model_folder(tmp_path, "bogus_rope",
                          rope_parameters={"rope_theta": 10000.0, "rope_type": "bogus"})
    message = refused(tmp_path, "model=hf", f"model.name_or_path={folder}", "task.max_tokens=40")
    assert "rope_type='bogus' is not a RoPE type this transformers builds; allowed: default" \
        in message


# --- Hints -----------------------------------------------------------------------------------

@pytest.mark.parametrize("value, got", [(None, "null is not one of its values"),
                                        (["max"], "got a list; give one value")])
def test_null_or_a_list_for_a_text_knob_lists_the_allowed_values(value, got):
    with pytest.raises(ConfigError) as err:
        build_method("quest", budget_tokens=64, group_reduce=value)
    assert got in str(err.value) and "allowed: max, sum" in str(err.value)
    assert "quote it" not in str(err.value)


def test_a_value_not_allowed_is_named_before_what_it_would_need():
    with pytest.raises(ConfigError, match=r"method.group_reduce='mean'; allowed: max, sum"):
        build_method("quest", budget_tokens=64, group_reduce="mean")


def test_null_for_a_text_key_of_a_yaml_group_is_not_told_to_quote(tmp_path, no_weights):
    message = refused(tmp_path, *ST, "runner.attn_impl=null")
    assert "quote it" not in message


def test_overriding_method_name_is_refused(tmp_path):
    from tests.test_reliability_third_pass import cli

    proc = cli(*ST, "method=snapkv", "method.name=pyramidkv",
               f"runner.results_root={tmp_path / 'r'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("method.name=pyramidkv overrides method=snapkv (whose settings were composed); "
            "choose it as method=pyramidkv") in proc.stderr
    assert not (tmp_path / "r").exists()


# --- Impossible combinations refused before loading ------------------------------------------

STORIES_INFO = ModelInfo(num_layers=5, num_heads=8, num_kv_heads=4, head_dim=8, max_positions=512,
                         rope_theta=10000.0)


def test_shadowkv_threshold_beyond_the_models_positions_is_named(tmp_path, no_weights):
    message = refused(tmp_path, *ST, "task.prefill_tokens=16", "method=shadowkv",
                      "method.budget_tokens=8")
    assert ("method.compress_above_tokens=4096: ShadowKV compresses only prompts longer than "
            "that, but this model has 512 max positions") in message


def test_shadowkv_rank_beyond_the_key_width_is_refused():
    reason = one_reason(build_method("shadowkv", compress_above_tokens=0, rank=64), STORIES_INFO)
    assert "method.rank=64 is larger than the keys' width on this model (H_kv x head_dim = 32)" \
        in reason
    assert not build_method("shadowkv", compress_above_tokens=0, rank=32).validate(
        STORIES_INFO, {"batch_size": 1})


def test_shadowkv_rank_and_rank_ratio_both_set_is_refused():
    with pytest.raises(ConfigError, match="the rank would win and the ratio be ignored"):
        build_method("shadowkv", rank=8, rank_ratio=0.5)
    build_method("shadowkv", rank=8)
    build_method("shadowkv", rank_ratio=0.5)


def test_scissorhands_recent_window_larger_than_the_budget_is_refused():
    with pytest.raises(ConfigError, match="method.recent_tokens=20 is more than "
                                          "method.budget_tokens=8"):
        build_method("scissorhands", budget_tokens=8, recent_tokens=20)
    build_method("scissorhands", budget_tokens=8, recent_tokens=8)


# --- Third-party errors name the input -------------------------------------------------------

def test_a_bad_line_in_an_include_path_data_file_is_named(tmp_path, no_weights, monkeypatch):
    from tests.tasks.test_lm_eval import write_custom_tasks

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    folder = write_custom_tasks(tmp_path / "yaml", tmp_path / "data")
    data = tmp_path / "data" / "gen.jsonl"
    lines = data.read_text().splitlines()
    data.write_text(lines[0] + "\n" + '{"question": "b", "answer": \n' + lines[1] + "\n")
    message = refused(tmp_path, "task=lm_eval", "model=stories260k", "task.names=[my_gen]",
                      f"task.include_path={folder}", "task.num_fewshot=0")
    assert f"{data} line 2: Expecting value" in message


# --- harness.check / harness.report edges ----------------------------------------------------

def thresholds(path, body):
    path.write_text("thresholds:\n" + body)
    return path


def test_check_ratio_to_a_method_no_run_has_is_bad_input(tmp_path, capsys):
    from harness import check
    from tests.harness.test_report_check import fake_run

    fake_run(tmp_path / "r", "full", 50.0, 100.0)
    fake_run(tmp_path / "r", "h2o", 55.0, 100.0, budget=0.2)
    gate = thresholds(tmp_path / "t.yaml", "  - {model: stories260k, method: h2o, task: "
                      "perplexity, metric: accuracy.ppl, ratio_to_method: snapkv, max: 1.2}\n")
    assert check.main([str(tmp_path / "r"), "--against", str(gate)]) == 2
    assert "ratio_to_method='snapkv' has no run of model='stories260k'" in capsys.readouterr().err


def test_check_refuses_a_key_given_twice_in_an_entry(tmp_path, capsys):
    from harness import check
    from tests.harness.test_report_check import fake_run

    fake_run(tmp_path / "r", "full", 50.0, 100.0)
    gate = thresholds(tmp_path / "t.yaml", "  - {model: stories260k, method: full, task: "
                      "perplexity, metric: accuracy.ppl, max: 60, max: 40}\n")
    assert check.main([str(tmp_path / "r"), "--against", str(gate)]) == 2
    assert "key 'max' given twice in one mapping" in capsys.readouterr().err


def test_check_against_a_device_says_what_it_is(tmp_path, capsys):
    from harness import check
    from tests.harness.test_report_check import fake_run

    fake_run(tmp_path / "r", "full", 50.0, 100.0)
    assert check.main([str(tmp_path / "r"), "--against", "/dev/zero"]) == 2
    err = capsys.readouterr().err
    assert "/dev/zero is not a regular file" in err and "no such file" not in err


def test_a_metrics_json_that_is_a_fifo_or_device_link_is_skipped_with_a_warning(tmp_path):
    import os

    from harness.report.collect import find_runs
    from tests.harness.test_report_check import fake_run

    good = fake_run(tmp_path / "r", "full", 50.0, 100.0)
    fifo = tmp_path / "r" / "x" / "metrics.json"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    link = tmp_path / "r" / "y" / "metrics.json"
    link.parent.mkdir()
    link.symlink_to("/dev/zero")
    warnings = []
    assert find_runs([str(tmp_path / "r")], warn=warnings.append) == [good / "metrics.json"]
    assert sorted(w.split(": not a regular")[0] for w in warnings) == [
        f"warning: skipped {fifo}", f"warning: skipped {link}"]


def test_runs_reached_through_a_link_are_counted_once(tmp_path):
    from harness.report.collect import find_runs
    from tests.harness.test_report_check import fake_run

    fake_run(tmp_path / "r", "full", 50.0, 100.0)
    (tmp_path / "alias").symlink_to(tmp_path / "r")
    assert len(find_runs([str(tmp_path / "r"), str(tmp_path / "alias")])) == 1


def test_a_non_finite_result_is_flagged_in_the_summary_and_never_passes_a_gate(tmp_path):
    from harness import check
    from harness.run import summary
    from tests.harness.test_report_check import fake_run

    folder = fake_run(tmp_path / "r", "full", float("nan"), 100.0)
    metrics = json.loads((folder / "metrics.json").read_text())
    metrics["kv"], metrics["transfer"] = {}, {}
    metrics["memory"] = {"kind": "cpu", "peak_bytes": 0}
    metrics["speed"].update(prefill_ms_total=1.0, prefill_tokens=1, decode_ms_per_token_p90=1.0)
    assert "NOT FINITE  ppl=nan" in summary(metrics, folder)
    (result,) = check.check([metrics], [{"model": "stories260k", "method": "full",
                                         "task": "perplexity", "metric": "accuracy.ppl",
                                         "max": 60}])
    assert not result["ok"] and "not a finite number" in result["why"]
