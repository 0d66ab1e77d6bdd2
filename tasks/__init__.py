"""Tasks: one file per task, `tasks/<name>.py` <-> `conf/task/<name>.yaml`.

A task builds requests, runs them through the `Engine` (so the KV method acts on every task) and
scores them; it never names a specific method.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from kvcore.errors import ConfigError
from kvcore.typecheck import check_types
from tasks.base import Task, TaskResult

__all__ = ["Task", "TaskResult", "available_tasks", "build_task", "task_class"]

_NOT_TASKS = {"base", "engine_api", "prompts", "text_sources"}


def available_tasks() -> list[str]:
    here = Path(__file__).parent
    return sorted(m.name for m in pkgutil.iter_modules([str(here)])
                  if m.name not in _NOT_TASKS and not m.name.startswith("_"))


def task_class(name: str) -> type[Task]:
    """The Task subclass of `tasks/<name>.py`; ConfigError for an unknown name."""
    if name not in available_tasks():
        raise ConfigError(f"task={name!r} is unknown; allowed: {', '.join(available_tasks())}")
    module = importlib.import_module(f"tasks.{name}")
    cls = next((o for o in vars(module).values() if isinstance(o, type) and issubclass(o, Task)
                and getattr(o, "name", None) == name), None)
    if cls is None:
        raise ConfigError(f"tasks/{name}.py defines no Task subclass with name = {name!r}")
    return cls


def build_task(name: str, **options) -> Task:
    """Instantiate a task; unknown or invalid options raise ConfigError naming the key."""
    cls = task_class(name)
    allowed = cls.option_names()
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(f"task.{unknown[0]} is not an option of task={name}; "
                          f"allowed: {', '.join(allowed)}")
    check_types(cls, options, "task")  # from the dataclass annotations, for every task alike
    return cls(**options)
