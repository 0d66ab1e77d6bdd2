"""The vLLM engine's tests. Checks that need no vLLM always run; those marked `needs_vllm` start
a real vLLM worker (1-5 min each on 2 cores) and run under `make test-vllm` only: elsewhere they
are skipped, saying why (no vLLM venv, or not asked for)."""

import os
from pathlib import Path

import pytest

from harness.engines.vllm_engine import DEFAULT_PYTHON


# Small settings the refusal tests compose (no weights load).
ST = ["model=stories260k"]
RULER = [*ST, "task=ruler", "task.lengths=[256]", "task.limit=2"]


def one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text
    return text


def vllm_python() -> Path:
    return Path(os.environ.get("KVH_VLLM_PYTHON") or DEFAULT_PYTHON)


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_vllm: starts a vLLM worker (make test-vllm)")


def pytest_collection_modifyitems(config, items):
    python = vllm_python()
    if not python.is_file():
        reason = f"needs the vLLM venv ({python} is absent): make vllm-setup, then make test-vllm"
    elif os.environ.get("KVH_VLLM_TESTS") != "1":
        reason = "starts vLLM (1-5 min on 2 cores): run by make test-vllm (KVH_VLLM_TESTS=1)"
    else:
        return
    for item in items:
        if "needs_vllm" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
