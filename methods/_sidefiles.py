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
* **Cache writes** that fail (a full disk, a read-only folder) cost the cache, never the run: one
  warning line naming the file, and the artefact stays in memory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from kvcore.errors import ConfigError

log = logging.getLogger(__name__)
_record: dict[str, dict[str, Any]] = {}


def reset() -> None:
    _record.clear()


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


def calibration_path(given: str | None, data_dir, what: str, folders: bool = False) -> Path:
    """`method.calibration_path` resolved: the file given (or folder, with `folders`), else
    PG-19's first book in the shared data folder; one line naming what is missing otherwise."""
    default = None if data_dir is None else Path(data_dir) / "pg19" / "pg19_firstbook.txt"
    path = Path(given) if given else default
    if path is None or not (path.exists() if folders else path.is_file()):
        kind = "file or folder" if folders else "file"
        raise ConfigError(f"method.calibration_path={path}: no such {kind} ({what}; default: "
                          "PG-19's first book in ../shared/data)")
    return path


def read_bytes(key: str, path: Path) -> bytes:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{key}={path}: no such file")
    try:
        content = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{key}={path}: cannot be read ({exc.strerror or exc})") from None
    record(key, path, content)
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


def save_cache(path: Path, write: Callable[[str], None], what: str) -> bool:
    """Write a cached artefact atomically (`write(tmp)` then rename); a failure (full disk,
    read-only folder) is one warning line and False: the artefact is used uncached."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        write(tmp)
        os.replace(tmp, path)
        return True
    except (OSError, RuntimeError) as exc:  # torch.save wraps a failed write in RuntimeError
        text = (str(getattr(exc, "strerror", None) or exc).splitlines() or [""])[0]
        log.warning("%s: cannot write the cache %s (%s); going on without caching it", what,
                    path, text)
        return False
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def load_cache(key: str, path: Path, load: Callable[[Path], Any]) -> Any:
    """`load(path)` of a cached artefact, recorded as read (its checks are the caller's)."""
    value = load(path)
    try:
        record(key, path, Path(path).read_bytes())
    except OSError:
        pass
    return value
