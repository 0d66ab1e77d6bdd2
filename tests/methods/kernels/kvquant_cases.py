"""Random KVQuant caches on small irregular shapes (tests of the decode kernels)."""

import torch

from methods.kernels.kvquant_attention import KVQuantCache, pack_bits, rope_table


def random_cache(h=3, d=16, t0=1, tq=37, k_bits=3, v_bits=2, k_outliers=9, v_outliers=7,
                 seed=0, extra_positions=5) -> KVQuantCache:
    """Codes, per-channel key ranges, per-token value ranges, sorted codebooks and outliers at
    distinct (token, head, channel), token-sorted; `t0` exact tokens first."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    exact_k = rand(1, h, t0, d) if t0 else None
    exact_v = rand(1, h, t0, d) if t0 else None
    k_codes = pack_bits(torch.randint(0, 1 << k_bits, (1, h, tq, d), generator=g), k_bits)
    v_codes = pack_bits(torch.randint(0, 1 << v_bits, (1, h, tq, d), generator=g), v_bits)
    v_scale = (rand(1, 1, tq, 1).abs() + 0.2).half()
    v_zero = rand(1, 1, tq, 1).half()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope_table(torch.arange(t0 + tq + extra_positions), inv_freq)
    return KVQuantCache(
        exact_k, exact_v, k_codes, v_codes, v_scale, v_zero,
        key_scale=rand(h, d).abs() + 0.3, key_zero=rand(h, d) * 0.5,
        key_codebook=rand(1 << k_bits).sort().values, value_codebook=rand(1 << v_bits).sort().values,
        k_outliers=_outliers(k_outliers, h, d, t0, tq, g), v_outliers=_outliers(v_outliers, h, d, t0, tq, g),
        inv_freq=inv_freq, rope_cos=cos, rope_sin=sin, k_bits=k_bits, v_bits=v_bits)


def _outliers(n, h, d, t0, tq, g):
    if n == 0:
        return None
    flat = torch.randperm(tq * h * d, generator=g)[:n].sort().values  # (token, head, channel) order
    token, lane = flat // (h * d), flat % (h * d)
    value = (torch.randn(n, generator=g) * 6).half()
    return (token + t0).to(torch.int32), lane.to(torch.int16), value
