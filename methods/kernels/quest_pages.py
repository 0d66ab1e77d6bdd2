"""Quest page scoring: per page, an upper bound of q.k over the page's keys, reduced over a GQA group.

Quest (Tang et al., ICML 2024) keeps, per page of the cache and per channel, the elementwise min
m and max M of the page's keys. For a query q the page's criticality is

    U(page) = sum_d max(q_d * M_d, q_d * m_d)

which bounds q.k from above for every key k of the page (per channel, q_d * k_d lies between
q_d * m_d and q_d * M_d). With GQA a KV head serves g query heads; the g bounds are reduced to
one score per KV head (`reduce`: "max" = the best bound of any query head of the group, "sum" =
a bound on the group's summed logit), so a single page set per KV head serves the group.

Shapes:
    query     (B, H_q, D)        one decode query per head
    page_min  (B, H_kv, P, D)    per-page channel minimum of the (post-RoPE) keys
    page_max  (B, H_kv, P, D)    per-page channel maximum
    out       (B, H_kv, P)       fp32 scores
Query head h belongs to KV head h // g. Computed in fp32.

Like methods/kernels/sparse_attention.py: `_page_scores_kernel` (Triton), `page_scores()`
(launcher: Triton on CUDA tensors, or in the CPU interpreter when TRITON_INTERPRET=1 was set
before import — tests), `page_scores_ref()` (torch).
"""

from __future__ import annotations

import os
from typing import Literal, get_args

import torch
import triton
import triton.language as tl

_INTERPRETED_AT_IMPORT = os.environ.get("TRITON_INTERPRET") == "1"
Reduction = Literal["max", "sum"]  # how a KV head reduces its group's page bounds
REDUCTIONS = get_args(Reduction)


def use_triton(x: torch.Tensor) -> bool:
    """Triton on CUDA, or in the CPU interpreter when it is on (read per call: tests flip it)."""
    if x.is_cuda:
        return True
    return _INTERPRETED_AT_IMPORT and os.environ.get("TRITON_INTERPRET") == "1"


def _check(query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, reduce: str) -> None:
    if query.dim() != 3 or page_min.dim() != 4:
        raise ValueError(f"expected query (B, H_q, D), page_min/page_max (B, H_kv, P, D); got "
                         f"{tuple(query.shape)}, {tuple(page_min.shape)}")
    if page_max.shape != page_min.shape:
        raise ValueError(f"page_max {tuple(page_max.shape)} differs from page_min "
                         f"{tuple(page_min.shape)}")
    b, h_q, d = query.shape
    if page_min.shape[0] != b or page_min.shape[3] != d:
        raise ValueError(f"pages {tuple(page_min.shape)} do not match query {tuple(query.shape)}")
    h_kv = page_min.shape[1]
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(f"H_q={h_q} is not a multiple of H_kv={h_kv}")
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce={reduce!r}; allowed: {', '.join(REDUCTIONS)}")


@triton.jit
def _page_scores_kernel(q_ptr, mn_ptr, mx_ptr, out_ptr, n_pages, head_dim,
                        sq_b, sq_h, sq_d, sn_b, sn_h, sn_p, sn_d, sx_b, sx_h, sx_p, sx_d,
                        so_b, so_h, so_p,
                        GROUPS: tl.constexpr, REDUCE_MAX: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program per (KV head, batch row, block of pages): the page bounds are read once and
    # scored against each of the group's g queries, reduced in registers.
    h_kv = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    p_ok = p < n_pages
    d_ok = d < head_dim
    tile_ok = p_ok[:, None] & d_ok[None, :]
    mn = tl.load(mn_ptr + b * sn_b + h_kv * sn_h + p[:, None] * sn_p + d[None, :] * sn_d,
                 mask=tile_ok, other=0.0).to(tl.float32)
    mx = tl.load(mx_ptr + b * sx_b + h_kv * sx_h + p[:, None] * sx_p + d[None, :] * sx_d,
                 mask=tile_ok, other=0.0).to(tl.float32)
    if REDUCE_MAX:
        acc = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_P], dtype=tl.float32)
    for g in range(GROUPS):
        h = h_kv * GROUPS + g
        q = tl.load(q_ptr + b * sq_b + h * sq_h + d * sq_d, mask=d_ok, other=0.0).to(tl.float32)
        bound = tl.sum(tl.maximum(q[None, :] * mn, q[None, :] * mx), axis=1)  # (BLOCK_P,)
        if REDUCE_MAX:
            acc = tl.maximum(acc, bound)
        else:
            acc = acc + bound
    tl.store(out_ptr + b * so_b + h_kv * so_h + p * so_p, acc, mask=p_ok)


def page_scores(query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor,
                reduce: str = "max") -> torch.Tensor:
    """Upper-bound scores `(B, H_kv, P)` fp32 of `query (B, H_q, D)` against the page bounds."""
    _check(query, page_min, page_max, reduce)
    if not use_triton(query):
        return page_scores_ref(query, page_min, page_max, reduce)
    b, h_q, d = query.shape
    h_kv, n_pages = page_min.shape[1], page_min.shape[2]
    out = torch.empty(b, h_kv, n_pages, dtype=torch.float32, device=query.device)
    if b == 0 or n_pages == 0:
        return out
    block_d = triton.next_power_of_2(d)
    # ~8K fp32 elements per bound tile (two tiles live at once), at least 16 pages per program.
    block_p = max(16, min(triton.next_power_of_2(n_pages), 8192 // block_d, 128))
    grid = (h_kv, b, triton.cdiv(n_pages, block_p))
    _page_scores_kernel[grid](
        query, page_min, page_max, out, n_pages, d,
        *query.stride(), *page_min.stride(), *page_max.stride(), *out.stride(),
        GROUPS=h_q // h_kv, REDUCE_MAX=reduce == "max", BLOCK_P=block_p, BLOCK_D=block_d)
    return out


def page_scores_ref(query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor,
                    reduce: str = "max") -> torch.Tensor:
    """Torch reference: the bound per query head `(B, H_kv, g, P)`, then reduced over g."""
    _check(query, page_min, page_max, reduce)
    b, h_q, d = query.shape
    h_kv = page_min.shape[1]
    q = query.float().reshape(b, h_kv, h_q // h_kv, 1, d)  # (B, H_kv, g, 1, D)
    mn, mx = page_min.float()[:, :, None], page_max.float()[:, :, None]  # (B, H_kv, 1, P, D)
    bound = torch.maximum(q * mn, q * mx).sum(-1)  # (B, H_kv, g, P)
    return bound.amax(2) if reduce == "max" else bound.sum(2)
