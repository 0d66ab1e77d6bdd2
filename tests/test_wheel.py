"""The harness installed from its wheel, away from the checkout: `python -m harness` finds its
Hydra configs inside the package and runs a tiny job, and a tiny multirun through the package's
own Hydra launcher (hydra_plugins.kvh_sweep), from another folder; so does an editable install.

Offline: the wheel is built without build isolation, installed without dependencies into a fresh
venv, and that venv reaches the dependencies already installed here through a .pth line."""

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from harness.core import models
from tests.conftest import PROJECT, STORIES, need_shared

SOURCES = ("pyproject.toml", "README.md", "conf", "harness", "hydra_plugins", "kvcore", "methods",
           "tasks")


# A sweep of two members on stories260K (seconds): the launcher Hydra must find in the package.
SWEEP = ["-m", "method=full,h2o", "task=perplexity",
         "model=stories260k", "model.device=cpu", "runner.threads=1", "task.dataset=pg19",
         "task.max_tokens=48", "task.block_tokens=16", "runner.results_root=out"]


def test_every_package_of_the_checkout_ships():
    """Every folder of the shipped trees holding an __init__.py is a package of the wheel: a
    Hydra plugin left out (hydra_plugins.kvh_sweep was) breaks multiruns only once installed."""
    listed = set(tomllib.loads((PROJECT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(init.parent.relative_to(PROJECT).parts)
             for top in ("harness", "hydra_plugins", "kvcore", "methods", "tasks")
             for init in (PROJECT / top).rglob("__init__.py")}
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"


def sh(*args, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{args}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def copy_sources(src: Path) -> Path:
    """The sources a build reads, copied (the build writes build/ and *.egg-info next to them)."""
    src.mkdir()
    for name in SOURCES:
        if (PROJECT / name).is_dir():
            shutil.copytree(PROJECT / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy(PROJECT / name, src / name)
    return src


def bare_venv(folder: Path, env: dict) -> tuple[Path, Path]:
    """A venv without pip (its python, its site-packages) reaching this environment's
    dependencies through a .pth line, so nothing is downloaded."""
    sh(sys.executable, "-m", "venv", "--without-pip", folder, env=env)
    python = folder / "bin" / "python"
    site = Path(sh(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
                .stdout.strip())
    (site / "kvh_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python, site


def offline_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVH_SHARED_DIR")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               WANDB_MODE="offline")
    return env


def sweep_from(python: Path, work: Path, env: dict) -> None:
    """`python -m harness -m ...` run in `work`: both members' results written there."""
    work.mkdir()
    done = sh(python, "-m", "harness", *SWEEP, cwd=work,
              env={**env, "KVH_SHARED_DIR": str(models.SHARED_DIR)})
    assert "Unknown plugin" not in done.stderr
    written = sorted(p.parent.parent.name for p in
                     (work / "out" / "perplexity" / "stories260k").glob("*/*/metrics.json"))
    assert written == ["full", "h2o"], (written, done.stdout[-2000:], done.stderr[-2000:])


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A venv holding only the wheel: (its python, an environment without this checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    env = offline_env()
    src = copy_sources(tmp / "src")
    sh(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
       "--no-index", "-w", tmp / "dist", src, env=env)
    wheel = next((tmp / "dist").glob("kv_harness-*.whl"))
    python, _ = bare_venv(tmp / "venv", env)
    sh(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
       "--no-index", wheel, env=env)
    return python, env, tmp


@pytest.mark.integration
def test_installed_package_is_not_the_checkout(installed):
    python, env, tmp = installed
    where = sh(python, "-c", "import harness; print(harness.__file__); print(harness.CONF_DIR)",
               cwd=tmp, env=env).stdout.split()
    assert all(Path(p).is_relative_to(tmp / "venv") for p in where), where
    assert (Path(where[1]) / "method" / "h2o.yaml").is_file()


@pytest.mark.integration
def test_installed_harness_runs_a_job_from_another_folder(installed):
    need_shared(STORIES)
    python, env, tmp = installed
    work = tmp / "work"
    work.mkdir()
    run = [python, "-m", "harness", "method=h2o", "task=perplexity", "model=stories260k",
           "model.device=cpu", "task.dataset=pg19", "task.max_tokens=48", "task.block_tokens=16",
           "runner.results_root=out"]
    # away from the checkout, the shared models are not found next to it: one line says how
    missing = subprocess.run([str(a) for a in run], cwd=work, env=env, capture_output=True,
                             text=True)
    assert missing.returncode == 2 and "set KVH_SHARED_DIR" in missing.stderr, missing.stderr
    done = sh(*run, cwd=work, env={**env, "KVH_SHARED_DIR": str(models.SHARED_DIR)})
    assert "method=h2o" in done.stdout
    assert list((work / "out" / "perplexity" / "stories260k" / "h2o").glob("*/metrics.json"))


@pytest.mark.integration
def test_installed_harness_sweeps_from_another_folder(installed):
    """A multirun needs the package's own launcher (conf/hydra/launcher/kvh_sweep.yaml names
    hydra_plugins.kvh_sweep): installed from the wheel, it is found away from the checkout."""
    need_shared(STORIES)
    python, env, tmp = installed
    sweep_from(python, tmp / "sweep", env)


@pytest.mark.integration
def test_editable_install_sweeps_from_another_folder(tmp_path):
    """`pip install -e` of a checkout, run in another folder: the same launcher found through
    the editable install's own package map."""
    need_shared(STORIES)
    env = offline_env()
    src = copy_sources(tmp_path / "src")
    python, _ = bare_venv(tmp_path / "venv", env)
    sh(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
       "--no-build-isolation", "--no-index", "-e", src, env=env)
    sweep_from(python, tmp_path / "work", env)
