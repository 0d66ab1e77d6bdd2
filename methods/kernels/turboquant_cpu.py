"""TurboQuant's decode attention on CPU: a small C kernel (turboquant_cpu.c), built on first use.

The CPU counterpart of the Triton kernel in methods/kernels/turboquant_attention.py, one call per
layer and step: per block and head the query permuted to the block's stream order and rotated
(block-diagonal), every token's codes looked up once and dotted with the g queries, QJL signs
with the projected query, the exact softmax, p.V accumulated in rotated coordinates per block
and rotated back; OpenMP with torch's thread count. Where built with AVX-512 VBMI, or else with
AVX2 + FMA, and the shape fits (`vector_path()`), 16 (8) coordinates at a time stay in
registers (codes cut from their bytes and looked up in a 32-entry register table, signs as a
lane mask); elsewhere byte tables. `extra_flags` builds a variant (`("-mno-avx512f",)`: the AVX2
path on an AVX-512 CPU) beside the default library.
Built by methods/kernels/cpu_build.py; without a C compiler `library()` is None and callers take
the torch path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from methods.kernels import cpu_build

_SOURCE = Path(__file__).with_name("turboquant_cpu.c")


def _declare(lib: ctypes.CDLL) -> None:
    long_, ptr = ctypes.c_long, ctypes.c_void_p
    fn = lib.tq_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = ([ptr] + [ptr, long_, long_] * 2 + [long_]
                   + [ptr, long_, long_, long_] + [ptr, long_, long_] * 4
                   + [ptr, ptr, ptr, ptr, long_]
                   + [ptr, long_, long_, long_] + [ptr, long_, long_] * 2
                   + [ptr, ptr, ptr, long_]
                   + [ptr] + [long_] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int])
    lib.tq_vector_path.restype = ctypes.c_int
    lib.tq_vector_path.argtypes = []


_KERNEL = cpu_build.CKernel(_SOURCE, _declare)
library = _KERNEL.library
build_error = _KERNEL.build_error
kernel_name = _KERNEL.name


VECTOR_PATHS = {16: "avx512", 8: "avx2", 0: "portable"}


def vector_path(extra_flags: tuple[str, ...] = ()) -> str | None:
    """The vector path the built kernel has: "avx512" (AVX-512 VBMI, 16 lanes), "avx2" (AVX2 +
    FMA, 8 lanes) or "portable" (none); None when it is not built. A vector path serves D and the
    outlier count multiples of its lanes, D <= 256, code widths <= 5 bits, g <= 16 (AVX2: at
    least 8 code bytes a token); other shapes take the portable path."""
    lib = library(extra_flags)
    return None if lib is None else VECTOR_PATHS[lib.tq_vector_path()]


def _unit(x: torch.Tensor | None) -> torch.Tensor | None:
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def _rows(x: torch.Tensor | None) -> list:
    """[pointer, head stride, row stride] of `x (H, N, C)` with a unit last stride."""
    if x is None:
        return [None, 0, 0]
    return [x.data_ptr(), x.stride(0), x.stride(1)]


def decode_attention(query: torch.Tensor, cache, scaling: float, vector: bool = True,
                     extra_flags: tuple[str, ...] = ()) -> torch.Tensor:
    """`query (1, H_q, 1, D)` over a `TQCache` -> `(1, H_q, 1, D)`: one kernel call.
    `vector=False` forces the portable path (the vector one runs where built and it fits);
    `extra_flags` selects a build variant."""
    b, hq, _, d = query.shape
    kq, vq, k, v = cache.key_quantizer, cache.value_quantizer, cache.keys, cache.values
    h = k.codes.shape[0]
    q = query.reshape(hq, d).float().contiguous()
    ek = None if cache.exact_k is None else cache.exact_k.float().contiguous()
    ev = None if cache.exact_v is None else cache.exact_v.float().contiguous()
    parts = {name: _unit(x) for name, x in (("kc", k.codes), ("ks", k.signs), ("kn", k.norms),
                             ("kr", k.rnorms), ("km", k.masks), ("vc", v.codes),
                             ("vn", v.norms), ("vm", v.masks))}
    kc, vc = kq.kernel_constants, vq.kernel_constants
    keep = [kc["rotation_t"], kc["projection_t"] if kq.qjl else None, kc["codebooks"], kc["layout"],
            vc["rotation"], vc["codebooks"], vc["layout"]]
    ptr = lambda x: None if x is None else x.data_ptr()  # noqa: E731
    out = torch.empty(hq, d)
    status = library(extra_flags).tq_decode_attention(
        q.data_ptr(), *_rows(ek), *_rows(ev)[:1], *_rows(ev)[1:],
        0 if ek is None else ek.shape[1],
        *_rows(parts["kc"]), kq.code_bytes(), *_rows(parts["ks"]), *_rows(parts["kn"]),
        *_rows(parts["kr"]), *_rows(parts["km"]),
        ptr(keep[0]), ptr(keep[1]), ptr(keep[2]), ptr(keep[3]), kq.outlier_channels,
        *_rows(parts["vc"]), vq.code_bytes(), *_rows(parts["vn"]), *_rows(parts["vm"]),
        ptr(keep[4]), ptr(keep[5]), ptr(keep[6]), vq.outlier_channels,
        out.data_ptr(), h, hq // h, d, k.codes.shape[1], kq.block_tokens, float(scaling),
        int(vector), torch.get_num_threads())
    cpu_build.check_status(status, "tq_decode_attention")
    return out.reshape(b, hq, 1, d).to(query.dtype)
