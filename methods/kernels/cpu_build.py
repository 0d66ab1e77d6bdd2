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

What a build is given, and where it writes, is ours to choose: every flag of
`$KVH_KERNEL_FLAGS` and `extra_flags` must be an optimisation level (`-O3`), a target option
(`-mno-avx512f`, `-march=haswell`), a define (`-DNAME=1`, `-UNAME`) or one of a few
code-generation switches (`_CODEGEN`), so nothing can name a file or hand arguments to the
linker or assembler (`-Wl,-o,<file>`, `-o`, `-MF`, `-specs=`, `@file` are refused with a
`ConfigError` naming the variable and the flag; `check_environment()` runs this before a run
loads anything). The compiler writes into a fresh private folder inside the cache, and the
library is moved into the cache by name; the cache folder must not be a symbolic link nor hold
files the harness did not write.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import torch

from kvcore.errors import ConfigError

_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
# Linked apart from the compile and without -ffast-math: gcc < 13 links crtfastmath.o into a
# shared library built with it, whose constructor sets flush-to-zero for the whole process when
# the library loads (every later torch, numpy and Python float op would read subnormals as 0).
_LINK = ("-shared", "-fopenmp")
_LIBS = ("-lm",)
_loaded: dict[str, ctypes.CDLL | None] = {}
_errors: dict[str, str] = {}


def _compiler() -> str:
    return os.environ.get("CC") or "cc"


def compiler_available() -> bool:
    return shutil.which(_compiler()) is not None


# What the kernel cache holds: `<source stem>_<16 hex digits>.so` libraries and, while one
# builds, its private `.build-*` folder (`tmp*.so.part`: an interrupted build of an earlier
# version). Anything else was not written by us.
_OURS = re.compile(r"[A-Za-z0-9_]+_[0-9a-f]{16}\.so|\.build-[A-Za-z0-9_]+|tmp\w+\.so\.part")


def _cache_dir() -> Path:
    """`$KVH_KERNEL_CACHE`, else ~/.cache/kv-harness/kernels, else (not writable) a temp dir."""
    root = os.environ.get("KVH_KERNEL_CACHE")
    if root:
        _check_cache_folder(Path(root), "KVH_KERNEL_CACHE")
    for path in ([Path(root)] if root else [Path.home() / ".cache" / "kv-harness" / "kernels"]) + [
            Path(tempfile.gettempdir()) / "kv-harness-kernels"]:
        try:
            path.mkdir(parents=True, exist_ok=True)
            _check_cache_folder(path, "KVH_KERNEL_CACHE" if root else "the kernel cache")
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
        except ConfigError:
            if root and path == Path(root):  # the folder the user named: refused by name
                raise
            continue  # our default holding something else: the next candidate
    raise RuntimeError("no writable directory for built kernels (set KVH_KERNEL_CACHE)")


def _check_cache_folder(path: Path, name: str) -> None:
    """Refuse a cache folder that is a symbolic link, not a folder, or one holding files the
    harness did not write (a user's folder named by mistake: builds would land among them)."""
    if path.is_symlink():
        raise ConfigError(f"{name}={path} is a symbolic link; the kernel cache must be a folder "
                          "of its own (kernels are never written through a link)")
    if not path.exists():
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as err:
        raise ConfigError(f"{name}={path} is not a folder the kernel cache can use "
                          f"({err.strerror})") from None
    try:
        foreign = sorted(n for n in os.listdir(fd) if not _OURS.fullmatch(n))
    finally:
        os.close(fd)
    if foreign:
        raise ConfigError(f"{name}={path} holds files the harness did not write "
                          f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
                          "name an empty folder or the harness's own kernel cache")


def _host_tag() -> str:
    """The CPU the library is built for (-march=native): a cache shared between machines (a
    cluster's home directory) must not hand one CPU's instructions to another."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags.strip()}"


# Code-generation switches a kernel variant may turn on or off (`-f<name>`, `-fno-<name>`,
# `-f<name>=<word>`): none of them names a file or writes one (unlike -fprofile-*, -fdump-*,
# -fplugin=, -fstack-usage, -fsave-optimization-record, -fdebug-prefix-map=).
_CODEGEN = frozenset((
    "fast-math", "finite-math-only", "math-errno", "trapping-math", "signed-zeros",
    "associative-math", "reciprocal-math", "rounding-math", "fp-contract", "excess-precision",
    "unroll-loops", "unroll-all-loops", "peel-loops", "split-loops", "tree-vectorize",
    "tree-loop-vectorize", "tree-slp-vectorize", "vect-cost-model", "simd-cost-model",
    "omit-frame-pointer", "strict-aliasing", "wrapv", "inline-functions", "inline-small-functions",
    "prefetch-loop-arrays", "openmp", "openmp-simd", "PIC", "pic", "builtin", "align-loops",
    "align-functions", "stack-protector", "stack-protector-strong", "stack-clash-protection",
    "schedule-insns", "schedule-insns2", "ivopts", "gcse", "predictive-commoning", "tracer"))
_WORD = r"[A-Za-z0-9_.+-]+"  # a value: no path separator, comma (tool arguments) or quote
_ALLOWED = (
    re.compile(r"-O[0-3sgz]?|-Ofast"),
    re.compile(rf"-m(?!llvm$)[a-z0-9][a-z0-9_.+-]*(={_WORD})?"),  # not -mllvm <next argument>
    re.compile(rf"-D[A-Za-z_][A-Za-z0-9_]*(={_WORD})?|-U[A-Za-z_][A-Za-z0-9_]*"),
    re.compile(rf"-f(no-)?(?P<name>[A-Za-z0-9-]+)(={_WORD})?"),
)
_ALLOWED_TEXT = ("-O<level>, -m<target option> (-mno-avx512f, -march=haswell), "
                 "-D<NAME>[=<value>], -U<NAME>, -f[no-]<option> for "
                 + ", ".join(sorted(_CODEGEN, key=str.lower))
                 + "; nothing naming a file or passed to another tool")


def check_flags(flags, source: str) -> tuple[str, ...]:
    """`flags` if each is a kernel build flag (`_ALLOWED`), else a `ConfigError` naming `source`
    (the variable or argument they came from) and the first one refused."""
    for flag in flags:
        match = next((m for m in (r.fullmatch(flag) for r in _ALLOWED) if m), None)
        name = match.groupdict().get("name") if match else None
        if match is None or (name is not None and name not in _CODEGEN):
            raise ConfigError(f"{source}: {flag!r} is not a kernel build flag; allowed: "
                              f"{_ALLOWED_TEXT}")
    return tuple(flags)


def environment_flags() -> tuple[str, ...]:
    """`$KVH_KERNEL_FLAGS`, split on spaces and checked (`check_flags`)."""
    return check_flags(os.environ.get("KVH_KERNEL_FLAGS", "").split(), "KVH_KERNEL_FLAGS")


def check_environment() -> None:
    """The kernel build's environment, checked before a run loads anything: `$KVH_KERNEL_FLAGS`
    and `$KVH_KERNEL_CACHE` (a `ConfigError` naming the variable)."""
    environment_flags()
    root = os.environ.get("KVH_KERNEL_CACHE")
    if root is not None:
        if not root.strip():
            raise ConfigError("KVH_KERNEL_CACHE is set but empty; name a folder for built "
                              "kernels or unset it")
        _check_cache_folder(Path(root), "KVH_KERNEL_CACHE")


def _flags(extra_flags: tuple[str, ...]) -> tuple[str, ...]:
    """The build flags: the fixed ones, then `$KVH_KERNEL_FLAGS`, then `extra_flags` (later
    flags win: `-mno-avx512f` after `-march=native` builds without AVX-512), each checked."""
    return (*_FLAGS, *environment_flags(), *check_flags(extra_flags, "extra_flags"))


def _build(source: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    compiler = _compiler()
    if not compiler_available():
        raise RuntimeError(f"no C compiler ({compiler}) on PATH")
    flags = _flags(extra_flags)
    recipe = " ".join((compiler, *flags, *_LINK, *_LIBS, _host_tag())).encode()
    digest = hashlib.sha256(source.read_bytes() + recipe).hexdigest()[:16]
    cache = _cache_dir()
    target = cache / f"{source.stem}_{digest}.so"
    if target.is_file() and not target.is_symlink():
        return target
    # The compiler writes only into a fresh folder of ours (mkdtemp: 0700, nothing in it to
    # follow); the library then replaces the cache's name (a rename never follows a link).
    work = Path(tempfile.mkdtemp(dir=cache, prefix=".build-"))
    try:
        built, obj = work / target.name, work / f"{source.stem}.o"
        for step in ([*flags, "-c", str(source), "-o", str(obj)],
                     [*_LINK, str(obj), "-o", str(built), *_LIBS]):
            done = subprocess.run([compiler, *step], capture_output=True, text=True,
                                  timeout=120, cwd=work)
            if done.returncode:
                raise RuntimeError(f"{compiler} failed on {source.name}: "
                                   f"{done.stderr.strip()[:500]}")
        os.replace(built, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
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
