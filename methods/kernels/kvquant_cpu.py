"""KVQuant's decode attention on CPU: a small C kernel (kvquant_cpu.c), built on first use.

The CPU counterpart of the Triton kernel in methods/kernels/kvquant_attention.py, one call per
layer and step: the codebook codes looked up and dequantized a block of tokens at a time in L1,
the sparse outliers written in, each key rotated once by its position's row of the cos/sin
table, the exact softmax, p.V from the value codes; OpenMP with torch's thread count.

Built on first use by methods/kernels/cpu_build.py; without a C compiler `library()` is None and
callers take the torch path (`build_error()` says why).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from methods.kernels import cpu_build

_SOURCE = Path(__file__).with_name("kvquant_cpu.c")


def _declare(lib: ctypes.CDLL) -> None:
    long_, ptr = ctypes.c_long, ctypes.c_void_p
    fn = lib.kvquant_decode_attention
    fn.restype = ctypes.c_int
    lib.kvquant_vector_path.restype = ctypes.c_int
    lib.kvquant_vector_path.argtypes = []
    fn.argtypes = ([ptr] + [ptr, long_, long_] * 4 + [ptr, ptr, ptr, ptr, long_] + [ptr] * 4
                   + [ptr, ptr, ptr, long_] * 2 + [ptr] + [long_] * 5
                   + [ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_int])


_KERNEL = cpu_build.CKernel(_SOURCE, _declare)
library = _KERNEL.library  # the loaded library, built once per process (None: cannot be built)
build_error = _KERNEL.build_error  # why library() is None
kernel_name = _KERNEL.name  # "c" when this kernel serves a device, else "torch"


def vector_path() -> bool:
    """Whether the built kernel has its AVX-512 path (D a multiple of 32, g <= 16)."""
    lib = library()
    return lib is not None and bool(lib.kvquant_vector_path())


def _rows(x: torch.Tensor | None) -> tuple[torch.Tensor | None, int, int]:
    """`x (1, H, T, C)` as `(H, T, C)` with a unit last stride, and its head / token strides."""
    if x is None:
        return None, 0, 0
    x = x[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x, x.stride(0), x.stride(1)


def _ptr(x: torch.Tensor | None):
    return None if x is None else x.data_ptr()


def decode_attention(query: torch.Tensor, cache, scaling: float, vector: bool = True
                     ) -> torch.Tensor:
    """`query (1, H_q, 1, D)` over a `KVQuantCache` -> `(1, H_q, 1, D)`: one kernel call.
    `vector=False` forces the portable path (the AVX-512 one runs where the CPU has it and D is a
    multiple of 32)."""
    b, hq, _, d = query.shape
    h = cache.key_scale.shape[0]
    q = query.reshape(hq, d).float().contiguous()  # (H * g, D)
    ek, s_ekh, s_ekt = _rows(None if cache.exact_k is None else cache.exact_k.float())
    ev, s_evh, s_evt = _rows(None if cache.exact_v is None else cache.exact_v.float())
    kc, s_kch, s_kct = _rows(cache.k_codes)
    vc, s_vch, s_vct = _rows(cache.v_codes)
    vs = None if cache.v_scale is None else cache.v_scale.reshape(-1)
    vz = None if cache.v_zero is None else cache.v_zero.reshape(-1)
    keep = []  # contiguous copies must outlive the call
    sparse = []
    for parts in (cache.k_outliers, cache.v_outliers):
        if parts is None or parts[0].numel() == 0:
            sparse += [None, None, None, 0]
        else:
            token, lane, value = (p.contiguous() for p in parts)
            keep.append((token, lane, value))
            sparse += [token.data_ptr(), lane.data_ptr(), value.data_ptr(), token.numel()]
    consts = [t.float().contiguous() for t in (cache.key_scale, cache.key_zero, cache.key_codebook,
                                                cache.value_codebook, cache.rope_cos,
                                                cache.rope_sin)]
    out = torch.empty(hq, d)
    status = library().kvquant_decode_attention(
        q.data_ptr(), _ptr(ek), s_ekh, s_ekt, _ptr(ev), s_evh, s_evt,
        _ptr(kc), s_kch, s_kct, _ptr(vc), s_vch, s_vct,
        consts[0].data_ptr(), consts[1].data_ptr(), _ptr(vs), _ptr(vz),
        0 if vs is None else vs.stride(0),
        consts[2].data_ptr(), consts[3].data_ptr(), consts[4].data_ptr(), consts[5].data_ptr(),
        *sparse, out.data_ptr(), h, hq // h, d, cache.exact_tokens(), cache.quantized_tokens(),
        cache.k_bits, cache.v_bits, float(scaling), int(vector), torch.get_num_threads())
    cpu_build.check_status(status, "kvquant_decode_attention")
    return out.reshape(b, hq, 1, d).to(query.dtype)
