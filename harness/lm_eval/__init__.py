"""lm-eval integration: the `kvharness` model (registered on import) and offline task YAMLs.

    python -m harness.lm_eval <lm-eval's own CLI arguments>   # lm-eval's CLI, our model known
    python -m harness.lm_eval.tasks [--data_dir DIR]          # prints the offline task folder

This package is named after lm-eval on purpose; every module here imports the real `lm_eval`
with absolute imports (a package never shadows a top-level module of the same name).
"""

from __future__ import annotations

from harness.lm_eval.model import KVHarnessLM

# The offline task folder is `harness.lm_eval.tasks.offline_task_dir`, imported from there: this
# package does not import that module, or `python -m harness.lm_eval.tasks` would import it twice.
__all__ = ["KVHarnessLM"]
