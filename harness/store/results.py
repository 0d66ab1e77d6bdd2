"""Result files, written atomically: a run folder appears complete or not at all.

A run is assembled in a hidden temp folder next to its final place and renamed into place when
every file is written; single files are written to a temp file and renamed. Files and folders get
the user's umask (a team can read shared results), not the 0600/0700 of temp files.

A path given by the user is never deleted or overwritten unless it is a complete previous run of
this harness holding only files the harness writes, at that exact path, and the user asked for
the replacement (`runner.overwrite=true`); `check_output_dir` says so before weights load.
Checks create nothing; the folders above a run are made when its result is written (and removed
again if writing fails). A staging folder left by a killed run is removed only when the mark this
harness wrote in it names a process that is gone, never because of its name.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable

from harness.store.schema import SchemaError, is_complete_run, json_safe, load
from kvcore.errors import ConfigError, OutputError
from kvcore.guards import check_stop


# What a run folder holds, all written by the runner; a folder with anything else is not ours.
RUN_FILES = frozenset({"config.yaml", "metrics.json", "samples.jsonl", "diagnostics.json", "wandb"})


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


def nearest_existing(path: Path) -> Path:
    """`path` or its closest ancestor that exists (a link counts, even one leading nowhere)."""
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def check_writable(folder: Path, key: str = "runner.output_dir") -> None:
    """Fail early (before weights load) if results cannot be written under `folder`, creating
    nothing: the closest existing ancestor must be a folder a file can be created in (`key`: the
    option the user set, named in the message)."""
    base = nearest_existing(folder)
    if base.is_symlink() and not base.exists():  # dangling, or a loop (ELOOP)
        raise ConfigError(f"{key}: cannot write under {folder} ({base} is a link that leads "
                          "nowhere: dangling or a loop)")
    if not base.is_dir():
        raise ConfigError(f"{key}: cannot write under {folder} ({base} is a file, not a folder)")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".write-test.", dir=base)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise ConfigError(f"{key}: cannot write under {folder} ({exc.strerror or exc}"
                          f"{'' if base == Path(os.path.abspath(folder)) else f' at {base}'})"
                          ) from None


def inside_a_run(path: Path) -> Path | None:
    """The complete run of this harness that `path` would be inside, if any (a run folder holds
    only its own files: a folder written into it makes it unrecognisable as a run)."""
    for parent in Path(os.path.abspath(path)).parents:
        if (parent / "metrics.json").is_file() and is_complete_run(parent):
            return parent
    return None


def check_output_dir(path: Path, overwrite: bool) -> None:
    """Refuse (before weights load) an explicit `runner.output_dir` the run must not replace:
    a file, a path ending in `..`, a non-empty folder that is not a run of this harness, a
    folder inside another run's folder, or a previous run without `runner.overwrite=true`. An
    empty folder is fine."""
    key = f"runner.output_dir={path}"
    if path.name in ("", ".", ".."):
        raise ConfigError(f"{key}: must name the run folder itself "
                          f"(it ends in {path.name or '/'!r})")
    outer = inside_a_run(path)
    if outer is not None:
        raise ConfigError(f"{key} is inside the run folder {outer}: a run folder holds only its "
                          "own files (the outer run would no longer be recognised); choose a "
                          "folder outside it")
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
    extra = sorted(p.name for p in folder.iterdir() if p.name not in RUN_FILES)
    if extra:
        return f"it holds {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}"
    try:
        load(folder / "metrics.json")
    except SchemaError as exc:
        return str(exc).replace(f"{folder / 'metrics.json'}: ", "metrics.json: ")
    return ""


# A staging folder holds this file while it is being written, so a later run removes only
# staging folders a run of this harness made, and only once that run's process is gone.
SWEEP_MARK = ".kvh-sweep.json"  # written in every sweep folder of this harness (config.multirun)
STAGING_MARK = ".kvh-staging.json"


def _process_start(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, /proc), which tells a reused pid apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _mark_staging(folder: Path) -> None:
    pid = os.getpid()
    (folder / STAGING_MARK).write_text(json.dumps({"harness": "kv-harness", "pid": pid,
                                                   "start": _process_start(pid)}))


def _dead_staging(path: Path) -> bool:
    """Whether `path` is a staging folder of a run of this harness whose process is gone: its
    mark is there, names the pid its folder name carries, and that pid no longer runs (or now
    belongs to a process started later). Anything else is left alone, whatever its name."""
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        mark = json.loads((path / STAGING_MARK).read_text())
        pid = int(path.name.split(".partial-")[1].split("-")[0])
    except (OSError, ValueError, IndexError, TypeError):
        return False
    if not isinstance(mark, dict) or mark.get("harness") != "kv-harness" or mark.get("pid") != pid:
        return False
    if not _alive(pid):
        return True
    started = _process_start(pid)
    return started is not None and mark.get("start") is not None and started != mark["start"]


def remove_stale_staging(folder: Path) -> None:
    """Remove staging folders left by killed runs of this harness (kill -9), found by their
    mark (never by name alone: a user's folder named like one is not touched)."""
    for path in folder.glob(".*.partial-*"):
        if _dead_staging(path):
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
        # folders created for this run, deepest first: removed again if it is abandoned
        self.created: list[Path] = []
        parent = Path(os.path.abspath(final.parent))
        while not parent.exists():
            self.created.append(parent)
            parent = parent.parent
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_staging(final.parent)
            self.staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-{os.getpid()}-",
                                                 dir=final.parent))
            _mark_staging(self.staging)
            os.chmod(self.staging, user_mode("dir"))  # mkdtemp makes 0700
        except BaseException:
            if hasattr(self, "staging"):
                shutil.rmtree(self.staging, ignore_errors=True)
            self._remove_created()
            raise

    def write_json(self, name: str, data: Any) -> None:
        write_json_atomic(self.staging / name, data)

    def write_jsonl(self, name: str, rows: Iterable[dict]) -> None:
        write_jsonl_atomic(self.staging / name, rows)

    def write_text(self, name: str, text: str) -> None:
        write_text_atomic(self.staging / name, text)

    def commit(self, overwrite: bool = False) -> Path:
        """Move into place. An empty folder there is replaced; a previous run of this harness only
        with `overwrite` (checked again now: the folder may have changed during the run);
        anything else is left untouched and OutputError raised. A stop asked by a signal
        (kvcore.guards) is raised here, before anything moves: a signal whose KeyboardInterrupt
        Python dropped (it landed in a finalizer) never lets a result through."""
        check_stop()
        if self.final.is_symlink() or (self.final.exists() and not self.final.is_dir()):
            raise OutputError(f"{self.final} became a file during the run; it was left untouched")
        if self.final.is_dir() and any(self.final.iterdir()):
            foreign = not_ours(self.final)
            if foreign or not overwrite:
                raise OutputError(f"{self.final} changed during the run ("
                                  f"{foreign or 'it now holds a run'}); it was left untouched")
            (self.staging / STAGING_MARK).unlink()
            # a fresh empty name of our own to move the old run to (never a user's folder)
            old = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.old-", dir=self.final.parent))
            os.replace(self.final, old)
            os.replace(self.staging, self.final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            (self.staging / STAGING_MARK).unlink()
            os.replace(self.staging, self.final)
        return self.final

    def abandon(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        self._remove_created()

    def _remove_created(self) -> None:
        """The folders made for this run, if still empty: a failed run leaves no empty
        `<results_root>/<task>/<model>/<method>/` behind."""
        for folder in self.created:
            try:
                folder.rmdir()
            except OSError:
                break
