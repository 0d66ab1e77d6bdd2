"""Attention over ragged heads: each (batch row, KV head) over its own tokens, read in place.

Head-wise budgets (Ada-KV, HeadKV, DuoAttention) give every KV head its own number of tokens;
paged storage scatters a head's tokens over blocks. Both are `kvcore.storage.HeadBlocks`: per-head
block tables over the storage itself and per-head lengths. The kernels here read them where they
are: no gather into a contiguous tensor, no padding to the longest head, no dense mask.

Shapes:
    query   (B, H_q, q, D)           the chunk's queries (q = 1: a decode step)
    keys    HeadBlocks               `lengths (B, H_kv)`, tables `(B * H_kv, blocks)`, data
    values  HeadBlocks               `(N, block_tokens, D)`; the same lengths as keys
    out     (B, q, H_q, D)           in query's dtype (the layout transformers' attention
                                     functions return)
GQA: query head j reads KV head j // (H_q / H_kv). Head (b, h) holds `n = lengths[b, h]` tokens,
the chunk's q new ones last (they were appended before attention): query row i attends the head's
first n - q + 1 + i tokens (causal). Computed in fp32:

    out[b, i, j] = softmax(scaling * K[b, h, :n - q + 1 + i] @ q[b, j, i]) @ V[b, h, :n - q + 1 + i]

**Zero-length heads**: a head holding no token (a budget of 0) attends to nothing and outputs
zeros — the convention of vLLM's and flash-attention's variable-length kernels for an empty key
set; the masked softmax of the reference would give NaN (0/0), which it maps to 0 the same way.
With q > 1, query rows with nothing visible (n < q) are zeros likewise.

Implementations (`ragged_attention` dispatches):
  * `ragged_attention_ref(query, keys, values, lengths, scaling)`: the torch reference over padded
    `(B, H_kv, T, D)` tensors with a dense `(B, H_q, q, T)` mask (tests only);
  * `_ragged_decode_kernel` + `_merge_spans_kernel` (Triton; q = 1): one program per (query head,
    span of tokens) with an online softmax over the span, then one per query head merging the
    spans (split-K / flash-decoding, so a long head still fills the device);
    `ragged_decode_attention_triton()` launches them (CUDA, or the CPU interpreter in tests);
  * methods.kernels.ragged_attention_cpu (C; q = 1, CPU): the same per-span split, cut by token
    index, never by block, so paged and contiguous rows give the same bits;
  * `packed_attention()` (torch; any q): heads of equal length packed together, one SDPA call per
    distinct length with the chunk's `(q, n)` causal mask (a CPU path without a C compiler, and
    prefill chunks: they may copy the heads they pack, never build a `(B, H, q, T)` mask).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvcore.storage import HeadBlocks
from methods.kernels import ragged_attention_cpu
from methods.scoring import causal_allowed

_INTERPRETED_AT_IMPORT = os.environ.get("TRITON_INTERPRET") == "1"
_LOG2E = 1.4426950408889634
MAX_SPANS = 64  # spans per head on the Triton path: the merge loads them as one tile


def use_triton(x: torch.Tensor) -> bool:
    """Triton on CUDA, or in the CPU interpreter when it is on (read per call: tests flip it)."""
    if x.is_cuda:
        return True
    return _INTERPRETED_AT_IMPORT and os.environ.get("TRITON_INTERPRET") == "1"


def _check(query: torch.Tensor, keys: HeadBlocks, values: HeadBlocks) -> None:
    # a few attribute reads: this runs once per layer and decode step
    b, h_q, _, d = query.shape
    b_kv, h_kv = keys.heads
    if b_kv != b or h_kv == 0 or h_q % h_kv:
        raise ValueError(f"keys hold {keys.heads} (B, H_kv) heads; query "
                         f"{tuple(query.shape)} needs B={b} and H_q a multiple of H_kv")
    if keys.data.shape[2:] != (d,) or values.data.shape[2:] != (d,):
        raise ValueError(f"K/V rows {tuple(keys.data.shape[2:])}, {tuple(values.data.shape[2:])}"
                         f" do not match the query's D={d}")
    if values.heads != keys.heads or values.block_tokens != keys.block_tokens:
        raise ValueError("keys and values must share heads and block size (one layer's K/V)")


# --- reference ----------------------------------------------------------------------------------
def ragged_attention_ref(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         lengths: torch.Tensor, scaling: float) -> torch.Tensor:
    """Dense masked attention: `keys`/`values` `(B, H_kv, T, D)` padded, head (b, h) valid on its
    first `lengths[b, h]` slots -> `(B, q, H_q, D)` (see the module docstring)."""
    b, h_q, q, d = query.shape
    h_kv, t = keys.shape[1], keys.shape[2]
    g = h_q // h_kv
    n = lengths.to(query.device).view(b, h_kv, 1, 1, 1)
    rows = torch.arange(q, device=query.device).view(1, 1, 1, q, 1)
    slots = torch.arange(t, device=query.device).view(1, 1, 1, 1, t)
    visible = slots < n - q + 1 + rows  # (B, H_kv, 1, q, T)
    held = (slots < n)[:, :, 0, 0, :, None]  # (B, H_kv, T, 1): slots past a head's length are
    keys, values = (torch.where(held, x.float(), 0.0) for x in (keys, values))  # never read
    qs = query.float().view(b, h_kv, g, q, d)
    scores = torch.einsum("bhgqd,bhtd->bhgqt", qs, keys) * scaling
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhgqt,bhtd->bhgqd", probs, values)
    return out.reshape(b, h_q, q, d).transpose(1, 2).to(query.dtype)


# --- torch: heads of equal length packed ------------------------------------------------------
def packed_attention(query: torch.Tensor, keys: HeadBlocks, values: HeadBlocks,
                     scaling: float) -> torch.Tensor:
    """Any q: for each distinct head length n, the heads holding n tokens are gathered
    `(m, n, D)` and attended with one SDPA call (their g query heads as a group, the chunk's
    causal `(q, n)` mask); returns `(B, q, H_q, D)`."""
    b, h_q, q, d = query.shape
    h_kv = keys.heads[1]
    g = h_q // h_kv
    flat = keys.lengths.reshape(-1)
    qs = query.reshape(b * h_kv, g, q, d)
    out = query.new_zeros(b * h_kv, g, q, d)
    for n in torch.unique(flat).tolist():
        if n == 0:
            continue  # zero-length heads: zeros
        heads = (flat == n).nonzero().squeeze(1)
        k, v = (_head_rows(x, heads, n) for x in (keys, values))  # (m, 1, n, D)
        mask = None if q == 1 else causal_allowed(q, n, query.device)  # row i: n - q + 1 + i
        o = F.scaled_dot_product_attention(qs[heads].float(), k.float(), v.float(),
                                           attn_mask=mask, scale=scaling, enable_gqa=True)
        out[heads] = o.nan_to_num(0.0).to(out.dtype)
    return out.view(b, h_q, q, d).transpose(1, 2)


def _head_rows(x: HeadBlocks, heads: torch.Tensor, n: int) -> torch.Tensor:
    """The first n rows of the heads `heads (m,)` as `(m, 1, n, D)` (a gather of their blocks)."""
    nb = -(-n // x.block_tokens)
    ids = x.table[heads, :nb]  # (m, nb)
    if nb == 1:  # a contiguous buffer (or short heads): copy only the n rows
        return x.data[ids[:, 0], :n][:, None]
    blocks = x.data.index_select(0, ids.flatten())  # (m * nb, bt, D)
    return blocks.view(heads.shape[0], 1, nb * x.block_tokens, -1)[:, :, :n]


# --- Triton (decode) ----------------------------------------------------------------------------
@triton.jit
def _ragged_decode_kernel(
        q_ptr, k_ptr, v_ptr, kt_ptr, vt_ptr, len_ptr, m_ptr, l_ptr, acc_ptr,
        scale_log2, head_dim, block_tokens, span_tokens, n_spans,
        sq_bh, sq_d, sk_blk, sk_t, sv_blk, sv_t, skt_bh, svt_bh,
        GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # Program (query head row j = b * H_q + h, span s): tokens [s * span, (s + 1) * span) of its
    # KV head r, read through the per-head block tables, with an online softmax; writes the
    # span's max m, sum l and unnormalised p.V (the merge kernel combines the spans).
    j = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    r = j // GROUPS  # b * H_kv + h // g: query heads of a KV head are consecutive
    n_tokens = tl.load(len_ptr + r)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + j * sq_bh + d * sq_d, mask=d_ok, other=0.0).to(tl.float32) * scale_log2
    t0 = s * span_tokens
    t1 = tl.minimum(t0 + span_tokens, n_tokens)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, span_tokens, BLOCK_N):
        t = t0 + start + tl.arange(0, BLOCK_N)
        t_ok = t < t1
        blk_k = tl.load(kt_ptr + r * skt_bh + t // block_tokens, mask=t_ok, other=0).to(tl.int64)
        blk_v = tl.load(vt_ptr + r * svt_bh + t // block_tokens, mask=t_ok, other=0).to(tl.int64)
        off = (t % block_tokens).to(tl.int64)
        tile_ok = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + blk_k[:, None] * sk_blk + off[:, None] * sk_t + d[None, :],
                    mask=tile_ok, other=0.0)
        x = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
        x = tl.where(t_ok, x, float("-inf"))
        # a tile with no valid lane keeps m at -inf; exp2(-inf - -inf) is NaN, so guard it
        m_new = tl.maximum(m_i, tl.max(x, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        correction = tl.exp2(m_i - m_safe)
        p = tl.exp2(x - m_safe)
        v = tl.load(v_ptr + blk_v[:, None] * sv_blk + off[:, None] * sv_t + d[None, :],
                    mask=tile_ok, other=0.0)
        acc = acc * correction + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        l_i = l_i * correction + tl.sum(p, axis=0)
        m_i = m_new
    tl.store(m_ptr + j * n_spans + s, m_i)
    tl.store(l_ptr + j * n_spans + s, l_i)
    tl.store(acc_ptr + (j * n_spans + s) * head_dim + d, acc, mask=d_ok)


@triton.jit
def _merge_spans_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, head_dim, n_spans, so_bh,
                        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # Program j: the global softmax of query head row j from its spans' (m, l, acc); a row
    # with no token (every span empty: l = 0) gives zeros.
    j = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    sp_ok = sp < n_spans
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    m = tl.load(m_ptr + j * n_spans + sp, mask=sp_ok, other=float("-inf"))
    l = tl.load(l_ptr + j * n_spans + sp, mask=sp_ok, other=0.0)
    top = tl.max(m, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.where(l > 0, tl.exp2(m - top), 0.0)
    acc = tl.load(acc_ptr + (j * n_spans + sp[:, None]) * head_dim + d[None, :],
                  mask=sp_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(l * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + j * so_bh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def _block_n(block_d: int) -> int:
    # ~8K fp32 elements per K (and V) tile, as methods.kernels.sparse_attention
    return max(16, min(8192 // block_d, 128))


def ragged_decode_attention_triton(query: torch.Tensor, keys: HeadBlocks, values: HeadBlocks,
                                   scaling: float) -> torch.Tensor:
    """The Triton path of `ragged_attention` for one query row: `(B, H_q, 1, D)` ->
    `(B, 1, H_q, D)` (CUDA tensors, or CPU ones under TRITON_INTERPRET=1)."""
    _check(query, keys, values)
    b, h_q, _, d = query.shape
    g = h_q // keys.heads[1]
    block_d = triton.next_power_of_2(d)
    block_n = _block_n(block_d)
    longest = max(1, keys.length)
    # spans of a power-of-two multiple of BLOCK_N tokens, at most MAX_SPANS per head
    span = block_n
    while span * MAX_SPANS < longest:
        span *= 2
    n_spans = -(-longest // span)
    q = query.reshape(b * h_q, d)
    dev, f32 = query.device, torch.float32
    m = torch.empty(b * h_q, n_spans, device=dev, dtype=f32)
    l = torch.empty_like(m)
    acc = torch.empty(b * h_q, n_spans, d, device=dev, dtype=f32)
    out = torch.empty(b * h_q, d, device=dev, dtype=query.dtype)
    lengths = keys.lengths.reshape(-1).contiguous()
    k_table, v_table = keys.table.contiguous(), values.table.contiguous()
    kd, vd = keys.data, values.data
    _ragged_decode_kernel[(b * h_q, n_spans)](
        q, kd, vd, k_table, v_table, lengths, m, l, acc, float(scaling) * _LOG2E, d,
        keys.block_tokens, span, n_spans, *q.stride(), kd.stride(0), kd.stride(1),
        vd.stride(0), vd.stride(1), k_table.stride(0), v_table.stride(0),
        GROUPS=g, BLOCK_N=block_n, BLOCK_D=block_d)
    _merge_spans_kernel[(b * h_q,)](m, l, acc, out, d, n_spans, out.stride(0),
                                    BLOCK_S=triton.next_power_of_2(n_spans), BLOCK_D=block_d)
    return out.view(b, 1, h_q, d)


# --- dispatch -----------------------------------------------------------------------------------
def decode_kernel(query: torch.Tensor, keys: HeadBlocks, values: HeadBlocks) -> str:
    """The implementation `ragged_attention` uses for this decode row: "c", "triton" or "torch"."""
    if query.is_cuda:
        return "triton"
    return "c" if ragged_attention_cpu.applies(query, keys, values) else "torch"


def decode_kernel_name(device) -> str:
    """What the full cache's decode steps run on `device` (for metrics.json): "c" on CPU when
    the C kernel builds (else "sdpa": the model's own attention), on CUDA "triton" for paged
    rows and "sdpa" for contiguous ones (methods.layer.FullLayer)."""
    if torch.device(device).type == "cuda":
        return "triton (paged), sdpa (contiguous)"
    return "c" if ragged_attention_cpu.library() is not None else "sdpa"


def ragged_attention(query: torch.Tensor, keys: HeadBlocks, values: HeadBlocks,
                     scaling: float) -> torch.Tensor:
    """Attention of `query (B, H_q, q, D)` over ragged rows read in place -> `(B, q, H_q, D)`
    (module docstring): decode rows through the C kernel (CPU) or Triton (CUDA), prefill chunks
    and CPUs without a compiler through `packed_attention`."""
    _check(query, keys, values)
    if query.shape[2] == 1:
        kind = decode_kernel(query, keys, values)
        if kind == "c":
            return ragged_attention_cpu.decode_attention(query, keys, values, scaling)
        if kind == "triton":
            return ragged_decode_attention_triton(query, keys, values, scaling)
    return packed_attention(query, keys, values, scaling)
