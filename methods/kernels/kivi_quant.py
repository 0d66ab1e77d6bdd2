"""KIVI's quantizer: asymmetric min-max uniform quantization in groups along the LAST axis, packed.

One group = `group_size` consecutive elements of the last axis. Per group (KIVI §3.3):
    scale = (max - min) / (2^bits - 1),  zero = min          (both stored in fp16)
    q     = clamp(floor((x - zero) / scale + 0.5), 0, 2^bits - 1)
    x_hat = q * scale + zero
Codes are packed `8 / bits` per uint8 byte (lowest bits = first element), so a 2-bit code really
takes 2 bits; bytes rather than int32 words so that a group as small as head_dim 8 (stories260K)
still fills whole words. The caller picks the grouping by choosing which axis is last:
  * keys, per channel over tokens: pass `K.transpose(-1, -2)` `(B, H_kv, D, T)` (groups of tokens);
  * values, per token over channels: pass `V` `(B, H_kv, T, D)` (groups of head-dim channels).

Each op has a Triton kernel (`_<op>_kernel`), a launcher (`<op>()`) and a torch reference
(`<op>_ref()`). The launcher uses Triton on CUDA tensors, or on CPU when TRITON_INTERPRET=1 (the
interpreter, for tests; it must be set before this module is imported), else the reference.
"""

from __future__ import annotations

import os
from typing import Literal, NamedTuple, get_args

import torch
import triton
import triton.language as tl

# KIVI's k_bits / v_bits knobs (the paper's 2 and 4; 8 near-lossless)
KiviBits = Literal[2, 4, 8]
ALLOWED_BITS = get_args(KiviBits)
# Code widths the packing and the kernels handle (whole codes per byte); 1 bit serves TailorKV's
# quantized layers (methods/tailorkv.py).
PackableBits = Literal[1, 2, 4, 8]
PACKABLE_BITS = get_args(PackableBits)
# Triton decides at decoration time whether kernels are interpreted: remember what it saw, so a
# CPU tensor never reaches a compiled kernel (which would fail with "0 active drivers").
_INTERPRETED_AT_IMPORT = os.environ.get("TRITON_INTERPRET") == "1"


class Quantized(NamedTuple):
    """Packed groups of a tensor `(..., N)`.

    codes `(..., N * bits / 8)` uint8; scale and zero `(..., N / group_size)` fp16.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.zero.nbytes

    def cat(self, other: "Quantized", dim: int) -> "Quantized":
        """Append along `dim` (-1: more groups of the last axis; other dims: more rows)."""
        return Quantized(*(torch.cat([a, b], dim=dim) for a, b in zip(self, other)))


def use_triton(x: torch.Tensor) -> bool:
    """Triton on CUDA, or in the CPU interpreter when it is on (read per call: tests flip it)."""
    if x.is_cuda:
        return True
    return _INTERPRETED_AT_IMPORT and os.environ.get("TRITON_INTERPRET") == "1"


def _check(bits: int, group_size: int, length: int) -> None:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits={bits}; allowed: {', '.join(map(str, PACKABLE_BITS))}")
    if group_size <= 0 or (group_size * bits) % 8:
        raise ValueError(f"group_size={group_size} at {bits} bits does not fill whole bytes")
    if length % group_size:  # callers quantize whole groups (KIVI's residual keeps the rest)
        raise ValueError(f"last axis {length} is not a multiple of group_size={group_size}")


def _blocks(group_size: int, bits: int) -> tuple[int, int, int]:
    """(bytes per group, that rounded up to a power of two, groups per program)."""
    group_bytes = group_size * bits // 8
    bytes_p2 = triton.next_power_of_2(group_bytes)
    # ~2048 elements per program: few programs (the interpreter loops over them), full warps on GPU.
    return group_bytes, bytes_p2, max(1, 2048 // (bytes_p2 * (8 // bits)))


# ------------------------------------------------------------------------------------------------
@triton.jit
def _quantize_pack_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, n_groups,
                          GROUP: tl.constexpr, BITS: tl.constexpr, GROUP_BYTES: tl.constexpr,
                          BYTES_P2: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    # Block (groups, bytes, codes-per-byte): packing is then a shift and a sum over the last axis.
    PER_BYTE: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    gid = tl.program_id(0) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    byte = tl.arange(0, BYTES_P2)
    lane = tl.arange(0, PER_BYTE)
    elem = byte[:, None] * PER_BYTE + lane[None, :]  # index inside the group
    valid = (gid < n_groups)[:, None, None] & (elem < GROUP)[None, :, :]
    offs = gid[:, None, None].to(tl.int64) * GROUP + elem[None, :, :]  # groups are contiguous
    x = tl.load(x_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    hi = tl.max(tl.max(tl.where(valid, x, float("-inf")), axis=2), axis=1)
    lo = tl.min(tl.min(tl.where(valid, x, float("inf")), axis=2), axis=1)
    # Codes are computed with the fp16-rounded scale/zero that dequantization will use.
    # div_rn: IEEE division, as torch (plain `/` may be approximate on GPU and flip a code).
    scale = tl.math.div_rn(hi - lo, LEVELS * 1.0).to(tl.float16).to(tl.float32)
    zero = lo.to(tl.float16).to(tl.float32)
    safe = tl.where(scale > 0, scale, 1.0)[:, None, None]  # constant group: scale 0, every code 0
    q = tl.floor(tl.math.div_rn(x - zero[:, None, None], safe) + 0.5)
    q = tl.where(scale[:, None, None] > 0, tl.minimum(tl.maximum(q, 0.0), LEVELS * 1.0), 0.0)
    packed = tl.sum(q.to(tl.int32) << (lane * BITS)[None, None, :], axis=2)
    byte_offs = gid[:, None].to(tl.int64) * GROUP_BYTES + byte[None, :]
    byte_ok = (gid < n_groups)[:, None] & (byte < GROUP_BYTES)[None, :]
    tl.store(codes_ptr + byte_offs, packed.to(tl.uint8), mask=byte_ok)
    tl.store(scale_ptr + gid, scale.to(tl.float16), mask=gid < n_groups)
    tl.store(zero_ptr + gid, zero.to(tl.float16), mask=gid < n_groups)


def quantize_pack(x: torch.Tensor, bits: int, group_size: int) -> Quantized:
    """Quantize `x (..., N)` in groups of `group_size` along the last axis; N % group_size == 0."""
    _check(bits, group_size, x.shape[-1])
    if not use_triton(x):
        return quantize_pack_ref(x, bits, group_size)
    x = x.contiguous()  # groups must be contiguous runs (a transposed K view is copied here)
    lead, n = x.shape[:-1], x.shape[-1]
    n_groups = x.numel() // group_size
    codes = torch.empty(*lead, n * bits // 8, dtype=torch.uint8, device=x.device)
    scale = torch.empty(*lead, n // group_size, dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale)
    if n_groups:
        group_bytes, bytes_p2, block = _blocks(group_size, bits)
        _quantize_pack_kernel[(triton.cdiv(n_groups, block),)](
            x, codes, scale, zero, n_groups, GROUP=group_size, BITS=bits,
            GROUP_BYTES=group_bytes, BYTES_P2=bytes_p2, BLOCK_GROUPS=block)
    return Quantized(codes, scale, zero)


def quantize_pack_ref(x: torch.Tensor, bits: int, group_size: int) -> Quantized:
    """Torch reference of `quantize_pack` (same arithmetic, so codes match exactly)."""
    _check(bits, group_size, x.shape[-1])
    lead, n = x.shape[:-1], x.shape[-1]
    levels = (1 << bits) - 1
    groups = x.reshape(-1, group_size).float()  # reshape copies a non-contiguous view
    hi, lo = groups.amax(dim=1), groups.amin(dim=1)
    scale, zero = ((hi - lo) / levels).half(), lo.half()
    s, z = scale.float()[:, None], zero.float()[:, None]
    q = torch.floor((groups - z) / torch.where(s > 0, s, 1.0) + 0.5).clamp_(0, levels)
    q = torch.where(s > 0, q, 0.0).to(torch.int32)
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=x.device, dtype=torch.int32) * bits
    packed = (q.reshape(-1, group_size // per_byte, per_byte) << shifts).sum(-1).to(torch.uint8)
    return Quantized(packed.reshape(*lead, n * bits // 8), scale.reshape(*lead, n // group_size),
                     zero.reshape(*lead, n // group_size))


# ------------------------------------------------------------------------------------------------
@triton.jit
def _dequantize_kernel(codes_ptr, scale_ptr, zero_ptr, out_ptr, n_groups,
                       GROUP: tl.constexpr, BITS: tl.constexpr, GROUP_BYTES: tl.constexpr,
                       BYTES_P2: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    PER_BYTE: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    gid = tl.program_id(0) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    byte = tl.arange(0, BYTES_P2)
    lane = tl.arange(0, PER_BYTE)
    byte_ok = (gid < n_groups)[:, None] & (byte < GROUP_BYTES)[None, :]
    byte_offs = gid[:, None].to(tl.int64) * GROUP_BYTES + byte[None, :]
    packed = tl.load(codes_ptr + byte_offs, mask=byte_ok, other=0).to(tl.int32)
    q = (packed[:, :, None] >> (lane * BITS)[None, None, :]) & LEVELS  # (groups, bytes, per byte)
    scale = tl.load(scale_ptr + gid, mask=gid < n_groups, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + gid, mask=gid < n_groups, other=0.0).to(tl.float32)
    x = q.to(tl.float32) * scale[:, None, None] + zero[:, None, None]
    elem = byte[:, None] * PER_BYTE + lane[None, :]
    offs = gid[:, None, None].to(tl.int64) * GROUP + elem[None, :, :]
    valid = (gid < n_groups)[:, None, None] & (elem < GROUP)[None, :, :]
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=valid)


def dequantize(quant: Quantized, bits: int, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Unpack and rescale `quant` back to a `(..., N)` tensor of `dtype` (N = codes * 8 / bits)."""
    codes, scale, zero = (t.contiguous() for t in quant)
    n = codes.shape[-1] * 8 // bits
    _check(bits, group_size, n)
    if not use_triton(codes):
        return dequantize_ref(Quantized(codes, scale, zero), bits, group_size, dtype)
    out = torch.empty(*codes.shape[:-1], n, dtype=dtype, device=codes.device)
    n_groups = out.numel() // group_size
    if n_groups:
        group_bytes, bytes_p2, block = _blocks(group_size, bits)
        _dequantize_kernel[(triton.cdiv(n_groups, block),)](
            codes, scale, zero, out, n_groups, GROUP=group_size, BITS=bits,
            GROUP_BYTES=group_bytes, BYTES_P2=bytes_p2, BLOCK_GROUPS=block)
    return out


def dequantize_ref(quant: Quantized, bits: int, group_size: int, dtype: torch.dtype
                   ) -> torch.Tensor:
    """Torch reference of `dequantize`."""
    codes, scale, zero = quant
    lead, n = codes.shape[:-1], codes.shape[-1] * 8 // bits
    _check(bits, group_size, n)
    shifts = torch.arange(8 // bits, device=codes.device, dtype=torch.int32) * bits
    q = (codes.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)  # (..., bytes, per byte)
    q = q.reshape(-1, group_size).float()
    x = q * scale.reshape(-1, 1).float() + zero.reshape(-1, 1).float()
    return x.reshape(*lead, n).to(dtype)
