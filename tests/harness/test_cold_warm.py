"""A machine that never ran the project writes what a warm one does: a method that caches a
prepared artefact (a calibration, skewing matrices, probe scores) records what the artefact is
(kind, key, content hash), never whether this run computed or loaded it, and reads no cached file
as a side file. Two runs of one setting, the first on an empty cache, the second on the cache it
left: identical metrics and samples apart from wall-clock figures."""

import pytest

from harness.run import run
from tests.conftest import STORIES, need_shared
from tests.helpers.runs import cfg_for
from tests.helpers.sweeps import TASK, folder_figures

# every method whose prepare() caches an artefact on disk (methods._artefacts)
CACHING = ["kvquant", "infinigen", "razor_attention", "headkv", "duo_attention"]


@pytest.mark.parametrize("name", CACHING)
def test_cold_and_warm_runs_write_the_same_figures(name, tmp_path, monkeypatch, torch_path):
    need_shared(STORIES)
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path / "cache"))
    cold = run(cfg_for(*TASK, f"method={name}", f"runner.output_dir={tmp_path}/cold"))
    cached = sorted(p.name for p in (tmp_path / "cache").rglob("*.pt"))
    assert cached, "the method cached nothing: it is not a caching method any more"
    warm = run(cfg_for(*TASK, f"method={name}", f"runner.output_dir={tmp_path}/warm"))
    assert folder_figures(warm) == folder_figures(cold)
    assert sorted(p.name for p in (tmp_path / "cache").rglob("*.pt")) == cached  # reused
