"""harness.store.inputs and uncertainty.load_samples: files a user names are checked by kind and size
before a byte is read, rows parsed strictly and checked per task, each refusal one line naming
the file (and line)."""

import json
import os
from pathlib import Path

import pytest

from harness.store import inputs
from harness.stats.uncertainty import load_samples, row_problem
from kvcore.errors import ConfigError


def refusal(path: Path, task: str = "perplexity") -> str:
    with pytest.raises(ConfigError) as info:
        load_samples(path, task)
    text = str(info.value)
    assert "\n" not in text and str(path) in text
    return text


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def link(path: Path, target: str) -> Path:
    os.symlink(target, path)
    return path


@pytest.mark.parametrize("make, expect", [
    (lambda p: fifo(p), "is a FIFO (named pipe)"),
    (lambda p: link(p, "/dev/zero"), "is a character device (a link to /dev/zero)"),
    (lambda p: link(p, "/dev/urandom"), "is a character device (a link to /dev/urandom)"),
    (lambda p: link(p, "/dev/null"), "is a character device"),
    (lambda p: (p.mkdir(), p)[1], "is a folder"),
    (lambda p: link(p, str(p.parent / "gone.jsonl")), "is a broken link"),
    (lambda p: link(p, str(fifo(p.parent / "pipe"))), "is a FIFO (named pipe) (a link to"),
])
def test_a_file_that_is_not_regular_is_refused_before_reading(make, expect, tmp_path):
    """A FIFO would block the reader and /dev/zero never ends: both are named, never opened."""
    path = tmp_path / "samples.jsonl"
    make(path)
    assert expect in refusal(path)


def test_a_sparse_giant_is_refused_by_its_size_unread(tmp_path):
    path = tmp_path / "samples.jsonl"
    with open(path, "wb") as f:
        f.truncate(inputs.JSONL_MAX_BYTES + 1)  # sparse: no block written
    text = refusal(path)
    assert "above the 256 MiB limit" in text and "nothing was read" in text


def test_a_capped_read_never_reads_past_its_limit(tmp_path):
    path = tmp_path / "gate.yaml"
    path.write_text("x" * 2048)
    with pytest.raises(ConfigError, match="above the 0.0009766 MiB limit"):
        inputs.read_text(path, "--against", max_bytes=1024)
    assert inputs.read_text(path, "--against", max_bytes=4096) == "x" * 2048


@pytest.mark.parametrize("line, expect", [
    ('{"sample_id": "a", "token_nll": [NaN]}', "line 2 is not JSON (NaN is not a JSON number)"),
    ('{"sample_id": "a", "token_nll": [Infinity]}', "Infinity is not a JSON number"),
    ('{"sample_id": "a", "token_nll": [-Infinity]}', "-Infinity is not a JSON number"),
    ('[1.0, 2.0]', "line 2 is a JSON array, not an object"),
    ('"a row"', "line 2 is a JSON string, not an object"),
    ('3.5', "line 2 is a JSON number, not an object"),
    ('null', "line 2 is a JSON null, not an object"),
    ('true', "line 2 is a JSON boolean, not an object"),
    ('{"sample_id": "a", "token_nll": [3.1', "line 2 is not JSON"),
])
def test_rows_are_strict_json_objects(line, expect, tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text('{"sample_id": "z", "token_nll": [1.0]}\n' + line + "\n")
    assert expect in refusal(path)


def test_bytes_that_are_not_utf8_are_named_with_their_line(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_bytes(b'{"sample_id": "a"}\n{"sample_id": "caf\xe9"}\n')
    assert "not UTF-8 text (line 2" in refusal(path)


@pytest.mark.parametrize("task, row, expect", [
    ("perplexity", {"token_nll": [1.0, None]}, "token_nll[1]=null must be a finite number >= 0"),
    ("perplexity", {"token_nll": [1.0, "2.5"]}, 'token_nll[1]="2.5" must be a finite number'),
    ("perplexity", {"token_nll": [True]}, "token_nll[0]=true must be a finite number"),
    ("perplexity", {"token_nll": [-0.5]}, "token_nll[0]=-0.5 must be a finite number >= 0"),
    ("perplexity", {"token_nll": "1.0 2.0"}, "token_nll must be a list of numbers"),
    ("perplexity", {"token_nll": None}, "token_nll must be a list of numbers"),
    ("ruler", {"score": None, "subtask": "s", "length_tokens": 512}, "score=null must be"),
    ("ruler", {"score": "1", "subtask": "s", "length_tokens": 512}, 'score="1" must be'),
    ("ruler", {"score": False, "subtask": "s", "length_tokens": 512}, "score=false must be"),
    ("ruler", {"score": 1.5, "subtask": "s", "length_tokens": 512}, "score=1.5 is outside [0, 1]"),
    ("ruler", {"score": 1, "subtask": "s", "length_tokens": "512"}, 'length_tokens="512" must'),
    ("ruler", {"score": 1, "subtask": 7, "length_tokens": 512}, "subtask=7 must be a non-empty"),
    ("longbench", {"score": [0.5], "dataset": "qasper"}, "score=[0.5] must be a finite number"),
    ("longbench", {"score": 0.5, "dataset": ""}, 'dataset="" must be a non-empty string'),
    ("multiturn", {"turns": {"correct": 1}}, "turns={\"correct\": 1} must be a non-empty list"),
    ("multiturn", {"turns": [{"correct": 1}, [1]]}, "turns[1] must be an object"),
    ("multiturn", {"turns": [{"correct": "yes"}]}, 'turns[0].correct="yes" must be'),
    ("xsum", {"skipped": False, "rougeL": None}, "rougeL=null must be a finite number"),
    ("xsum", {"skipped": False, "rougeL": 250.0}, "rougeL=250.0 is outside [0, 100]"),
    ("lm_eval", {"task": "copa", "acc": "1"}, 'acc="1" must be a finite number'),
    ("ruler", {"sample_id": 12, "score": 1}, "sample_id=12 must be a non-empty string"),
])
def test_a_score_that_is_not_a_finite_number_in_range_is_named(task, row, expect, tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text(json.dumps({"sample_id": "ok", **row}) if "sample_id" not in row
                    else json.dumps(row))
    assert f"line 1: {expect}" in refusal(path, task)


def test_rows_written_before_a_record_existed_are_read_and_good_rows_pass(tmp_path):
    """A key that is absent (an older writer) is no corruption: the interval says it has none."""
    assert row_problem("perplexity", {"sample_id": "a"}) == ""
    assert row_problem("ruler", {"sample_id": "a", "score": 0.5}) == ""
    assert row_problem("xsum", {"sample_id": "a", "skipped": True}) == ""
    path = tmp_path / "samples.jsonl"
    rows = [{"sample_id": "a", "token_nll": [0.0, 3.25]}, {"sample_id": "b", "token_nll": [1]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert load_samples(path, "perplexity") == rows


def test_projection_skips_a_metrics_json_it_cannot_read_without_blocking(tmp_path, capsys):
    """harness.core.projection --runs reads metrics.json through the same capped reader."""
    from harness.core import projection

    for name, make in (("fifo", os.mkfifo), ("zero", lambda p: os.symlink("/dev/zero", p)),
                       ("list", lambda p: p.write_text("[1, 2]"))):
        (tmp_path / name).mkdir()
        make(tmp_path / name / "metrics.json")
    assert projection.load_runs([str(tmp_path)]) == []
    err = capsys.readouterr().err
    assert "is a FIFO (named pipe)" in err and "(a link to /dev/zero)" in err
    assert "a JSON array, not a run's metrics" in err
