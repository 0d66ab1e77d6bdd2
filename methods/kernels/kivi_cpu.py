"""KIVI's fused decode attention on CPU: a small C kernel (kivi_cpu.c), built on first use.

Triton runs on CPU only in its interpreter (exact but slow), and torch's eager ops unpack the
codes into a full fp32 copy block by block, which costs more than reading the fp32 cache itself.
This kernel is the CPU counterpart of the Triton one, one call per layer and step: codes unpacked
a byte at a time into L1 and used at once, scale folded into the query or the probability, the
exact softmax in between, the fp residuals read in the same call; OpenMP with the thread count
torch uses, one parallel region per call.

Built on first use by methods/kernels/cpu_build.py; without a C compiler `library()` is None
and callers take the torch path (`build_error()` says why).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from methods.kernels import cpu_build
from methods.kernels.cpu_build import kernel_rows

_SOURCE = Path(__file__).with_name("kivi_cpu.c")


def _declare(lib: ctypes.CDLL) -> None:
    long_, ptr = ctypes.c_long, ctypes.c_void_p
    fn = lib.kivi_decode_attention
    fn.restype = None
    segment = [ptr, long_, long_, ptr, ptr, long_, long_, ptr, long_, long_]
    fn.argtypes = ([ptr, long_, long_] + segment * 2 + [ptr] + [long_] * 8
                   + [ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int])


_KERNEL = cpu_build.CKernel(_SOURCE, _declare)
library = _KERNEL.library  # the loaded library, built once per process (None: cannot be built)
build_error = _KERNEL.build_error  # why library() is None
kernel_name = _KERNEL.name  # "c" when this kernel serves a device, else "torch"


def _segment(parts) -> list[torch.Tensor]:
    """A quantized segment's (codes, scale, zero) ready for the kernel (a dummy when empty: the
    kernel reads none of it)."""
    if parts is None:
        dummy = torch.zeros(1, 1, 1, 2, dtype=torch.uint8)
        return [dummy, dummy.view(torch.float16), dummy.view(torch.float16)]
    codes, scale, zero = (kernel_rows(t) for t in parts)
    if scale.stride() != zero.stride():
        scale, zero = scale.contiguous(), zero.contiguous()
    return [codes, scale, zero]


def decode_attention(query: torch.Tensor, cache, scaling: float) -> torch.Tensor:
    """`query (B, H_q, 1, D)` over a `KIVICache` (methods/kernels/kivi_attention.py) ->
    `(B, H_q, 1, D)`: one kernel call (key scores, exact softmax, p.V)."""
    b, hq, _, d = query.shape
    h = cache.k_res.shape[1]
    g = hq // h
    q = kernel_rows(query.reshape(b, h, g, d).float())  # (B, H_kv, g, D)
    k_res, v_res = kernel_rows(cache.k_res.float()), kernel_rows(cache.v_res.float())
    kc, ks, kz = _segment(cache.k_quant)
    vc, vs, vz = _segment(cache.v_quant)
    out = torch.empty(b, h, g, d)
    library().kivi_decode_attention(
        q.data_ptr(), q.stride(1), q.stride(2),
        kc.data_ptr(), kc.stride(1), kc.stride(2),
        ks.data_ptr(), kz.data_ptr(), ks.stride(1), ks.stride(2),
        k_res.data_ptr(), k_res.stride(1), k_res.stride(2),
        vc.data_ptr(), vc.stride(1), vc.stride(2),
        vs.data_ptr(), vz.data_ptr(), vs.stride(1), vs.stride(2),
        v_res.data_ptr(), v_res.stride(1), v_res.stride(2),
        out.data_ptr(), b * h, g, d, cache.tokens(), cache.quantized_key_tokens(),
        cache.quantized_value_tokens(), cache.k_group_tokens, cache.v_group_channels,
        cache.k_bits, cache.v_bits, float(scaling), torch.get_num_threads())
    return out.reshape(b, hq, 1, d).to(query.dtype)
