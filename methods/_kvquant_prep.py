"""KVQuant's offline calibration (methods/kvquant.py): the non-uniform datatype, per-channel key
ranges, Q-Norm, and the on-disk cache of the constants.

Official code: SqueezeAILab/KVQuant `quant/kvquant/simquant_module_quantizer.py` (`SimQuant
.quantize`: percentile thresholds, k-means on the normalised outlier-free activations, Q-Norm).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from methods import _artefacts as artefacts
from methods.model import ModelInfo
from methods.rope import rotate

log = logging.getLogger(__name__)
FORMAT_VERSION = 2  # 2: Q-Norm (scale, offset) per layer and tensor
KMEANS_POINTS = 1 << 20
KMEANS_ITERS = 50


# --------------------------------------------------------------------------------------------
# the non-uniform datatype
def nearest_centroid(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest of the sorted `centroids` for every element of x (ties: the lower)."""
    return torch.bucketize(x.contiguous(), midpoints(centroids).to(x.dtype))


def midpoints(centroids: torch.Tensor) -> torch.Tensor:
    """The rounding boundaries of sorted centroids (bucketize against them = nearest_centroid)."""
    return (centroids[1:] + centroids[:-1]) / 2


def kmeans_1d(points: torch.Tensor, k: int, seed: int = 0) -> torch.Tensor:
    """Sorted k-means centroids of 1-D points (init at the (i + 0.5)/k quantiles; Lloyd)."""
    points = points.flatten().float()
    if points.numel() > KMEANS_POINTS:
        g = torch.Generator().manual_seed(seed)
        points = points[torch.randperm(points.numel(), generator=g)[:KMEANS_POINTS]]
    if points.numel() == 0:
        return torch.linspace(-1, 1, k)
    points = points.sort().values
    centroids = torch.quantile(points, (torch.arange(k) + 0.5) / k)
    for _ in range(KMEANS_ITERS):
        idx = nearest_centroid(points, centroids)
        sums = torch.zeros(k).index_add_(0, idx, points)
        counts = torch.bincount(idx, minlength=k).float()
        new = torch.where(counts > 0, sums / counts.clamp(min=1), centroids)
        new = new.sort().values
        if torch.allclose(new, centroids, atol=1e-7):
            break
        centroids = new
    return centroids


def q_norm(points: torch.Tensor, codebook: torch.Tensor) -> tuple[float, float]:
    """Q-Norm (official `--norm`, used by the 2-bit checkpoints): the (scale, offset) that give the
    quantized calibration points the mean and standard deviation of the points themselves.

    Official (`SimQuant.quantize`, one pair per layer and tensor): over the normalised non-outlier
    calibration elements x, m1 = mean(x), s1 = std(x); q = the nearest centroid of each x,
    m2 = mean(q), s2 = std(q) (both population std); scale = s1 / s2, offset = m1 - m2 * scale;
    dequantization then reads centroid * scale + offset. Rounding still uses the centroids."""
    x = points.flatten().double()
    if x.numel() == 0:
        return 1.0, 0.0
    q = codebook.double()[nearest_centroid(x, codebook.double())]
    m1, s1 = x.mean(), x.std(unbiased=False)
    m2, s2 = q.mean(), q.std(unbiased=False)
    scale = s1 / s2 if s2 > 0 else torch.ones((), dtype=torch.float64)
    return float(scale), float(m1 - m2 * scale)


def vector_thresholds(x: torch.Tensor, outlier_ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-vector (last axis) lower/upper thresholds: the 1 - t and t quantiles (min/max at 0)."""
    if outlier_ratio == 0:
        return x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    q = torch.quantile(x.float(), _quantile_points(outlier_ratio, x.device), dim=-1, keepdim=True)
    return q[0], q[1]


@functools.lru_cache(maxsize=8)
def _quantile_points(outlier_ratio: float, device: torch.device) -> torch.Tensor:
    """(1 - t, t), t = 1 - outlier_ratio / 2 (built once: a decode step quantizes every layer)."""
    t = 1 - outlier_ratio / 2
    return torch.tensor([1 - t, t], device=device)


def safe(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def value_normalise(v: torch.Tensor, outlier_ratio: float):
    """Per-vector zero/scale (fp16-rounded, as stored) and the outlier mask (official dynamic rule:
    at or beyond the thresholds; none at outlier_ratio 0)."""
    lower, upper = vector_thresholds(v, outlier_ratio)
    zero, scale = ((upper + lower) / 2).half().float(), ((upper - lower) / 2).half().float()
    if outlier_ratio == 0:
        outliers = torch.zeros_like(v, dtype=torch.bool)
    else:
        outliers = (v <= lower) | (v >= upper)
    return zero, scale, outliers


@dataclass
class Calibration:
    """Per-model constants: key zero/scale per (layer, KV head, channel) and one codebook per layer
    for keys and values (fp16, as held), and each codebook's Q-Norm (scale, offset) (fp32;
    (1, 0) without Q-Norm)."""

    key_zero: torch.Tensor  # (L, H_kv, D)
    key_scale: torch.Tensor  # (L, H_kv, D)
    key_codebook: torch.Tensor  # (L, 2^k_bits)
    value_codebook: torch.Tensor  # (L, 2^v_bits)
    key_norm: torch.Tensor  # (L, 2)
    value_norm: torch.Tensor  # (L, 2)

    def tensors(self):
        return (self.key_zero, self.key_scale, self.key_codebook, self.value_codebook,
                self.key_norm, self.value_norm)

    def layer_bytes(self) -> int:
        return sum(t[0].nbytes for t in self.tensors())

    def decode_codebooks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The values codes dequantize to (fp32): each codebook with its Q-Norm applied."""
        return tuple(cb[layer].float() * norm[layer, 0] + norm[layer, 1]
                     for cb, norm in ((self.key_codebook, self.key_norm),
                                      (self.value_codebook, self.value_norm)))


def calibrate(ctx, samples: list[torch.Tensor], method, capture_method) -> Calibration:
    """The constants from the calibration samples (`method`: KVQuant's knobs; `capture_method`:
    plain full-cache layers holding one forward's post-RoPE keys and values)."""
    info = ctx.info
    keys = [[] for _ in range(info.num_layers)]  # pre-RoPE (T, H_kv, D) per sample
    values = [[] for _ in range(info.num_layers)]  # (T * H_kv, D)
    for ids in samples:
        layers = ctx.capture(capture_method, ids)
        pos = torch.arange(ids.numel(), dtype=torch.float32)
        for i, layer in enumerate(layers):
            k = rotate(layer.keys[0].float().cpu(), -pos, ctx.rope_inv_freq)  # (H_kv, T, D)
            keys[i].append(k.transpose(0, 1).half())
            v = layer.values[0].float().cpu().transpose(0, 1)  # (T, H_kv, D)
            values[i].append(v.reshape(v.shape[0], -1).half())  # per token: v_proj output
    out = {name: [] for name in ("kz", "ks", "kc", "vc", "kn", "vn")}
    k_norm, v_norm = method.q_norm_on(method.k_bits), method.q_norm_on(method.v_bits)
    for i in range(info.num_layers):
        k = torch.cat(keys[i]).float()  # (N, H_kv, D)
        lower, upper = vector_thresholds(k.permute(1, 2, 0), method.outlier_ratio)  # per channel
        zero, scale = ((upper + lower) / 2)[..., 0].half(), ((upper - lower) / 2)[..., 0].half()
        kn = (k - zero.float()) / safe(scale.float())
        kn = kn[kn.abs() <= 1]  # the outlier-free elements
        codebook = kmeans_1d(kn, 1 << method.k_bits, seed=i).half()
        out["kc"].append(codebook)
        out["kn"].append(q_norm(kn, codebook.float()) if k_norm else (1.0, 0.0))
        v = torch.cat(values[i]).float()  # (N, H_kv * D)
        vz, vs, _ = value_normalise(v, method.outlier_ratio)
        vn = (v - vz) / safe(vs)
        vn = vn[vn.abs() <= 1]
        codebook = kmeans_1d(vn, 1 << method.v_bits, seed=i).half()
        out["vc"].append(codebook)
        out["vn"].append(q_norm(vn, codebook.float()) if v_norm else (1.0, 0.0))
        out["kz"].append(zero)
        out["ks"].append(scale)
    return Calibration(torch.stack(out["kz"]), torch.stack(out["ks"]), torch.stack(out["kc"]),
                       torch.stack(out["vc"]), torch.tensor(out["kn"], dtype=torch.float32),
                       torch.tensor(out["vn"], dtype=torch.float32))


def save(path: Path, cal: Calibration) -> None:
    payload = {"version": FORMAT_VERSION, "tensors": list(cal.tensors())}
    artefacts.save(path, lambda tmp: torch.save(payload, tmp), "kvquant calibration")


def load(path: Path, info: ModelInfo, k_bits: int, v_bits: int) -> Calibration | None:
    """The cached constants, or None (absent, unreadable or not this model's: recalibrate)."""
    try:
        payload = artefacts.load(path)
        if payload is None:
            return None
        cal = Calibration(*payload["tensors"])
    except Exception as exc:  # unreadable: recalibrate
        log.warning("kvquant calibration %s unreadable (%s): recomputing", path, exc)
        return None
    shapes = [(info.num_layers, info.num_kv_heads, info.head_dim)] * 2 + [
        (info.num_layers, 1 << k_bits), (info.num_layers, 1 << v_bits)] + [
        (info.num_layers, 2)] * 2
    if [tuple(t.shape) for t in cal.tensors()] != shapes or not all(
            torch.isfinite(t.float()).all() for t in cal.tensors()):
        log.warning("kvquant calibration %s does not fit this model: recomputing", path)
        return None
    return cal
