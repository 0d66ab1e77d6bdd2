"""InfiniGen's speculation on CPU in one call (speculation_cpu.c): partial scores, the group's
max logit, the count above max - alpha and the slots of that many best-scored tokens.

In torch this is a batched matmul, a max over the group, a max over tokens, a comparison, a sum
and a top-k: six kernels per layer and step, of which the batched matmul, the group max and the
top-k run as parallel kernels whose launch, for a few thousand tokens, costs more than their
arithmetic. The C call does the same arithmetic in one parallel region over heads.

`applies(...)` says when it serves a step (CPU tensors, fp32, one row of the partial query per
selecting head — one skewing matrix per KV head selecting per KV head, or per query head
selecting per query head (g = 1 rows) —, `group_reduce=max`, no head-0 threshold; a C compiler); `kernel_name(device)` names what a run
uses. Built on first use by methods/kernels/cpu_build.py; `build_error()` says why not.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from methods.kernels import cpu_build
from methods.kernels.cpu_build import kernel_rows

_SOURCE = Path(__file__).with_name("speculation_cpu.c")


def _declare(lib: ctypes.CDLL) -> None:
    long_, ptr = ctypes.c_long, ctypes.c_void_p
    fn = lib.speculate
    fn.restype = ctypes.c_int
    fn.argtypes = ([ptr, long_, long_] * 2 + [long_] * 5
                   + [ctypes.c_float, ctypes.c_int, ptr, ptr, ctypes.c_int])


_KERNEL = cpu_build.CKernel(_SOURCE, _declare)
library = _KERNEL.library  # the loaded library, built once per process (None: cannot be built)
build_error = _KERNEL.build_error  # why library() is None
kernel_name = _KERNEL.name  # "c" when this kernel serves speculation on a device, else "torch"


def applies(q_partial: torch.Tensor, partial_keys: torch.Tensor, selecting_heads: int,
            group_reduce: str, head0_threshold: bool) -> bool:
    """Whether `select` computes what the torch path would for this layer's configuration."""
    return (q_partial.device.type == "cpu" and group_reduce == "max" and not head0_threshold
            and q_partial.shape[1] == selecting_heads  # its skewing heads are the selecting ones
            and q_partial.dtype == partial_keys.dtype == torch.float32
            and library() is not None)


def select(q_partial: torch.Tensor, partial_keys: torch.Tensor, cap: int, alpha: float,
           shared_count: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`q_partial (B, H, g, k)`, `partial_keys (B, H, k, T)` fp32 (H selecting heads; g = 1 per
    query head) -> `(slots (B, H, cap), counts (B, H))` int64: each head uses its first `counts` slots, the best-scored tokens in
    slot order (the rest are other distinct slots); counts = the tokens scoring above the head's
    max logit - alpha (shared: the floor of their mean over heads), clamped to [1, cap]."""
    b, h, g, k = q_partial.shape
    t = partial_keys.shape[3]
    q, pk = kernel_rows(q_partial), kernel_rows(partial_keys)
    top = torch.empty(b, h, cap, dtype=torch.int64)
    count = torch.empty(b, h, dtype=torch.int64)
    status = library().speculate(q.data_ptr(), q.stride(1), q.stride(2), pk.data_ptr(),
                                 pk.stride(1), pk.stride(2), b * h, g, k, t, cap, float(alpha),
                                 int(shared_count), top.data_ptr(), count.data_ptr(),
                                 torch.get_num_threads())
    cpu_build.check_status(status, "speculate")
    return top, count
