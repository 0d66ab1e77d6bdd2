"""Small C kernels for the CPU paths, compiled on first use and loaded with ctypes.

Triton runs on CPU only in its interpreter, so the CPU counterparts of the harness's fused
kernels are plain C files (methods/kernels/kivi_cpu.c).
`library(source, declare)` compiles one
with the system C compiler (`$CC`, else `cc`) into `$KVH_KERNEL_CACHE` (default
`~/.cache/kv-harness/kernels`), named by a hash of source, compiler, flags and the CPU and written
atomically (concurrent processes never see half a library), loads it once per process and lets
`declare(lib)` set the argument types. `$KVH_KERNEL_FLAGS` (space-separated, e.g.
`-mno-avx512f`) adds flags to every build, and `extra_flags` to one library: a build variant
(another instruction set than the CPU's best) with its own cache entry, for tests and
benchmarks. Without a compiler, or when the build fails, it returns
None and `build_error(source)` says why: callers then take their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import torch

_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_LIBS = ("-lm",)
_loaded: dict[str, ctypes.CDLL | None] = {}
_errors: dict[str, str] = {}


def _compiler() -> str:
    return os.environ.get("CC") or "cc"


def compiler_available() -> bool:
    return shutil.which(_compiler()) is not None


def _cache_dir() -> Path:
    """`$KVH_KERNEL_CACHE`, else ~/.cache/kv-harness/kernels, else (not writable) a temp dir."""
    root = os.environ.get("KVH_KERNEL_CACHE")
    for path in ([Path(root)] if root else [Path.home() / ".cache" / "kv-harness" / "kernels"]) + [
            Path(tempfile.gettempdir()) / "kv-harness-kernels"]:
        try:
            path.mkdir(parents=True, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    raise RuntimeError("no writable directory for built kernels (set KVH_KERNEL_CACHE)")


def _host_tag() -> str:
    """The CPU the library is built for (-march=native): a cache shared between machines (a
    cluster's home directory) must not hand one CPU's instructions to another."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags.strip()}"


def _flags(extra_flags: tuple[str, ...]) -> tuple[str, ...]:
    """The build flags: the fixed ones, then `$KVH_KERNEL_FLAGS`, then `extra_flags` (later
    flags win: `-mno-avx512f` after `-march=native` builds without AVX-512)."""
    return (*_FLAGS, *os.environ.get("KVH_KERNEL_FLAGS", "").split(), *extra_flags)


def _build(source: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    compiler = _compiler()
    if not compiler_available():
        raise RuntimeError(f"no C compiler ({compiler}) on PATH")
    flags = _flags(extra_flags)
    recipe = " ".join((compiler, *flags, *_LIBS, _host_tag())).encode()
    digest = hashlib.sha256(source.read_bytes() + recipe).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}_{digest}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.part")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, str(source), "-o", tmp, *_LIBS],
                              capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed on {source.name}: {done.stderr.strip()[:500]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def library(source: Path, declare: Callable[[ctypes.CDLL], None],
            extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The C file `source` built (with `extra_flags` added) and loaded (once per process), or
    None when it cannot be."""
    key = " ".join((str(source), *_flags(extra_flags)))
    if key not in _loaded:
        try:
            lib = ctypes.CDLL(str(_build(source, extra_flags)))
            declare(lib)
            _loaded[key] = lib
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as err:
            _loaded[key], _errors[key] = None, str(err)
    return _loaded[key]


class CKernel:
    """One C source built on first use: its loaded library (None when it cannot be built), why
    not, and the name of the implementation a device gets ("c" on CPU when built, else "torch")."""

    def __init__(self, source: Path, declare: Callable[[ctypes.CDLL], None]):
        self.source, self.declare = source, declare

    def library(self, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
        return library(self.source, self.declare, extra_flags)

    def build_error(self, extra_flags: tuple[str, ...] = ()) -> str | None:
        return build_error(self.source, extra_flags)

    def name(self, device: torch.device) -> str:
        return "c" if torch.device(device).type == "cpu" and self.library() is not None else "torch"


def check_status(status: int, name: str) -> None:
    """A kernel's return code (0 = done; 1 = sizes it cannot serve; 2 = out of memory) as an
    exception: its outputs were not written."""
    if status == 1:
        raise ValueError(f"{name}: sizes the kernel cannot serve (empty or inconsistent shapes)")
    if status:
        raise MemoryError(f"{name}: the kernel could not allocate its scratch memory")


def kernel_rows(x: torch.Tensor) -> torch.Tensor:
    """`x (B, H, R, C)` as the kernels read it: a unit last stride and B, H mergeable into one
    (BH) stride (a copy only when the view is not already so)."""
    if x.stride(-1) != 1 or x.stride(0) != x.shape[1] * x.stride(1):
        x = x.contiguous()
    return x


def build_error(source: Path, extra_flags: tuple[str, ...] = ()) -> str | None:
    """Why `library(source, ..., extra_flags)` is None (None when it loaded or was not tried)."""
    return _errors.get(" ".join((str(source), *_flags(extra_flags))))
