"""harness.store.out_dirs (the first step of `make gate` and `make parity`): the folder GATE_DIR or
PARITY_DIR names is emptied only when all it holds is what that target writes; a user's folder,
a file or a link is refused in one line naming the variable, and nothing is changed."""

import hashlib
import json
import os
from pathlib import Path

import pytest

from harness.store import out_dirs
from harness.store.results import STAGING_MARK
from harness.store.results import SWEEP_MARK
from tests.helpers.reports import fake_run


def digest(folder: Path) -> dict[str, str]:
    """Every entry under `folder` (links as their target text): what must survive a refusal."""
    out = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            out[key] = "link:" + os.readlink(path)
        elif path.is_file():
            out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[key] = "dir"
    return out


def gate_tree(root: Path) -> Path:
    """What `make gate` leaves: runs under <task>/<model>/<method>/, sweep folders with their
    mark under _sweeps/, a staging folder of a killed run."""
    fake_run(root, "full", 50.0, 100.0)
    fake_run(root, "h2o", 55.0, 90.0, budget=0.2)
    for name in ("stories", "smollm2"):
        sweep = root / "_sweeps" / name
        (sweep / "status").mkdir(parents=True)
        (sweep / SWEEP_MARK).write_text(json.dumps({"harness": "kv-harness", "pid": 1}))
        (sweep / "multirun.yaml").write_text("hydra: {}\n")
        (sweep / "status" / "0000.json").write_text("{}")
    staging = root / "perplexity" / "stories260k" / "full" / ".t0.partial-1-x"
    staging.mkdir()
    (staging / STAGING_MARK).write_text("{}")
    return root


def run(monkeypatch, capsys, value: str, variable: str = "GATE_DIR") -> tuple[int, str]:
    monkeypatch.setenv(variable, value)
    code = out_dirs.main([variable])
    return code, capsys.readouterr().err


def test_an_earlier_gates_folder_is_emptied(tmp_path, monkeypatch, capsys):
    gate = gate_tree(tmp_path / "ci_gate")
    assert run(monkeypatch, capsys, str(gate)) == (0, "")
    assert gate.is_dir() and not any(gate.iterdir())
    assert run(monkeypatch, capsys, str(tmp_path / "new" / "gate")) == (0, "")  # created
    assert (tmp_path / "new" / "gate").is_dir()


@pytest.mark.parametrize("plant, expect", [
    (lambda g: (g / "notes.txt").write_text("mine"), "notes.txt"),
    (lambda g: (g / "perplexity" / "stories260k" / "thesis.tex").write_text("mine"),
     "perplexity/stories260k/thesis.tex"),
    (lambda g: (next(g.rglob("metrics.json")).parent / "mine.csv").write_text("1"),
     "(it holds mine.csv)"),
    (lambda g: os.symlink("/etc", g / "perplexity" / "etc"), "perplexity/etc"),
    (lambda g: os.mkfifo(g / "pipe"), "pipe"),
    (lambda g: (g / "_sweeps" / "other").mkdir() or (g / "_sweeps" / "other" / "a.txt")
     .write_text("x"), "_sweeps/other/a.txt"),
])
def test_a_folder_holding_files_the_harness_did_not_write_is_refused_untouched(
        plant, expect, tmp_path, monkeypatch, capsys):
    gate = gate_tree(tmp_path / "ci_gate")
    plant(gate)
    before = digest(gate)
    code, err = run(monkeypatch, capsys, str(gate))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: GATE_DIR={gate}: ") and expect in err
    assert "nothing was changed" in err and digest(gate) == before


def test_a_users_folder_named_by_the_variable_is_never_emptied(tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    (home / "photos").mkdir(parents=True)
    (home / "photos" / "cat.jpg").write_bytes(b"\xff\xd8 a cat")
    (home / "todo.txt").write_text("buy milk")
    before = digest(home)
    code, err = run(monkeypatch, capsys, str(home))
    assert code == 2 and "holds files the harness did not write" in err
    assert "photos/cat.jpg" in err and "todo.txt" in err and digest(home) == before


def test_a_link_is_refused_and_its_target_untouched(tmp_path, monkeypatch, capsys):
    target = gate_tree(tmp_path / "elsewhere")
    os.symlink(target, tmp_path / "ci_gate")
    before = digest(target)
    code, err = run(monkeypatch, capsys, str(tmp_path / "ci_gate"))
    assert code == 2 and "is a link (to " in err and "never through a link" in err
    assert digest(target) == before and (tmp_path / "ci_gate").is_symlink()


def test_a_file_and_an_empty_value(tmp_path, monkeypatch, capsys):
    user = tmp_path / "report.pdf"
    user.write_bytes(b"%PDF")
    code, err = run(monkeypatch, capsys, str(user))
    assert code == 2 and "is a file, not a folder" in err and user.read_bytes() == b"%PDF"
    code, err = run(monkeypatch, capsys, "  ")
    assert code == 2 and "GATE_DIR='  ' is empty" in err


def parity_folder(folder: Path) -> Path:
    folder.mkdir()
    for name in out_dirs.PARITY_FILES:
        (folder / name).write_text("{}")
    return folder


def test_an_earlier_parity_folder_is_emptied(tmp_path, monkeypatch, capsys):
    folder = parity_folder(tmp_path / "parity")
    assert run(monkeypatch, capsys, str(folder), "PARITY_DIR") == (0, "")
    assert folder.is_dir() and not any(folder.iterdir())


@pytest.mark.parametrize("plant, expect", [
    (lambda f: (f / "notes.txt").write_text("mine"), "notes.txt"),
    (lambda f: ((f / "peer.json").unlink(), os.symlink("/etc/hostname", f / "peer.json")),
     "peer.json"),
    (lambda f: (f / "sub").mkdir(), "sub"),
])
def test_a_parity_folder_with_anything_else_is_refused_untouched(plant, expect, tmp_path,
                                                                 monkeypatch, capsys):
    folder = parity_folder(tmp_path / "parity")
    plant(folder)
    before = digest(folder)
    code, err = run(monkeypatch, capsys, str(folder), "PARITY_DIR")
    assert code == 2 and err.startswith(f"error: PARITY_DIR={folder}: ") and expect in err
    assert len(err.strip().splitlines()) == 1 and digest(folder) == before


@pytest.mark.parametrize("target, variable", [("gate", "GATE_DIR"), ("parity", "PARITY_DIR")])
def test_the_makefile_empties_its_folders_through_this_check_only(target, variable):
    """`make gate` and `make parity` once ran `rm -rf $(GATE_DIR)` / `$(PARITY_DIR)`: a variable
    pointing at a user's folder lost it. Each recipe now runs harness.store.out_dirs first, and
    removes nothing itself."""
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    recipe = makefile.split(f"\n{target}: setup", 1)[1].split("\n\n", 1)[0]
    assert f"-m harness.store.out_dirs {variable}" in recipe and "rm " not in recipe
    assert f"export {variable}" in makefile


def test_make_clean_never_removes_a_folder_that_is_not_a_virtual_environment(tmp_path):
    """VENV / PEER_VENV may come from the environment: a user's folder they name is refused
    (exit 2, one line, untouched) before anything is removed."""
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    project = Path(__file__).resolve().parents[2]
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("mine")
    venv = tmp_path / "venv"  # the other variable: a venv of the test's own, never the project's
    venv.mkdir()
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    before = digest(home)
    for variable, other in (("VENV", "PEER_VENV"), ("PEER_VENV", "VENV")):
        env = {**os.environ, variable: str(home), other: str(venv)}
        proc = subprocess.run(["make", "-s", "-C", str(project), "clean"], env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and digest(home) == before
        assert f"error: {home} is not a virtual environment (no pyvenv.cfg)" in proc.stderr
        assert (venv / "pyvenv.cfg").is_file()  # refused before anything was removed
