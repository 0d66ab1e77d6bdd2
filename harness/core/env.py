"""What a result needs to be reproduced: versions, commit, machine, threads, load."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch

PACKAGES = ("torch", "transformers", "lm_eval", "datasets", "triton", "hydra-core", "wandb",
            "tokenizers", "numpy")


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_state(root: Path) -> dict[str, str | bool | None]:
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(root: Path) -> dict:
    gpu = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {"name": props.name, "memory_bytes": props.total_memory,
               "capability": f"{props.major}.{props.minor}"}
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "versions": {p: _version(p) for p in PACKAGES},
        "python": platform.python_version(),
        "git": git_state(root),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu": gpu,
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "load_average_1m": round(load[0], 2) if load else None,
        "hostname": platform.node(),
    }
