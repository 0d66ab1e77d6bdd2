"""scripts/gpu_summary.py on what the real steps write (benchmarks/throughput.py on a tiny random
Llama on CPU, a pytest junit xml): the table, the goal lines (InfiniGen vs full_offload, KIVI-2 vs
full, kernels), nulls with a reason for what is missing, partial parts from a killed step, and
atomic writes. Seconds."""

import importlib.util
import json
import os
import sys

import pytest

from benchmarks import throughput
from tests.conftest import PROJECT

_spec = importlib.util.spec_from_file_location("gpu_summary",
                                               PROJECT / "scripts" / "gpu_summary.py")
gpu_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_summary)

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"
failures="1" skipped="1" tests="4"><testcase classname="tests.kvcore.test_offload" name="test_a"/>
<testcase classname="tests.kvcore.test_offload" name="test_b"><failure message="x">tb</failure>
</testcase><testcase classname="tests.methods.test_kivi" name="test_c"><skipped message="s"/>
</testcase><testcase classname="tests.methods.test_kivi" name="test_d"/></testsuite></testsuites>
"""


def run_throughput(monkeypatch, json_path, *extra, die_at=None):
    """benchmarks/throughput.py's main() on the tiny random Llama (CPU); `die_at=n`: the n-th
    measurement is killed (as a timeout would), after the earlier ones were written."""
    calls = []
    real = throughput.measure

    def measure(*a, **kw):
        calls.append(a[3])
        if die_at is not None and len(calls) == die_at:
            raise KeyboardInterrupt  # what SIGINT / a timeout's kill looks like mid-run
        return real(*a, **kw)

    monkeypatch.setattr(throughput, "measure", measure)
    monkeypatch.setattr(sys, "argv", [
        "throughput.py", "--model", "random_llama_tiny", "--device", "cpu", "--new-tokens", "2",
        "--prompt-tokens", "32", "64", "--batches", "1", "2", "--json", str(json_path), *extra])
    if die_at is None:
        throughput.main()
    else:
        with pytest.raises(KeyboardInterrupt):
            throughput.main()
    return calls


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """A finished 8B-named part (one cell skipped) and the junit xml; no 1B part, no kernels."""
    folder = tmp_path_factory.mktemp("parts")
    with pytest.MonkeyPatch.context() as mp:
        run_throughput(mp, folder / "throughput_8b.json", "--methods", "full", "kivi",
                       "full_offload", "infinigen", "--order", "batch",
                       "--skip-cells", "infinigen:64:2")
    (folder / "gpu_tests.xml").write_text(JUNIT)
    return folder


PLAN = ["throughput_8b:32,64:1,2", "throughput_1b:32:1,2", "kernels:8192:1"]


def test_summary_goals_table_and_nulls(parts, tmp_path):
    expect = [arg for p in PLAN for arg in ("--expect", p)]
    assert gpu_summary.main([str(parts), str(tmp_path), *expect]) == 0
    summary = json.loads((tmp_path / "gpu_summary.json").read_text())
    run = summary["throughput_8b"]
    assert run["finished"] and run["complete_contexts"] == [32, 64]
    assert summary["throughput_1b"] is None and summary["kernels"] is None  # missing: null
    assert summary["gpu_tests"] == {"tests": 4, "failures": 1, "errors": 0, "skipped": 1,
                                    "passed": 2,
                                    "failed_names": ["tests.kvcore.test_offload::test_b"]}
    goals = summary["goals"]
    assert goals["gpu tests"]["met"] is False
    for ctx in (32, 64):
        for b in (1, 2):
            kivi = goals[f"throughput_8b {ctx} B={b} kivi2/full decode"]
            cells = run["contexts"][str(ctx)]["cells"]
            want = (cells["kivi"][str(b)]["decode_tokens_per_s"]
                    / cells["full"][str(b)]["decode_tokens_per_s"])
            assert kivi["value"] == pytest.approx(want, abs=1e-3) and kivi["min"] is None
    ig = goals["throughput_8b 32 B=2 infinigen/full_offload decode"]
    assert ig["value"] > 0 and ig["min"] == 2.0 and ig["met"] == (ig["value"] >= 2.0)
    skipped = goals["throughput_8b 64 B=2 infinigen/full_offload decode"]
    assert skipped["value"] is None and "skipped" in skipped["note"]
    missing = goals["throughput_1b 32 B=1 infinigen/full_offload decode"]
    assert missing["value"] is None and "part missing" in missing["note"]
    kern = goals["kernels kivi B=1 T=8192 share of peak"]
    assert kern["value"] is None and kern["min"] == 0.7
    reported = goals["kernels kvquant B=1 T=8192 share of peak"]  # batch 1, no bound
    assert reported["value"] is None and reported["min"] is None
    assert "kernels kvquant B=8 T=8192 share of peak" not in goals
    assert summary["not_cuda"] == ["throughput_8b"] and summary["dry_run"] is False
    table = (tmp_path / "gpu_table.md").read_text()
    assert table.startswith("NOT CUDA: throughput_8b")
    assert "| random_llama_tiny | 64 | 2 | kivi |" in table
    assert "goal throughput_1b 32 B=2 kivi2/full decode: null [part missing" in table
    assert "| infinigen |" in table and "| 64 | 2 | infinigen |" not in table


def test_partial_part_from_a_killed_step(monkeypatch, tmp_path):
    """Killed during the second context: the first context is complete on disk, the second
    holds what it measured, and the summary says which cells were not reached."""
    parts = tmp_path / "parts"
    calls = run_throughput(monkeypatch, parts / "throughput_8b.json", "--methods", "full", "kivi",
                           die_at=8)  # (32,1), (32,2), (64,1) done; (64,2): full done, kivi killed
    assert calls == ["full", "kivi"] * 4
    run = json.loads((parts / "throughput_8b.json").read_text())
    assert run["complete_contexts"] == [32] and run["finished"] is False
    assert run["contexts"]["64"]["complete"] is False
    assert set(run["contexts"]["64"]["cells"]["full"]) == {"1", "2"}
    assert set(run["contexts"]["64"]["cells"]["kivi"]) == {"1"}
    summary = gpu_summary.summarize(parts, gpu_summary.parse_expect(PLAN[:1]), dry_run=True)
    goals = summary["goals"]
    assert goals["throughput_8b 64 B=1 kivi2/full decode"]["value"] is not None
    late = goals["throughput_8b 64 B=2 kivi2/full decode"]
    assert late["value"] is None and "not reached" in late["note"]
    assert goals["gpu tests"]["value"] is None  # no junit xml: null
    text = gpu_summary.write(summary, tmp_path)
    assert text[0].startswith("DRY RUN") and any("| 64* | 1 | kivi |" in line for line in text)


def test_writes_are_atomic(parts, tmp_path, monkeypatch):
    """A failing write leaves the previous files whole and no temp file behind."""
    (tmp_path / "gpu_summary.json").write_text('{"old": true}\n')
    (tmp_path / "gpu_table.md").write_text("old\n")
    summary = gpu_summary.summarize(parts, gpu_summary.parse_expect(PLAN))

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        gpu_summary.write(summary, tmp_path)
    assert (tmp_path / "gpu_summary.json").read_text() == '{"old": true}\n'
    assert (tmp_path / "gpu_table.md").read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_summary.json", "gpu_table.md"]
    monkeypatch.undo()
    gpu_summary.write(summary, tmp_path)
    assert json.loads((tmp_path / "gpu_summary.json").read_text())["goals"]
