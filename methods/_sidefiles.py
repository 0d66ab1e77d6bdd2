"""Side files a method reads (calibration texts, learned head patterns, score tables, cached
artefacts): checked like knobs and recorded.

* **Checked like knobs.** A path knob given as an empty string is refused (never read as "not
  given"); a text must be UTF-8 text, a JSON file valid JSON of the expected kind, a table of
  numbers finite, in range and of the model's shape. Every refusal is one line naming the knob,
  the file and what is wrong (`ConfigError`), raised before weights load where the method checks
  its files in `validate`.
* **Recorded.** Every side file read in this process is recorded once (knob, path, sha256 of
  its content, bytes); the runner writes the record into metrics.json (`side_files`), so a report
  tells a run that read the authors' artefacts from one that fell back to a proxy by what it
  read, not by its label. `reset()` starts a new record (one per run).
* **Read once, size and kind first.** A side file is opened without blocking, must be a
  regular file (a FIFO, a device, a socket or a folder is refused by name, also behind a link)
  of at most `MAX_SIDE_FILE_BYTES` (a sparse giant is refused by its size before a byte is
  read); its bytes are read once per run and handed to every later reader of the same path, so
  what is hashed in the record is what the method uses (a file rewritten between `validate`
  and `prepare` changes nothing).
* Cached artefacts a method computes (calibrations, probe scores) are not side files: they are
  the project's own outputs, recorded by what they are (`methods._artefacts`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Callable

from kvcore.errors import ConfigError
from kvcore.files import nonregular_kind as _kind

log = logging.getLogger(__name__)
_record: dict[str, dict[str, Any]] = {}
_content: dict[str, bytes] = {}  # resolved path -> the bytes read this run (read once)
# The largest side file read: calibration texts, head tables and published filters are a few
# MiB; anything near this size is a mistake (a disk image, a sparse file, /dev/zero behind a
# link) that would be read whole into memory.
MAX_SIDE_FILE_BYTES = 256 * 2 ** 20


def reset() -> None:
    _record.clear()
    _content.clear()


def read() -> list[dict[str, Any]]:
    """Every side file read since `reset()`: knob, path, sha256, bytes (in reading order)."""
    return list(_record.values())


def record(key: str, path: Path, content: bytes) -> None:
    path = Path(path).resolve()
    _record.setdefault(f"{key}:{path}", {"key": key, "path": str(path),
                                         "sha256": hashlib.sha256(content).hexdigest(),
                                         "bytes": len(content)})


def empty_path_reasons(method) -> list[str]:
    """A path knob (`*_path`, `*_dir`) given as '' or blanks: refused, never read as null."""
    reasons = []
    for field in dataclasses.fields(method):
        value = getattr(method, field.name)
        if field.name.endswith(("_path", "_dir")) and isinstance(value, str) and not value.strip():
            reasons.append(f"method.{field.name}={value!r} is empty; give a file or folder, or "
                           "null (the default)")
    return reasons


def path_kind_reasons(method) -> list[str]:
    """A path knob (`*_path`) naming a FIFO, a device or a socket, or a file larger than a side
    file may be: refused by what it is before weights load (a method may read it only in
    `prepare`); folders and missing paths are left to the method's own checks."""
    reasons = []
    for field in dataclasses.fields(method):
        value = getattr(method, field.name)
        if not field.name.endswith("_path") or not isinstance(value, str) or not value.strip():
            continue
        try:
            info = os.stat(value)
        except (OSError, ValueError):
            continue
        kind = _kind(info.st_mode)
        if kind not in (None, "a folder"):
            reasons.append(f"method.{field.name}={value}: {kind}; allowed: a regular file")
        elif kind is None and info.st_size > MAX_SIDE_FILE_BYTES:
            reasons.append(f"method.{field.name}={value}: {info.st_size / 2 ** 30:.2f} GiB; a "
                           f"side file is at most {MAX_SIDE_FILE_BYTES // 2 ** 20} MiB")
    return reasons


def calibration_path(given: str | None, data_dir, what: str, folders: bool = False) -> Path:
    """`method.calibration_path` resolved: the file given (or folder, with `folders`), else
    PG-19's first book in the shared data folder; one line naming what is missing otherwise."""
    default = None if data_dir is None else Path(data_dir) / "pg19" / "pg19_firstbook.txt"
    path = Path(given) if given else default
    kind = None if path is None else kind_of(path)
    if kind is not None and not (kind == "a folder" and folders):
        raise ConfigError(f"method.calibration_path={path}: {kind}, not a text file ({what})")
    if path is None or not (path.exists() if folders else path.is_file()):
        kind = "file or folder" if folders else "file"
        raise ConfigError(f"method.calibration_path={path}: no such {kind} ({what}; default: "
                          "PG-19's first book in ../shared/data)")
    return path


def kind_of(path: Path) -> str | None:
    """What `path` is when it is there but not a regular file ("a FIFO (named pipe)", "a
    character device", ...; links followed), else None (a regular file, or nothing there)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return _kind(mode)


def read_bytes(key: str, path: Path) -> bytes:
    """The file's bytes, checked (a regular file within MAX_SIDE_FILE_BYTES) and read once per
    run: a second reader of the same path gets the bytes the record's hash was taken of."""
    path = Path(path)
    resolved = str(path.resolve())
    if resolved not in _content:
        _content[resolved] = _read_checked(key, path)
    content = _content[resolved]
    record(key, path, content)
    return content


def _read_checked(key: str, path: Path) -> bytes:
    """Open without blocking (a FIFO would wait for a writer), check kind and size on the open
    file itself, then read at most the size it had (a file that grows meanwhile is refused)."""
    kind = kind_of(path)
    if kind is not None:
        raise ConfigError(f"{key}={path}: {kind}; allowed: a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{key}={path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{key}={path}: cannot be read ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        kind = _kind(info.st_mode)
        if kind is not None:
            raise ConfigError(f"{key}={path}: {kind}; allowed: a regular file")
        if info.st_size > MAX_SIDE_FILE_BYTES:
            sparse = " (sparse: most of it was never written)" \
                if info.st_blocks * 512 < info.st_size // 2 else ""
            raise ConfigError(f"{key}={path}: {info.st_size / 2 ** 30:.2f} GiB{sparse}; a side file "
                              f"is at most {MAX_SIDE_FILE_BYTES // 2 ** 20} MiB")
        try:
            content = f.read(info.st_size + 1)
        except OSError as exc:
            raise ConfigError(f"{key}={path}: cannot be read ({exc.strerror or exc})") from None
    if len(content) != info.st_size:
        raise ConfigError(f"{key}={path}: changed while it was read ({info.st_size} bytes, then "
                          f"{len(content)}); give a file that is not being written")
    return content


def read_text(key: str, path: Path) -> str:
    """The file as UTF-8 text, or one line saying where it is not."""
    content = read_bytes(key, path)
    nul = content.find(b"\x00")
    if nul >= 0:
        raise ConfigError(f"{key}={path}: a binary file (NUL byte at offset {nul}); allowed: "
                          "UTF-8 text")
    try:
        return content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{key}={path}: not UTF-8 text (byte 0x{content[exc.start]:02x} at "
                          f"offset {exc.start}); allowed: UTF-8 text") from None


def parse_json(key: str, path: Path, text: str, kind: type, what: str) -> Any:
    """`text` (the content of `path`) as JSON of `kind` (dict, list)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{key}={path}: not valid JSON ({exc}); expected {what}") from None
    if not isinstance(value, kind):
        raise ConfigError(f"{key}={path}: a JSON {type(value).__name__}, expected {what}")
    return value


def check_numbers(key: str, path: Path, values, where: Callable[[int], str],
                  low: float | None = None, high: float | None = None,
                  allowed: str = "finite numbers") -> None:
    """Every number of the flat sequence `values` finite and within [low, high]; `where(i)` names
    the i-th (e.g. "layer 3 head 1")."""
    for i, v in enumerate(values):
        v = float(v)
        if not math.isfinite(v) or (low is not None and v < low) or (high is not None and v > high):
            raise ConfigError(f"{key}={path}: {where(i)} is {v!r}; allowed: {allowed}")
