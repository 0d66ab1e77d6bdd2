"""RoPE re-rotation in HF's rotate-half layout (pure torch; no transformers import).

Rotations compose: a key rotated at text position p, rotated again by delta, equals the key
rotated at p + delta. Angles are computed in fp32 exactly as the model does (delta * inv_freq).
"""

from __future__ import annotations

import functools

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate `x (..., T, D)` by `delta` positions (broadcastable to `(..., T)`), in fp32."""
    angles = delta.to(torch.float32)[..., None] * inv_freq.to(x.device)  # (..., T, D/2)
    angles = torch.cat((angles, angles), dim=-1)
    return _turn(x, angles.cos(), angles.sin())


def rotate_by(x: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """`rotate` with one integer `delta` for every row: the same result, and the angles are
    computed once per (delta, inv_freq) and reused (every layer of a decode step shifts its rows
    by the same delta)."""
    return rotate_prepared(*prepared(x), int(delta), inv_freq, x.dtype)


def prepared(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` in fp32 and its rotate-half, for rows rotated again and again from one original by a
    changing delta (StreamingLLM's sinks, every decode step): each rotation is then three
    kernels (`rotate_prepared`)."""
    xf = x.float().clone()
    return xf, rotate_half(xf)


def rotate_prepared(xf: torch.Tensor, xf_half: torch.Tensor, delta: int, inv_freq: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """`rotate_by` of the rows `prepared` gave, cast to `dtype` (bit for bit the same)."""
    cos, sin = _cos_sin(int(delta), inv_freq, xf.device)
    out = xf * cos
    out += xf_half * sin
    return out.to(dtype)


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


@functools.lru_cache(maxsize=8)
def _cos_sin(delta: int, inv_freq: torch.Tensor, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.tensor(float(delta), device=device) * inv_freq.to(device)  # (D/2,) fp32
    angles = torch.cat((angles, angles))
    return angles.cos(), angles.sin()
