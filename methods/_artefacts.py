"""Prepared artefacts cached on disk (KVQuant's calibration, InfiniGen's skewing matrices, the
head-wise methods' probe scores): where they live, how they are written, and what a run records
of them.

* **Provenance says what an artefact is, never where it came from this time.** A run records the
  artefact's kind, its cache key (a hash of everything it is made from) and the sha256 of its
  tensors, the same whether it was computed now or loaded from an earlier run's cache: a machine
  that never ran the project writes the same metrics as a warm one. Whether it was computed or
  loaded is logged (INFO), not recorded: it is a fact about the cache, not about the result.
* **Not a side file.** A cached artefact is the project's own output, keyed by its inputs; the
  side files a run records (`methods._sidefiles`) are the inputs a user gave.
* **Cache writes** that fail (a full disk, a read-only folder) cost the cache, never the run: one
  warning line naming the file, and the artefact stays in memory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from kvcore.files import user_cache_root

log = logging.getLogger(__name__)


def cache_root(kind: str, *given) -> Path:
    """The folder of one kind of artefact: the first folder given (a method's `cache_dir`, the
    run's), else `$KVH_CACHE_DIR`, else ~/.cache/kv-harness."""
    for folder in given:
        if folder:
            return Path(folder) / kind
    return user_cache_root() / kind


def tensors_sha256(tensors: Iterable[torch.Tensor]) -> str:
    """One hash over the tensors' dtypes, shapes and bytes (bit-exact: a saved tensor loads back
    with the same hash)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def provenance(kind: str, key: str, path: Path, tensors: Iterable[torch.Tensor],
               loaded: bool) -> dict[str, Any]:
    """What a run records of an artefact (identical cold and warm); logs how it was had."""
    log.info("%s %s: %s", kind, "loaded from the cache" if loaded else "computed", path)
    return {"kind": kind, "key": key, "sha256": tensors_sha256(tensors), "path": str(path)}


def save(path: Path, write: Callable[[str], None], what: str) -> bool:
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


def load(path: Path) -> Any | None:
    """A cached payload (torch, weights only), or None when absent; a link or a file that is not
    a regular one is never followed (a cache is written by the project, never as a link)."""
    if path.is_symlink() or not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)
