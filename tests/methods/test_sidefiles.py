"""The side files a method reads (methods/_sidefiles.py): checked like its knobs before the
weights load (a binary or non-UTF-8 text, an empty path) and recorded with their hash in
metrics.json."""

import hashlib
import json

import pytest

from methods import _sidefiles as sidefiles
from methods import build_method
from tests.conftest import STORIES, need_shared
from tests.helpers.runs import ST, cfg_for
from tests.helpers.validation import INFO, head_scores, one_reason


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


@pytest.mark.parametrize("name, key", [("headkv", "head_scores_path"),
                                       ("duo_attention", "pattern_path"),
                                       ("infinigen", "calibration_path"),
                                       ("kvquant", "calibration_path"),
                                       ("kvquant", "cache_dir")])
def test_an_empty_path_is_refused_not_read_as_not_given(name, key):
    knobs = {"budget_tokens": 16} if name == "headkv" else {}
    reason = one_reason(build_method(name, **knobs, **{key: ""}))
    assert f"method.{key}='' is empty; give a file or folder, or null" in reason


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
    out = run(cfg_for(*ST, "task.prefill_tokens=16", "method=headkv", "method.budget_tokens=8",
                  f"method.head_scores_path={path}", f"runner.output_dir={tmp_path / 'o'}"))
    metrics = json.loads((out / "metrics.json").read_text())
    files = metrics["method"]["side_files"]
    assert [f["key"] for f in files] == ["method.head_scores_path"]
    assert files[0]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
