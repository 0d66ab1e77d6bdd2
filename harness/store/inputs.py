"""Reading the files a user names (samples.jsonl, paired references, thresholds, metrics.json):
kind and size checked before a byte is read, then read with a cap.

A FIFO would block the reader forever, a link to /dev/zero or /dev/urandom never ends, and a
sparse file can claim gigabytes it never wrote: each is refused in one line naming the file and
what it is (ConfigError), before any parsing. JSON lines are parsed strictly (NaN and Infinity,
which Python's json accepts, are not JSON) and every row must be an object.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Callable

from kvcore.errors import ConfigError
from kvcore.files import nonregular_kind as _kind

# samples.jsonl of a long streaming-perplexity run holds ~10 bytes per scored token: 256 MiB is
# ~25M tokens, far beyond any run here, and parses into a few GiB of Python objects at most.
JSONL_MAX_BYTES = 256 * 2**20
# metrics.json and thresholds files are a few kB; a megabyte-sized one is not ours.
SMALL_MAX_BYTES = 16 * 2**20

def _mib(n: int) -> str:
    return f"{n / 2**20:.4g} MiB"


def _link_note(path: Path) -> str:
    """' (a link to <target>)' when `path` is a symbolic link, so the message names both."""
    if not path.is_symlink():
        return ""
    try:
        return f" (a link to {os.path.realpath(path)})"
    except OSError:
        return " (a link)"


def check_regular(path: Path, key: str, max_bytes: int) -> os.stat_result:
    """The file's stat when it is a regular file of at most `max_bytes`; ConfigError naming `key`
    and what the path is otherwise (missing, a broken link, a folder, FIFO, device, too large)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if path.is_symlink():
            raise ConfigError(f"{key}: {path} is a broken link (its target "
                              f"{os.readlink(path)} does not exist)") from None
        raise ConfigError(f"{key}: {path}: no such file") from None
    except OSError as exc:  # a link loop, a path through a file, permissions
        raise ConfigError(f"{key}: {path}: unreadable ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{key}: {path} is {_kind(st.st_mode)}{_link_note(path)}, not a "
                          "regular file; nothing was read")
    if st.st_size > max_bytes:
        raise ConfigError(f"{key}: {path} is {_mib(st.st_size)}, above the {_mib(max_bytes)} "
                          "limit for this file; nothing was read")
    return st


def read_bytes(path: Path, key: str, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most `max_bytes` (checked before opening, and again on
    the opened file: a FIFO or device swapped in between is refused, never read from)."""
    check_regular(path, key, max_bytes)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ConfigError(f"{key}: {path}: unreadable ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{key}: {path} became {_kind(st.st_mode)} while it was opened; "
                              "nothing was read")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ConfigError(f"{key}: {path} grew above the {_mib(max_bytes)} limit while it was "
                          "read")
    return data


def read_text(path: Path, key: str, max_bytes: int = SMALL_MAX_BYTES) -> str:
    """A capped regular file as UTF-8 text; ConfigError naming the file otherwise."""
    data = read_bytes(path, key, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{key}: {path}: not UTF-8 text (line {line}, byte "
                          f"{exc.start})") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def strict_json(text: str) -> Any:
    """json.loads, refusing NaN, Infinity and -Infinity (Python's json accepts them)."""
    return json.loads(text, parse_constant=_no_constant)


def jsonl_rows(path: Path, key: str, check_row: Callable[[dict], str] | None = None,
               max_bytes: int = JSONL_MAX_BYTES) -> list[dict]:
    """The rows of a JSON-lines file (blank lines skipped), each a JSON object that `check_row`
    finds no problem with ('' = fine); the first bad line is named in a ConfigError."""
    rows = []
    for number, line in enumerate(read_text(path, key, max_bytes).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = strict_json(line)
        except ValueError as exc:
            raise ConfigError(f"{key}: {path}: line {number} is not JSON "
                              f"({str(exc).splitlines()[0]})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{key}: {path}: line {number} is a JSON {json_type(row)}, "
                              "not an object (one sample per line)")
        problem = check_row(row) if check_row else ""
        if problem:
            raise ConfigError(f"{key}: {path}: line {number}: {problem}")
        rows.append(row)
    return rows


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type (array, string, number, boolean, null, object)."""
    return {list: "array", str: "string", bool: "boolean", type(None): "null", dict: "object"}.get(
        type(value), "number")
