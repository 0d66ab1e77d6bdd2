"""KIVI's fused decode attention on CPU: a small C kernel (kivi_cpu.c), built on first use.

Triton runs on CPU only in its interpreter (exact but slow), and torch's eager ops unpack the
codes into a full fp32 copy block by block, which costs more than reading the fp32 cache itself.
This kernel is the CPU counterpart of the Triton one: codes unpacked a byte at a time into
registers/L1 and used at once, scale folded into the query or the probability, OpenMP over
(KV head, token group) with the thread count torch uses.

The library is compiled with the system C compiler (`$CC`, else `cc`) into
`$KVH_KERNEL_CACHE` (default `~/.cache/kv-harness/kernels`), named by a hash of the source and
flags, written atomically; later processes load it as is. Without a compiler `library()` is None
and callers take the torch path (`build_error()` says why).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("kivi_cpu.c")
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_state: dict[str, object] = {}


def _cache_dir() -> Path:
    root = os.environ.get("KVH_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "kv-harness" / "kernels"


def _build() -> Path:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler ({compiler}) on PATH")
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join((compiler, *_FLAGS)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"kivi_cpu_{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.part")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", tmp],
                              capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[:500]}")
        os.replace(tmp, target)  # atomic: a concurrent process sees no half-written library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built once per process (None when it cannot be built)."""
    if "lib" not in _state:
        try:
            lib = ctypes.CDLL(str(_build()))
            long_, ptr = ctypes.c_long, ctypes.c_void_p
            for fn in (lib.kivi_key_scores, lib.kivi_value_out):
                fn.restype = None
                fn.argtypes = [ptr, long_, long_, ptr, long_, long_, ptr, ptr, long_, long_, ptr,
                               long_, long_, long_, long_, long_, ctypes.c_int, ctypes.c_int]
            _state["lib"], _state["error"] = lib, None
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            _state["lib"], _state["error"] = None, str(err)
    return _state["lib"]


def build_error() -> str | None:
    """Why `library()` is None (None when it loaded or was not tried)."""
    return _state.get("error")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`(B, H, R, C)` with a unit last stride and B, H mergeable into one (BH) stride."""
    if x.stride(-1) != 1 or x.stride(0) != x.shape[1] * x.stride(1):
        x = x.contiguous()
    return x


def key_scores(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               group: int, bits: int) -> torch.Tensor:
    """`q (B, H, g, D)` fp32 (pre-scaled) against quantized keys `codes (B, H, D, n * G * bits/8)`,
    `scale/zero (B, H, D, n)` -> scores `(B, H, g, n * G)` fp32."""
    b, h, g, d = q.shape
    n_groups = scale.shape[-1]
    q, codes = _rows(q), _rows(codes)
    scale, zero = _rows(scale.float()), _rows(zero.float())
    if scale.stride() != zero.stride():
        scale, zero = scale.contiguous(), zero.contiguous()
    out = torch.empty(b, h, g, n_groups * group)
    library().kivi_key_scores(
        q.data_ptr(), q.stride(1), q.stride(2), codes.data_ptr(), codes.stride(1),
        codes.stride(2), scale.data_ptr(), zero.data_ptr(), scale.stride(1), scale.stride(2),
        out.data_ptr(), b * h, g, d, n_groups, group, bits, torch.get_num_threads())
    return out


def value_output(p: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 group: int, bits: int) -> torch.Tensor:
    """`p (B, H, g, T)` fp32 times quantized values `codes (B, H, T, D * bits/8)`,
    `scale/zero (B, H, T, D / G)` -> `(B, H, g, D)` fp32."""
    b, h, g, t = p.shape
    d = codes.shape[-1] * 8 // bits
    p, codes = _rows(p), _rows(codes)
    scale, zero = _rows(scale.float()), _rows(zero.float())
    if scale.stride() != zero.stride():
        scale, zero = scale.contiguous(), zero.contiguous()
    out = torch.empty(b, h, g, d)
    library().kivi_value_out(
        p.data_ptr(), p.stride(1), p.stride(2), codes.data_ptr(), codes.stride(1),
        codes.stride(2), scale.data_ptr(), zero.data_ptr(), scale.stride(1), scale.stride(2),
        out.data_ptr(), b * h, g, d, t, group, bits, torch.get_num_threads())
    return out
