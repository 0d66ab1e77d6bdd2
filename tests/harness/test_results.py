"""Run folders (harness.store.results): a result is written whole or not at all (full disk, crash), a
user's folder is never replaced nor staged over, `runner.output_dir` and `runner.skip_existing`,
the user's umask, and results roots that cannot be written refused before the weights load."""

import errno
import json
import os
import subprocess
import sys

import pytest

from harness.run import run
from kvcore.errors import ConfigError
from tests.helpers.reports import fake_run
from tests.helpers.runs import ST, cfg_for, refused


@pytest.mark.usefixtures("shared_folder")
def test_disk_full_while_writing_keeps_the_previous_result(tmp_path, monkeypatch):
    out = tmp_path / "pinned"
    base = ["model=stories260k", "task.max_tokens=80", f"runner.output_dir={out}"]
    first = run(cfg_for(*base))
    before = (first / "metrics.json").read_bytes()

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(ConfigError, match="No space left on device.*nothing was written"):
        run(cfg_for(*base, "method=h2o", "runner.overwrite=true"))
    assert (out / "metrics.json").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["pinned"]  # no staging left behind


@pytest.mark.usefixtures("shared_folder")
def test_crash_mid_run_leaves_previous_result(tmp_path, monkeypatch):
    from tasks.perplexity import Perplexity

    out = tmp_path / "pinned"
    base = ["model=stories260k", "task.max_tokens=80", f"runner.output_dir={out}"]
    run(cfg_for(*base))
    before = (out / "metrics.json").read_bytes()
    monkeypatch.setattr(Perplexity, "evaluate", lambda self, engine: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        run(cfg_for(*base, "runner.overwrite=true"))
    assert (out / "metrics.json").read_bytes() == before


@pytest.mark.usefixtures("shared_folder")
def test_output_dir_never_replaces_a_users_folder(tmp_path, no_weight_loading):
    """A non-empty folder that is not a run of this harness (a user's folder, a results root)
    is refused before weights load, and nothing in it moves."""
    user = tmp_path / "mine"
    (user / "sub").mkdir(parents=True)
    (user / "keep").write_text("k")
    with pytest.raises(ConfigError, match="not a run of this harness.*nothing was changed"):
        run(cfg_for("model=stories260k", f"runner.output_dir={user}"))
    assert sorted(p.name for p in user.iterdir()) == ["keep", "sub"]
    assert (user / "keep").read_text() == "k"
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]  # nothing renamed or staged


@pytest.mark.usefixtures("shared_folder")
def test_output_dir_replaces_only_a_previous_run_on_request(tmp_path):
    out = tmp_path / "pinned"
    base = ["model=stories260k", "task.max_tokens=40", f"runner.output_dir={out}"]
    first = json.loads((run(cfg_for(*base)) / "metrics.json").read_text())
    with pytest.raises(ConfigError, match="holds a previous run; pass runner.overwrite=true"):
        run(cfg_for(*base, "method=h2o"))
    assert json.loads((out / "metrics.json").read_text()) == first
    run(cfg_for(*base, "method=h2o", "runner.overwrite=true"))
    assert json.loads((out / "metrics.json").read_text())["method"]["name"] == "h2o"
    # a run folder a user added a file to is no longer only ours: never replaced
    (out / "notes.txt").write_text("my notes")
    with pytest.raises(ConfigError, match="not a run of this harness .*notes.txt"):
        run(cfg_for(*base, "runner.overwrite=true"))
    assert (out / "notes.txt").read_text() == "my notes"
    # a results root holding runs is not a run either
    root = tmp_path / "root"
    run(cfg_for("model=stories260k", "task.max_tokens=40", f"runner.results_root={root}"))
    with pytest.raises(ConfigError, match="not a run of this harness"):
        run(cfg_for(*base[:2], f"runner.output_dir={root}", "runner.overwrite=true"))
    assert len(list(root.rglob("metrics.json"))) == 1


@pytest.mark.usefixtures("shared_folder")
def test_empty_output_dir_is_used(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    config = cfg_for("model=stories260k", "task.max_tokens=40", f"runner.output_dir={out}")
    assert run(config) == out
    assert (out / "metrics.json").is_file()


@pytest.mark.usefixtures("shared_folder")
def test_skip_existing_with_output_dir_reuses_only_that_path(tmp_path, capsys):
    base = ["model=stories260k", "task.max_tokens=40", "runner.skip_existing=true"]
    sibling = run(cfg_for(*base, f"runner.output_dir={tmp_path / 'a'}"))
    wanted = tmp_path / "b"
    assert run(cfg_for(*base, f"runner.output_dir={wanted}")) == wanted  # not the sibling
    assert (wanted / "metrics.json").is_file() and sibling != wanted
    stamp = (wanted / "metrics.json").stat().st_mtime_ns
    capsys.readouterr()
    assert run(cfg_for(*base, f"runner.output_dir={wanted}")) == wanted  # same config: reused
    assert "skipped: a complete result" in capsys.readouterr().out
    assert (wanted / "metrics.json").stat().st_mtime_ns == stamp


@pytest.mark.usefixtures("shared_folder")
def test_results_get_the_users_umask(tmp_path):
    old = os.umask(0o002)
    try:
        out = run(cfg_for("model=stories260k", "task.max_tokens=40",
                          f"runner.results_root={tmp_path}"))
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o775
    for name in ("metrics.json", "config.yaml", "samples.jsonl"):
        assert (out / name).stat().st_mode & 0o777 == 0o664, name


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_staging_cleanup_spares_a_users_folder_named_like_one(tmp_path):
    from harness.store.results import STAGING_MARK, RunFolder

    pid = _dead_pid()
    users = tmp_path / f".backup.partial-{pid}-important"  # named like a staging folder
    users.mkdir()
    (users / "thesis.tex").write_text("years of work")
    ours = tmp_path / f".old.partial-{pid}-x1y2"  # a killed run's staging, with its mark
    ours.mkdir()
    (ours / STAGING_MARK).write_text(json.dumps({"harness": "kv-harness", "pid": pid,
                                                 "start": None}))
    folder = RunFolder(tmp_path / "newrun")
    folder.abandon()
    assert (users / "thesis.tex").read_text() == "years of work"
    assert not ours.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [users.name]


@pytest.mark.usefixtures("shared_folder")
def test_a_failing_run_leaves_no_empty_result_folders(tmp_path, monkeypatch):
    from tasks.perplexity import Perplexity

    root = tmp_path / "results"
    monkeypatch.setattr(Perplexity, "evaluate", lambda self, engine: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        run(cfg_for(*ST, f"runner.results_root={root}"))
    assert not root.exists()
    monkeypatch.undo()

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(ConfigError, match="nothing was written"):
        run(cfg_for(*ST, f"runner.results_root={root}"))
    assert not root.exists()


@pytest.mark.usefixtures("shared_folder")
def test_output_dir_inside_another_run_is_refused(tmp_path, no_weight_loading):
    outer = fake_run(tmp_path / "r", "full", 50.0, 100.0)
    message = refused(tmp_path, *ST, f"runner.output_dir={outer / 'inner'}")
    assert f"is inside the run folder {outer}" in message
    message = refused(tmp_path, *ST, f"runner.output_dir={outer / 'a' / 'b'}")
    assert "inside the run folder" in message
    assert sorted(p.name for p in outer.iterdir()) == ["metrics.json"]


@pytest.mark.usefixtures("shared_folder")
def test_messages_name_the_key_the_user_set(tmp_path, no_weight_loading):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    message = refused(tmp_path, *ST, f"runner.results_root={a_file}/sub")
    assert message.startswith(f"runner.results_root={a_file}/sub: cannot write under")


@pytest.mark.usefixtures("shared_folder")
@pytest.mark.parametrize("target", ["loop", "gone/away"])
def test_a_results_root_link_leading_nowhere_is_refused_before_the_weights(target, tmp_path,
                                                                           no_weight_loading):
    """A symlink loop (or a dangling link) does not `exist()`: the writability check walked past
    it to its folder, and the run was lost at its end (ELOOP) after the weights and the work."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / target if target != "loop" else link)
    message = refused(tmp_path, *ST, f"runner.results_root={link}")
    assert message.startswith(f"runner.results_root={link}: cannot write under")
    assert "is a link that leads nowhere" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]


def test_a_stop_whose_interrupt_was_swallowed_still_writes_nothing(tmp_path):
    """A signal's KeyboardInterrupt raised inside a finalizer is dropped by Python ("Exception
    ignored in ... __del__"); the stop it recorded is raised again when the result would be
    committed, so the run folder never appears."""
    from harness.store.results import RunFolder
    from kvcore import guards

    folder = RunFolder(tmp_path / "run")
    folder.write_json("metrics.json", {"accuracy": {}})
    guards.request_stop()
    try:
        with pytest.raises(KeyboardInterrupt):
            folder.commit()
    finally:
        guards.clear_stop()
    assert not (tmp_path / "run").exists()
