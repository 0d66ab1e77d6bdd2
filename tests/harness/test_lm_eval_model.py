"""The `kvharness` lm-eval model: HFLM parity with the full cache, the KV method really acting,
rolling loglikelihoods and generation, model_args handling, the offline task folder and the CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcore.errors import ConfigError
from harness.lm_eval import KVHarnessLM
from harness.lm_eval.tasks import offline_task_dir
from methods import build_method, method_class
from tests.conftest import DATA, PROJECT, STORIES, make_engine, need_shared

TOL = 1e-4  # |delta loglikelihood| allowed against HFLM (fp32, different kernels / shapes)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    need_shared(DATA)
    return offline_task_dir(cache_dir=tmp_path_factory.mktemp("lm_eval_tasks"))


@pytest.fixture(scope="module")
def manager(task_dir):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_dir), include_defaults=False)


def evaluate(lm, manager, task="copa", limit=20, shots=5):
    from lm_eval import simple_evaluate

    out = simple_evaluate(model=lm, tasks=[task], num_fewshot=shots, limit=limit,
                          task_manager=manager, log_samples=True, bootstrap_iters=0)
    lls = [float(r[0][0]) for s in out["samples"][task] for r in s["resps"]]
    greedy = [bool(r[0][1]) for s in out["samples"][task] for r in s["resps"]]
    return lls, greedy, out["results"][task]["acc,none"]


def hflm(model, tokenizer):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1)


def engine_for(model, tokenizer, method="full", **hyper):
    return make_engine(model, build_method(method, **hyper), tokenizer)


# --- parity with lm-eval's own HFLM (method=full) ------------------------------------------------
@pytest.mark.parametrize("scoring", ["chunked", "stepwise"])
def test_full_cache_equals_hflm_on_copa_stories(stories, manager, scoring):
    """20 COPA docs, 5-shot (40 requests): every loglikelihood within 1e-4 of HFLM's, the same
    greedy flags, hence the same accuracy."""
    model, tok = stories
    ref, ref_greedy, ref_acc = evaluate(hflm(model, tok), manager)
    ours, greedy, acc = evaluate(KVHarnessLM(engine_for(model, tok), scoring=scoring), manager)
    assert len(ours) == len(ref) == 40
    assert max(abs(a - b) for a, b in zip(ours, ref)) < TOL
    assert greedy == ref_greedy and acc == ref_acc


def test_full_cache_equals_hflm_on_smollm2(smollm2, manager):
    """SmolLM2 (no BOS), a handful of COPA (0-shot) and PIQA (1-shot) requests."""
    model, tok = smollm2
    for task, limit, shots in (("copa", 3, 0), ("piqa", 2, 1)):
        ref, ref_greedy, ref_acc = evaluate(hflm(model, tok), manager, task, limit, shots)
        ours, greedy, acc = evaluate(KVHarnessLM(engine_for(model, tok)), manager, task, limit,
                                     shots)
        assert max(abs(a - b) for a, b in zip(ours, ref)) < TOL, task
        assert greedy == ref_greedy and acc == ref_acc


def test_truncation_matches_hflm(stories):
    """A context longer than max_length is left-truncated exactly as HFLM does."""
    model, tok = stories
    context = list(range(3, 400)) * 2  # 794 tokens > 512 positions
    continuation = [5, 6, 7, 8]
    ours = KVHarnessLM(engine_for(model, tok))._loglikelihood_tokens(
        [(None, context, continuation)], disable_tqdm=True)
    ref = hflm(model, tok)._loglikelihood_tokens([(None, context, continuation)],
                                                 disable_tqdm=True)
    assert abs(ours[0][0] - ref[0][0]) < TOL and ours[0][1] == ref[0][1]


def test_rolling_equals_hflm(stories):
    """Rolling loglikelihood (prefix token, windows of max_length) streamed token by token."""
    from lm_eval.api.instance import Instance

    model, tok = stories
    texts = ["Once upon a time, there was a little girl named Lily.",
             " ".join(["The cat sat on the mat and the dog ran to the park."] * 60)]
    assert len(tok(texts[1])["input_ids"]) > 512  # more than one window
    requests = [Instance("loglikelihood_rolling", {}, (t,), 0) for t in texts]
    ours = KVHarnessLM(engine_for(model, tok)).loglikelihood_rolling(requests, disable_tqdm=True)
    ref = hflm(model, tok).loglikelihood_rolling(requests, disable_tqdm=True)
    assert abs(ours[0] - ref[0]) < TOL
    assert abs(ours[1] - ref[1]) < 1e-3  # 1261 tokens, 3 windows


def test_generate_until_equals_hflm(stories):
    from lm_eval.api.instance import Instance

    model, tok = stories
    args = [("Once upon a time", {"until": ["."], "max_gen_toks": 40, "do_sample": False}),
            ("One day", {"until": ["zzz"], "max_gen_toks": 12})]
    requests = [Instance("generate_until", {}, a, 0) for a in args]
    ours = KVHarnessLM(engine_for(model, tok)).generate_until(requests, disable_tqdm=True)
    ref = hflm(model, tok).generate_until(requests, disable_tqdm=True)
    assert ours == ref
    assert ours[0] == ", there was a little girl named Lily"  # stories260K's known greedy text


@pytest.mark.parametrize("scoring", ["chunked", "stepwise"])
def test_batch_size_three_equals_batch_one(stories, manager, scoring):
    """lm-eval batch_size=3 (harness.core.batch) while H2O compresses: the same loglikelihoods (fp32
    tolerance), greedy flags and generations as batch 1."""
    from lm_eval.api.instance import Instance

    model, tok = stories
    one = KVHarnessLM(engine_for(model, tok, "h2o", budget_tokens=24), scoring=scoring)
    three = KVHarnessLM(engine_for(model, tok, "h2o", budget_tokens=24), scoring=scoring,
                        batch_size=3)
    assert three.batch_size == 3 and three.engine.settings.batch_size == 3
    ref, ref_greedy, _ = evaluate(one, manager, limit=5, shots=1)
    got, greedy, _ = evaluate(three, manager, limit=5, shots=1)
    assert max(abs(a - b) for a, b in zip(got, ref)) < TOL and greedy == ref_greedy
    args = [("Once upon a time", {"until": ["."], "max_gen_toks": 40, "do_sample": False}),
            ("One day", {"until": ["zzz"], "max_gen_toks": 12}),
            ("The cat", {"until": [","], "max_gen_toks": 30})]
    requests = [Instance("generate_until", {}, a, 0) for a in args]
    assert (three.generate_until(requests, disable_tqdm=True)
            == one.generate_until(requests, disable_tqdm=True))


# --- the KV method acts --------------------------------------------------------------------------
def test_h2o_changes_loglikelihoods_and_lossless_budget_does_not(stories, manager):
    model, tok = stories
    full, _, _ = evaluate(KVHarnessLM(engine_for(model, tok)), manager, limit=10)
    small, _, _ = evaluate(KVHarnessLM(engine_for(model, tok, "h2o", budget_tokens=16),
                                       scoring="stepwise"), manager, limit=10)
    assert max(abs(a - b) for a, b in zip(small, full)) > 0.5
    lossless = method_class("h2o").lossless_hyperparameters(512)
    same, _, _ = evaluate(KVHarnessLM(engine_for(model, tok, "h2o", **lossless),
                                      scoring="stepwise"), manager, limit=10)
    assert max(abs(a - b) for a, b in zip(same, full)) < TOL


@pytest.mark.parametrize("scoring", ["chunked", "stepwise"])
def test_shared_context_prefill_changes_nothing(stories, manager, scoring):
    """One context prefill per document (cache snapshot/restore) == one request per choice."""
    model, tok = stories
    results = []
    for share in (True, False):
        engine = engine_for(model, tok, "h2o", budget_ratio=0.3)
        lm = KVHarnessLM(engine, scoring=scoring, share_context=share)
        results.append((evaluate(lm, manager, limit=8)[0], engine.ledger.samples))
    (shared, ledger_a), (separate, ledger_b) = results
    assert shared == separate
    assert ledger_a == ledger_b  # one KV sample per request, equal states


def test_stepwise_feeds_answer_tokens_as_decode_steps(stories):
    model, tok = stories
    engine = engine_for(model, tok)
    lm = KVHarnessLM(engine, scoring="stepwise")
    lm._loglikelihood_tokens([(None, [1, 403, 407], [261, 378, 432, 383])], disable_tqdm=True)
    assert engine.speed().decode_steps == 3  # continuation[:-1]
    assert engine.prefill_tokens == 3


# --- tokenization, construction ------------------------------------------------------------------
def test_tok_encode_keeps_the_tokenizer_default(stories):
    model, tok = stories
    lm = KVHarnessLM(engine_for(model, tok))
    assert lm.tok_encode("Once upon a time") == [1, 403, 407, 261, 378]  # BOS by default
    assert lm.tok_encode("Once upon a time", add_special_tokens=False) == [403, 407, 261, 378]
    assert lm.tok_encode("<s>Once upon a time")[0:2] != [1, 1]  # no second BOS
    assert lm.prefix_token_id == 1 and lm.eot_token_id == 2 and lm.max_length == 512


def test_model_args_build_engine_with_method():
    need_shared(STORIES)
    lm = KVHarnessLM.create_from_arg_string(
        "model=stories260k,method=h2o,budget_ratio=0.5,recent_ratio=0.25,scoring=stepwise,"
        "prefill_chunk_tokens=64",
        {"batch_size": 1, "max_batch_size": None, "device": "cpu"})
    assert lm.engine.method.name == "h2o" and lm.scoring == "stepwise"
    assert lm.engine.method.hyperparameters()["budget_ratio"] == 0.5
    assert lm.engine.method.hyperparameters()["recent_ratio"] == 0.25
    assert lm.engine.settings.prefill_chunk_tokens == 64
    info = lm.get_model_info()
    assert info["kvharness_method"] == "h2o" and info["kvharness_scoring"] == "stepwise"


@pytest.mark.parametrize("args, message", [
    (dict(model="stories260k", scoring="sometimes"), "scoring='sometimes'; allowed: chunked"),
    (dict(model="stories260k", batch_size=0), "batch_size=0: allowed: a positive integer"),
    (dict(model="stories260k", method="h2o", budgte_ratio=0.2), "budgte_ratio=0.2 is neither"),
    (dict(model="stories260k", method="nosuch"), "method='nosuch' is unknown"),
    (dict(model="stories260k", method="h2o", budget_ratio=3.0), "method.budget_ratio=3.0"),
    (dict(model="nosuch"), "model.name='nosuch' is unknown"),
    (dict(method="full"), "kvharness needs model="),
    (dict(model="stories260k", device="tpu"), "device='tpu'"),
    (dict(model="stories260k", prefill_chunk_tokens=0), "prefill_chunk_tokens=0"),
])
def test_bad_model_args_raise_one_config_error(args, message, monkeypatch):
    from harness.core import models

    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the config error was found")
    monkeypatch.setattr(models, "load_model", refuse)
    with pytest.raises(ConfigError) as err:
        KVHarnessLM(**args)
    assert message in str(err.value)


def test_engine_plus_method_args_is_an_error(stories):
    model, tok = stories
    with pytest.raises(ConfigError, match="given together with an engine"):
        KVHarnessLM(engine_for(model, tok), method="h2o")


# --- offline task folder -------------------------------------------------------------------------
def test_offline_task_dir_is_reused_and_repaired(tmp_path):
    need_shared(DATA)
    first = offline_task_dir(DATA, cache_dir=tmp_path)
    assert offline_task_dir(DATA, cache_dir=tmp_path) == first
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(["copa.yaml", "piqa.yaml", "openbookqa.yaml", "winogrande.yaml",
                            "rte.yaml", "lambada_openai.yaml", "utils.py", "kvh_paths.json"])
    copa = (first / "copa.yaml").read_text()
    assert f'"{DATA.resolve()}/copa/copa.jsonl"' in copa
    assert "lm_eval/tasks/super_glue/copa/default.yaml" in copa and "@" not in copa
    (first / "copa.yaml").write_text("task: broken\n")  # a stale / edited file is rewritten
    assert offline_task_dir(DATA, cache_dir=tmp_path) == first
    assert (first / "copa.yaml").read_text() == copa
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_offline_task_dir_names_a_missing_data_dir(tmp_path):
    with pytest.raises(ConfigError, match=r"task.data_dir=.*nope: no such folder"):
        offline_task_dir(tmp_path / "nope", cache_dir=tmp_path)


# --- the CLI -------------------------------------------------------------------------------------
def _cli(*args, tmp_path):
    env = dict(os.environ, KVH_CACHE_DIR=str(tmp_path / "cache"), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", PYTHONPATH=str(PROJECT))
    return subprocess.run([sys.executable, "-m", "harness.lm_eval", *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def cli_main(tmp_path, monkeypatch):
    """lm-eval's own CLI as `python -m harness.lm_eval` runs it (its main, in this process: the
    entry point's start is test_cli_entry_point_starts'), `main(*args)`. Of lm-eval's built-in
    tasks only copa's folder is indexed, so ours still overrides a built-in one (indexing all of
    them takes lm-eval 10-20 s, which is not ours to test)."""
    from lm_eval.tasks import _index

    from harness.lm_eval.__main__ import main

    build, builtin = _index.TaskIndex.build, Path(_index.__file__).parent
    monkeypatch.setattr(_index.TaskIndex, "build", staticmethod(lambda paths, **kw: build(
        [builtin / "super_glue" / "copa" if Path(p) == builtin else p for p in paths], **kw)))
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["harness.lm_eval", *args])
        main()
    return run


def test_cli_runs_lm_eval_with_our_model_and_tasks(task_dir, tmp_path, cli_main):
    need_shared(STORIES)
    out = tmp_path / "out"
    cli_main("--model", "kvharness", "--model_args", "model=stories260k,method=full",
             "--tasks", "copa", "--include_path", str(task_dir), "--limit", "4",
             "--num_fewshot", "1", "--output_path", str(out), "--log_samples", "--device", "cpu")
    results = list(out.rglob("results_*.json"))
    samples = list(out.rglob("samples_copa_*.jsonl"))
    assert len(results) == 1 and len(samples) == 1
    data = json.loads(results[0].read_text())
    assert 0.0 <= data["results"]["copa"]["acc,none"] <= 1.0
    assert data["n-shot"]["copa"] == 1 and data["config"]["kvharness_method"] == "full"
    assert len(samples[0].read_text().splitlines()) == 4


def test_cli_config_error_is_one_line(task_dir, cli_main, capsys):
    with pytest.raises(SystemExit) as stop:
        cli_main("--model", "kvharness", "--model_args", "model=stories260k,scoring=sometimes",
                 "--tasks", "copa", "--include_path", str(task_dir), "--limit", "1")
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "error: kvharness scoring='sometimes'" in err and "Traceback" not in err


def test_cli_entry_point_starts(tmp_path):
    """`python -m harness.lm_eval` hands its arguments to lm-eval's CLI (its help, here)."""
    proc = _cli("--help", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: lm-eval")


def test_package_name_does_not_shadow_lm_eval():
    import lm_eval
    import lm_eval.api.model

    import harness.lm_eval

    assert harness.lm_eval.__name__ == "harness.lm_eval"
    assert "site-packages" in lm_eval.__file__ or "dist-packages" in lm_eval.__file__
    assert issubclass(KVHarnessLM, lm_eval.api.model.TemplateLM)
    from lm_eval.api.registry import get_model

    assert get_model("kvharness") is KVHarnessLM


@pytest.mark.usefixtures("shared_folder")
def test_lm_eval_records_and_flags_an_inactive_method(capsys):
    from harness.lm_eval import __main__ as lm_main
    from harness.lm_eval.model import ACTIVITY, KVHarnessLM

    lm = KVHarnessLM(model="stories260k", method="kivi", device="cpu")  # residual > the text
    lm.score([1, 2, 3, 4], [5, 6])
    info = lm.get_model_info()
    assert info["kvharness_method_active"] is False and info["kvharness_inactive_reason"]
    lm_main.flag_inactive()
    assert "INACTIVE: method=kivi did not act" in capsys.readouterr().err
    ACTIVITY.clear()


@pytest.mark.usefixtures("shared_folder")
def test_lm_eval_batch_size_in_model_args(monkeypatch):
    from harness.lm_eval.model import KVHarnessLM, merge_cli_options

    cli_defaults = {"batch_size": 1, "max_batch_size": None, "device": "cpu"}
    lm = KVHarnessLM.create_from_arg_string("model=stories260k,batch_size=2", cli_defaults)
    assert lm.batch_size == 2
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
