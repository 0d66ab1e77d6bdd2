"""KIVI decode attention straight from the packed cache: no dequantized copy of the whole cache.

One decode query row per head attends over T tokens whose keys and values each come in two
segments (KIVI's layout, methods/kivi.py):
  * keys:   tokens [0, T_qk) as packed codes per channel, `codes (B, H_kv, D, T_qk * k_bits / 8)`
            with scale/zero `(B, H_kv, D, T_qk / G_k)`; tokens [T_qk, T) full precision
            `k_res (B, H_kv, T - T_qk, D)`;
  * values: tokens [0, T_qv) as packed codes per token, `codes (B, H_kv, T_qv, D * v_bits / 8)`
            with scale/zero `(B, H_kv, T_qv, D / G_v)`; tokens [T_qv, T) full precision
            `v_res (B, H_kv, T - T_qv, D)`.
Query `(B, H_q, 1, D)`, H_q = g * H_kv (grouped-query heads share their KV head's codes).

Three implementations of the same attention (softmax(q K^T * scaling) V, no mask):
  * `decode_attention_triton`: the fused kernel KIVI's speed relies on (the official code's
    `cuda_bmm_fA_qB_outer` gemv, written anew): per program one KV head and one split of the
    tokens; each tile of BLOCK_T tokens unpacks key codes and dequantizes them in registers with
    the per-channel scale/zero (or loads the fp residual), q.K^T, online softmax, then unpacks
    the value codes (per-token scale/zero) and accumulates p.V. Split-K over tokens keeps long
    contexts parallel; the splits' (max, sum, acc) partials are merged afterwards.
  * `decode_attention_cpu`: the CPU counterpart (methods/kernels/kivi_cpu.c, built on first use):
    key scores and p.V straight from the codes, unpacked a byte at a time and used at once, the
    scale folded into the query / probability; the exact softmax over all T scores in between.
  * `decode_attention_torch`: blockwise eager torch, the fallback without a C compiler and the
    reference the kernels are tested against: BLOCK tokens are unpacked and dequantized at a
    time (bounded scratch, never the whole cache), scores for all tokens take an exact softmax,
    then p.V blockwise.
`decode_attention` dispatches: Triton on CUDA or under TRITON_INTERPRET=1, else the C kernel,
else torch; `decode_kernel(device)` names the one a run uses (KIVI records it in metrics.json).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from methods.kernels import kivi_cpu
from methods.kernels.kivi_quant import Quantized, dequantize

# As in kivi_quant: whether this module's kernel was decorated for the interpreter.
_INTERPRETED_AT_IMPORT = os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(x: torch.Tensor) -> bool:
    """The fused kernel on CUDA, or in the CPU interpreter when it was on at import and still is."""
    return _triton_on(x.device)


def _triton_on(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    return _INTERPRETED_AT_IMPORT and os.environ.get("TRITON_INTERPRET") == "1"


class KIVICache(NamedTuple):
    """One layer's KIVI cache as attention sees it this step (shapes in the module docstring)."""

    k_quant: Quantized | None
    v_quant: Quantized | None
    k_res: torch.Tensor  # (B, H_kv, T - T_qk, D)
    v_res: torch.Tensor  # (B, H_kv, T - T_qv, D)
    k_bits: int
    v_bits: int
    k_group_tokens: int
    v_group_channels: int

    def quantized_key_tokens(self) -> int:
        return 0 if self.k_quant is None else self.k_quant.codes.shape[-1] * 8 // self.k_bits

    def quantized_value_tokens(self) -> int:
        return 0 if self.v_quant is None else self.v_quant.codes.shape[-2]

    def tokens(self) -> int:
        return self.quantized_key_tokens() + self.k_res.shape[-2]


_UNPACK_TABLES: dict[tuple, torch.Tensor] = {}


def _unpack(codes: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed uint8 `(..., n_bytes)` -> code values `(..., n_bytes * 8 / bits)` in `dtype`.

    One table lookup per byte (a 256-row table of its 8/bits codes): on CPU this is one pass,
    several times faster than shifting and masking a broadcast uint8 tensor."""
    key = (bits, dtype, codes.device)
    if key not in _UNPACK_TABLES:
        shifts = torch.arange(0, 8, bits, device=codes.device)
        table = (torch.arange(256, device=codes.device)[:, None] >> shifts) & ((1 << bits) - 1)
        _UNPACK_TABLES[key] = table.to(dtype)  # (256, 8 / bits)
    return torch.nn.functional.embedding(codes.int(), _UNPACK_TABLES[key]).flatten(-2)


def _dequant_block(q: Quantized, bits: int, group: int, start: int, end: int,
                   axis_tokens_last: bool, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize tokens [start, end) only. Keys (tokens last): `(B, H, D, end-start)`; values:
    `(B, H, end-start, D)`."""
    if axis_tokens_last:  # keys: token groups along the last axis
        per_byte = 8 // bits
        codes = q.codes[..., start // per_byte: end // per_byte]
        scale = q.scale[..., start // group: end // group]
        zero = q.zero[..., start // group: end // group]
    else:  # values: whole token rows
        codes, scale, zero = (t[..., start:end, :] for t in q)
    x = _unpack(codes, bits, dtype).unflatten(-1, (-1, group))  # (..., n_groups, group)
    return torch.addcmul(zero.to(dtype)[..., None], x, scale.to(dtype)[..., None]).flatten(-2)


def decode_attention_torch(query: torch.Tensor, cache: KIVICache, scaling: float,
                           block_tokens: int = 2048) -> torch.Tensor:
    """Torch path: `query (B, H_q, 1, D)` -> `(B, H_q, 1, D)`; scratch bounded by `block_tokens`
    (rounded to whole key groups)."""
    b, hq, _, d = query.shape
    h = cache.k_res.shape[1]
    dtype = torch.float32  # scores and accumulation in fp32 (as SDPA's CPU math)
    q = query.reshape(b, h, hq // h, d).to(dtype) * scaling  # (B, H_kv, g, D)
    block = max(cache.k_group_tokens, block_tokens // cache.k_group_tokens * cache.k_group_tokens)
    t_qk, t_qv = cache.quantized_key_tokens(), cache.quantized_value_tokens()
    scores = []
    for start in range(0, t_qk, block):
        k = _dequant_block(cache.k_quant, cache.k_bits, cache.k_group_tokens, start,
                           min(t_qk, start + block), True, dtype)  # (B, H, D, n)
        scores.append(q @ k)
    scores.append(q @ cache.k_res.to(dtype).transpose(-1, -2))
    probs = torch.softmax(torch.cat(scores, -1), dim=-1)  # (B, H_kv, g, T)
    out = probs[..., t_qv:] @ cache.v_res.to(dtype)
    for start in range(0, t_qv, block):
        end = min(t_qv, start + block)
        v = _dequant_block(cache.v_quant, cache.v_bits, cache.v_group_channels, start, end, False,
                           dtype)  # (B, H, n, D)
        out = out + probs[..., start:end] @ v
    return out.reshape(b, hq, 1, d).to(query.dtype)


# ------------------------------------------------------------------------------------------------
@triton.jit
def _kivi_decode_kernel(
        q_ptr, kc_ptr, ks_ptr, kz_ptr, kr_ptr, vc_ptr, vs_ptr, vz_ptr, vr_ptr,
        m_ptr, l_ptr, acc_ptr,
        H, T, T_QK, T_QV, tokens_per_split, scaling,
        sq_b, sq_h, skc_b, skc_h, skc_d, sks_b, sks_h, sks_d, skr_b, skr_h, skr_t,
        svc_b, svc_h, svc_t, svs_b, svs_h, svs_t, svr_b, svr_h, svr_t,
        G: tl.constexpr, G_P2: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
        K_BITS: tl.constexpr, K_GROUP: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr,
        BLOCK_T: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    b = bh // H
    h = bh % H
    heads = tl.arange(0, G_P2)
    dims = tl.arange(0, D_P2)
    head_ok = heads < G
    dim_ok = dims < D
    # the g query heads of this KV head: (G_P2, D_P2), pre-scaled
    q = tl.load(q_ptr + b * sq_b + (h * G + heads)[:, None] * sq_h + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32) * scaling
    K_PER_BYTE: tl.constexpr = 8 // K_BITS
    V_PER_BYTE: tl.constexpr = 8 // V_BITS
    m_i = tl.full([G_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([G_P2], tl.float32)
    acc = tl.zeros([G_P2, D_P2], tl.float32)
    start = split * tokens_per_split
    stop = tl.minimum(start + tokens_per_split, T)
    for t0 in range(start, stop, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        live = t < stop
        # keys (D_P2, BLOCK_T): packed codes per channel for t < T_QK, else the fp residual
        kq_ok = dim_ok[:, None] & (live & (t < T_QK))[None, :]
        kbyte = tl.load(kc_ptr + b * skc_b + h * skc_h + dims[:, None] * skc_d
                        + (t // K_PER_BYTE)[None, :], mask=kq_ok, other=0).to(tl.int32)
        kcode = (kbyte >> ((t % K_PER_BYTE) * K_BITS)[None, :]) & ((1 << K_BITS) - 1)
        kgrp = b * sks_b + h * sks_h + dims[:, None] * sks_d + (t // K_GROUP)[None, :]
        kscale = tl.load(ks_ptr + kgrp, mask=kq_ok, other=0.0).to(tl.float32)
        kzero = tl.load(kz_ptr + kgrp, mask=kq_ok, other=0.0).to(tl.float32)
        kr_ok = dim_ok[:, None] & (live & (t >= T_QK))[None, :]
        kres = tl.load(kr_ptr + b * skr_b + h * skr_h + (t - T_QK)[None, :] * skr_t
                       + dims[:, None], mask=kr_ok, other=0.0).to(tl.float32)
        k = tl.where(kq_ok, kcode.to(tl.float32) * kscale + kzero, kres)
        s = tl.sum(q[:, :, None] * k[None, :, :], axis=1)  # (G_P2, BLOCK_T)
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        # values (BLOCK_T, D_P2): packed codes per token for t < T_QV, else the fp residual
        vq_ok = (live & (t < T_QV))[:, None] & dim_ok[None, :]
        vbyte = tl.load(vc_ptr + b * svc_b + h * svc_h + t[:, None] * svc_t
                        + (dims // V_PER_BYTE)[None, :], mask=vq_ok, other=0).to(tl.int32)
        vcode = (vbyte >> ((dims % V_PER_BYTE) * V_BITS)[None, :]) & ((1 << V_BITS) - 1)
        vgrp = b * svs_b + h * svs_h + t[:, None] * svs_t + (dims // V_GROUP)[None, :]
        vscale = tl.load(vs_ptr + vgrp, mask=vq_ok, other=0.0).to(tl.float32)
        vzero = tl.load(vz_ptr + vgrp, mask=vq_ok, other=0.0).to(tl.float32)
        vr_ok = (live & (t >= T_QV))[:, None] & dim_ok[None, :]
        vres = tl.load(vr_ptr + b * svr_b + h * svr_h + (t - T_QV)[:, None] * svr_t
                       + dims[None, :], mask=vr_ok, other=0.0).to(tl.float32)
        v = tl.where(vq_ok, vcode.to(tl.float32) * vscale + vzero, vres)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    part = bh * n_splits + split
    tl.store(m_ptr + part * G_P2 + heads, m_i)
    tl.store(l_ptr + part * G_P2 + heads, l_i)
    tl.store(acc_ptr + (part * G_P2 + heads)[:, None] * D_P2 + dims[None, :], acc)


def _splits(bh: int, tokens: int, block_t: int, device: torch.device) -> int:
    """Token splits per KV head: enough programs to fill the device, each >= 4 tiles long."""
    if device.type == "cuda":
        programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        programs = 4  # the interpreter runs programs one by one
    return max(1, min(triton.cdiv(tokens, 4 * block_t), triton.cdiv(programs, bh)))


def decode_attention_triton(query: torch.Tensor, cache: KIVICache, scaling: float,
                            splits: int | None = None, block_t: int | None = None) -> torch.Tensor:
    """Fused kernel: `query (B, H_q, 1, D)` -> `(B, H_q, 1, D)`. A tile holds g x D x BLOCK_T
    products in registers, so BLOCK_T shrinks as heads per group and head_dim grow."""
    b, hq, _, d = query.shape
    h = cache.k_res.shape[1]
    g = hq // h
    t = cache.tokens()
    t_qk, t_qv = cache.quantized_key_tokens(), cache.quantized_value_tokens()
    empty_u8 = torch.zeros(1, 1, 1, 1, dtype=torch.uint8, device=query.device)
    empty_h = torch.zeros(1, 1, 1, 1, dtype=torch.float16, device=query.device)
    # strided views are read as they are (the values' token-major store); only the last axis
    # must be unit-stride
    kc, ks, kz = map(_unit_last, cache.k_quant) if t_qk else (empty_u8, empty_h, empty_h)
    vc, vs, vz = map(_unit_last, cache.v_quant) if t_qv else (empty_u8, empty_h, empty_h)
    kr, vr = _unit_last(cache.k_res), _unit_last(cache.v_res)
    q = _unit_last(query.reshape(b, hq, d))
    g_p2, d_p2 = triton.next_power_of_2(g), triton.next_power_of_2(d)
    block_t = block_t or max(16, min(64, 8192 // (g_p2 * d_p2)))
    splits = splits or _splits(b * h, t, block_t, query.device)
    per_split = triton.cdiv(triton.cdiv(t, splits), block_t) * block_t
    splits = triton.cdiv(t, per_split)
    m = torch.empty(b * h, splits, g_p2, dtype=torch.float32, device=query.device)
    l_sum = torch.empty_like(m)
    acc = torch.empty(b * h, splits, g_p2, d_p2, dtype=torch.float32, device=query.device)
    _kivi_decode_kernel[(b * h, splits)](
        q, kc, ks, kz, kr, vc, vs, vz, vr, m, l_sum, acc,
        h, t, t_qk, t_qv, per_split, float(scaling),
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2), kr.stride(0), kr.stride(1), kr.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
        vr.stride(0), vr.stride(1), vr.stride(2),
        G=g, G_P2=g_p2, D=d, D_P2=d_p2, K_BITS=cache.k_bits, K_GROUP=cache.k_group_tokens,
        V_BITS=cache.v_bits, V_GROUP=cache.v_group_channels, BLOCK_T=block_t)
    out = combine_splits(m, l_sum, acc)[:, :g, :d]  # (B*H_kv, g, D)
    return out.reshape(b, hq, 1, d).to(query.dtype)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def combine_splits(m: torch.Tensor, l_sum: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Merge split-K partials `m, l (N, S, G)`, `acc (N, S, G, D)` into `(N, G, D)`."""
    top = m.amax(dim=1, keepdim=True)  # every head has >= 1 non-empty split: finite
    weight = torch.exp(m - top)  # empty splits: exp(-inf) = 0
    return (acc * weight[..., None]).sum(1) / (l_sum * weight).sum(1)[..., None]


def decode_attention_cpu(query: torch.Tensor, cache: KIVICache, scaling: float) -> torch.Tensor:
    """C kernel path (CPU): `query (B, H_q, 1, D)` -> `(B, H_q, 1, D)`; scratch is the T scores."""
    return kivi_cpu.decode_attention(query, cache, scaling)


def decode_kernel(device: torch.device) -> str:
    """Which implementation `decode_attention` runs for tensors on `device`: "triton", "c" or
    "torch" (the C kernel is built here on first use)."""
    if _triton_on(device):
        return "triton"
    return kivi_cpu.kernel_name(device)  # "c" on CPU when built, else "torch"


def decode_attention(query: torch.Tensor, cache: KIVICache, scaling: float) -> torch.Tensor:
    """Decode attention over a KIVI cache (`decode_kernel` says which implementation)."""
    kernel = decode_kernel(query.device)
    if kernel == "triton":
        return decode_attention_triton(query, cache, scaling)
    if kernel == "c":
        return decode_attention_cpu(query, cache, scaling)
    return decode_attention_torch(query, cache, scaling)


def dequantize_cache(cache: KIVICache, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole cache dequantized, `(B, H_kv, T, D)` each: for attention the fused path does not
    cover (prefill chunks, masks) and for tests."""
    keys, values = cache.k_res, cache.v_res
    if cache.k_quant is not None:
        old = dequantize(cache.k_quant, cache.k_bits, cache.k_group_tokens, dtype)
        keys = torch.cat([old.transpose(-1, -2), keys], -2)
    if cache.v_quant is not None:
        old = dequantize(cache.v_quant, cache.v_bits, cache.v_group_channels, dtype)
        values = torch.cat([old, values], -2)
    return keys, values
