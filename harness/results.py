"""Result files, written atomically: a run folder appears complete or not at all.

A run is assembled in a hidden temp folder next to its final place and renamed into place when
every file is written; single files are written to a temp file and renamed.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable

from kvcore.errors import ConfigError


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf become None (strict JSON), tuples become lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(_clean(data), indent=2, sort_keys=False) + "\n")


def write_jsonl_atomic(path: Path, rows: Iterable[dict]) -> None:
    write_text_atomic(path, "".join(json.dumps(_clean(r)) + "\n" for r in rows))


def check_writable(folder: Path) -> None:
    """Fail early (before weights load) if results cannot be written under `folder`."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".write-test.", dir=folder)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise ConfigError(f"runner.output_dir: cannot write under {folder} ({exc.strerror})") from None


def remove_stale_staging(folder: Path) -> None:
    """Remove staging folders left by killed runs (kill -9): their owning process is gone."""
    for path in folder.glob(".*.partial-*"):
        try:
            pid = int(path.name.split(".partial-")[1].split("-")[0])
        except (IndexError, ValueError):
            continue
        if not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunFolder:
    """Stage a run's files in a temp folder, then move it into place in one rename."""

    def __init__(self, final: Path):
        self.final = final
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(final.parent)
        self.staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-{os.getpid()}-",
                                             dir=final.parent))

    def write_json(self, name: str, data: Any) -> None:
        write_json_atomic(self.staging / name, data)

    def write_jsonl(self, name: str, rows: Iterable[dict]) -> None:
        write_jsonl_atomic(self.staging / name, rows)

    def write_text(self, name: str, text: str) -> None:
        write_text_atomic(self.staging / name, text)

    def commit(self) -> Path:
        """Move into place; an existing complete run at the same path is replaced only now."""
        if self.final.exists():
            old = self.final.with_name(f".{self.final.name}.old-{os.getpid()}")
            os.replace(self.final, old)
            os.replace(self.staging, self.final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.staging, self.final)
        return self.final

    def abandon(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
