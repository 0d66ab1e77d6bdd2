"""KVQuant: pre-RoPE per-channel keys, per-token values, a calibrated non-uniform datatype and
dense-and-sparse outliers.

Hooper, Kim, Mohammadzadeh, Mahoney, Shao, Keutzer, Gholami, "KVQuant: Towards 10 Million Context
Length LLM Inference with KV Cache Quantization", NeurIPS 2024, arXiv 2401.18079 (official code
SqueezeAILab/KVQuant, `quant/`; spec: reference/methods.md §4.3 and methods-2.md §13.1).

Spec, as the official simulation (`llama_simquant.py`, `simquant_module_quantizer.py`):
  * Keys are quantized *before* RoPE, per channel, with offline-calibrated statistics: per (KV head,
    channel) outlier thresholds at the t and 1 - t quantiles of the calibration keys,
    t = 1 - outlier_ratio / 2; zero = (upper + lower) / 2, scale = (upper - lower) / 2; the key
    normalised to (k - zero) / scale is rounded to the nearest of 2^k_bits centroids. HF hands the
    cache post-RoPE keys: they are rotated back by their positions (methods/rope.py, fp32), quantized,
    and re-rotated at their positions when attention reads them (the deployment kernels
    dequantize, then apply RoPE).
  * Values are quantized per token (over the whole v_proj output of the token, all KV heads, as
    the official hook), with thresholds computed online from the token's own quantiles
    (`dynamicquantization=True`), scale/zero stored in fp16 per token.
  * NUQ datatype: one codebook per layer and tensor (keys, values), 2^bits centroids from k-means
    on the normalised, outlier-free calibration activations (`prepare`, cached on disk).
  * Dense-and-sparse: elements outside the thresholds (`outlier_ratio` of them; 0.01 = the paper's
    "-1%", `--sparsity-threshold 0.99`) are kept exactly in fp16 in a sparse list (token index
    int32, head*channel int16, value fp16 = 8 bytes each). With outlier_ratio = 0 the range is
    min-max (official: without `--include_sparse`).
  * `first_fp16_tokens`: the first N tokens kept exact (official `--first_few_fp16`, off by
    default in the code, "e.g. 5" in the README, 1 for the DBRX checkpoints). Default here: 1, the
    attention-sink token (our choice for any model, not tuned here; 0 = the code's default).
  * As in the official simulation, a token's own K/V are quantized before it attends.
Bits: `k_bits`, `v_bits` in {2, 3, 4}; codes are packed as a little-endian bit stream per token
(b bits per element, D * b / 8 bytes per head vector; at 2 and 4 bits this is KIVI's byte layout,
`methods/kernels/kivi_quant.py`, which the tests check). KIVI's quantizer itself (uniform min-max
groups, 2/4/8 bits) does not fit a codebook datatype or 3 bits, so only the layout is shared.

KV held (`stats()`): packed codes + value scales/zeros (fp16) + sparse outliers + the exact first
tokens + this layer's share of the calibrated constants (per-channel key zero/scale and both
codebooks, fp16). Nothing is evicted.

Paper's numbers: < 0.1 PPL degradation at 3 bits (nuq3-1%) on WikiText-2/C4 for LLaMA, Llama-2 and
Mistral; DBRX WikiText-2 fp16 3.96 / nuq4-1% 3.98 / nuq3-1% 4.03 / nuq2-1% 4.26 (code README).

Deliberate deviations:
  * Unweighted k-means (the official `--fisher` weights samples by squared gradients; `prepare`
    gets no backward pass here). Without `--fisher` the official code also runs plain k-means.
  * Calibration text: WikiText-2 *train* is not available offline and the test split is the
    evaluation text, so the default is PG-19's first book (as InfiniGen); `calibration_path` may
    name a file or a folder of .txt files; as many samples of `calibration_tokens` as the text
    holds, up to `calibration_samples` (official 16 x 2048), recorded in the prepare facts.
    k-means runs on at most 2^20 sampled points per codebook (seeded).
  * No Q-Norm (`--norm`, mainly for 2 bits) and no per-token outlier cap (`--cap_outliers`).
  * Dequantize-then-attend in torch (the paper's fused CUDA kernels are not reproduced): the
    transient dequantized copy is not counted as held.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from kvcore.errors import ConfigError
from methods.base import Capabilities, KVLayer, KVMethod, ModelInfo
from methods.rope import rotate

log = logging.getLogger(__name__)
ALLOWED_BITS = (2, 3, 4)
FORMAT_VERSION = 1
KMEANS_POINTS = 1 << 20
KMEANS_ITERS = 50


# --------------------------------------------------------------------------------------------
# bit packing (little-endian bit stream; at 2/4 bits identical to KIVI's byte layout)
def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., N) integer codes < 2^bits -> (..., N * bits / 8) uint8; N * bits % 8 == 0."""
    n = codes.shape[-1]
    if (n * bits) % 8:
        raise ValueError(f"{n} codes of {bits} bits do not fill whole bytes")
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    stream = (codes.to(torch.int32)[..., None] >> shifts) & 1  # (..., N, bits)
    stream = stream.reshape(*codes.shape[:-1], n * bits // 8, 8)
    weights = 1 << torch.arange(8, device=codes.device, dtype=torch.int32)
    return (stream * weights).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_bits`: (..., N * bits / 8) uint8 -> (..., N) int64 codes."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = (packed.to(torch.int32)[..., None] >> shifts) & 1  # (..., bytes, 8)
    n = packed.shape[-1] * 8 // bits
    stream = stream.reshape(*packed.shape[:-1], n, bits)
    weights = 1 << torch.arange(bits, device=packed.device, dtype=torch.int32)
    return (stream * weights).sum(-1).long()


# --------------------------------------------------------------------------------------------
# the non-uniform datatype
def nearest_centroid(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest of the sorted `centroids` for every element of x."""
    mid = (centroids[1:] + centroids[:-1]) / 2
    return torch.bucketize(x.contiguous(), mid.to(x.dtype))


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


def vector_thresholds(x: torch.Tensor, outlier_ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-vector (last axis) lower/upper thresholds: the 1 - t and t quantiles (min/max at 0)."""
    if outlier_ratio == 0:
        return x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    t = 1 - outlier_ratio / 2
    q = torch.quantile(x.float(), torch.tensor([1 - t, t], device=x.device), dim=-1, keepdim=True)
    return q[0], q[1]


@dataclass
class Calibration:
    """Per-model constants (fp16, as held): key zero/scale per (layer, KV head, channel) and one
    codebook per layer for keys and values."""

    key_zero: torch.Tensor  # (L, H_kv, D)
    key_scale: torch.Tensor  # (L, H_kv, D)
    key_codebook: torch.Tensor  # (L, 2^k_bits)
    value_codebook: torch.Tensor  # (L, 2^v_bits)

    def tensors(self):
        return self.key_zero, self.key_scale, self.key_codebook, self.value_codebook

    def layer_bytes(self) -> int:
        return sum(t[0].nbytes for t in self.tensors())


# --------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class _CaptureMethod(KVMethod):
    """Plain full-cache layers: after one forward they hold the post-RoPE keys and the values."""

    name = "kvquant_capture"


@dataclass(kw_only=True)
class KVQuant(KVMethod):
    """KVQuant: nuq keys (pre-RoPE, per channel) and values (per token), dense-and-sparse."""

    name: ClassVar[str] = "kvquant"
    provenance: ClassVar[str] = "official code"
    operating_point: ClassVar[str] = (
        "SqueezeAILab/KVQuant: LLaMA-7B..65B, Llama-2; 2..4-bit non-uniform, 1 % "
        "outliers; WikiText-2 / C4 perplexity, 2K..128K"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(needs_prepare=True, needs_rope=True)
    axis_keys: ClassVar[tuple[str, ...]] = ("k_bits", "v_bits")

    k_bits: int = 4
    v_bits: int = 4
    outlier_ratio: float = 0.01
    first_fp16_tokens: int = 1
    calibration_path: str | None = None
    calibration_tokens: int = 2048
    calibration_samples: int = 16
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self._cal: Calibration | None = None
        self._inv_freq: torch.Tensor | None = None

    def check_hyperparameters(self) -> list[str]:
        r = []
        for key in ("k_bits", "v_bits"):
            if getattr(self, key) not in ALLOWED_BITS:
                r.append(f"method.{key}={getattr(self, key)!r}; allowed: 2, 3, 4")
        o = self.outlier_ratio
        if not isinstance(o, (int, float)) or not 0 <= o < 0.5:
            r.append(f"method.outlier_ratio={o!r} must be in [0, 0.5) (0.01 = the paper's 1 %)")
        if not isinstance(self.first_fp16_tokens, int) or self.first_fp16_tokens < 0:
            r.append(f"method.first_fp16_tokens={self.first_fp16_tokens!r} must be an integer >= 0")
        if not isinstance(self.calibration_tokens, int) or self.calibration_tokens < 16:
            r.append(f"method.calibration_tokens={self.calibration_tokens!r} must be >= 16")
        if not isinstance(self.calibration_samples, int) or self.calibration_samples < 1:
            r.append(f"method.calibration_samples={self.calibration_samples!r} must be >= 1")
        return r

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict[str, Any]:
        """Every token inside the exact first-tokens store: nothing is quantized."""
        return {"first_fp16_tokens": seq_tokens, "calibration_tokens": 64,
                "calibration_samples": 1}

    def validate(self, info: ModelInfo, runner: dict[str, Any]) -> list[str]:
        reasons = super().validate(info, runner)
        if info.rope_theta is None:
            reasons.append(f"method=kvquant quantizes pre-RoPE keys: {info.model_type} has no RoPE")
        for key in ("k_bits", "v_bits"):
            if (info.head_dim * getattr(self, key)) % 8:
                reasons.append(f"method.{key}={getattr(self, key)}: head_dim={info.head_dim} codes "
                               "do not fill whole bytes")
        if self.calibration_path and not Path(self.calibration_path).exists():
            reasons.append(f"method.calibration_path={self.calibration_path}: no such file or "
                           "folder")
        return reasons

    # --- offline calibration ------------------------------------------------------------------
    def prepare(self, ctx) -> dict:
        if ctx.rope_inv_freq is None:
            raise ConfigError("method=kvquant un-rotates keys: this model has no plain RoPE (none "
                              "or a scaled variant)")
        t0 = time.time()
        samples, source = self._calibration_samples(ctx)
        key = hashlib.sha256(json.dumps({
            "v": FORMAT_VERSION, "model": ctx.fingerprint, "k": self.k_bits, "vb": self.v_bits,
            "o": self.outlier_ratio, "ids": hashlib.sha256(torch.stack(samples).numpy().tobytes())
            .hexdigest()}).encode()).hexdigest()[:24]
        root = Path(self.cache_dir or ctx.cache_dir or os.environ.get("KVH_CACHE_DIR")
                    or Path.home() / ".cache" / "kv-harness") / "kvquant"
        path = root / f"{key}.pt"
        self._cal = _load(path, ctx.info, self)
        status = "loaded"
        if self._cal is None:
            self._cal = self._calibrate(ctx, samples)
            _save(path, self._cal)
            status = "computed"
        self._cal = Calibration(*(t.to(ctx.device) for t in self._cal.tensors()))
        self._inv_freq = ctx.rope_inv_freq.to(ctx.device)
        return {"calibration": status, "calibration_path": str(path), "calibration_source": source,
                "calibration_samples": len(samples),
                "calibration_tokens": int(sum(s.numel() for s in samples)),
                "kmeans_weighting": "none (official without --fisher)",
                "prepare_s": round(time.time() - t0, 3)}

    def _calibration_samples(self, ctx) -> tuple[list[torch.Tensor], str]:
        length = min(self.calibration_tokens, ctx.info.max_positions or self.calibration_tokens)
        if ctx.calibration_ids is not None:
            ids, source = torch.as_tensor(ctx.calibration_ids).flatten(), "ctx.calibration_ids"
        elif ctx.tokenizer is None:  # models built in code (tests): seeded random tokens
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(3, ctx.vocab_size, (length * self.calibration_samples,), generator=g)
            source = "seeded random token ids (no tokenizer)"
        else:
            path = self._calibration_file(ctx.data_dir)
            files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
            text = "\n\n".join(f.read_text(encoding="utf-8") for f in files)
            ids = torch.tensor(ctx.tokenizer(text, verbose=False)["input_ids"])
            source = str(path)
        n = min(self.calibration_samples, max(1, ids.numel() // length))
        return [ids[i * length:(i + 1) * length] for i in range(n)], source

    def _calibration_file(self, data_dir) -> Path:
        default = None if data_dir is None else Path(data_dir) / "pg19" / "pg19_firstbook.txt"
        path = Path(self.calibration_path) if self.calibration_path else default
        if path is None or not path.exists():
            raise ConfigError(f"method.calibration_path={path}: no such file or folder (KVQuant's "
                              "calibration text; default: PG-19's first book in ../shared/data)")
        return path

    def _calibrate(self, ctx, samples: list[torch.Tensor]) -> Calibration:
        info = ctx.info
        keys = [[] for _ in range(info.num_layers)]  # pre-RoPE (T, H_kv, D) per sample
        values = [[] for _ in range(info.num_layers)]  # (T * H_kv, D)
        for ids in samples:
            layers = ctx.capture(_CaptureMethod(), ids)
            pos = torch.arange(ids.numel(), dtype=torch.float32)
            for i, layer in enumerate(layers):
                k = rotate(layer.keys[0].float().cpu(), -pos, ctx.rope_inv_freq)  # (H_kv, T, D)
                keys[i].append(k.transpose(0, 1).half())
                v = layer.values[0].float().cpu().transpose(0, 1)  # (T, H_kv, D)
                values[i].append(v.reshape(v.shape[0], -1).half())  # per token: v_proj output
        out = {"kz": [], "ks": [], "kc": [], "vc": []}
        for i in range(info.num_layers):
            k = torch.cat(keys[i]).float()  # (N, H_kv, D)
            lower, upper = vector_thresholds(k.permute(1, 2, 0), self.outlier_ratio)  # per channel
            zero, scale = ((upper + lower) / 2)[..., 0].half(), ((upper - lower) / 2)[..., 0].half()
            kn = (k - zero.float()) / _safe(scale.float())
            out["kc"].append(kmeans_1d(kn[kn.abs() <= 1], 1 << self.k_bits, seed=i))
            v = torch.cat(values[i]).float()  # (N, H_kv * D)
            vz, vs, _ = _value_normalise(v, self.outlier_ratio)
            vn = (v - vz) / _safe(vs)
            out["vc"].append(kmeans_1d(vn[vn.abs() <= 1], 1 << self.v_bits, seed=i))
            out["kz"].append(zero)
            out["ks"].append(scale)
        return Calibration(torch.stack(out["kz"]), torch.stack(out["ks"]),
                           torch.stack(out["kc"]).half(), torch.stack(out["vc"]).half())

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        if self._cal is None:
            raise RuntimeError("kvquant: call prepare(ctx) first (it calibrates the datatype)")
        return KVQuantLayer(layer_idx, info, self)


def _safe(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _value_normalise(v: torch.Tensor, outlier_ratio: float):
    """Per-vector zero/scale (fp16-rounded, as stored) and the outlier mask (official dynamic rule:
    at or beyond the thresholds; none at outlier_ratio 0)."""
    lower, upper = vector_thresholds(v, outlier_ratio)
    zero, scale = ((upper + lower) / 2).half().float(), ((upper - lower) / 2).half().float()
    if outlier_ratio == 0:
        outliers = torch.zeros_like(v, dtype=torch.bool)
    else:
        outliers = (v <= lower) | (v >= upper)
    return zero, scale, outliers


# --------------------------------------------------------------------------------------------
class KVQuantLayer(KVLayer):
    """One layer: packed key/value codes per token `(B, H_kv, T, D * bits / 8)`, value zero/scale
    `(B, 1, T, 1)` fp16, sparse outliers, and the exact first tokens `(B, H_kv, T_0, D)`."""

    def __init__(self, layer_idx: int, info: ModelInfo, method: KVQuant):
        super().__init__(layer_idx, info)
        self.method = method
        cal = method._cal
        self.key_zero = cal.key_zero[layer_idx][None, :, None, :]  # (1, H_kv, 1, D)
        self.key_scale = cal.key_scale[layer_idx][None, :, None, :]
        self.key_codebook, self.value_codebook = cal.key_codebook[layer_idx], cal.value_codebook[
            layer_idx]
        self.constants_bytes = cal.layer_bytes()
        self.exact_k = self.exact_v = None  # (B, H_kv, T_0, D) first tokens, compute dtype
        self.k_codes = self.v_codes = None  # (B, H_kv, T_q, D * bits / 8) uint8
        self.v_zero = self.v_scale = None  # (B, 1, T_q, 1) fp16, per token
        # sparse outliers, COO (token position int32, head * D + channel int16, value fp16)
        self.outliers: dict[str, tuple | None] = {"k": None, "v": None}

    # --- quantize ------------------------------------------------------------------------------
    def _quantize_keys(self, keys: torch.Tensor, positions: torch.Tensor):
        pre = rotate(keys, -positions.to(keys.device).float(), self.method._inv_freq).float()
        zero, scale = self.key_zero.float(), self.key_scale.float()
        norm = (pre - zero) / _safe(scale)
        outliers = (norm.abs() > 1) if self.method.outlier_ratio > 0 else torch.zeros_like(
            norm, dtype=torch.bool)  # official static rule: strictly beyond the thresholds
        codes = nearest_centroid(norm, self.key_codebook.float())
        return pack_bits(codes, self.method.k_bits), self._sparse(pre, outliers, positions)

    def _quantize_values(self, values: torch.Tensor, positions: torch.Tensor):
        """Per token over all KV heads (the official hook sits on the v_proj output)."""
        v = values.float()
        b, h, t, d = v.shape
        per_token = v.transpose(1, 2).reshape(b, t, h * d)
        zero, scale, outliers = _value_normalise(per_token, self.method.outlier_ratio)
        zero, scale = zero[:, None], scale[:, None]  # (B, 1, T, 1)
        outliers = outliers.reshape(b, t, h, d).transpose(1, 2)
        codes = nearest_centroid((v - zero) / _safe(scale), self.value_codebook.float())
        return (pack_bits(codes, self.method.v_bits), zero.half(), scale.half(),
                self._sparse(v, outliers, positions))

    @staticmethod
    def _sparse(x: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor):
        """COO of the outliers of x (1, H_kv, T, D): token position, head * D + channel, fp16."""
        _, h, t, d = mask.nonzero(as_tuple=True)
        if h.numel() == 0:
            return None
        token = positions.to(t.device)[t].to(torch.int32)
        lane = (h * x.shape[-1] + d).to(torch.int16)
        return token, lane, x[0, h, t, d].half()

    # --- dequantize ----------------------------------------------------------------------------
    def _dequantize(self, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        first = 0 if self.exact_k is None else self.exact_k.shape[-2]
        kc = self.key_codebook.float()[unpack_bits(self.k_codes, self.method.k_bits)]
        k = kc * self.key_scale.float() + self.key_zero.float()
        vc = self.value_codebook.float()[unpack_bits(self.v_codes, self.method.v_bits)]
        v = vc * self.v_scale.float() + self.v_zero.float()
        for target, sparse in ((k, self.outliers["k"]), (v, self.outliers["v"])):
            if sparse is not None:
                token, lane, val = sparse
                d, lane = target.shape[-1], lane.long()
                target[0, lane // d, token.long() - first, lane % d] = val.float()
        positions = torch.arange(first, first + k.shape[-2], device=k.device, dtype=torch.float32)
        k = rotate(k, positions, self.method._inv_freq)
        return k.to(dtype), v.to(dtype)

    # --- cache seam ----------------------------------------------------------------------------
    def update(self, keys, values, position_ids):
        q_len = keys.shape[-2]
        positions = torch.arange(self.seen_tokens, self.seen_tokens + q_len)
        self.seen_tokens += q_len
        n_exact = max(0, min(q_len, self.method.first_fp16_tokens - int(positions[0])))
        if n_exact:
            self.exact_k = _cat(self.exact_k, keys[:, :, :n_exact])
            self.exact_v = _cat(self.exact_v, values[:, :, :n_exact])
        if n_exact < q_len:
            pos = positions[n_exact:]
            k_codes, k_sparse = self._quantize_keys(keys[:, :, n_exact:], pos)
            v_codes, v_zero, v_scale, v_sparse = self._quantize_values(values[:, :, n_exact:], pos)
            self.k_codes, self.v_codes = _cat(self.k_codes, k_codes), _cat(self.v_codes, v_codes)
            self.v_zero, self.v_scale = _cat(self.v_zero, v_zero), _cat(self.v_scale, v_scale)
            for name, sparse in (("k", k_sparse), ("v", v_sparse)):
                held = self.outliers[name]
                if sparse is not None:
                    self.outliers[name] = sparse if held is None else tuple(
                        torch.cat([a, b]) for a, b in zip(held, sparse))
        if self.k_codes is None:
            return self.exact_k, self.exact_v
        k, v = self._dequantize(keys.dtype)
        if self.exact_k is not None:
            k, v = torch.cat([self.exact_k, k], -2), torch.cat([self.exact_v, v], -2)
        return k, v

    def kept_tokens(self) -> int:
        return self.seen_tokens  # KVQuant evicts nothing

    # --- accounting ----------------------------------------------------------------------------
    def allowed_tokens(self) -> int | None:
        return None  # bits, not tokens

    def stats(self) -> dict[str, int]:
        parts = [self.exact_k, self.exact_v, self.k_codes, self.v_codes, self.v_zero, self.v_scale]
        held = sum(p.nbytes for p in parts if p is not None)
        held += sum(sum(t.nbytes for t in o) for o in self.outliers.values() if o is not None)
        held += self.constants_bytes if self.seen_tokens else 0
        return {"kv_tokens": self.seen_tokens, "kv_bytes": int(held)}


def _cat(held, new):
    return new if held is None else torch.cat([held, new], dim=-2)


def _save(path: Path, cal: Calibration) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        torch.save({"version": FORMAT_VERSION, "tensors": list(cal.tensors())}, tmp)
        os.replace(tmp, path)  # atomic
    finally:
        Path(tmp).unlink(missing_ok=True)


def _load(path: Path, info: ModelInfo, method: KVQuant) -> Calibration | None:
    if not path.is_file():
        return None
    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True)["tensors"]
        cal = Calibration(*tensors)
    except Exception as exc:  # unreadable: recalibrate
        log.warning("kvquant calibration %s unreadable (%s): recomputing", path, exc)
        return None
    shapes = [(info.num_layers, info.num_kv_heads, info.head_dim)] * 2 + [
        (info.num_layers, 1 << method.k_bits), (info.num_layers, 1 << method.v_bits)]
    if [tuple(t.shape) for t in cal.tensors()] != shapes or not all(
            torch.isfinite(t.float()).all() for t in cal.tensors()):
        log.warning("kvquant calibration %s does not fit this model: recomputing", path)
        return None
    return cal
