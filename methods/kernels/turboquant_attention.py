"""TurboQuant decode attention straight from the codes: no dequantized copy of the cache.

One layer's cache as attention sees it (`TQCache`, built by methods/turboquant.py; one sequence):
  * tokens [0, T_q): quantized in blocks of `block_tokens` tokens. Per tensor (keys, values) and
    head: every token's MSE codes as one bit stream (`codes (H, T_q, code_bytes)`: the outlier
    part's coordinates first, then the regular part's, each at its part's width), for QJL keys
    the sign bits (`signs (H, T_q, ceil(D / 8))`), fp16 norms (and residual norms) per part
    `(H, T_q, parts)`, and per block the outlier-channel bit mask `(H, NB, ceil(D / 8))`.
    A token of block b dequantizes as (methods/_turboquant_quant.py):
        x[perm_b] = concat_i( norm_i Pi_i^T c_i[codes_i] + rnorm_i sqrt(pi/2)/d_i S_i^T s_i )
    perm_b = the block's outlier channels ascending, then the rest ascending.
  * tokens [T_q, T): the not yet quantized tail (< block_tokens tokens, plus this step's),
    exact `(H, T_e, D)`.

Scores without dequantizing: <q, x> = sum_i norm_i <Pi_i q_i, c_i[codes]> + rnorm_i <coef_i S_i
q_i, s_i> with q_i = q[perm_b] restricted to part i: the query is permuted and rotated once per
block (a block-diagonal D x D product), then each token costs D codebook lookups and D sign
reads. Values: p.V accumulates sum_t p_t norm_i c_i[codes] in the rotated coordinates of the
block, rotated back (Pi^T) and scattered to the block's channels once per block.

Three implementations of softmax(q K^T * scaling) V over the whole cache:
  * `decode_attention_torch`: the reference (and the fallback): dequantize, then attend in fp32;
  * `decode_attention_cpu`: the C kernel (methods/kernels/turboquant_cpu.c), the scheme above;
  * `decode_attention_triton`: one program per (head, block) (split-K over blocks, online
    softmax within a block, the splits merged as KIVI's), the tail attended in torch and merged.
`decode_attention` dispatches (Triton on CUDA or under TRITON_INTERPRET=1, else C, else torch).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from methods import _turboquant_quant as tq
from methods.kernels import turboquant_cpu
from methods.kernels.kivi_attention import combine_splits

_INTERPRETED_AT_IMPORT = os.environ.get("TRITON_INTERPRET") == "1"


class TQTensor(NamedTuple):
    """One tensor's quantized blocks (shapes in the module docstring; signs/rnorms None without
    QJL, masks None without an outlier split)."""

    codes: torch.Tensor  # (H, T_q, code_bytes) uint8
    signs: torch.Tensor | None  # (H, T_q, ceil(D / 8)) uint8
    norms: torch.Tensor  # (H, T_q, parts) fp16
    rnorms: torch.Tensor | None  # (H, T_q, parts) fp16
    masks: torch.Tensor | None  # (H, NB, ceil(D / 8)) uint8, bit c = channel c is an outlier


class TQCache(NamedTuple):
    keys: TQTensor | None  # None: nothing quantized yet
    values: TQTensor | None
    exact_k: torch.Tensor | None  # (H, T_e, D) the tail, compute dtype
    exact_v: torch.Tensor | None
    key_quantizer: tq.Quantizer
    value_quantizer: tq.Quantizer

    def quantized_tokens(self) -> int:
        return 0 if self.keys is None else self.keys.codes.shape[1]

    def exact_tokens(self) -> int:
        return 0 if self.exact_k is None else self.exact_k.shape[1]


def unpack_masks(masks: torch.Tensor | None, heads: int, blocks: int, d: int,
                 device: torch.device) -> torch.Tensor:
    """Bit masks `(H, NB, ceil(D/8))` -> bool `(H, NB, D)` (all False without a split)."""
    if masks is None:
        return torch.zeros(heads, blocks, d, dtype=torch.bool, device=device)
    bits = (masks.long()[..., None] >> torch.arange(8, device=masks.device)) & 1
    return bits.flatten(-2)[..., :d].bool()


def pack_masks(mask: torch.Tensor) -> torch.Tensor:
    """bool `(..., D)` -> `(..., ceil(D/8))` uint8 (bit c of byte c // 8)."""
    return tq.pack_stream(mask.long(), torch.ones(mask.shape[-1], dtype=torch.long))


def block_permutations(part: TQTensor, q: tq.Quantizer) -> torch.Tensor:
    """Every block's stream order `(H, NB, D)` int64."""
    h, t = part.codes.shape[:2]
    blocks = -(-t // q.block_tokens)
    return tq.permutation(unpack_masks(part.masks, h, blocks, q.head_dim, part.codes.device))


def dequantize_tensor(part: TQTensor, q: tq.Quantizer) -> torch.Tensor:
    """The quantized tokens `(H, T_q, D)` fp32."""
    t = part.codes.shape[1]
    perm = block_permutations(part, q).repeat_interleave(q.block_tokens, dim=1)[:, :t]
    return tq.dequantize(part.codes, part.signs, part.norms, part.rnorms, perm, q)


def dequantize_cache(cache: TQCache, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole cache `(1, H, T, D)` each (keys: the unbiased QJL estimate), in `dtype`."""
    ks, vs = [], []
    if cache.keys is not None:
        ks.append(dequantize_tensor(cache.keys, cache.key_quantizer).to(dtype))
        vs.append(dequantize_tensor(cache.values, cache.value_quantizer).to(dtype))
    if cache.exact_k is not None:
        ks.append(cache.exact_k.to(dtype))
        vs.append(cache.exact_v.to(dtype))
    return torch.cat(ks, 1)[None], torch.cat(vs, 1)[None]


# --------------------------------------------------------------------------------------------
# torch reference
def decode_attention_torch(query: torch.Tensor, cache: TQCache, scaling: float) -> torch.Tensor:
    """Reference: `query (1, H_q, 1, D)` -> `(1, H_q, 1, D)`: dequantize, then attend in fp32."""
    b, hq, _, d = query.shape
    keys, values = dequantize_cache(cache, torch.float32)  # (1, H, T, D)
    h = keys.shape[1]
    q = query.reshape(b, h, hq // h, d).float()
    probs = torch.softmax((q @ keys.transpose(-1, -2)) * scaling, dim=-1)  # (1, H, g, T)
    return (probs @ values).reshape(b, hq, 1, d).to(query.dtype)


# --------------------------------------------------------------------------------------------
# Triton: one program per (head, quantized block)
@triton.jit
def _stream_codes(ptr, rows, row_ok, offs, widths, dim_ok):
    """Codes `(BLOCK_T, D_P2)` of per-row bit streams (`ptr + rows` = each row's first byte);
    coordinate j starts at bit offs[j] and has widths[j] bits (<= 8: two bytes hold it)."""
    byte = offs // 8
    ok = row_ok[:, None] & dim_ok[None, :]
    lo = tl.load(ptr + rows[:, None] + byte[None, :], mask=ok, other=0).to(tl.int32)
    hi = tl.load(ptr + rows[:, None] + byte[None, :] + 1, mask=ok & ((offs % 8) + widths > 8)[None, :],
                 other=0).to(tl.int32)
    return ((lo | (hi << 8)) >> (offs % 8)[None, :]) & ((1 << widths) - 1)[None, :]


@triton.jit
def _tq_block_kernel(
        q_ptr, kperm_ptr, vperm_ptr, krot_ptr, kproj_ptr, vrot_ptr,
        kc_ptr, ks_ptr, kn_ptr, kr_ptr, vc_ptr, vn_ptr,
        koff_ptr, kwid_ptr, kbase_ptr, kpart_ptr, kcb_ptr,
        voff_ptr, vwid_ptr, vbase_ptr, vpart_ptr, vcb_ptr,
        m_ptr, l_ptr, acc_ptr, T, scaling,
        skc_h, skc_t, sks_h, sks_t, skn_h, skn_t, svc_h, svc_t, svn_h, svn_t, NB,
        G: tl.constexpr, G_P2: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
        BLOCK_T: tl.constexpr, BT_P2: tl.constexpr, QJL: tl.constexpr):
    h = tl.program_id(0)
    blk = tl.program_id(1)
    heads = tl.arange(0, G_P2)
    dims = tl.arange(0, D_P2)
    head_ok = heads < G
    dim_ok = dims < D
    dd = dim_ok[:, None] & dim_ok[None, :]
    # the query in this block's key stream order, rotated (and projected, for QJL) per part
    kperm = tl.load(kperm_ptr + (h * NB + blk) * D + dims, mask=dim_ok, other=0)
    qm = head_ok[:, None] & dim_ok[None, :]
    qp = tl.load(q_ptr + (h * G + heads)[:, None] * D + kperm[None, :], mask=qm, other=0.0)
    rot = tl.load(krot_ptr + dims[:, None] * D + dims[None, :], mask=dd, other=0.0)  # (D, D)
    rq = tl.sum(qp[:, None, :] * rot[None, :, :], axis=2)  # (G, D): rot @ q
    t = blk * BLOCK_T + tl.arange(0, BT_P2)
    live = (tl.arange(0, BT_P2) < BLOCK_T) & (t < T)
    koff = tl.load(koff_ptr + dims, mask=dim_ok, other=0)
    kwid = tl.load(kwid_ptr + dims, mask=dim_ok, other=1)
    kpart = tl.load(kpart_ptr + dims, mask=dim_ok, other=0)
    code = _stream_codes(kc_ptr + h * skc_h, t * skc_t, live, koff, kwid, dim_ok)
    kbase = tl.load(kbase_ptr + dims, mask=dim_ok, other=0)
    tm = live[:, None] & dim_ok[None, :]
    y = tl.load(kcb_ptr + kbase[None, :] + code, mask=tm, other=0.0)
    norm = tl.load(kn_ptr + h * skn_h + t[:, None] * skn_t + kpart[None, :], mask=tm,
                   other=0.0).to(tl.float32)
    s = tl.sum(rq[:, None, :] * (y * norm)[None, :, :], axis=2)  # (G, BT)
    if QJL:
        proj = tl.load(kproj_ptr + dims[:, None] * D + dims[None, :], mask=dd, other=0.0)
        sq = tl.sum(qp[:, None, :] * proj[None, :, :], axis=2)  # (G, D): coef * S @ q
        ones = tl.full([D_P2], 1, tl.int32)
        bit = _stream_codes(ks_ptr + h * sks_h, t * sks_t, live, dims, ones, dim_ok)
        rnorm = tl.load(kr_ptr + h * skn_h + t[:, None] * skn_t + kpart[None, :], mask=tm,
                        other=0.0).to(tl.float32)
        sgn = tl.where(tm, bit.to(tl.float32) * 2.0 - 1.0, 0.0)
        s += tl.sum(sq[:, None, :] * (sgn * rnorm)[None, :, :], axis=2)
    s = tl.where(live[None, :], s * scaling, float("-inf"))
    m = tl.max(s, axis=1)
    p = tl.exp(s - m[:, None])
    l_sum = tl.sum(p, axis=1)
    # values: accumulate in this block's rotated value coordinates, then rotate back
    voff = tl.load(voff_ptr + dims, mask=dim_ok, other=0)
    vwid = tl.load(vwid_ptr + dims, mask=dim_ok, other=1)
    vpart = tl.load(vpart_ptr + dims, mask=dim_ok, other=0)
    vbase = tl.load(vbase_ptr + dims, mask=dim_ok, other=0)
    vcode = _stream_codes(vc_ptr + h * svc_h, t * svc_t, live, voff, vwid, dim_ok)
    vy = tl.load(vcb_ptr + vbase[None, :] + vcode, mask=tm, other=0.0)
    vnorm = tl.load(vn_ptr + h * svn_h + t[:, None] * svn_t + vpart[None, :], mask=tm,
                    other=0.0).to(tl.float32)
    acc_rot = tl.sum(p[:, :, None] * (vy * vnorm)[None, :, :], axis=1)  # (G, D)
    vrot = tl.load(vrot_ptr + dims[:, None] * D + dims[None, :], mask=dd, other=0.0)
    acc = tl.sum(acc_rot[:, :, None] * vrot[None, :, :], axis=1)  # (G, D): acc_rot @ rot
    vperm = tl.load(vperm_ptr + (h * NB + blk) * D + dims, mask=dim_ok, other=0)
    part = h * NB + blk
    tl.store(m_ptr + part * G_P2 + heads, m)
    tl.store(l_ptr + part * G_P2 + heads, l_sum)
    tl.store(acc_ptr + (part * G_P2 + heads)[:, None] * D_P2 + vperm[None, :], acc, mask=qm)


def _on(device: torch.device, q: tq.Quantizer) -> dict[str, torch.Tensor]:
    return {name: x.to(device) for name, x in q.kernel_constants.items()}


def decode_attention_triton(query: torch.Tensor, cache: TQCache, scaling: float) -> torch.Tensor:
    """`query (1, H_q, 1, D)` -> `(1, H_q, 1, D)`: the blocks in Triton, the tail in torch."""
    b, hq, _, d = query.shape
    dev = query.device
    kq, vq = cache.key_quantizer, cache.value_quantizer
    k, v = cache.keys, cache.values
    h, t = k.codes.shape[:2]
    g, nb = hq // h, -(-t // kq.block_tokens)
    q = query.reshape(hq, d).float().contiguous()
    kperm = block_permutations(k, kq).to(torch.int32).contiguous()
    vperm = block_permutations(v, vq).to(torch.int32).contiguous()
    g_p2, d_p2 = triton.next_power_of_2(g), triton.next_power_of_2(d)
    m = torch.empty(h, nb, g_p2, dtype=torch.float32, device=dev)
    l_sum = torch.empty_like(m)
    acc = torch.zeros(h, nb, g_p2, d_p2, dtype=torch.float32, device=dev)
    kc, vc = _on(dev, kq), _on(dev, vq)
    signs = k.signs if k.signs is not None else k.codes
    rnorms = k.rnorms if k.rnorms is not None else k.norms
    _tq_block_kernel[(h, nb)](
        q, kperm, vperm, kc["rotation"], kc["projection"], vc["rotation"],
        k.codes, signs, k.norms, rnorms, v.codes, v.norms,
        *kc["layout"], kc["codebooks"], *vc["layout"], vc["codebooks"],
        m, l_sum, acc, t, float(scaling),
        k.codes.stride(0), k.codes.stride(1), signs.stride(0), signs.stride(1),
        k.norms.stride(0), k.norms.stride(1), v.codes.stride(0), v.codes.stride(1),
        v.norms.stride(0), v.norms.stride(1), nb,
        G=g, G_P2=g_p2, D=d, D_P2=d_p2, BLOCK_T=kq.block_tokens,
        BT_P2=triton.next_power_of_2(kq.block_tokens), QJL=kq.qjl)
    if cache.exact_k is not None:  # the tail: one more split, in torch
        qe = q.reshape(h, g, d)
        s = (qe @ cache.exact_k.float().transpose(-1, -2)) * scaling  # (H, g, T_e)
        me = s.amax(-1)
        pe = torch.exp(s - me[..., None])
        ae = torch.zeros(h, 1, g_p2, d_p2, device=dev)
        ae[:, 0, :g, :d] = pe @ cache.exact_v.float()
        full = lambda x, fill: torch.nn.functional.pad(x, (0, g_p2 - g), value=fill)[:, None]
        m = torch.cat([m, full(me, float("-inf"))], 1)
        l_sum = torch.cat([l_sum, full(pe.sum(-1), 0.0)], 1)
        acc = torch.cat([acc, ae], 1)
    out = combine_splits(m, l_sum, acc)[:, :g, :d]  # (H, g, D)
    return out.reshape(b, hq, 1, d).to(query.dtype)


# --------------------------------------------------------------------------------------------
def _triton_on(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    return _INTERPRETED_AT_IMPORT and os.environ.get("TRITON_INTERPRET") == "1"


def decode_kernel(device: torch.device) -> str:
    """Which implementation `decode_attention` runs on `device`: "triton", "c" or "torch"."""
    if _triton_on(device):
        return "triton"
    return turboquant_cpu.kernel_name(device)


def decode_attention(query: torch.Tensor, cache: TQCache, scaling: float) -> torch.Tensor:
    """Decode attention over a TurboQuant cache (`decode_kernel` says which implementation)."""
    kernel = decode_kernel(query.device)
    if kernel == "triton":
        return decode_attention_triton(query, cache, scaling)
    if kernel == "c":
        return turboquant_cpu.decode_attention(query, cache, scaling)
    return decode_attention_torch(query, cache, scaling)
