"""Facts about the files the harness reads and writes, shared by every layer above (methods'
side files and artefacts, the runner's inputs and caches): one definition each."""

from __future__ import annotations

import os
import stat
from pathlib import Path

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def nonregular_kind(mode: int) -> str | None:
    """What a file of this `st_mode` is when it is not a regular file ("a FIFO (named pipe)",
    "a character device", ...), else None: the words every refusal of such a file uses."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def user_cache_root() -> Path:
    """The harness's user cache: `$KVH_CACHE_DIR`, else ~/.cache/kv-harness (converted models,
    prepared artefacts and built kernels live below it)."""
    return Path(os.environ.get("KVH_CACHE_DIR") or Path.home() / ".cache" / "kv-harness")
