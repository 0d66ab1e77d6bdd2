"""Decode-time attention over selected token indices, gathering K/V rows inside the kernel.

Selection methods (InfiniGen, oracle top-k) attend, at a decode step, to N chosen rows of each KV
head's cache out of T. The torch ways to do that either build a keep-mask over all T keys (work
and memory in T, not N) or gather the rows into a new (B, H_kv, N, D) tensor first (an extra
write and read of every selected row). The kernel here reads each selected row once, straight
from the full cache, and never materialises the gathered K/V.

Shapes:
    query  (B, H_q, D)       one query per head (the decode token)
    keys   (B, H_kv, T, D)   the full cache; any strides (a token-strided view is fine)
    values (B, H_kv, T, D)   same shape as keys, its own strides
    index  (B, H_kv, N)      int32/int64 cache slots to attend, per KV head, each in [0, T)
    out    (B, H_q, D)       in query's dtype
GQA: query head h reads KV head h // (H_q // H_kv). The caller includes the new token's slot in
`index` (it is simply one more position of the cache).

    rows = index[b, h_kv]  (N slots)
    out[b, h] = softmax(scaling * K[b, h_kv, rows] @ q[b, h]) @ V[b, h_kv, rows]

computed in fp32. Duplicate indices are NOT merged: a slot listed twice is two softmax entries
(twice the weight), exactly as the gather reference; a keep-mask would count it once. Callers
that want set semantics pass unique indices (InfiniGen's top-k slots plus the new slot are).
Out-of-range indices are not checked on the kernel path (that would cost a device sync per call);
the torch reference raises on them.

Like kivi_quant: `_sparse_decode_attention_kernel` (Triton), `sparse_decode_attention()` (launcher)
and `sparse_decode_attention_ref()` (torch). The launcher uses Triton on CUDA tensors, or on CPU
when TRITON_INTERPRET=1 was set before this module was imported (the interpreter, for tests),
else the reference.

No speculation-score kernel: InfiniGen's partial-key scoring is a small dense matmul
(k = 0.2 * D columns) that torch already does in one call; a kernel would only save the
expand_kv copy, which a grouped view avoids just as well, so it was left out.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton decides at decoration time whether kernels are interpreted: remember what it saw, so a
# CPU tensor never reaches a compiled kernel (which would fail with "0 active drivers").
_INTERPRETED_AT_IMPORT = os.environ.get("TRITON_INTERPRET") == "1"
_LOG2E = 1.4426950408889634


def use_triton(x: torch.Tensor) -> bool:
    """Triton on CUDA, or in the CPU interpreter when it is on (read per call: tests flip it)."""
    if x.is_cuda:
        return True
    return _INTERPRETED_AT_IMPORT and os.environ.get("TRITON_INTERPRET") == "1"


def _check(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           index: torch.Tensor) -> None:
    if query.dim() != 3 or keys.dim() != 4 or index.dim() != 3:
        raise ValueError(f"expected query (B, H_q, D), keys/values (B, H_kv, T, D), index "
                         f"(B, H_kv, N); got {tuple(query.shape)}, {tuple(keys.shape)}, "
                         f"{tuple(index.shape)}")
    b, h_q, d = query.shape
    if values.shape != keys.shape:
        raise ValueError(f"values {tuple(values.shape)} differ from keys {tuple(keys.shape)}")
    if keys.shape[0] != b or keys.shape[3] != d:
        raise ValueError(f"keys {tuple(keys.shape)} do not match query {tuple(query.shape)}")
    h_kv = keys.shape[1]
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(f"H_q={h_q} is not a multiple of H_kv={h_kv}")
    if index.shape[:2] != (b, h_kv):
        raise ValueError(f"index {tuple(index.shape)} is not (B={b}, H_kv={h_kv}, N)")
    if index.shape[2] == 0:  # a softmax over nothing has no meaning; the caller has a bug
        raise ValueError("index selects no tokens (N = 0)")
    if index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"index dtype {index.dtype}; expected int32 or int64")
    devices = {x.device for x in (query, keys, values, index)}
    if len(devices) > 1:  # the kernel would read a host pointer as a device one
        raise ValueError(f"query, keys, values and index are on different devices: "
                         f"{', '.join(str(x.device) for x in (query, keys, values, index))}")


def _block_n(n: int, block_d: int) -> int:
    # ~8K fp32 elements per K (and V) tile: a 64 x 128 tile at D=128 stays in registers with 4
    # warps on GPU, and the interpreter (which pays per block operation) gets few loop trips.
    # At least 16 lanes: the smallest tile Triton lays out well; short N is handled by masking.
    return max(16, min(triton.next_power_of_2(n), 8192 // block_d, 128))


# ------------------------------------------------------------------------------------------------
@triton.jit
def _sparse_decode_attention_kernel(
        q_ptr, k_ptr, v_ptr, idx_ptr, out_ptr, scale_log2, n_sel, head_dim,
        sq_b, sq_h, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
        si_b, si_h, si_n, so_b, so_h, so_d,
        GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per (query head, batch row): it streams its KV head's selected rows in blocks of
    # BLOCK_N with an online softmax, so nothing of size N is kept and nothing is written but out.
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)  # int64 offsets: B * H * T * D can pass 2^31 elements
    h_kv = (h // GROUPS).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + b * sq_b + h.to(tl.int64) * sq_h + d * sq_d, mask=d_ok, other=0.0)
    # Fold scaling and log2(e) into q once, then use exp2: one multiply per D instead of per N.
    q = q.to(tl.float32) * scale_log2
    k_base = k_ptr + b * sk_b + h_kv * sk_h
    v_base = v_ptr + b * sv_b + h_kv * sv_h
    i_base = idx_ptr + b * si_b + h_kv * si_h
    m_i = float("-inf")  # running max of the (log2-scaled) scores
    l_i = 0.0  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)  # running sum of exp2(score - m_i) * v
    for start in range(0, n_sel, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < n_sel
        tok = tl.load(i_base + n * si_n, mask=n_ok, other=0).to(tl.int64)
        tile_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + tok[:, None] * sk_t + d[None, :] * sk_d, mask=tile_ok, other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
        s = tl.where(n_ok, s, float("-inf"))  # masked lanes get zero weight
        # Every block has >= 1 valid lane (start < n_sel), so m_new is finite and the first
        # block's correction exp2(-inf - m_new) is 0, not NaN.
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        correction = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        v = tl.load(v_base + tok[:, None] * sv_t + d[None, :] * sv_d, mask=tile_ok, other=0.0)
        acc = acc * correction + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        l_i = l_i * correction + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + b * so_b + h.to(tl.int64) * so_h + d * so_d,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)


def sparse_decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            index: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention of `query (B, H_q, D)` over the rows `index (B, H_kv, N)` of `keys`/`values`
    `(B, H_kv, T, D)`; returns `(B, H_q, D)` in query's dtype (see the module docstring)."""
    _check(query, keys, values, index)
    if not use_triton(query):
        return sparse_decode_attention_ref(query, keys, values, index, scaling)
    b, h_q, d = query.shape
    h_kv, n_sel = keys.shape[1], index.shape[2]
    out = torch.empty(b, h_q, d, dtype=query.dtype, device=query.device)
    if b == 0 or h_q == 0:
        return out
    block_d = triton.next_power_of_2(d)
    _sparse_decode_attention_kernel[(h_q, b)](
        query, keys, values, index, out, float(scaling) * _LOG2E, n_sel, d,
        *query.stride(), *keys.stride(), *values.stride(), *index.stride(), *out.stride(),
        GROUPS=h_q // h_kv, BLOCK_N=_block_n(n_sel, block_d), BLOCK_D=block_d)
    return out


def sparse_decode_attention_ref(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                index: torch.Tensor, scaling: float) -> torch.Tensor:
    """Torch reference: gather the N rows `(B, H_kv, N, D)`, softmax in fp32, weighted sum.

    Query heads are viewed as `(B, H_kv, g, D)` so the gathered rows are shared by the group
    (no repeat of K/V per query head).
    """
    _check(query, keys, values, index)
    b, h_q, d = query.shape
    h_kv = keys.shape[1]
    rows = index.long()[..., None].expand(*index.shape, d)
    k = keys.gather(2, rows).float()  # (B, H_kv, N, D)
    v = values.gather(2, rows).float()
    q = query.float().reshape(b, h_kv, h_q // h_kv, d)  # (B, H_kv, g, D)
    probs = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * scaling, dim=-1)  # (B, H_kv, g, N)
    return torch.matmul(probs, v).reshape(b, h_q, d).to(query.dtype)

