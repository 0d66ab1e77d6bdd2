"""Side files read with their size and kind checked first and read once per run
(methods/_sidefiles.py): a FIFO, a device or a sparse giant refused by name (never "no such
file", never a hang or a read of gigabytes), and the bytes hashed in the record the bytes used."""

import hashlib
import os

import pytest
import torch
from safetensors.torch import save_file

from kvcore.errors import ConfigError
from methods import _sidefiles as sidefiles
from methods import build_method
from tests.helpers.validation import INFO, one_reason


@pytest.fixture(autouse=True)
def fresh_record():
    sidefiles.reset()
    yield
    sidefiles.reset()


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "calib.fifo"
    os.mkfifo(path)
    return path


def test_a_fifo_is_named_and_never_waited_on(fifo):
    with pytest.raises(ConfigError, match=r"method.calibration_path=.*calib.fifo: a FIFO \(named "
                                          r"pipe\); allowed: a regular file"):
        sidefiles.read_text("method.calibration_path", fifo)
    with pytest.raises(ConfigError, match="a FIFO"):
        sidefiles.calibration_path(str(fifo), None, "a test text")


@pytest.mark.parametrize("device, kind", [("/dev/zero", "a character device"),
                                          ("/dev/urandom", "a character device")])
def test_a_device_behind_a_link_is_named(tmp_path, device, kind):
    link = tmp_path / "calib.txt"
    link.symlink_to(device)
    with pytest.raises(ConfigError, match=f"calib.txt: {kind}; allowed: a regular file"):
        sidefiles.read_bytes("method.calibration_path", link)
    with pytest.raises(ConfigError, match=f"{kind}, not a text file"):
        sidefiles.calibration_path(str(link), None, "a test text")


def test_a_folder_is_named(tmp_path):
    with pytest.raises(ConfigError, match="a folder; allowed: a regular file"):
        sidefiles.read_bytes("method.pattern_path", tmp_path)


def test_a_sparse_giant_is_refused_by_its_size_before_reading(tmp_path, monkeypatch):
    giant = tmp_path / "calib.txt"
    with open(giant, "wb") as f:
        f.truncate(11 * 10 ** 9)  # 11 GB that were never written
    monkeypatch.setattr(os, "read", lambda *a: pytest.fail("read"))
    with pytest.raises(ConfigError, match=r"calib.txt: 10.24 GiB \(sparse: most of it was never "
                                          r"written\); a side file is at most 256 MiB"):
        sidefiles.read_text("method.calibration_path", giant)
    assert sidefiles.read() == []


def test_read_once_what_is_hashed_is_what_is_used(tmp_path):
    """A file rewritten between two reads of one run (validate, then prepare) gives the second
    reader the first bytes, the ones the record hashed; a new run reads it anew."""
    path = tmp_path / "calib.txt"
    path.write_text("first version\n")
    first = sidefiles.read_text("method.calibration_path", path)
    path.write_text("second version, longer\n")
    assert sidefiles.read_text("method.calibration_path", path) == first
    (row,) = sidefiles.read()
    assert row["sha256"] == hashlib.sha256(first.encode()).hexdigest()
    sidefiles.reset()
    assert sidefiles.read_text("method.calibration_path", path) == "second version, longer\n"


def test_published_qfilters_are_a_recorded_side_file(tmp_path):
    """Q-Filters' filters_path was read past the side-file record: now checked, recorded with
    its hash, and read once for validate and prepare."""
    want = torch.randn(INFO.num_layers, INFO.num_kv_heads, INFO.head_dim)
    path = tmp_path / "filters.safetensors"
    save_file({"q_filters": want}, str(path))
    method = build_method("qfilters", filters_path=str(path))
    assert method.validate(INFO, {"batch_size": 1}) == []
    (row,) = sidefiles.read()
    assert row["key"] == "method.filters_path"
    assert row["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_qfilters_filters_path_that_is_a_fifo_is_named(fifo):
    method = build_method("qfilters", filters_path=str(fifo))
    assert "a FIFO (named pipe)" in one_reason(method)


@pytest.mark.parametrize("name, knob", [("qfilters", "calibration_path"),
                                        ("tailorkv", "calibration_path"),
                                        ("qfilters", "filters_path"),
                                        ("duo_attention", "pattern_path")])
def test_a_path_knob_naming_a_fifo_or_device_is_refused_before_weights(fifo, name, knob):
    """Every `*_path` knob, whether its method reads it in validate or only in prepare: a FIFO
    or a device is named by validate (once, even where the method then reads it too)."""
    for path in (fifo, "/dev/zero"):
        reason = one_reason(build_method(name, **{knob: str(path)}))
        kind = "a FIFO (named pipe)" if path == fifo else "a character device"
        assert reason == f"method.{knob}={path}: {kind}; allowed: a regular file" or \
            reason.startswith(f"method.{knob}={path}: {kind}; allowed: a regular file; ")


def test_a_path_knob_naming_a_sparse_giant_is_refused_before_weights(tmp_path):
    giant = tmp_path / "calib.txt"
    with open(giant, "wb") as f:
        f.truncate(11 * 10 ** 9)
    reason = one_reason(build_method("qfilters", calibration_path=str(giant)))
    assert "calib.txt: 10.24 GiB; a side file is at most 256 MiB" in reason


def test_duo_attention_pattern_folder_holding_a_fifo_names_it(tmp_path):
    folder = tmp_path / "pattern"
    folder.mkdir()
    os.mkfifo(folder / "full_attention_heads.tsv")
    reason = one_reason(build_method("duo_attention", pattern_path=str(folder)))
    assert "full_attention_heads.tsv: a FIFO (named pipe); allowed: a regular file" in reason
