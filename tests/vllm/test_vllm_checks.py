"""The vLLM engine's checks before anything starts (no vLLM needed): every refusal is one line
naming the key and what is allowed, and nothing is written."""

import os
import signal
import subprocess
import sys

import pytest

from harness.engines import vllm_engine
from harness.engines.vllm_engine import VllmEngine, check_setting, compose_setting, kv_held_ratio, parse_knobs
from kvcore.errors import ConfigError
from tests.helpers.processes import gone_within
from tests.vllm.conftest import RULER, ST, one_line  # noqa: E402



@pytest.mark.parametrize("arg, expected", [
    ("vllm.kv_cache_dtype=fp4", "allowed: auto, fp8, fp8_e4m3, fp8_e5m2"),
    ("vllm.kv_cache_dtype=turboquant_k8v4", "Triton GPU kernels"),
    ("vllm.kv_cache=fp8", "did you mean vllm.kv_cache_dtype?"),
    ("vllm.kv_space_gib=0", "vllm.kv_space_gib=0 must be a positive integer"),
    ("vllm.max_num_seqs=many", "vllm.max_num_seqs='many' must be an integer"),
    ("vllm.python=/nonexistent/python", "make vllm-setup"),
    ("vllm.kv_cache_dtype", "write vllm.<key>=<value>"),
    ("vllm.prefix_caching=maybe", "vllm.prefix_caching='maybe' must be true or false"),
])
def test_bad_knobs_are_refused_in_one_line(arg, expected):
    with pytest.raises(ConfigError) as err:
        parse_knobs([arg, "vllm.python=/bin/sh"] if "python" not in arg else [arg])
    assert expected in one_line(err)


def test_knobs_and_overrides_are_split():
    knobs, rest = parse_knobs(["task=ruler", "vllm.kv_cache_dtype=fp8_e5m2",
                               "vllm.max_num_seqs=4", "vllm.prefix_caching=false",
                               "vllm.python=/bin/sh"])
    assert (knobs.kv_cache_dtype, knobs.max_num_seqs, knobs.prefix_caching, rest) == (
        "fp8_e5m2", 4, False, ["task=ruler"])


@pytest.mark.parametrize("overrides, expected", [
    ([*RULER, "method=h2o"], "method=h2o: the vLLM engine runs the full cache, "),
    ([*ST, "task=lm_eval"], "task=lm_eval: scores loglikelihood requests through our cache"),
    ([*ST, "task=perplexity", "task.mode=chunked"], "task.mode=chunked"),
    ([*RULER, "runner.kv_layout=paged"], "runner.kv_layout='paged' configures our engine"),
    ([*RULER, "runner.attn_impl=eager"], "runner.attn_impl='eager' configures our engine"),
    ([*ST, "task=perplexity", "task.mode=streaming", "method=quest"],
     "task=perplexity with method=quest"),
])
def test_what_vllm_cannot_run_is_refused(overrides, expected):
    _, setting = compose_setting(overrides)
    with pytest.raises(ConfigError) as err:
        check_setting(setting)
    assert expected in one_line(err)


def test_the_cli_refuses_before_starting_anything(tmp_path, capsys):
    root = tmp_path / "results"
    code = vllm_engine.main([*RULER, "method=snapkv", f"runner.results_root={root}",
                             "vllm.python=/bin/sh"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: method=snapkv") and "\n" not in err
    assert not root.exists()


def test_a_bad_override_is_one_line():
    with pytest.raises(ConfigError) as err:
        compose_setting([*ST, "task=ruler", "task.lenghts=[256]"])
    assert "task.lenghts" in one_line(err)


def test_a_full_ruler_setting_passes():
    _, setting = compose_setting(RULER)
    check_setting(setting)  # no exception


def test_kv_held_ratio_is_bytes_of_the_format_over_the_model_dtype():
    assert kv_held_ratio("auto", 4) == 1.0
    assert kv_held_ratio("fp8_e4m3", 4) == 0.25
    assert kv_held_ratio("fp8", 2) == 0.5


class FakeWorker:
    """Answers as scripts/vllm_worker.py does, from canned token times."""

    def __init__(self):
        self.sent = []

    def call(self, msg):
        self.sent.append(msg)
        if msg["op"] == "generate":
            return {"ok": True, "wall_s": 1.0, "outputs": [
                {"token_ids": [7, 8, 9], "token_s": [0.5, 0.6, 0.8], "prompt_tokens": 3},
                {"token_ids": [5], "token_s": [0.4], "prompt_tokens": 2}]}
        return {"ok": True, "wall_s": 0.1, "logprobs": [None, -1.0, -2.0, -0.5]}


def test_engine_joins_query_to_prompt_and_times_tokens():
    worker = FakeWorker()
    engine = VllmEngine(worker, tokenizer=None, info=None, method=None, model_dir="/nowhere")
    outs = list(engine.generate_many([[1, 2], [3]], [3, 1], {0}, queries=[[4], [5]]))
    assert outs == [[7, 8, 9], [5]]
    sent = worker.sent[0]["requests"]
    assert [r["prompt_ids"] for r in sent] == [[1, 2, 4], [3, 5]]
    assert sent[0]["stop_token_ids"] == [0]
    speed = engine.speed()
    assert speed["ttft_ms_median"] == pytest.approx(450.0)
    assert speed["decode_ms_per_token_median"] == pytest.approx(150.0)  # 100 and 200 ms
    assert speed["generated_tokens"] == 4


def test_stream_scores_are_negative_logprobs_after_the_prompt():
    engine = VllmEngine(FakeWorker(), tokenizer=None, info=None, method=None, model_dir="/x")
    import torch

    assert engine.stream_scores(torch.tensor([1, 2, 3, 4]), 0).tolist() == [1.0, 2.0, 0.5]
    assert engine.stream_scores(torch.tensor([1, 2, 3, 4]), 2).tolist() == [2.0, 0.5]


class ReplayWorker:
    """A stand-in for the vLLM worker that serves `generate` with our own engine's full cache,
    each request prefilled from its whole prompt, as vLLM serves a turn of a conversation."""

    def __init__(self, engine):
        self.engine = engine

    def call(self, msg):
        assert msg["op"] == "generate"
        outs = []
        for r in msg["requests"]:
            ids = next(self.engine.generate_many([r["prompt_ids"]], r["max_new_tokens"],
                                                 set(r["stop_token_ids"])))
            outs.append({"token_ids": ids, "token_s": [0.1 * (i + 1) for i in range(len(ids))],
                         "prompt_tokens": len(r["prompt_ids"])})
        return {"outputs": outs, "wall_s": 0.5}


def test_a_conversation_through_the_vllm_engine_holds_what_our_request_holds(stories):
    """Multi-turn through VllmEngine.request (each turn one request of the whole history) gives
    our engine's answers and feeds the same positions: the history is our cache's content."""
    from methods import build_method
    from tasks import build_task
    from tests.conftest import make_engine

    model, tokenizer = stories
    ours = make_engine(model, build_method("full"), tokenizer)
    vllm = VllmEngine(ReplayWorker(make_engine(model, build_method("full"), tokenizer)),
                      tokenizer, ours.info, ours.method, "")
    task = build_task("multiturn", context_tokens=250, turns=2, samples=2, max_new_tokens=6,
                      haystack="repeat")
    mine, theirs = task.evaluate(ours).samples, task.evaluate(vllm).samples
    assert [s["positions_fed"] for s in theirs] == [s["positions_fed"] for s in mine]
    assert [[t["prediction"] for t in s["turns"]] for s in theirs] == \
        [[t["prediction"] for t in s["turns"]] for s in mine]
    assert vllm.speed()["generated_tokens"] == sum(t["generated_tokens"] for s in mine
                                                  for t in s["turns"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_the_worker_dies_with_a_harness_killed_outright(tmp_path):
    """A harness SIGKILLed mid-run (no handler of ours runs) takes its vLLM worker down: the
    kernel sends the worker SIGTERM and the worker kills its process group (vLLM's engine
    core and model runner with it). The worker here is the real script under our own python:
    it imports vLLM only when started."""
    # The worker's stdin stays open after the parent dies (a sleeper holds its write end), as
    # when the worker is busy in vLLM and not reading: only the parent-death signal ends it.
    code = ("import subprocess, sys, time; from pathlib import Path; from harness.engines.vllm_engine "
            f"import VllmWorker; w = VllmWorker(sys.executable, Path({str(tmp_path / 'log')!r}));"
            " s = subprocess.Popen(['sleep', '60'], pass_fds=[w.proc.stdin.fileno()]); "
            "print(w.proc.pid, s.pid, flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=str(vllm_engine.ROOT))
    worker, sleeper = (int(x) for x in parent.stdout.readline().split())
    try:
        assert os.getpgid(worker) == worker  # it leads its own group
        parent.kill()
        parent.wait()
        assert gone_within([worker], 20)
    finally:
        os.kill(sleeper, signal.SIGKILL)


def test_killing_the_worker_takes_its_group(tmp_path):
    w = vllm_engine.VllmWorker(sys.executable, tmp_path / "log")
    w.kill()
    assert w.proc.returncode == -signal.SIGKILL
    w.close()
