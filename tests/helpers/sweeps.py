"""A sweep's settings against their single runs: the figures a setting must give alike either
way (wall-clock ones left out), on a RULER task small enough for stories260K."""

import json

import pytest

from harness.run import run
from harness.sweep.run import run_sweep
from kvcore.errors import ConfigError, UnsupportedCombination
from tests.helpers.runs import cfg_for

TASK = ["model=stories260k", "task=ruler", "task.lengths=[320]", "task.subtasks=[niah_single]",
        "task.depths=[25,75]", "task.max_new_tokens=8", "runner.threads=1"]
# Figures of the run as a whole, not of the setting: the sweep's are its own.
NOT_COMPARED = {"speed", "memory", "env", "run"}


def folder_figures(folder):
    metrics = json.loads((folder / "metrics.json").read_text())
    samples = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
    kept = {k: v for k, v in metrics.items() if k not in NOT_COMPARED}
    kept["speed"] = {k: metrics["speed"][k] for k in ("prefill_tokens", "decode_steps",
                                                         "decode_tokens")}
    for timed in ("exposed_ms", "transfer_ms"):  # wall-clock figures
        kept["transfer"].pop(timed, None)
    kept["method"]["prepare"] = {k: v for k, v in kept["method"]["prepare"].items()
                                 if not k.endswith(("_s", "_ms"))}  # its wall time
    facts = kept["kv"].get("method_facts") or {}
    kept["kv"]["method_facts"] = {k: v for k, v in facts.items()
                                  if not k.endswith(("_s", "_ms"))}  # e.g. KVzip's reconstruction
    return kept, samples


def single_runs(overrides_list, tmp_path):
    folders = []
    for i, knobs in enumerate(overrides_list):
        try:
            folders.append(run(cfg_for(*knobs, f"runner.output_dir={tmp_path}/single{i}")))
        except (ConfigError, UnsupportedCombination) as exc:
            pytest.skip(f"refused on this model/task before weights: {exc}")
    return folders


def sweep_folders(overrides_list, tmp_path, copy_on_use=True):
    cfgs = [cfg_for(*knobs, f"runner.results_root={tmp_path}/sweep") for knobs in overrides_list]
    outcomes = run_sweep(cfgs, copy_on_use=copy_on_use)
    assert [o.status for o in outcomes] == ["ok"] * len(cfgs), [o.detail for o in outcomes]
    return [o.folder for o in outcomes]


def assert_equal_to_single_runs(settings, tmp_path, given=()):
    """`given`: (setting, its single run's folder) pairs, swept too."""
    alone = single_runs(settings, tmp_path) + [folder for _, folder in given]
    settings = [*settings, *(setting for setting, _ in given)]
    swept = sweep_folders(settings, tmp_path)
    for a, b in zip(alone, swept):
        (ma, sa), (mb, sb) = folder_figures(a), folder_figures(b)
        assert sb == sa  # every sample's prediction, score, generated tokens
        assert mb == ma  # accuracy, KV figures, protocol, method, task
    shared = json.loads((swept[0] / "metrics.json").read_text())["run"]["sweep"]
    assert shared["settings"] == len(settings)
    return swept


def assert_close(got, want, rel: float, where: str = "") -> None:
    """`got` equals `want` (nested dicts and lists of a run's figures), floats within `rel`
    relative (and as much absolute, for values near zero), everything else exactly."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            assert_close(got[key], want[key], rel, f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, rel, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(got, bool):
        assert got == pytest.approx(want, rel=rel, abs=rel), where
    else:
        assert got == want, where


def sharded_folders(overrides_list, root, count=2):
    """Each shard of the settings in turn (as its own process would), then their merge."""
    from harness.sweep.shards import Shard

    cfgs = [cfg_for(*knobs, f"runner.results_root={root}", f"runner.shards={count}")
            for knobs in overrides_list]
    for i in range(count):
        outcomes = run_sweep(cfgs, shard=Shard(i, count))
        assert [o.status for o in outcomes] == ["ok"] * len(cfgs), [o.detail for o in outcomes]
        assert not list(root.rglob("metrics.json"))  # a shard writes records, no result
    outcomes = run_sweep(cfgs, merge=count)
    assert [o.status for o in outcomes] == ["ok"] * len(cfgs), [o.detail for o in outcomes]
    return [o.folder for o in outcomes]
