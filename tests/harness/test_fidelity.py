"""Paired fidelity per sample (`task.fidelity_tokens`, harness.core.fidelity): the full cache against
itself is exact, an aggressive eviction is not, the setting's own figures never change, and a
sweep gives every setting what its single run gives."""

import json
import math

import pytest
import torch

from harness.core import fidelity
from harness.stats import fidelity as fidelity_stats
from harness.sweep import decode as sweep_decode
from harness.sweep import execute as sweep_execute
from harness.run import run
from tests.conftest import STORIES, need_shared
from tests.helpers.runs import cfg_for, refused
from tests.helpers.sweeps import (TASK, assert_close, folder_figures, sharded_folders,
                                  single_runs, sweep_folders)

K = 4
EVICTING = ["method=streaming_llm", "method.budget_tokens=32"]  # 32 of ~310 prompt tokens
STREAM = ["model=stories260k", "task=perplexity", "task.max_tokens=48", "runner.threads=1"]


def single(tmp_path, name: str, *overrides):
    need_shared(STORIES)
    return run(cfg_for(*overrides, f"runner.output_dir={tmp_path}/{name}"))


def records(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]


def section(folder) -> dict:
    return json.loads((folder / "metrics.json").read_text())["fidelity"]


def test_kl_of_a_distribution_with_itself_is_zero_and_otherwise_positive():
    logits = torch.randn(3, 11)
    assert torch.equal(fidelity.kl(logits, logits), torch.zeros(3, dtype=torch.float64))
    other = logits.clone()
    other[:, 0] += 2
    p, q = torch.softmax(logits.double(), -1), torch.softmax(other.double(), -1)
    assert torch.allclose(fidelity.kl(logits, other), (p * (p / q).log()).sum(-1))
    assert fidelity.top_agree(logits, logits).all()


def test_full_cache_against_itself_is_exact(tmp_path):
    folder = single(tmp_path, "full", *TASK, "method=full", f"task.fidelity_tokens={K}")
    rows = records(folder)
    for row in rows:
        fid = row["fidelity"]
        assert 1 <= fid["tokens"] <= K and len(fid["kl"]) == fid["tokens"]
        assert fid["kl"] == [0.0] * fid["tokens"] and fid["kl_max"] == 0.0
        assert fid["top_agree_ratio"] == 1.0
        assert fid["gold_logprob"] == fid["gold_logprob_full"] < 0
    stats = section(folder)
    assert stats["kl_mean"]["value"] == 0 and stats["kl_p99"]["value"] == 0
    assert stats["top_agree_percent"]["value"] == 100
    assert stats["samples"] == len(rows) and stats["gold_samples"] == len(rows)


def test_an_aggressive_eviction_moves_the_distributions(tmp_path):
    folder = single(tmp_path, "evict", *TASK, *EVICTING, f"task.fidelity_tokens={K}")
    rows = records(folder)
    # the first distribution is the dense prefill's own (the prompt is compressed at its end)
    assert all(r["fidelity"]["kl"][0] == 0 for r in rows)
    assert all(r["fidelity"]["kl_max"] > 1e-4 for r in rows)
    assert all(r["fidelity"]["gold_logprob"] != r["fidelity"]["gold_logprob_full"] for r in rows)
    stats = section(folder)
    low, high = stats["kl_mean"]["ci95"]
    assert 0 < low <= stats["kl_mean"]["value"] <= high


def test_a_wrong_token_offset_is_caught(tmp_path, monkeypatch):
    """Planted bug: the reference tokens fed one position early (each distribution then follows
    one more token than the full cache's did): the full cache no longer equals itself."""
    def early(req, logits, tokens):
        rows = [logits[0, -1]]
        for token in tokens[1:]:
            rows.append(req.step(token)[0, -1])
        return torch.stack(rows).float()

    fidelity._REFERENCES.clear()
    monkeypatch.setattr(fidelity, "forced", early)
    folder = single(tmp_path, "bug", *TASK, "method=full", f"task.fidelity_tokens={K}")
    assert any(r["fidelity"]["kl_max"] > 0 for r in records(folder))
    fidelity._REFERENCES.clear()


def test_the_setting_figures_are_those_of_a_run_without_fidelity(tmp_path):
    """Same accuracy, KV figures, token counts, protocol and samples with K = 0 and K > 0; only
    the fidelity section (and its records) is added."""
    off = folder_figures(single(tmp_path, "off", *TASK, *EVICTING))
    on = folder_figures(single(tmp_path, "on", *TASK, *EVICTING, f"task.fidelity_tokens={K}"))
    (m_off, s_off), (m_on, s_on) = off, on
    assert "fidelity" in m_on and "fidelity" not in m_off
    m_on.pop("fidelity")
    for m in (m_on, m_off):  # the knob itself
        m["task"]["options"].pop("fidelity_tokens")
        m["uncertainty"].pop("interval", None)
    assert m_on == m_off
    assert [{k: v for k, v in r.items() if k != "fidelity"} for r in s_on] == s_off


def test_streaming_perplexity_against_a_full_cache_pass(tmp_path):
    full = records(single(tmp_path, "pf", *STREAM, "method=full", "task.fidelity_tokens=1"))[0]
    assert full["fidelity"]["tokens"] == 47 == len(full["token_nll"])
    assert full["fidelity"]["kl_max"] == 0 and full["fidelity"]["top_agree_ratio"] == 1
    evict = records(single(tmp_path, "pe", *STREAM, "method=streaming_llm",
                           "method.budget_tokens=16", "task.fidelity_tokens=1"))[0]
    kl = evict["fidelity"]["kl"]
    assert kl[:15] == [0.0] * 15 and max(kl) > 1e-4  # the first 16 tokens fit the budget


SWEPT = [EVICTING, ["method=snapkv", "method.budget_tokens=48"],
         ["method=h2o", "method.budget_tokens=24"], ["method=full"]]


def sweep_against_single_runs(tmp_path, size: int) -> None:
    settings = [[*TASK, f"task.fidelity_tokens={K}", *knobs] for knobs in SWEPT]
    alone = single_runs(settings, tmp_path)
    swept = sweep_folders([[*s, f"runner.sweep_decode_batch={size}"] for s in settings],
                          tmp_path)
    for knobs, a, b in zip(SWEPT, alone, swept):
        (ma, sa), (mb, sb) = folder_figures(a), folder_figures(b)
        assert section(b)["tokens"] > 0
        if size == 1:  # every setting teacher-forced alone: bit for bit
            assert sb == sa and mb == ma, knobs
        else:  # batched rows: within the reassociation of the batched matmuls
            assert_close(sb, sa, 1e-4, knobs[0])
            assert_close(mb, ma, 1e-4, knobs[0])


@pytest.mark.parametrize("size", [1, 3])
def test_sweep_gives_each_setting_its_single_run_fidelity(size, tmp_path, monkeypatch):
    """A sweep's settings share one full-cache reference per sample and take their prompt states
    from the sweep's shared prefill (no setting prefills the prompt again); 3 at a time they
    are teacher-forced in lockstep (one batched forward per token, the last batch partial)."""
    need_shared(STORIES)
    fidelity._REFERENCES.clear()
    batched = []
    real = sweep_decode._lockstep
    monkeypatch.setattr(sweep_decode, "_lockstep",
                        lambda reqs, *a: batched.append(len(reqs)) or real(reqs, *a))
    states = []  # what each fidelity request started from: the sweep's shared prompt states
    opened = sweep_execute.give_prompt_state
    monkeypatch.setattr(sweep_execute, "give_prompt_state", lambda req, prompt, query, shared, **kw:
                        states.append(type(shared).__name__) or opened(req, prompt, query,
                                                                       shared, **kw))
    sweep_against_single_runs(tmp_path, size)
    assert (max(batched) == 3) if size > 1 else not batched
    # every setting's requests took a replayed prompt state (none fed the prompt itself), in
    # the answers' own pass (each prompt's forward recorded once for both)
    assert states and "NoneType" not in states, states


def test_unforkable_prompt_states_are_replayed_into_each_fidelity_request(tmp_path,
                                                                         monkeypatch):
    """Settings whose prompt state cannot be copied (a host-tier store: TailorKV; the method's
    own query statistics: ExpectedAttention) get the recorded forward replayed into each
    fidelity request, as their answers do, bit for bit their single runs' figures."""
    need_shared(STORIES)
    fidelity._REFERENCES.clear()
    states = []
    opened = sweep_execute.give_prompt_state
    monkeypatch.setattr(sweep_execute, "give_prompt_state", lambda req, prompt, query, shared, **kw:
                        states.append(type(shared).__name__) or opened(req, prompt, query,
                                                                       shared, **kw))
    settings = [[*TASK, f"task.fidelity_tokens={K}", "runner.sweep_decode_batch=1", *knobs]
                for knobs in (["method=full"], ["method=tailorkv", "method.budget_ratio=0.3"],
                              ["method=expected_attention", "method.budget_ratio=0.3"])]
    alone = single_runs(settings, tmp_path)
    swept = sweep_folders(settings, tmp_path)
    for knobs, a, b in zip(settings, alone, swept):
        assert folder_figures(b) == folder_figures(a), knobs[-2]
    assert "Recording" in states, states


def test_shards_answer_and_their_merge_records_each_single_run_fidelity(tmp_path):
    """Shards record answers only; the merge, which computes no answer, computes every
    setting's fidelity afterwards, from the group's prompt states as a sweep's pass would."""
    need_shared(STORIES)
    fidelity._REFERENCES.clear()
    settings = [[*TASK, f"task.fidelity_tokens={K}", *knobs] for knobs in SWEPT[:2]]
    alone = single_runs(settings, tmp_path)
    merged = sharded_folders(settings, tmp_path / "sharded")
    for knobs, a, b in zip(settings, alone, merged):
        assert section(b)["tokens"] > 0
        assert folder_figures(b) == folder_figures(a), knobs[-2]


@pytest.mark.parametrize("size", [1, 2])
def test_streams_swept_together_equal_their_single_runs(size, tmp_path):
    """Streaming perplexity: one full-cache pass beside the settings, 2 at a time in lockstep
    (the last batch partial), each equal to its single run."""
    need_shared(STORIES)
    settings = [[*STREAM, "task.fidelity_tokens=1", *knobs] for knobs in
                (["method=full"], ["method=streaming_llm", "method.budget_tokens=16"],
                 ["method=h2o", "method.budget_tokens=16"])]
    alone = single_runs(settings, tmp_path)
    swept = sweep_folders([[*s, f"runner.sweep_decode_batch={size}"] for s in settings],
                          tmp_path)
    for knobs, a, b in zip(settings, alone, swept):
        (ma, sa), (mb, sb) = folder_figures(a), folder_figures(b)
        assert_close(sb, sa, 1e-4, knobs[-1])
        assert_close(mb, ma, 1e-4, knobs[-1])
    # stepped alone the full cache equals its pass bit for bit; as a batched row, to rounding
    assert records(swept[0])[0]["fidelity"]["kl_max"] <= (0 if size == 1 else 1e-9)
    assert records(swept[1])[0]["fidelity"]["kl_max"] > 1e-4


def test_a_wrong_offset_in_the_lockstep_is_caught(tmp_path, monkeypatch):
    """Planted bug: the settings stepped together are fed the reference one token early."""
    need_shared(STORIES)
    real = sweep_decode._lockstep
    monkeypatch.setattr(sweep_decode, "_lockstep",
                        lambda reqs, starts, tokens: real(reqs, starts, [*tokens[1:], 0]))
    with pytest.raises(AssertionError):
        sweep_against_single_runs(tmp_path, 3)


@pytest.mark.parametrize("override, message", [
    ("task.fidelity_tokens=-1", "task.fidelity_tokens=-1 must be an integer >= 0"),
    ("task.fidelity_tokens=x", "task.fidelity_tokens='x' must be an integer"),
    ("task.fidelity_tokens=true", "task.fidelity_tokens=True must be an integer"),
])
def test_a_bad_value_is_refused_in_one_line(override, message, tmp_path):
    assert message in refused(tmp_path, *TASK, override)


def test_tasks_without_fidelity_refuse_it_by_name(tmp_path):
    assert "task=multiturn records no paired fidelity" in refused(
        tmp_path, "model=stories260k", "task=multiturn", "task.fidelity_tokens=4")
    assert "task.mode=chunked records none" in refused(
        tmp_path, *STREAM, "task.mode=chunked", "task.fidelity_tokens=4")


def test_summary_pools_tokens_and_resamples_samples():
    rows = [{"fidelity": {"kl": [0.0, 1.0], "top_agree": [True, False], "gold_logprob": -1.0,
                          "gold_logprob_full": -0.5}},
            {"fidelity": {"kl": [3.0], "top_agree": [True], "gold_logprob": None,
                          "gold_logprob_full": None}}]
    out = fidelity_stats.summary(rows, resamples=200)
    assert out["tokens"] == 3 and out["samples"] == 2 and out["gold_samples"] == 1
    assert out["kl_mean"]["value"] == pytest.approx(4 / 3)
    assert out["kl_median"]["value"] == 1.0
    assert out["top_agree_percent"]["value"] == pytest.approx(200 / 3)
    assert out["gold_logprob_mean"]["value"] == -1.0
    low, high = out["kl_mean"]["ci95"]
    assert low == pytest.approx(0.5) and high == pytest.approx(3.0)  # all of one, all of other
    assert math.isfinite(out["kl_p99"]["value"])
    assert fidelity_stats.summary([{"id": 0}]) is None


def with_fidelity(folder, kl: float, gold_gap: float) -> None:
    """Give a fake RULER run per-sample fidelity records and their metrics.json section."""
    rows = records(folder)
    for i, row in enumerate(rows):
        per_token = [kl * (1 + (i % 3)), 0.0]
        row["fidelity"] = {"tokens": 2, "kl_mean": sum(per_token) / 2, "kl_max": max(per_token),
                           "top_agree_ratio": 0.5 if kl else 1.0, "kl": per_token,
                           "top_agree": [not kl, True], "gold_logprob": -2.0 - gold_gap,
                           "gold_logprob_full": -2.0}
    (folder / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    metrics = json.loads((folder / "metrics.json").read_text())
    metrics["fidelity"] = fidelity_stats.summary(rows, resamples=200)
    (folder / "metrics.json").write_text(json.dumps(metrics))


def test_report_shows_fidelity_beside_accuracy_and_ranks_by_accuracy(tmp_path):
    from harness import report
    from tests.helpers.reports import ruler_run

    runs = tmp_path / "runs"
    with_fidelity(ruler_run(runs, "full", [1.0] * 20), 0.0, 0.0)
    with_fidelity(ruler_run(runs, "h2o", [1.0] * 18 + [0.0] * 2, budget=0.2,
                            started="2026-11-29T12:00:00"), 0.1, 0.5)
    _, out, _ = report.build_report([str(runs)], runs / "out", resamples=200)
    board = (out / "leaderboard.md").read_text()
    head = next(line for line in board.splitlines() if line.startswith("| method"))
    assert "ruler average · KL mean ↓" in head and "ruler average · same top % ↑" in head
    h2o = next(line for line in board.splitlines() if line.startswith("| h2o"))
    # pooled tokens: (0.1 x (7 x 1 + 7 x 2 + 6 x 3) / 20 + 0) / 2; one of two top tokens agree
    assert "| 0.0975 [" in h2o and "| 50 [50, 50] |" in h2o
    table = board.split("Paired fidelity with the full cache")[1]
    row = next(line for line in table.splitlines() if line.startswith("| stories260k"))
    assert "| 20 | 0.0975 [" in row and "| -0.5 [-0.5, -0.5] |" in row
    csv_head = (out / "leaderboard.csv").read_text().splitlines()[0]
    assert "ruler average · KL mean" in csv_head and "ruler average · KL mean ci95_low" in csv_head
    compared = (out / "comparisons.csv").read_text().splitlines()
    assert "fidelity_gold_logprob_difference" in compared[0]
    assert ">KL mean ↓</th>" in (out / "report.html").read_text()
    # the rank interval is still the task metric's (accuracy), in the task's own column
    assert "| 90 [" in h2o and " n=20 #" in h2o.split(" · KL")[0]
