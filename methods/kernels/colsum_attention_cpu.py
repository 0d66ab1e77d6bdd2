"""Decode attention that accumulates each key's attention, on CPU (colsum_attention_cpu.c).

H2O needs the attention probabilities of every decode step (their column sums are its scores).
torch's fused SDPA cannot return them, so the eager path runs matmul, softmax, matmul and a
reduction, ~2x SDPA's time at one query row on CPU (benchmarks/eviction_step_cost.py). This kernel
does the step in one call: key scores, the exact softmax, p.V and the group-mean column sums added
in place into the caller's accumulator; the probabilities never leave a scratch row.

`applies(...)` says when it can run (CPU, fp32 K/V, one query row, an accumulator it can write
in place, a C compiler); callers also check the call is plain softmax attention over an unmasked
row (`methods.scoring.plain_decode_row`), else they take their eager path. Built on first use by
methods/kernels/cpu_build.py; `build_error()` says why not.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from methods.kernels import cpu_build
from methods.kernels.cpu_build import kernel_rows

_SOURCE = Path(__file__).with_name("colsum_attention_cpu.c")


def _declare(lib: ctypes.CDLL) -> None:
    long_, ptr = ctypes.c_long, ctypes.c_void_p
    fn = lib.colsum_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = ([ptr, long_, long_] * 3 + [ptr, ptr, long_] + [ptr, long_, long_, long_, ptr]
                   + [long_] * 4 + [ctypes.c_float, ctypes.c_int])


_KERNEL = cpu_build.CKernel(_SOURCE, _declare)
library = _KERNEL.library  # the loaded library, built once per process (None: cannot be built)
build_error = _KERNEL.build_error  # why library() is None
kernel_name = _KERNEL.name  # "c" when this kernel serves decode steps on a device, else "torch"


def applies(query, keys, values, acc: torch.Tensor) -> bool:
    """Whether `decode_attention` can serve these tensors (the caller checks that the call is a
    plain decode row: `methods.scoring.plain_decode_row`)."""
    return (query.shape[2] == 1 and keys.device.type == "cpu"
            and keys.dtype == values.dtype == acc.dtype == torch.float32
            and acc.stride(-1) == 1 and acc.stride(0) == acc.shape[1] * acc.stride(1)
            and library() is not None)


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     scaling: float, acc: torch.Tensor, evict: tuple | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`query (B, H_q, 1, D)` over `keys, values (B, H_kv, T, D)` fp32 -> `(B, 1, H_q, D)` (the
    model's attention layout); adds the group-mean probabilities into `acc (B, H_kv, T)` in place.

    `evict = (positions (B, H_kv, T) int64, lo, hi)`: also returns the slot to evict per head
    `(B, H_kv)`, the lowest updated `acc` among tokens with lo <= position < hi (first on ties;
    slot 0 when none is eligible: torch's argmin over the template's guarded scores); else None."""
    b, hq, _, d = query.shape
    h, t = keys.shape[1], keys.shape[2]
    g = hq // h
    q = kernel_rows(query.reshape(b, h, g, d).float())  # (B, H_kv, g, D)
    k, v = kernel_rows(keys), kernel_rows(values)
    out = torch.empty(b, h, g, d)  # = (B, 1, H_q, D) for one query row
    pos, lo, hi, slots = None, 0, 0, None
    if evict is not None:
        pos, lo, hi = evict
        pos, slots = kernel_rows(pos.long()), torch.empty(b, h, dtype=torch.int64)
    status = library().colsum_decode_attention(
        q.data_ptr(), q.stride(1), q.stride(2), k.data_ptr(), k.stride(1), k.stride(2),
        v.data_ptr(), v.stride(1), v.stride(2), out.data_ptr(), acc.data_ptr(), acc.stride(1),
        None if pos is None else pos.data_ptr(), 0 if pos is None else pos.stride(1), lo, hi,
        None if slots is None else slots.data_ptr(),
        b * h, g, d, t, float(scaling), torch.get_num_threads())
    cpu_build.check_status(status, "colsum_decode_attention")
    return out.view(b, 1, hq, d).to(query.dtype), slots
