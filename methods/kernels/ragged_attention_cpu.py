"""Decode attention over per-head rows read in place, on CPU (ragged_attention_cpu.c).

The CPU counterpart of the Triton kernel in methods/kernels/ragged_attention.py: one call per
layer and step reads the stored K/V where they are (`kvcore.storage.HeadBlocks`: a contiguous
buffer as one block per head, or the paged pool's blocks through per-head block tables), each
(batch row, KV head) over its own length, the g query heads of a KV head together (each key row
read once per group). No gather, no mask: ragged heads cost what their own tokens cost.

Token spans are cut by token index, never by block, so a paged layer gives the same bits as a
contiguous one, whatever its block size, and the thread count does not change them either.
Built on first use by methods/kernels/cpu_build.py; without a C compiler `library()` is None
(`build_error()` says why) and callers take their torch path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvcore.storage import HeadBlocks
from methods.kernels import cpu_build
from methods.kernels.cpu_build import kernel_rows

_SOURCE = Path(__file__).with_name("ragged_attention_cpu.c")


def _declare(lib: ctypes.CDLL) -> None:
    long_, ptr = ctypes.c_long, ctypes.c_void_p
    fn = lib.ragged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = ([ptr, long_, long_] * 3 + [ptr, long_] * 2 + [long_, ptr, long_, ptr]
                   + [long_] * 3 + [ctypes.c_float, ctypes.c_int])


_KERNEL = cpu_build.CKernel(_SOURCE, _declare)
library = _KERNEL.library  # the loaded library, built once per process (None: cannot be built)
build_error = _KERNEL.build_error  # why library() is None
kernel_name = _KERNEL.name  # "c" when this kernel serves decode steps on a device, else "torch"


def applies(query: torch.Tensor, keys: HeadBlocks, values: HeadBlocks) -> bool:
    """Whether `decode_attention` can serve these (CPU, fp32, one query row, rows of one
    trailing axis with a unit stride, a C compiler)."""
    k, v = keys.data, values.data
    return (query.shape[2] == 1 and query.device.type == "cpu" and k.device.type == "cpu"
            and k.dtype == v.dtype == torch.float32 and k.dim() == v.dim() == 3
            and k.stride(-1) == v.stride(-1) == 1 and library() is not None)


def decode_attention(query: torch.Tensor, keys: HeadBlocks, values: HeadBlocks,
                     scaling: float) -> torch.Tensor:
    """`query (B, H_q, 1, D)` over the rows `keys`/`values` (one layer's K and V: the same
    lengths and block size, tables of their own) -> `(B, 1, H_q, D)` in query's dtype (the
    model's attention layout); a head with no token gives zeros."""
    b, hq, _, d = query.shape
    h = keys.heads[1]
    g = hq // h
    q = kernel_rows(query.reshape(b, h, g, d).float()).view(b * h, g, d)  # (B*H_kv, g, D)
    k_table, v_table = keys.table.contiguous(), values.table.contiguous()  # (B*H_kv, blocks)
    # (B*H_kv,) per head, or none: every head holds keys.length (rectangular rows)
    lengths = None if keys.per_head is None else keys.per_head.reshape(-1).contiguous()
    out = torch.empty(b * h, g, d)  # = (B, 1, H_q, D) for one query row
    kd, vd = keys.data, values.data
    status = library().ragged_decode_attention(
        q.data_ptr(), q.stride(0), q.stride(1), kd.data_ptr(), kd.stride(0), kd.stride(1),
        vd.data_ptr(), vd.stride(0), vd.stride(1), k_table.data_ptr(), k_table.stride(0),
        v_table.data_ptr(), v_table.stride(0), keys.block_tokens,
        None if lengths is None else lengths.data_ptr(), keys.length, out.data_ptr(),
        b * h, g, d, float(scaling), torch.get_num_threads())
    cpu_build.check_status(status, "ragged_decode_attention")
    return out.view(b, 1, hq, d).to(query.dtype)
