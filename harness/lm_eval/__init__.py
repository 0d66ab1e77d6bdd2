"""lm-eval integration: the `kvharness` model (registered on import) and offline task YAMLs.

    python -m harness.lm_eval <lm-eval's own CLI arguments>   # lm-eval's CLI, our model known
    python -m harness.lm_eval.tasks [--data_dir DIR]          # prints the offline task folder

This package is named after lm-eval on purpose; every module here imports the real `lm_eval`
with absolute imports (a package never shadows a top-level module of the same name).
"""

from __future__ import annotations

from typing import Any

from harness.lm_eval.model import KVHarnessLM

__all__ = ["KVHarnessLM", "offline_task_dir"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `python -m harness.lm_eval.tasks` does not import its own module twice.
    if name == "offline_task_dir":
        from harness.lm_eval.tasks import offline_task_dir

        return offline_task_dir
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
