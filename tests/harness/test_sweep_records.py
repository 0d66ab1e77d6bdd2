"""Sweep records prove what they hold: the file names its setting (and shard) on its first line,
every record its setting and prompt; a file of another setting or split, a malformed line, a link
or a non-regular file is refused by name (never merged or resumed); a line cut by a kill is
dropped; record files of a sweep split otherwise are named before work."""

import json
import os
from types import SimpleNamespace

import pytest

from harness.config.runner import RunnerSettings
from harness.sweep.records import FOLDER, Records, owner, record_path, strays
from harness.sweep.shards import Shard
from kvcore.errors import ConfigError

RUNNER_KEY = "runner.results_root"


def setting(identity="aaaa1111", method="h2o", label="h2o(budget_tokens=24)"):
    return SimpleNamespace(identity=identity, method_name=method, label=label)


def written(tmp_path, who=None, shard=None, answers=2):
    """A record file of `who` with `answers` records, as a sweep writes it."""
    who = who or setting()
    path = record_path(RunnerSettings(results_root=str(tmp_path)), who.identity, shard)
    rec = Records(path, owner(who, shard))
    for i in range(answers):
        rec.append(0, i, f"key{i}", [1, 2, 3], {"prefill_tokens": 5})
    return path


def test_records_read_back_by_their_own_setting(tmp_path):
    path = written(tmp_path)
    back = Records(path, owner(setting()))
    assert back.resumed == 2 and back.get(0, 1, "key1")["output"] == [1, 2, 3]
    head = json.loads(path.read_text().splitlines()[0])
    assert head["identity"] == "aaaa1111" and head["setting"] == "h2o(budget_tokens=24)"


def test_fidelity_records_read_back_beside_the_answers(tmp_path):
    path = written(tmp_path, answers=1)
    Records(path, owner(setting())).append_fidelity(0, 0, "key0", {"kl_mean": 0.25,
                                                                  "gold_logprob": None})
    back = Records(path, owner(setting()))
    assert back.resumed == 1 and back.get(0, 0, "key0")["output"] == [1, 2, 3]
    assert back.fidelity_of(0, 0, "key0") == {"kl_mean": 0.25, "gold_logprob": None}
    assert back.fidelity_of(0, 1, "key1") is None


def test_a_file_of_another_setting_is_refused_naming_both(tmp_path):
    path = written(tmp_path, setting("bbbb2222", "snapkv", "snapkv(budget_tokens=24)"))
    mine = path.with_name("aaaa1111.jsonl")
    path.rename(mine)  # another setting's answers under this setting's name
    with pytest.raises(ConfigError) as err:
        Records(mine, owner(setting()))
    text = str(err.value)
    assert "snapkv(budget_tokens=24)" in text and "aaaa1111" in text and str(mine) in text


def test_a_shards_file_is_not_another_shards(tmp_path):
    path = written(tmp_path, shard=Shard(0, 2))
    with pytest.raises(ConfigError, match="shard 0/2"):
        Records(path, owner(setting(), Shard(1, 2)))


@pytest.mark.parametrize("line, why", [
    ("not json at all", "line 2 is not JSON"),
    ("[1, 2, 3]", "line 2 is a JSON list"),
    ('{"identity": "aaaa1111", "call": 0, "prompt": "x", "key": "k", "output": [], '
     '"tally": {}, "shared": false}', "line 2 has no valid 'prompt'"),
    ('{"identity": "cccc", "call": 0, "prompt": 1, "key": "k", "output": [], "tally": {}, '
     '"shared": false}', "line 2 is a record of setting 'cccc'"),
    ('{"identity": "aaaa1111", "call": 0, "prompt": 1, "key": "k", "fidelity": [0.1]}',
     "line 2 has no valid 'fidelity'"),
])
def test_a_malformed_record_is_named_by_file_and_line(tmp_path, line, why):
    path = written(tmp_path, answers=1)
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], line, *lines[1:]]) + "\n")
    with pytest.raises(ConfigError) as err:
        Records(path, owner(setting()))
    assert why in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize("content", ["", "a user's notes\n", '{"kind": "something else"}\n'])
def test_a_file_the_project_did_not_write_is_refused(tmp_path, content):
    path = record_path(RunnerSettings(results_root=str(tmp_path)), "aaaa1111")
    path.parent.mkdir(parents=True)
    path.write_text(content + '{"identity": "aaaa1111"}\n')
    with pytest.raises(ConfigError, match="does not say it holds kv-harness sweep records"):
        Records(path, owner(setting()))


def test_a_line_cut_by_a_kill_is_dropped_and_the_next_record_starts_clean(tmp_path):
    path = written(tmp_path, answers=2)
    with path.open("a") as f:
        f.write('{"identity": "aaaa1111", "call": 0, "pro')  # killed mid-write
    back = Records(path, owner(setting()))
    assert back.resumed == 2
    back.append(0, 2, "key2", [4], {})
    assert Records(path, owner(setting())).resumed == 3  # no line glued to the cut one


def test_a_records_file_that_is_a_link_is_refused_and_its_target_untouched(tmp_path):
    users = tmp_path / "users_notes.txt"
    users.write_text("precious\n")
    path = record_path(RunnerSettings(results_root=str(tmp_path / "results")), "aaaa1111")
    path.parent.mkdir(parents=True)
    path.symlink_to(users)
    with pytest.raises(ConfigError, match="link"):
        Records(path, owner(setting()))
    fresh = Records.__new__(Records)  # a writer that never read it (the planted race)
    fresh.path, fresh.writer, fresh.done, fresh.fidelity = path, owner(setting()), {}, {}
    with pytest.raises(ConfigError, match="link"):
        fresh.append(0, 0, "k", [1], {})
    assert users.read_text() == "precious\n"


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    path = record_path(RunnerSettings(results_root=str(tmp_path)), "aaaa1111")
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    with pytest.raises(ConfigError, match="not a regular file"):
        Records(path, owner(setting()))


def test_records_of_a_sweep_split_otherwise_are_strays(tmp_path):
    runner = RunnerSettings(results_root=str(tmp_path))
    written(tmp_path, shard=Shard(0, 2))
    written(tmp_path, shard=Shard(1, 2))
    assert strays(runner, "aaaa1111", 2) == []
    assert [p.name for p in strays(runner, "aaaa1111", 1)] == [
        "aaaa1111.shard-0-of-2.jsonl", "aaaa1111.shard-1-of-2.jsonl"]
    assert len(strays(runner, "aaaa1111", 3)) == 2
    assert strays(runner, "other", 1) == []
    assert (tmp_path / FOLDER).is_dir()


def test_a_sweep_names_stray_and_foreign_records_before_work(tmp_path, no_weight_loading):
    """An unsharded sweep beside a killed 2-shard sweep's records, and a setting whose record
    file holds another setting's answers: each such member fails with one line naming the file
    before any weights load, and nothing is written or removed."""
    from harness.sweep.run import run_sweep
    from harness.session import compose
    from tests.conftest import STORIES, need_shared
    from tests.helpers.runs import cfg_for
    from tests.helpers.sweeps import TASK

    need_shared(STORIES)
    root = tmp_path / "sweep"
    cfgs = [cfg_for(*TASK, "method=h2o", f"method.budget_tokens={b}",
                    f"runner.results_root={root}") for b in (24, 48)]
    first, second = (compose(c, None) for c in cfgs)
    written(root, first, shard=Shard(0, 2))
    foreign = record_path(RunnerSettings(results_root=str(root)), second.identity)
    written(root, first).rename(foreign)
    before = sorted(p.name for p in (root / FOLDER).iterdir())
    outcomes = run_sweep(cfgs)
    assert [o.status for o in outcomes] == ["failed", "failed"]
    assert "split otherwise" in outcomes[0].detail and "shard-0-of-2" in outcomes[0].detail
    assert "holds the records of" in outcomes[1].detail and foreign.name in outcomes[1].detail
    assert sorted(p.name for p in (root / FOLDER).iterdir()) == before
    assert not list(root.rglob("metrics.json"))
