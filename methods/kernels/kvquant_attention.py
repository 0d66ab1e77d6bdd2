"""KVQuant decode attention straight from the packed codes: no dequantized, re-rotated copy.

One layer's cache as attention sees it (`KVQuantCache`, methods/kvquant.py builds it; one
sequence, B = 1):
  * tokens [0, T0): exact (the attention-sink tokens), post-RoPE keys / values `(1, H, T0, D)`;
  * tokens [T0, T): codes packed as a little-endian bit stream per token, keys `(1, H, T_q,
    D * k_bits / 8)`, values `(1, H, T_q, D * v_bits / 8)`, T_q = T - T0. Keys are *pre-RoPE*:
      k_pre[t, c] = key_codebook[code] * key_scale[h, c] + key_zero[h, c]   (per channel, static)
      v[t, c]     = value_codebook[code] * v_scale[t] + v_zero[t]          (per token)
    then the dense-and-sparse outliers replace their elements (token position int32, lane =
    head * D + channel int16, value fp16, sorted by token), and the key of position p is rotated
    by RoPE at p (HF's rotate-half pairs (j, j + D/2), angles fl(p * inv_freq) in fp32).
Query `(1, H_q, 1, D)`, H_q = g * H.

Scores without materialising rotated keys: q . R(p) k_pre = (R(p)^T q) . k_pre, i.e. per pair j
    q . R(p) k = sum_j cos_pj (q_j k_j + q_j' k_j') + sin_pj (q_j' k_j - q_j k_j'),  j' = j + D/2
which is how the official fused kernel applies RoPE on the fly
(`VecQuant4MatMulKernelNUQPerChannelTransposedRopeMHABatchedFusedOpt`: coefficient
`q[k] cos + sign q[k +- D/2] sin` per pre-RoPE key element). The cos/sin of every position come
from one table (`rope_cos`, `rope_sin` `(P, D/2)` fp32, P >= T) computed once per position with
the same fp32 angles as methods/rope.py, so every path rotates by the very angles the model used.

Three implementations of softmax(q K^T * scaling) V over the whole cache:
  * `decode_attention_torch`: the reference (and the path without a C compiler): the cache
    dequantized, outliers written in, keys rotated (methods/rope.py), then attention in fp32.
  * `decode_attention_cpu`: the C kernel (methods/kernels/kvquant_cpu.c): blocks of 16 tokens
    dequantized into L1, outliers patched, rotated with the table, dotted with the g queries;
    exact softmax; then p.V from the value codes likewise.
  * `decode_attention_triton`: fused, flash-decoding style (split-K over tokens, online
    softmax): per tile the codes are unpacked and looked up in registers, the score taken in the
    coefficient form above; the tile's outliers (a per-token offset table into the sorted list)
    are added as corrections, (value - its dense dequantization) times the RoPE-weighted query
    (keys, as the official `SPMV_ATOMIC_CSR_ROPE_BALANCED`) or the probability (values).
`decode_attention` dispatches (Triton on CUDA or under TRITON_INTERPRET=1, else C, else torch);
`decode_kernel(device)` names the one a run uses.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from methods.kernels import kvquant_cpu
from methods.kernels.kivi_attention import combine_splits
from methods.rope import rotate

_INTERPRETED_AT_IMPORT = os.environ.get("TRITON_INTERPRET") == "1"
OUTLIER_BLOCK = 16  # outliers per correction chunk of a Triton tile


# --------------------------------------------------------------------------------------------
# bit packing (little-endian bit stream; at 2/4 bits identical to KIVI's byte layout)
def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., N) integer codes < 2^bits -> (..., N * bits / 8) uint8; N * bits % 8 == 0. Codes
    are whole within a byte at 2 and 4 bits; at 3 bits every 8 codes fill 3 bytes."""
    n = codes.shape[-1]
    if (n * bits) % 8:
        raise ValueError(f"{n} codes of {bits} bits do not fill whole bytes")
    per = 8 // bits if 8 % bits == 0 else 8  # codes per byte, or per 3-byte word at 3 bits
    words = (codes.long().unflatten(-1, (-1, per)) << _shifts(per, bits, codes.device)).sum(-1)
    if per * bits == 8:
        return words.to(torch.uint8)
    octets = (words[..., None] >> _shifts(bits, 8, codes.device)) & 255  # (..., N / 8, 3)
    return octets.flatten(-2).to(torch.uint8)


@functools.lru_cache(maxsize=16)
def _shifts(count: int, step: int, device: torch.device) -> torch.Tensor:
    return torch.arange(count, device=device) * step


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_bits`: (..., N * bits / 8) uint8 -> (..., N) int64 codes."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = (packed.to(torch.int32)[..., None] >> shifts) & 1  # (..., bytes, 8)
    n = packed.shape[-1] * 8 // bits
    stream = stream.reshape(*packed.shape[:-1], n, bits)
    weights = 1 << torch.arange(bits, device=packed.device, dtype=torch.int32)
    return (stream * weights).sum(-1).long()


class KVQuantCache(NamedTuple):
    """One layer's KVQuant cache as attention sees it this step (shapes in the module docstring;
    `None` for an empty part)."""

    exact_k: torch.Tensor | None  # (1, H, T0, D) post-RoPE
    exact_v: torch.Tensor | None  # (1, H, T0, D)
    k_codes: torch.Tensor | None  # (1, H, T_q, D * k_bits / 8) uint8
    v_codes: torch.Tensor | None  # (1, H, T_q, D * v_bits / 8) uint8
    v_scale: torch.Tensor | None  # (1, 1, T_q, 1) fp16
    v_zero: torch.Tensor | None  # (1, 1, T_q, 1) fp16
    key_scale: torch.Tensor  # (H, D) fp32, calibrated
    key_zero: torch.Tensor  # (H, D) fp32
    key_codebook: torch.Tensor  # (2^k_bits,) fp32, the decode table (Q-Norm folded in)
    value_codebook: torch.Tensor  # (2^v_bits,) fp32
    k_outliers: tuple | None  # (token int32, lane int16, value fp16), each (n,), sorted by token
    v_outliers: tuple | None
    inv_freq: torch.Tensor  # (D/2,) fp32
    rope_cos: torch.Tensor  # (P, D/2) fp32, P >= T: cos(fl(p * inv_freq))
    rope_sin: torch.Tensor  # (P, D/2) fp32
    k_bits: int
    v_bits: int

    def exact_tokens(self) -> int:
        return 0 if self.exact_k is None else self.exact_k.shape[-2]

    def quantized_tokens(self) -> int:
        return 0 if self.k_codes is None else self.k_codes.shape[-2]

    def tokens(self) -> int:
        return self.exact_tokens() + self.quantized_tokens()


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """cos and sin `(len(positions), D/2)` fp32 of the angles methods/rope.py uses."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.float()
    return angles.cos(), angles.sin()


# --------------------------------------------------------------------------------------------
# torch reference
def _scatter(target: torch.Tensor, sparse: tuple | None, first: int) -> None:
    """Write the outliers into target `(1, H, T_q, D)` (in place)."""
    if sparse is None or sparse[0].numel() == 0:
        return
    token, lane, value = sparse
    d, lane = target.shape[-1], lane.long()
    target[0, lane // d, token.long() - first, lane % d] = value.to(target.dtype)


def dequantize_cache(cache: KVQuantCache, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole cache dequantized and keys rotated, `(1, H, T, D)` each (fp32 math, then
    `dtype`): for attention the fused path does not cover and as the kernels' reference."""
    first = cache.exact_tokens()
    parts_k = [] if cache.exact_k is None else [cache.exact_k.to(dtype)]
    parts_v = [] if cache.exact_v is None else [cache.exact_v.to(dtype)]
    if cache.k_codes is not None:
        k = cache.key_codebook[unpack_bits(cache.k_codes, cache.k_bits)]
        k = k * cache.key_scale[None, :, None, :] + cache.key_zero[None, :, None, :]
        v = cache.value_codebook[unpack_bits(cache.v_codes, cache.v_bits)]
        v = v * cache.v_scale.float() + cache.v_zero.float()
        _scatter(k, cache.k_outliers, first)
        _scatter(v, cache.v_outliers, first)
        positions = torch.arange(first, first + k.shape[-2], device=k.device)
        parts_k.append(rotate(k, positions.float(), cache.inv_freq).to(dtype))
        parts_v.append(v.to(dtype))
    return torch.cat(parts_k, -2), torch.cat(parts_v, -2)


def decode_attention_torch(query: torch.Tensor, cache: KVQuantCache, scaling: float
                           ) -> torch.Tensor:
    """Reference: `query (1, H_q, 1, D)` -> `(1, H_q, 1, D)`, dequantize then attend in fp32."""
    b, hq, _, d = query.shape
    keys, values = dequantize_cache(cache, torch.float32)  # (1, H, T, D)
    h = keys.shape[1]
    q = query.reshape(b, h, hq // h, d).float()  # (1, H, g, D)
    probs = torch.softmax((q @ keys.transpose(-1, -2)) * scaling, dim=-1)  # (1, H, g, T)
    return (probs @ values).reshape(b, hq, 1, d).to(query.dtype)


# --------------------------------------------------------------------------------------------
# Triton
@triton.jit
def _codes(ptr, rows, row_ok, dims, dim_ok, BITS: tl.constexpr, D: tl.constexpr):
    """Codes `(BLOCK_T, D_P2)` of a packed bit stream per row (`ptr + rows` = each row's first
    byte): two bytes per code, so a 3-bit code across a byte boundary reads whole."""
    bit = dims * BITS
    byte = bit // 8
    ok = row_ok[:, None] & dim_ok[None, :]
    lo = tl.load(ptr + rows[:, None] + byte[None, :], mask=ok, other=0).to(tl.int32)
    hi_ok = ok & ((byte + 1) < (D * BITS // 8))[None, :]
    hi = tl.load(ptr + rows[:, None] + byte[None, :] + 1, mask=hi_ok, other=0).to(tl.int32)
    return ((lo | (hi << 8)) >> (bit % 8)[None, :]) & ((1 << BITS) - 1)


@triton.jit
def _outliers(tok_ptr, lane_ptr, val_ptr, o0, hi, h, T0, D: tl.constexpr,
              BLOCK_O: tl.constexpr):
    """One chunk of the sorted list: this head's entries among [o0, min(o0 + BLOCK_O, hi)):
    (mine, token position, channel, quantized index, value), masked entries zeroed."""
    o = o0 + tl.arange(0, BLOCK_O)
    ok = o < hi
    tok = tl.load(tok_ptr + o, mask=ok, other=-1)
    ch = tl.load(lane_ptr + o, mask=ok, other=0).to(tl.int32) - h * D
    mine = ok & (ch >= 0) & (ch < D)
    ch = tl.where(mine, ch, 0)
    val = tl.load(val_ptr + o, mask=mine, other=0.0).to(tl.float32)
    return mine, tl.where(mine, tok, -1), ch, tl.where(mine, tok - T0, 0), val


@triton.jit
def _code_at(row_ptr, ch, mine, BITS: tl.constexpr, D: tl.constexpr):
    """Codes of channels `ch` of the rows at `row_ptr` (one per entry)."""
    bit = ch * BITS
    byte = bit // 8
    lo = tl.load(row_ptr + byte, mask=mine, other=0).to(tl.int32)
    hi = tl.load(row_ptr + byte + 1, mask=mine & ((byte + 1) < (D * BITS // 8)),
                 other=0).to(tl.int32)
    return ((lo | (hi << 8)) >> (bit % 8)) & ((1 << BITS) - 1)


@triton.jit
def _kvquant_decode_kernel(
        q_ptr, ek_ptr, ev_ptr, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, kcb_ptr, vcb_ptr,
        cos_ptr, sin_ptr, ko_ptr, kt_ptr, kl_ptr, kv_ptr, vo_ptr, vt_ptr, vl_ptr, vv_ptr,
        m_ptr, l_ptr, acc_ptr,
        T, T0, tokens_per_split, scaling,
        sq_h, sek_h, sek_t, sev_h, sev_t, skc_h, skc_t, svc_h, svc_t, svs_t,
        G: tl.constexpr, G_P2: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
        K_BITS: tl.constexpr, V_BITS: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_O: tl.constexpr):
    h = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    HALF: tl.constexpr = D // 2
    heads = tl.arange(0, G_P2)
    dims = tl.arange(0, D_P2)
    head_ok = heads < G
    dim_ok = dims < D
    qm = head_ok[:, None] & dim_ok[None, :]
    q_rows = q_ptr + (h * G + heads)[:, None] * sq_h
    q = tl.load(q_rows + dims[None, :], mask=qm, other=0.0).to(tl.float32)  # (G_P2, D_P2)
    # the partner of each channel in its rotate-half pair, signed: the sin coefficient
    partner = tl.where(dims < HALF, dims + HALF, dims - HALF)
    sign = tl.where(dims < HALF, 1.0, -1.0)
    q_sin = tl.load(q_rows + partner[None, :], mask=qm, other=0.0).to(tl.float32) * sign[None, :]
    pair = dims % HALF
    k_scale = tl.load(ks_ptr + h * D + dims, mask=dim_ok, other=0.0)
    k_zero = tl.load(kz_ptr + h * D + dims, mask=dim_ok, other=0.0)
    m_i = tl.full([G_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([G_P2], tl.float32)
    acc = tl.zeros([G_P2, D_P2], tl.float32)
    start = split * tokens_per_split
    stop = tl.minimum(start + tokens_per_split, T)
    for t0 in range(start, stop, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        live = t < stop
        exact = live & (t < T0)
        quant = live & (t >= T0)
        i = tl.where(quant, t - T0, 0)  # index among the quantized tokens
        t_last = tl.minimum(t0 + BLOCK_T, stop)
        em = exact[:, None] & dim_ok[None, :]
        qmask = quant[:, None] & dim_ok[None, :]
        # keys: exact rows (already rotated) or pre-RoPE codes, scored in the coefficient form
        ek = tl.load(ek_ptr + h * sek_h + t[:, None] * sek_t + dims[None, :], mask=em, other=0.0)
        code = _codes(kc_ptr + h * skc_h, i * skc_t, quant, dims, dim_ok, K_BITS, D)
        k = tl.load(kcb_ptr + code, mask=qmask, other=0.0) * k_scale[None, :] + k_zero[None, :]
        cos = tl.load(cos_ptr + t[:, None] * HALF + pair[None, :], mask=qmask, other=0.0)
        sin = tl.load(sin_ptr + t[:, None] * HALF + pair[None, :], mask=qmask, other=0.0)
        k_cos = tl.where(qmask, k * cos, ek.to(tl.float32))  # exact rows: plain q . k
        k_sin = tl.where(qmask, k * sin, 0.0)
        s = tl.sum(q[:, None, :] * k_cos[None, :, :] + q_sin[:, None, :] * k_sin[None, :, :],
                   axis=2)  # (G_P2, BLOCK_T)
        # key outliers: (value - dense) times the RoPE-weighted query (the official SpMV)
        lo = tl.load(ko_ptr + t0)
        hi = tl.load(ko_ptr + t_last)
        for o0 in range(lo, hi, BLOCK_O):
            mine, tok, ch, io, val = _outliers(kt_ptr, kl_ptr, kv_ptr, o0, hi, h, T0, D,
                                               BLOCK_O)
            c = _code_at(kc_ptr + h * skc_h + io * skc_t, ch, mine, K_BITS, D)
            dense = (tl.load(kcb_ptr + c, mask=mine, other=0.0)
                     * tl.load(ks_ptr + h * D + ch, mask=mine, other=0.0)
                     + tl.load(kz_ptr + h * D + ch, mask=mine, other=0.0))
            om = head_ok[:, None] & mine[None, :]
            p_ch = tl.where(ch < HALF, ch + HALF, ch - HALF)
            o_sign = tl.where(ch < HALF, 1.0, -1.0)
            o_cos = tl.load(cos_ptr + tok * HALF + ch % HALF, mask=mine, other=0.0)
            o_sin = tl.load(sin_ptr + tok * HALF + ch % HALF, mask=mine, other=0.0)
            coef = (tl.load(q_rows + ch[None, :], mask=om, other=0.0).to(tl.float32)
                    * o_cos[None, :]
                    + tl.load(q_rows + p_ch[None, :], mask=om, other=0.0).to(tl.float32)
                    * (o_sign * o_sin)[None, :])  # (G_P2, BLOCK_O)
            at_t = ((tok[:, None] == t[None, :]) & mine[:, None]).to(tl.float32)
            s += tl.sum((coef * (val - dense)[None, :])[:, :, None] * at_t[None, :, :], axis=1)
        s = tl.where(live[None, :], s * scaling, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        # values: exact rows or per-token codes
        ev = tl.load(ev_ptr + h * sev_h + t[:, None] * sev_t + dims[None, :], mask=em, other=0.0)
        code = _codes(vc_ptr + h * svc_h, i * svc_t, quant, dims, dim_ok, V_BITS, D)
        v_scale = tl.load(vs_ptr + i * svs_t, mask=quant, other=0.0).to(tl.float32)
        v_zero = tl.load(vz_ptr + i * svs_t, mask=quant, other=0.0).to(tl.float32)
        v = tl.load(vcb_ptr + code, mask=qmask, other=0.0) * v_scale[:, None] + v_zero[:, None]
        v = tl.where(qmask, v, ev.to(tl.float32))
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        # value outliers: (value - dense) times the token's probability
        lo = tl.load(vo_ptr + t0)
        hi = tl.load(vo_ptr + t_last)
        for o0 in range(lo, hi, BLOCK_O):
            mine, tok, ch, io, val = _outliers(vt_ptr, vl_ptr, vv_ptr, o0, hi, h, T0, D,
                                               BLOCK_O)
            c = _code_at(vc_ptr + h * svc_h + io * svc_t, ch, mine, V_BITS, D)
            dense = (tl.load(vcb_ptr + c, mask=mine, other=0.0)
                     * tl.load(vs_ptr + io * svs_t, mask=mine, other=0.0).to(tl.float32)
                     + tl.load(vz_ptr + io * svs_t, mask=mine, other=0.0).to(tl.float32))
            at_t = ((tok[:, None] == t[None, :]) & mine[:, None]).to(tl.float32)
            p_o = tl.sum(p[:, None, :] * at_t[None, :, :], axis=2)  # (G_P2, BLOCK_O)
            at_c = ((ch[:, None] == dims[None, :]) & mine[:, None]).to(tl.float32)
            acc += tl.sum((p_o * (val - dense)[None, :])[:, :, None] * at_c[None, :, :], axis=1)
    part = h * n_splits + split
    tl.store(m_ptr + part * G_P2 + heads, m_i)
    tl.store(l_ptr + part * G_P2 + heads, l_i)
    tl.store(acc_ptr + (part * G_P2 + heads)[:, None] * D_P2 + dims[None, :], acc)


def _outlier_args(sparse: tuple | None, tokens: int, device: torch.device) -> list:
    """(offsets (T+1,) int32 into the sorted list per position, tokens, lanes, values)."""
    if sparse is None or sparse[0].numel() == 0:
        offsets = torch.zeros(tokens + 1, dtype=torch.int32, device=device)
        empty = torch.zeros(1, dtype=torch.int32, device=device)
        return [offsets, empty, empty.to(torch.int16), empty.to(torch.float16)]
    token = sparse[0].contiguous()
    grid = torch.arange(tokens + 1, dtype=torch.int32, device=device)
    offsets = torch.searchsorted(token, grid, out_int32=True)
    return [offsets, token, sparse[1].contiguous(), sparse[2].contiguous()]


def _splits(h: int, tokens: int, block_t: int, device: torch.device) -> int:
    if device.type == "cuda":
        programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        programs = 4  # the interpreter runs programs one by one
    return max(1, min(triton.cdiv(tokens, 4 * block_t), triton.cdiv(programs, h)))


def decode_attention_triton(query: torch.Tensor, cache: KVQuantCache, scaling: float,
                            splits: int | None = None, block_t: int = 16) -> torch.Tensor:
    """Fused kernel: `query (1, H_q, 1, D)` -> `(1, H_q, 1, D)`."""
    b, hq, _, d = query.shape
    dev = query.device
    h = cache.key_scale.shape[0]
    g, t, t0 = hq // h, cache.tokens(), cache.exact_tokens()
    f32 = torch.zeros(1, 1, 1, 1, device=dev)
    ek = f32 if cache.exact_k is None else cache.exact_k[0].float().contiguous()
    ev = f32 if cache.exact_v is None else cache.exact_v[0].float().contiguous()
    if cache.k_codes is None:
        u8, f16 = torch.zeros(1, 1, 1, dtype=torch.uint8, device=dev), f32.half().flatten()
        kc, vc, vs, vz = u8, u8, f16, f16
    else:
        kc, vc = (_unit_last(x[0]) for x in (cache.k_codes, cache.v_codes))  # (H, T_q, bytes)
        vs, vz = cache.v_scale.reshape(-1), cache.v_zero.reshape(-1)  # (T_q,)
    cos, sin = cache.rope_cos.contiguous(), cache.rope_sin.contiguous()
    k_out = _outlier_args(cache.k_outliers, t, dev)
    v_out = _outlier_args(cache.v_outliers, t, dev)
    q = query.reshape(hq, d).float().contiguous()
    g_p2, d_p2 = triton.next_power_of_2(g), triton.next_power_of_2(d)
    splits = splits or _splits(h, t, block_t, dev)
    per_split = triton.cdiv(triton.cdiv(t, splits), block_t) * block_t
    splits = triton.cdiv(t, per_split)
    m = torch.empty(h, splits, g_p2, dtype=torch.float32, device=dev)
    l_sum = torch.empty_like(m)
    acc = torch.empty(h, splits, g_p2, d_p2, dtype=torch.float32, device=dev)
    _kvquant_decode_kernel[(h, splits)](
        q, ek, ev, kc, vc, cache.key_scale.contiguous(), cache.key_zero.contiguous(), vs, vz,
        cache.key_codebook.contiguous(), cache.value_codebook.contiguous(), cos, sin,
        *k_out, *v_out, m, l_sum, acc,
        t, t0, per_split, float(scaling),
        q.stride(0), ek.stride(0), ek.stride(1), ev.stride(0), ev.stride(1),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), vs.stride(0),
        G=g, G_P2=g_p2, D=d, D_P2=d_p2, K_BITS=cache.k_bits, V_BITS=cache.v_bits,
        BLOCK_T=block_t, BLOCK_O=OUTLIER_BLOCK)
    out = combine_splits(m, l_sum, acc)[:, :g, :d]  # (H, g, D)
    return out.reshape(b, hq, 1, d).to(query.dtype)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# --------------------------------------------------------------------------------------------
def _triton_on(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    return _INTERPRETED_AT_IMPORT and os.environ.get("TRITON_INTERPRET") == "1"


def decode_kernel(device: torch.device) -> str:
    """Which implementation `decode_attention` runs on `device`: "triton", "c" or "torch"."""
    if _triton_on(device):
        return "triton"
    return kvquant_cpu.kernel_name(device)


def decode_attention(query: torch.Tensor, cache: KVQuantCache, scaling: float) -> torch.Tensor:
    """Decode attention over a KVQuant cache (`decode_kernel` says which implementation)."""
    kernel = decode_kernel(query.device)
    if kernel == "triton":
        return decode_attention_triton(query, cache, scaling)
    if kernel == "c":
        return kvquant_cpu.decode_attention(query, cache, scaling)
    return decode_attention_torch(query, cache, scaling)
