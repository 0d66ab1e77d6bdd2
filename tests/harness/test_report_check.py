"""Report (table + plots) and regression gates, on a small results tree built here."""

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from harness import report
from harness.report import check
from kvcore.errors import ConfigError
from tests.helpers.reports import fake_run


@pytest.fixture
def tree(tmp_path):
    fake_run(tmp_path, "full", 50.0, 100.0)
    fake_run(tmp_path, "full", 50.0, 310.0, batch=4)
    fake_run(tmp_path, "h2o", 55.0, 90.0, budget=0.2, density=0.21)
    fake_run(tmp_path, "h2o", 52.0, 85.0, budget=0.5, density=0.51)
    grid = {"depths": [0, 50, 100], "lengths": [256, 512], "accuracy": [[100, 0], [50, None], [0, 100]]}
    fake_run(tmp_path, "full", 0.0, 100.0, task="ruler", extra_acc={"average": 40.0,
                                                                    "niah_single_grid": grid})
    return tmp_path


def test_report_table_values_and_plots(tree, tmp_path):
    rows, out, made = report.build_report([str(tree)], tmp_path / "out")
    h2o = [r for r in rows if r["method"] == "h2o" and r["task"] == "perplexity"]
    assert sorted(r["value"] for r in h2o) == [52.0, 55.0]
    assert sorted(r["kv_held"] for r in h2o) == [0.2, 0.5]
    assert sorted(r["attended_fraction"] for r in h2o) == [0.21, 0.51]
    csv_text = (out / "report.csv").read_text()
    assert csv_text.splitlines()[0].startswith("run,model,method,budget,protocol,batch,task,metric")
    assert sorted(r["batch"] for r in rows if r["method"] == "full") == [1, 1, 4]
    assert "budget_ratio=0.2" in (out / "report.md").read_text()
    names = {p.name for p in made}  # decode vs context needs two contexts: none here
    assert names == {"accuracy_vs_kv_held.png", "accuracy_vs_attended.png", "nll_curve.png",
                     "bytes_per_step.png", "ruler_grid.png", "throughput_vs_batch.png",
                     "capacity.png"}
    for p in made:
        assert p.stat().st_size > 5000 and p.read_bytes()[:4] == b"\x89PNG"


def test_curves_never_join_runs_of_different_protocols(tmp_path):
    """The same method and budget under other dense layers is another curve, labelled so."""
    fake_run(tmp_path, "h2o", 55.0, 90.0, budget=0.2, density=0.21)
    fake_run(tmp_path, "h2o", 50.0, 90.0, budget=0.2, density=0.21, dense_layers=(0, 1))
    rows, _, _ = report.build_report([str(tmp_path)], tmp_path / "out")
    assert sorted(r["series"] for r in rows) == ["h2o [dense=[0, 1] prefill=dense]",
                                                 "h2o [dense=[] prefill=dense]"]


def test_a_bf16_run_is_its_own_model_row(tmp_path):
    """The model name (folder + config hash) leaves the dtype out; the report's model column
    does not, so fp32 and bf16 runs never share a row group or a plot."""
    fake_run(tmp_path, "full", 50.0, 100.0)
    bf16 = fake_run(tmp_path, "full", 50.1, 180.0, started="2026-11-29T12:00:00")
    metrics = json.loads((bf16 / "metrics.json").read_text())
    metrics["model"]["dtype"] = "bfloat16"
    (bf16 / "metrics.json").write_text(json.dumps(metrics))
    rows, _, _ = report.build_report([str(tmp_path)], tmp_path / "out")
    assert sorted(r["model"] for r in rows) == ["stories260k", "stories260k (bfloat16)"]


THRESHOLDS = """
thresholds:
  - {model: stories260k, method: full, task: perplexity, metric: accuracy.ppl, max: 51}
  - {model: stories260k, method: h2o, task: perplexity, metric: accuracy.ppl, max: 56,
     hyperparameters: {budget_ratio: 0.2}}
  - {model: stories260k, method: h2o, task: perplexity, metric: speed.decode_tokens_per_s,
     ratio_to_method: full, min: 0.8, hyperparameters: {budget_ratio: 0.2}}
"""


def test_gate_passes_then_catches_an_injected_regression(tree, tmp_path, capsys):
    gate = tmp_path / "gate.yaml"
    gate.write_text(THRESHOLDS)
    assert check.main([str(tree), "--against", str(gate)]) == 0
    # inject: a newer h2o run whose perplexity got worse and whose decode got 2x slower
    fake_run(tree, "h2o", 70.0, 45.0, budget=0.2, started="2026-11-29T11:00:00")
    assert check.main([str(tree), "--against", str(gate)]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION: above max" in out and "REGRESSION: below min" in out


def test_a_ratio_compares_with_a_reference_run_measured_alike(tmp_path):
    """ratio_to_method divides by the latest reference run of the same setting (batch, dtype,
    ...), not by the latest reference run: a newer full run at batch 4 must not be the
    denominator of an h2o run at batch 1, nor a bf16 one of an fp32 one."""
    fake_run(tmp_path, "full", 50.0, 100.0)
    fake_run(tmp_path, "h2o", 55.0, 90.0, budget=0.2)
    newer = fake_run(tmp_path, "full", 50.0, 310.0, batch=4, started="2026-11-29T11:00:00")
    gate = tmp_path / "gate.yaml"
    gate.write_text(THRESHOLDS)
    runs = lambda: [json.loads(p.read_text()) for p in report.find_runs([str(tmp_path)])]
    results = check.check(runs(), check.load_thresholds(gate))
    assert results[2]["value"] == pytest.approx(0.9) and results[2]["ok"]
    bf16 = fake_run(tmp_path, "full", 50.0, 400.0, started="2026-11-29T12:00:00")
    metrics = json.loads((bf16 / "metrics.json").read_text())
    metrics["model"]["dtype"] = "bfloat16"
    (bf16 / "metrics.json").write_text(json.dumps(metrics))
    assert check.check(runs(), check.load_thresholds(gate))[2]["value"] == pytest.approx(0.9)
    (tmp_path / "perplexity" / "stories260k" / "full" / "full-None-10-0-1" / "metrics.json"
     ).unlink()  # only runs measured otherwise are left: no ratio, said so
    results = check.check(runs(), check.load_thresholds(gate))
    assert results[2]["value"] is None and "measured like it" in results[2]["why"]
    assert newer.exists()


def test_a_gate_that_matches_nothing_fails(tree, tmp_path):
    gate = tmp_path / "gate.yaml"
    gate.write_text("thresholds:\n  - {model: stories260k, method: kivi, task: perplexity, "
                    "metric: accuracy.ppl, max: 60}\n")
    results = check.check([json.loads(p.read_text()) for p in report.find_runs([str(tree)])],
                          check.load_thresholds(gate))
    assert results[0]["ok"] is False and results[0]["why"] == "matched no run"
    assert check.main([str(tree), "--against", str(gate)]) == 1


def test_bad_threshold_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("thresholds:\n  - {model: m, method: full, task: t}\n")
    with pytest.raises(ConfigError, match="lacks metric"):
        check.load_thresholds(bad)


ENTRY = "{model: stories260k, method: full, task: perplexity, metric: accuracy.ppl"


@pytest.mark.parametrize("text, expect", [
    ("thresholds: [\n  - {a: 1", "not valid YAML"),
    ("- " + ENTRY + ", max: 51}\n", "must be a mapping with one key, 'thresholds:' (got list)"),
    ("thresholds: [1, 2]\n", "thresholds[0] must be a mapping (got 1)"),
    ("thresholds:\n  - " + ENTRY + ", min: abc}\n", "thresholds[0] min='abc' must be a number"),
    ("thresholds:\n  - " + ENTRY + ", mxa: 2}\n", "unknown key 'mxa'; allowed:"),
    ("thresholds:\n  - " + ENTRY + ", max: 60, ratio_to_metod: full}\n", "unknown key 'ratio_to_metod'"),
    ("thresholds:\n  - " + ENTRY + ", min: 60, max: 50}\n", "min=60 is above max=50"),
    ("thresholds:\n  - " + ENTRY + ", max: true}\n", "max=True must be a number"),
    ("thresholds:\n  - " + ENTRY + ", max: 60}\nthreshold: []\n", "(got ['threshold', 'thresholds'])"),
    ("", "must be a mapping with one key"),
])
def test_bad_thresholds_exit_2_with_one_line(text, expect, tree, tmp_path, capsys):
    gate = tmp_path / "gate.yaml"
    gate.write_text(text)
    assert check.main([str(tree), "--against", str(gate)]) == 2
    err = capsys.readouterr().err
    assert expect in err and len(err.strip().splitlines()) == 1 and err.startswith("error: ")


def test_missing_paths_are_bad_input(tree, tmp_path, capsys):
    gate = tmp_path / "gate.yaml"
    gate.write_text(THRESHOLDS)
    assert check.main([str(tree), "--against", str(tmp_path / "nope.yaml")]) == 2
    assert check.main([str(tmp_path / "nope"), "--against", str(gate)]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def corrupt_runs(root: Path) -> list[Path]:
    """A corrupt file, a key-less record, an unversioned one and a list, among good runs."""
    bad = []
    for name, text in (("corrupt", '{"accuracy": {"ppl": 1'), ("keyless", '{"accuracy": {}}'),
                       ("old", json.dumps({"model": {"name": "x"}})), ("list", "[1, 2]")):
        folder = root / "perplexity" / "stories260k" / "bad" / name
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text(text)
        bad.append(folder / "metrics.json")
    return bad


def test_check_skips_corrupt_runs_with_a_warning(tree, tmp_path, capsys):
    bad = corrupt_runs(tree)
    gate = tmp_path / "gate.yaml"
    gate.write_text(THRESHOLDS)
    assert check.main([str(tree), "--against", str(gate)]) == 0
    err = capsys.readouterr().err
    for path in bad:
        assert f"warning: skipped {path}" in err


def test_report_skips_bad_runs_and_reports_the_rest(tree, tmp_path, capsys):
    bad = corrupt_runs(tree)
    assert report.main([str(tree), "--out", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    for path in bad:
        assert f"warning: skipped {path}" in captured.err
    assert "5 runs ->" in captured.out
    assert len((tmp_path / "out" / "report.csv").read_text().splitlines()) == 6  # header + 5


def test_report_reads_underscore_folders_not_hidden_ones(tmp_path):
    fake_run(tmp_path / "_archive", "full", 50.0, 100.0)
    fake_run(tmp_path / ".staging", "h2o", 55.0, 90.0, budget=0.2)
    rows, _, _ = report.build_report([str(tmp_path)], tmp_path / "out")
    assert [r["method"] for r in rows] == ["full"]


def test_report_bad_input_exits_2_and_writes_nothing(tree, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    assert report.main([str(tree), "--out", str(a_file)]) == 2
    assert "is a file" in capsys.readouterr().err and a_file.read_text() == "mine"
    users = tmp_path / "users"
    users.mkdir()
    (users / "notes.txt").write_text("n")
    assert report.main([str(tree), "--out", str(users)]) == 2
    assert "not a report (notes.txt)" in capsys.readouterr().err
    assert sorted(p.name for p in users.iterdir()) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert report.main([str(empty)]) == 2
    assert "no runs to report under" in capsys.readouterr().err
    assert not (empty / "_report").exists()  # nothing left behind
    only_bad = tmp_path / "only_bad"
    corrupt_runs(only_bad)
    assert report.main([str(only_bad)]) == 2
    assert "4 metrics.json, none valid" in capsys.readouterr().err
    assert not (only_bad / "_report").exists()
    assert report.main([str(tmp_path / "nope")]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_query_agnostic_runs_are_their_own_curve(tmp_path):
    """A task's query protocol (RULER task.query) is part of the protocol label: a query-agnostic
    run never joins the query-aware curve of the same method and budget."""
    for hour, query in ((10, "query-aware: the question is compressed"),
                        (11, "query-agnostic: after compression")):
        folder = fake_run(tmp_path, "snapkv", 0.0, 90.0, budget=0.5, density=0.5, task="ruler",
                          extra_acc={"average": 40.0}, started=f"2026-11-29T{hour}:00:00")
        metrics = json.loads((folder / "metrics.json").read_text())
        metrics["protocol"]["query"] = query
        (folder / "metrics.json").write_text(json.dumps(metrics))
    rows, _, _ = report.build_report([str(tmp_path)], tmp_path / "out")
    assert sorted({r["series"] for r in rows}) == [
        "snapkv [dense=[] prefill=dense query-agnostic]", "snapkv [dense=[] prefill=dense query-aware]"]


FROZEN = Path(__file__).resolve().parents[2] / "conf" / "regression" / "reference" / \
    "stories260k-pg19-400-full.samples.jsonl"


def paired_tree(root: Path, token_nll, started="2026-11-29T10:00:00") -> Path:
    """An h2o run whose samples are the frozen full-cache sample with other token losses."""
    folder = fake_run(root, "h2o", float(np.exp(np.mean(token_nll))), 90.0, budget=0.2,
                      started=started)
    frozen = json.loads(FROZEN.read_text().splitlines()[0])
    (folder / "samples.jsonl").write_text(json.dumps(dict(frozen, token_nll=list(token_nll))))
    return folder


def paired_gate(tmp_path: Path) -> Path:
    gate = tmp_path / "gate.yaml"
    gate.write_text("thresholds:\n  - {model: stories260k, method: h2o, task: perplexity, "
                    f"metric: paired.difference, paired_reference: {FROZEN}, max: 5.0}}\n")
    return gate


@pytest.mark.parametrize("shift, noise, fails", [
    (0.0, 0.3, False),   # zero-mean noise on every token's loss: ppl -0.56 [-2.1, 1.0]
    (0.2, 0.0, True),    # a planted regression of +0.2 nats/token: ppl +11.0 [7.8, 15.8]
    (0.12, 0.5, False),  # the point (+7.3) is over the bound, its interval [3.9, 12.4] is not
])
def test_paired_gate_fails_outside_the_noise_only(shift, noise, fails, tmp_path, capsys):
    base = np.array(json.loads(FROZEN.read_text().splitlines()[0])["token_nll"])
    nll = base + shift + np.random.default_rng(3 if shift else 0).normal(0, noise, base.size)
    paired_tree(tmp_path / "runs", np.maximum(nll, 0).round(6))  # -log p is never below 0
    assert check.main([str(tmp_path / "runs"), "--against", str(paired_gate(tmp_path))]) == \
        (1 if fails else 0)
    out = capsys.readouterr().out
    assert ("REGRESSION: interval wholly above max" in out) == fails


def test_paired_gate_refuses_other_samples(tmp_path, capsys):
    """A run on another text (other token ids, so another sample_id) cannot be held against the
    reference: bad input (exit 2, naming the reference), never a regression."""
    folder = paired_tree(tmp_path / "runs", [3.9] * 399)
    row = json.loads((folder / "samples.jsonl").read_text())
    (folder / "samples.jsonl").write_text(json.dumps(dict(row, sample_id="0123456789abcdef")))
    assert check.main([str(tmp_path / "runs"), "--against", str(paired_gate(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "does not pair with the run" in err and "not the same samples" in err
    assert FROZEN.name in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("entry, expect", [
    ("metric: paired.difference, max: 1", "go with paired_reference"),
    ("metric: accuracy.ppl, paired_reference: x.jsonl, max: 1", "go with paired_reference"),
    ("metric: paired.difference, paired_reference: nope.jsonl, max: 1", "nope.jsonl: no such file"),
])
def test_bad_paired_thresholds_are_bad_input(entry, expect, tree, tmp_path, capsys):
    gate = tmp_path / "gate.yaml"
    gate.write_text(f"thresholds:\n  - {{model: stories260k, method: h2o, task: perplexity, "
                    f"{entry}}}\n")
    assert check.main([str(tree), "--against", str(gate)]) == 2
    assert expect in capsys.readouterr().err


def test_report_cells_carry_interval_n_and_rank(tmp_path):
    """Runs with samples: every leaderboard cell shows [low, high] n=..., the comparison with
    the full cache is paired and the noise floor (eager) run is not a board row."""
    base = np.array(json.loads(FROZEN.read_text().splitlines()[0])["token_nll"])
    frozen = json.loads(FROZEN.read_text().splitlines()[0])
    for method, nll, attn in (("full", base, "sdpa"), ("full", base + 1e-6, "eager"),
                              ("h2o", base + 0.2, "sdpa")):
        folder = fake_run(tmp_path, method, float(np.exp(nll.mean())), 90.0,
                          budget=0.2 if method == "h2o" else None,
                          started=f"2026-11-29T1{len(attn)}:00:00")
        metrics = json.loads((folder / "metrics.json").read_text())
        metrics["protocol"]["attn_impl"] = attn
        (folder / "metrics.json").write_text(json.dumps(metrics))
        (folder / "samples.jsonl").write_text(json.dumps(dict(frozen, token_nll=list(nll))))
    rows, out, _ = report.build_report([str(tmp_path)], tmp_path / "out", resamples=500)
    board = (out / "leaderboard.md").read_text()
    assert board.count(" n=399 #") == 2 and "#1 " in board  # two board rows, ranked
    assert "worse than full" in board and "Noise floor" in board and "floor ±" in board
    assert (out / "comparisons.csv").read_text().count("worse than full") == 1


def test_the_ci_gate_holds_paired_thresholds_on_a_committed_reference():
    entries = check.load_thresholds(FROZEN.parents[1] / "ci.yaml")
    paired = [e for e in entries if e["metric"] == "paired.difference"]
    assert len(paired) >= 1 and all(len(e["_reference_samples"][0]["token_nll"]) == 399
                                    for e in paired)


@pytest.mark.usefixtures("shared_folder")
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


def thresholds(path, body):
    path.write_text("thresholds:\n" + body)
    return path


def test_check_ratio_to_a_method_no_run_has_is_bad_input(tmp_path, capsys):
    from harness.report import check

    fake_run(tmp_path / "r", "full", 50.0, 100.0)
    fake_run(tmp_path / "r", "h2o", 55.0, 100.0, budget=0.2)
    gate = thresholds(tmp_path / "t.yaml", "  - {model: stories260k, method: h2o, task: "
                      "perplexity, metric: accuracy.ppl, ratio_to_method: snapkv, max: 1.2}\n")
    assert check.main([str(tmp_path / "r"), "--against", str(gate)]) == 2
    assert "ratio_to_method='snapkv' has no run of model='stories260k'" in capsys.readouterr().err


def test_check_refuses_a_key_given_twice_in_an_entry(tmp_path, capsys):
    from harness.report import check

    fake_run(tmp_path / "r", "full", 50.0, 100.0)
    gate = thresholds(tmp_path / "t.yaml", "  - {model: stories260k, method: full, task: "
                      "perplexity, metric: accuracy.ppl, max: 60, max: 40}\n")
    assert check.main([str(tmp_path / "r"), "--against", str(gate)]) == 2
    assert "key 'max' given twice in one mapping" in capsys.readouterr().err


def test_check_against_a_device_says_what_it_is(tmp_path, capsys):
    from harness.report import check

    fake_run(tmp_path / "r", "full", 50.0, 100.0)
    assert check.main([str(tmp_path / "r"), "--against", "/dev/zero"]) == 2
    err = capsys.readouterr().err
    assert "/dev/zero is not a regular file" in err and "no such file" not in err


def test_a_metrics_json_that_is_a_fifo_or_device_link_is_skipped_with_a_warning(tmp_path):
    import os

    from harness.report.collect import find_runs

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

    fake_run(tmp_path / "r", "full", 50.0, 100.0)
    (tmp_path / "alias").symlink_to(tmp_path / "r")
    assert len(find_runs([str(tmp_path / "r"), str(tmp_path / "alias")])) == 1


# --- statistics inputs held against bad input ------------------------------------------------

def user_file(root: Path) -> Path:
    keep = root / "keep.txt"
    keep.write_text("a user's file\n")
    return keep


def one_line_error(capsys) -> str:
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    return err


def sparse(path: Path, size: int) -> None:
    """Extend `path` (created when absent) to `size` bytes without writing them: a sparse file
    that claims far more than it holds."""
    with open(path, "ab") as f:
        f.truncate(size)


def samples_tree(root: Path) -> tuple[Path, Path]:
    """A full-cache and an h2o run on the frozen reference's sample: (h2o's samples, root)."""
    frozen = json.loads(FROZEN.read_text().splitlines()[0])
    base = np.array(frozen["token_nll"])
    fake_run(root, "full", float(np.exp(base.mean())), 100.0)
    (next(root.rglob("full-*")) / "samples.jsonl").write_text(json.dumps(frozen))
    h2o = paired_tree(root, (base + 0.1).round(6))
    return h2o / "samples.jsonl", root


PLANTS = [
    (lambda p: os.mkfifo(p), "is a FIFO (named pipe)"),
    (lambda p: os.symlink("/dev/zero", p), "(a link to /dev/zero)"),
    (lambda p: os.symlink("/dev/full", p), "(a link to /dev/full)"),
    (lambda p: p.write_text('{"sample_id": "a", "token_nll": [1.0, NaN]}\n'),
     "line 1 is not JSON (NaN is not a JSON number)"),
    (lambda p: p.write_text('{"sample_id": "a", "token_nll": [1.0, null]}\n'),
     "line 1: token_nll[1]=null must be a finite number >= 0"),
    (lambda p: p.write_text('{"sample_id": "a", "token_nll": ["1.0"]}\n'),
     'line 1: token_nll[0]="1.0" must be a finite number'),
    (lambda p: p.write_text('[1.0, 2.0]\n'), "line 1 is a JSON array, not an object"),
    (lambda p: sparse(p, 2**30), "above the 256 MiB limit"),
]


def plant_in(samples: Path, plant) -> None:
    samples.unlink()
    plant(samples)


def no_hang(seconds: int = 60):
    """Fail (instead of hanging the suite) when a FIFO is opened for reading."""
    def fail(*_):
        raise AssertionError("a read blocked (a FIFO was opened)")
    signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)


@pytest.mark.parametrize("plant, expect", PLANTS)
def test_report_refuses_samples_it_cannot_read_before_writing(plant, expect, tmp_path, capsys):
    samples, root = samples_tree(tmp_path / "runs")
    keep = user_file(tmp_path)
    plant_in(samples, plant)
    no_hang()
    try:
        code = report.main([str(root), "--out", str(tmp_path / "out"), "--resamples", "200"])
    finally:
        signal.alarm(0)
    assert code == 2
    err = one_line_error(capsys)
    assert str(samples) in err and expect in err
    assert not (tmp_path / "out").exists() and keep.read_text() == "a user's file\n"


@pytest.mark.parametrize("resamples, expect", [
    ("1", "--resamples 1: at least 100"), ("99", "--resamples 99: at least 100"),
    ("400000000", "above the 2 GiB limit (harness.stats.intervals.MEMORY_LIMIT_BYTES)"),
    ("1000000000000", "above the 2 GiB limit"),
])
def test_report_bounds_resamples_before_reading(resamples, expect, tmp_path, capsys):
    _, root = samples_tree(tmp_path / "runs")
    assert report.main([str(root), "--out", str(tmp_path / "out"), "--resamples",
                        resamples]) == 2
    assert expect in one_line_error(capsys) and not (tmp_path / "out").exists()


def test_report_resamples_are_bounded_by_the_widest_column(tmp_path, capsys, monkeypatch):
    """The estimate counts the runs one bootstrap holds side by side (rank intervals)."""
    from harness.stats import intervals as stats

    _, root = samples_tree(tmp_path / "runs")
    monkeypatch.setattr(stats, "MEMORY_LIMIT_BYTES", stats.bootstrap_bytes(1000, 1))
    assert report.main([str(root), "--out", str(tmp_path / "out"), "--resamples", "1000"]) == 2
    assert "the bootstrap of 2 run(s) side by side" in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def reference_gate(tmp_path: Path, reference: Path) -> Path:
    gate = tmp_path / "gate.yaml"
    gate.write_text("thresholds:\n  - {model: stories260k, method: h2o, task: perplexity, "
                    f"metric: paired.difference, paired_reference: {reference}, max: 5.0}}\n")
    return gate


@pytest.mark.parametrize("plant, expect", PLANTS + [
    (lambda p: p.write_text(""), "needs samples.jsonl rows with sample_id"),
    (lambda p: p.write_text('{"sample_id": "a"}\n'), "no scored units for task=perplexity"),
    (lambda p: p.mkdir(), "is a folder"),
])
def test_a_bad_paired_reference_is_bad_input_never_a_regression(plant, expect, tmp_path,
                                                                capsys):
    paired_tree(tmp_path / "runs", [3.9] * 399)
    reference = tmp_path / "reference.samples.jsonl"
    plant(reference)
    keep = user_file(tmp_path)
    no_hang()
    try:
        code = check.main([str(tmp_path / "runs"), "--against",
                           str(reference_gate(tmp_path, reference))])
    finally:
        signal.alarm(0)
    assert code == 2
    err = one_line_error(capsys)
    assert "paired_reference" in err and str(reference) in err and expect in err
    assert keep.read_text() == "a user's file\n"


@pytest.mark.parametrize("plant, expect", PLANTS[:4])
def test_check_refuses_a_runs_samples_it_cannot_read(plant, expect, tmp_path, capsys):
    samples = paired_tree(tmp_path / "runs", [3.9] * 399) / "samples.jsonl"
    plant_in(samples, plant)
    no_hang()
    try:
        code = check.main([str(tmp_path / "runs"), "--against", str(paired_gate(tmp_path))])
    finally:
        signal.alarm(0)
    assert code == 2
    err = one_line_error(capsys)
    assert str(samples) in err and expect in err


@pytest.mark.parametrize("plant, expect", [
    (lambda p: sparse(p, 2**34), "above the 16 MiB limit"),
    (lambda p: os.symlink("/dev/urandom", p), "not a regular file"),
    (lambda p: os.mkfifo(p), "not a regular file"),
    (lambda p: p.write_bytes(b"thresholds: [\xff\xfe]\n"), "not UTF-8 text (line 1"),
])
def test_a_thresholds_file_is_checked_by_kind_and_size_before_reading(plant, expect, tree,
                                                                      tmp_path, capsys):
    gate = tmp_path / "gate.yaml"
    plant(gate)
    assert check.main([str(tree), "--against", str(gate)]) == 2
    err = one_line_error(capsys)
    assert "--against" in err and str(gate) in err and expect in err


@pytest.mark.parametrize("plant, expect", [
    (lambda p: sparse(p, 2**34), "above the 16 MiB limit"),
    (lambda p: p.write_text(p.read_text().replace('"ppl": 50.0', '"ppl": NaN')),
     "NaN is not a JSON number"),
])
def test_a_metrics_json_too_large_or_not_json_is_skipped_by_name(plant, expect, tree, tmp_path,
                                                                 capsys):
    victim = next(tree.rglob("full-None-10-0-1")) / "metrics.json"
    plant(victim)
    rows, _, _ = report.build_report([str(tree)], tmp_path / "out", resamples=200)
    err = capsys.readouterr().err
    assert f"warning: skipped {victim}" in err and expect in err
    assert all(r["_folder"] != victim.parent for r in rows)
    assert len(rows) == 4  # the other runs are reported


def test_a_folder_of_only_unreadable_runs_is_one_line_naming_the_first(tmp_path, capsys):
    fake_run(tmp_path / "runs", "full", 50.0, 100.0)
    victim = next((tmp_path / "runs").rglob("metrics.json"))
    sparse(victim, 2**34)  # a metrics.json that claims 16 GiB
    assert report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 2
    err = one_line_error(capsys)
    assert "1 metrics.json, none valid" in err and "above the 16 MiB limit" in err
    assert not (tmp_path / "out").exists()


def test_a_folder_whose_only_metrics_json_is_a_device_link_is_one_line(tmp_path, capsys):
    """find_runs skips it (not a regular file); the refusal says so in its one line."""
    fake_run(tmp_path / "runs", "full", 50.0, 100.0)
    victim = next((tmp_path / "runs").rglob("metrics.json"))
    victim.unlink()
    os.symlink("/dev/zero", victim)
    assert report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 2
    err = one_line_error(capsys)
    assert "(no metrics.json; skipped" in err and "not a regular file" in err
    assert not (tmp_path / "out").exists()
