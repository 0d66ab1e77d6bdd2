"""Result files, written atomically: a run folder appears complete or not at all.

A run is assembled in a hidden temp folder next to its final place and renamed into place when
every file is written; single files are written to a temp file and renamed. Files and folders get
the user's umask (a team can read shared results), not the 0600/0700 of temp files.

A path given by the user is never deleted or overwritten unless it is a complete previous run of
this harness holding only files the harness writes, at that exact path, and the user asked for
the replacement (`runner.overwrite=true`); `check_output_dir` says so before weights load.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable

from kvcore.errors import ConfigError, OutputError


# What a run folder holds, all written by the runner; a folder with anything else is not ours.
RUN_FILES = frozenset({"config.yaml", "metrics.json", "samples.jsonl", "diagnostics.json", "wandb"})


def json_safe(value: Any) -> Any:
    """JSON-safe: NaN/inf become None (strict JSON), tuples become lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def user_mode(kind: str) -> int:
    """Permission bits a plain open()/mkdir() would give under the process umask."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if kind == "dir" else 0o666) & ~mask


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, user_mode("file"))  # mkstemp makes 0600
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(json_safe(data), indent=2, sort_keys=False) + "\n")


def write_jsonl_atomic(path: Path, rows: Iterable[dict]) -> None:
    write_text_atomic(path, "".join(json.dumps(json_safe(r)) + "\n" for r in rows))


def check_writable(folder: Path) -> None:
    """Fail early (before weights load) if results cannot be written under `folder`."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".write-test.", dir=folder)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise ConfigError(f"runner.output_dir: cannot write under {folder} ({exc.strerror})") from None


def check_output_dir(path: Path, overwrite: bool) -> None:
    """Refuse (before weights load) an explicit `runner.output_dir` the run must not replace:
    a file, a path ending in `..`, a non-empty folder that is not a run of this harness, or a
    previous run without `runner.overwrite=true`. An empty folder is fine."""
    key = f"runner.output_dir={path}"
    if path.name in ("", ".", ".."):
        raise ConfigError(f"{key}: must name the run folder itself "
                          f"(it ends in {path.name or '/'!r})")
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise ConfigError(f"{key} is a file (or a link), not a folder; nothing was changed. "
                          "Allowed: a new or empty folder, or a previous run of this harness "
                          "with runner.overwrite=true")
    if path.is_dir() and any(path.iterdir()):
        foreign = not_ours(path)
        if foreign:
            raise ConfigError(f"{key} is a non-empty folder that is not a run of this harness "
                              f"({foreign}); nothing was changed. Choose a new or empty folder")
        if not overwrite:
            raise ConfigError(f"{key} holds a previous run; pass runner.overwrite=true to "
                              "replace it (runner.skip_existing=true reuses it when the config "
                              "is the same)")
    check_writable(path.parent)


def not_ours(folder: Path) -> str:
    """Why `folder` is not a replaceable run of this harness ('' when it is one)."""
    from harness.schema import SchemaError, load

    extra = sorted(p.name for p in folder.iterdir() if p.name not in RUN_FILES)
    if extra:
        return f"it holds {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}"
    try:
        load(folder / "metrics.json")
    except SchemaError as exc:
        return str(exc).replace(f"{folder / 'metrics.json'}: ", "metrics.json: ")
    return ""


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
        os.chmod(self.staging, user_mode("dir"))  # mkdtemp makes 0700

    def write_json(self, name: str, data: Any) -> None:
        write_json_atomic(self.staging / name, data)

    def write_jsonl(self, name: str, rows: Iterable[dict]) -> None:
        write_jsonl_atomic(self.staging / name, rows)

    def write_text(self, name: str, text: str) -> None:
        write_text_atomic(self.staging / name, text)

    def commit(self, overwrite: bool = False) -> Path:
        """Move into place. An empty folder there is replaced; a previous run of this harness only
        with `overwrite` (checked again now: the folder may have changed during the run);
        anything else is left untouched and OutputError raised."""
        if self.final.is_symlink() or (self.final.exists() and not self.final.is_dir()):
            raise OutputError(f"{self.final} became a file during the run; it was left untouched")
        if self.final.is_dir() and any(self.final.iterdir()):
            foreign = not_ours(self.final)
            if foreign or not overwrite:
                raise OutputError(f"{self.final} changed during the run ("
                                  f"{foreign or 'it now holds a run'}); it was left untouched")
            old = self.final.with_name(f".{self.final.name}.old-{os.getpid()}")
            os.replace(self.final, old)
            os.replace(self.staging, self.final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.staging, self.final)
        return self.final

    def abandon(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
