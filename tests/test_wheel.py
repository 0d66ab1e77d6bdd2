"""The harness installed from its wheel, away from the checkout: `python -m harness` finds its
Hydra configs inside the package and runs a tiny job from another folder.

Offline: the wheel is built without build isolation, installed without dependencies into a fresh
venv, and that venv reaches the dependencies already installed here through a .pth line."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from harness import models
from tests.conftest import PROJECT, STORIES, need_shared

pytestmark = pytest.mark.integration
SOURCES = ("pyproject.toml", "README.md", "conf", "harness", "hydra_plugins", "kvcore", "methods",
           "tasks")


def sh(*args, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{args}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A venv holding only the wheel: (its python, an environment without this checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVH_SHARED_DIR")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               WANDB_MODE="offline")
    src = tmp / "src"  # a copy: the build writes build/ and *.egg-info next to the sources
    src.mkdir()
    for name in SOURCES:
        if (PROJECT / name).is_dir():
            shutil.copytree(PROJECT / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy(PROJECT / name, src / name)
    sh(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
       "--no-index", "-w", tmp / "dist", src, env=env)
    wheel = next((tmp / "dist").glob("kv_harness-*.whl"))
    sh(sys.executable, "-m", "venv", "--without-pip", tmp / "venv", env=env)
    python = tmp / "venv" / "bin" / "python"
    sh(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
       "--no-index", wheel, env=env)
    site = Path(sh(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
                .stdout.strip())
    (site / "kvh_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python, env, tmp


def test_installed_package_is_not_the_checkout(installed):
    python, env, tmp = installed
    where = sh(python, "-c", "import harness; print(harness.__file__); print(harness.CONF_DIR)",
               cwd=tmp, env=env).stdout.split()
    assert all(Path(p).is_relative_to(tmp / "venv") for p in where), where
    assert (Path(where[1]) / "method" / "h2o.yaml").is_file()


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
