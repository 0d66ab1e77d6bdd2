"""benchmarks/throughput.py: a bad argument is one line (exit 2)."""

import sys

import pytest

from tests.conftest import PROJECT


def test_throughput_benchmark_refuses_zero_batches(monkeypatch, capsys):
    import runpy

    monkeypatch.setattr(sys, "argv", ["throughput.py", "--batches", "0"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(PROJECT / "benchmarks" / "throughput.py"), run_name="__main__")
    assert exit_.value.code == 2
    assert "--batches 0: each must be a positive integer" in capsys.readouterr().err
