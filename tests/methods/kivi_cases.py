"""KIVI caches for the kernel tests (KIVI's and TailorKV's 1-bit path): keys with per-channel
offsets and values, packed at given bits and group sizes, and the dense attention they stand for."""

import torch

from methods.kernels import kivi_quant as kq


def keys_and_values(tokens, b=1, h=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, tokens, d, generator=g) * 2 + torch.linspace(-3, 3, d)  # channel offsets
    v = torch.randn(b, h, tokens, d, generator=g)
    return k, v


def packed_cache(t_qk, t_kr, t_qv, b=1, h=2, d=16, k_bits=2, v_bits=2, k_group=32, v_group=16,
                 seed=0, dtype=torch.float32):
    """A KIVI cache over T = t_qk + t_kr tokens, keys and values split at different tokens."""
    from methods.kernels.kivi_attention import KIVICache

    k, v = keys_and_values(t_qk + t_kr, b=b, h=h, d=d, seed=seed)
    k_quant = (kq.quantize_pack_ref(k[..., :t_qk, :].transpose(-1, -2), k_bits, k_group)
               if t_qk else None)
    v_quant = kq.quantize_pack_ref(v[..., :t_qv, :], v_bits, v_group) if t_qv else None
    return KIVICache(k_quant, v_quant, k[..., t_qk:, :].to(dtype), v[..., t_qv:, :].to(dtype),
                     k_bits, v_bits, k_group, v_group)


def dense_reference(query, cache, scaling):
    from methods.kernels.kivi_attention import dequantize_cache

    keys, values = dequantize_cache(cache, torch.float32)
    g = query.shape[1] // keys.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        query.float(), keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1), scale=scaling)
