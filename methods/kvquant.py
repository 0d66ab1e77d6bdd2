"""KVQuant: pre-RoPE per-channel keys, per-token values, a calibrated non-uniform datatype and
dense-and-sparse outliers.

Hooper, Kim, Mohammadzadeh, Mahoney, Shao, Keutzer, Gholami, "KVQuant: Towards 10 Million Context
Length LLM Inference with KV Cache Quantization", NeurIPS 2024, arXiv 2401.18079 (official code
github.com/SqueezeAILab/KVQuant: `quant/` the simulation, `deployment/` the CUDA kernels).

From the official code (`quant/llama_simquant.py`, `quant/kvquant/simquant_module_quantizer.py`):
  * Keys are quantized *before* RoPE, per channel, with offline-calibrated statistics: per (KV head,
    channel) outlier thresholds at the t and 1 - t quantiles of the calibration keys,
    t = 1 - outlier_ratio / 2; zero = (upper + lower) / 2, scale = (upper - lower) / 2; the key
    normalised to (k - zero) / scale is rounded to the nearest of 2^k_bits centroids. HF hands the
    cache post-RoPE keys: they are rotated back by their positions (methods/rope.py, fp32) and
    quantized; attention applies RoPE to them again on the fly (below).
  * Values are quantized per token (over the whole v_proj output of the token, all KV heads, as
    the official hook), with thresholds computed online from the token's own quantiles
    (`dynamicquantization=True`), scale/zero stored in fp16 per token.
  * NUQ datatype: one codebook per layer and tensor (keys, values), 2^bits centroids from k-means
    on the normalised, outlier-free calibration activations (`prepare`, cached on disk;
    methods/_kvquant_prep.py).
  * Q-Norm (`q_norm`; official `--norm`, "for the 2-bit checkpoints, Q-Norm is used" in
    `quant/README.md`): per layer and tensor, a scale and offset computed at calibration so that
    the dequantized normalised calibration elements keep their mean and standard deviation
    (`_kvquant_prep.q_norm`); rounding still uses the plain centroids. Default (`null`): on for a
    tensor quantized at 2 bits, off otherwise (the official flag is one switch for both tensors,
    which share `--abits`). The released `--norm` calibration calls
    `round_to_nearest_pole_sim(..., return_freq=True)`, which that function does not accept, so
    it cannot run as released; the formulas are those of the lines around that call.
  * Dense-and-sparse: elements outside the thresholds (`outlier_ratio` of them; 0.01 = the paper's
    "-1%", `--sparsity-threshold 0.99`) are kept exactly in fp16 in a sparse list (token index
    int32, head*channel int16, value fp16 = 8 bytes each), sorted by token. With outlier_ratio = 0
    the range is min-max (official: without `--include_sparse`).
  * `first_fp16_tokens`: the first N tokens kept exact (official `--first_few_fp16`, off by
    default in the code, "e.g. 5" in the README, 1 for the DBRX checkpoints). Default here: 1, the
    attention-sink token (our choice for any model, not tuned here; 0 = the code's default).
  * As in the official simulation, a token's own K/V are quantized before it attends (decode
    steps; prompts under `runner.prefill=chunked|sparse`). Under the default protocol
    (`runner.prefill=dense`) a prompt is attended in full and quantized once, at its end, from
    the whole prompt's exact K/V: the codes are then a function of the prompt's K/V alone,
    whatever `runner.prefill_chunk_tokens` is.
  * Decode attention from the codes with RoPE fused (official `deployment/kvquant/
    quant_cuda_kernel.cu`, `...RopeMHABatchedFusedOpt`: the pre-RoPE key codes looked up and
    multiplied by the RoPE-weighted query on the fly, the sparse outliers added by an SpMV with
    RoPE, `SPMV_ATOMIC_CSR_ROPE_BALANCED`). Ours (methods/kernels/kvquant_attention.py, written
    anew, one call per layer and step, softmax and p.V included): a C kernel on CPU
    (methods/kernels/kvquant_cpu.c: with AVX-512 the codes become codebook values by an
    in-register table lookup, each key is dequantized, rotated and dotted with the g query heads
    in registers, outliers added as corrections; a portable path patches them into 16-token L1
    blocks), a fused Triton kernel on CUDA (the official coefficient form, split-K, online
    softmax, in-tile outlier corrections), and the dequantize-rotate-attend torch path as the
    reference and the fallback without a compiler; metrics.json records which ran
    (`prepare.decode_attention`). cos/sin come from one table per position with the model's own
    fp32 angles (the official kernel computes cosf(theta * pos) in the kernel), so the rotation
    is the very one the model applied; prefill chunks (and any attention with a mask)
    dequantize the whole cache and run the model's attention.
Bits: `k_bits`, `v_bits` in {2, 3, 4}; codes are packed as a little-endian bit stream per token
(b bits per element, D * b / 8 bytes per head vector; at 2 and 4 bits this is KIVI's byte layout,
`methods/kernels/kivi_quant.py`, which the tests check). KIVI's quantizer itself (uniform min-max
groups, 2/4/8 bits) does not fit a codebook datatype or 3 bits, so only the layout is shared.

KV held (`stats()`): packed codes + value scales/zeros (fp16) + sparse outliers + the exact first
tokens + this layer's share of the calibrated constants (per-channel key zero/scale and both
codebooks, fp16; the Q-Norm pairs, fp32). Nothing is evicted. Codes, scales and outliers grow in
buffers with amortised capacity (`kv_bytes_allocated`); nothing is re-concatenated per step.

Paper's numbers: < 0.1 PPL degradation at 3 bits (nuq3-1%) on WikiText-2/C4 for LLaMA, Llama-2 and
Mistral; DBRX WikiText-2 fp16 3.96 / nuq4-1% 3.98 / nuq3-1% 4.03 / nuq2-1% 4.26 (code README).

Deliberate deviations (ours):
  * Unweighted k-means (the official `--fisher` weights samples by squared gradients; `prepare`
    gets no backward pass here). Without `--fisher` the official code also runs plain k-means.
  * Calibration text: WikiText-2 *train* is not available offline and the test split is the
    evaluation text, so the default is PG-19's first book (as InfiniGen); `calibration_path` may
    name a file or a folder of .txt files; as many samples of `calibration_tokens` as the text
    holds, up to `calibration_samples` (official 16 x 2048), recorded in the prepare facts.
    k-means runs on at most 2^20 sampled points per codebook (seeded); Q-Norm's statistics use
    every outlier-free element (as the official).
  * No per-token outlier cap (`--cap_outliers`).
  * The dequantized copy prefill chunks attend over is transient and not counted as held.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

import torch

from kvcore.errors import ConfigError
from kvcore.storage import ContiguousRows
from methods import _artefacts as artefacts
from methods import _kvquant_prep as prep
from methods import _sidefiles as sidefiles
from methods._kvquant_prep import (Calibration, kmeans_1d, nearest_centroid,  # noqa: F401
                                   q_norm, safe, value_normalise)
from methods.base import KVMethod
from methods.capabilities import Capabilities, ServingNeeds
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.kernels.kvquant_attention import (KVQuantCache, decode_attention, decode_kernel,
                                               dequantize_cache, pack_bits, rope_table,
                                               unpack_bits)  # noqa: F401
from methods.rope import rotate
from methods.scoring import plain_decode_row

KVQuantBits = Literal[2, 3, 4]
ALLOWED_BITS = get_args(KVQuantBits)


@dataclass(kw_only=True)
class _CaptureMethod(KVMethod):
    """Plain full-cache layers: after one forward they hold the post-RoPE keys and the values."""

    name = "kvquant_capture"


class RopeTable:
    """cos/sin `(P, D/2)` fp32 of every position seen so far (methods/rope.py's angles), grown with
    amortised capacity: a position's row is computed once, then read by every layer and step."""

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq
        self.cos = self.sin = inv_freq.new_empty(0, inv_freq.numel())

    def upto(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of positions [0, positions)."""
        if positions > self.cos.shape[0]:
            capacity = max(positions, 2 * self.cos.shape[0], 256)
            cos, sin = rope_table(torch.arange(capacity, device=self.inv_freq.device),
                                  self.inv_freq)
            self.cos, self.sin = cos, sin
        return self.cos[:positions], self.sin[:positions]


@dataclass(kw_only=True)
class KVQuant(KVMethod):
    """KVQuant: nuq keys (pre-RoPE, per channel) and values (per token), dense-and-sparse."""

    name: ClassVar[str] = "kvquant"
    provenance: ClassVar[str] = "official code"
    family: ClassVar[str] = "quantization"
    summary: ClassVar[str] = (
        "pre-RoPE per-channel keys, per-token values, calibrated non-uniform codes with outliers")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2401.18079"
    code_url: ClassVar[str | None] = "https://github.com/SqueezeAILab/KVQuant"
    operating_point: ClassVar[str] = (
        "SqueezeAILab/KVQuant: LLaMA-7B..65B, Llama-2; 2..4-bit non-uniform, 1 % "
        "outliers; WikiText-2 / C4 perplexity, 2K..128K"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(needs_rope=True)
    serving_needs: ClassVar[ServingNeeds] = ServingNeeds(needs_calibration=True)
    axis_keys: ClassVar[tuple[str, ...]] = ("k_bits", "v_bits")

    k_bits: KVQuantBits = 4
    v_bits: KVQuantBits = 4
    outlier_ratio: float = 0.01
    first_fp16_tokens: int = 1
    q_norm: bool | None = None
    calibration_path: str | None = None
    calibration_tokens: int = 2048
    calibration_samples: int = 16
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self._cal: Calibration | None = None
        self._inv_freq: torch.Tensor | None = None
        self._rope: RopeTable | None = None

    def q_norm_on(self, bits: int) -> bool:
        """Whether a tensor quantized at `bits` uses Q-Norm (null: the official 2-bit setting)."""
        return bits == 2 if self.q_norm is None else bool(self.q_norm)

    def check_hyperparameters(self) -> list[str]:
        r = []
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
        if self.calibration_path and self.calibration_path.strip():
            try:  # UTF-8 text files, before weights load
                self._calibration_texts(Path(self.calibration_path))
            except ConfigError as exc:
                reasons.append(str(exc))
        return reasons

    @staticmethod
    def _calibration_texts(path: Path) -> str:
        if not path.exists():
            raise ConfigError(f"method.calibration_path={path}: no such file or folder (KVQuant's "
                              "calibration text; default: PG-19's first book in ../shared/data)")
        files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
        if not files:
            raise ConfigError(f"method.calibration_path={path}: a folder with no .txt file")
        return "\n\n".join(sidefiles.read_text("method.calibration_path", f) for f in files)

    # --- offline calibration ------------------------------------------------------------------
    artefact_names = ("_cal", "_inv_freq", "_rope")  # what `prepare` sets

    def prepare(self, ctx) -> dict:
        if ctx.rope_inv_freq is None:
            raise ConfigError("method=kvquant un-rotates keys: this model has no plain RoPE (none "
                              "or a scaled variant)")
        t0 = time.time()
        samples, source = self._calibration_samples(ctx)
        norms = [self.q_norm_on(self.k_bits), self.q_norm_on(self.v_bits)]
        key = hashlib.sha256(json.dumps({
            "v": prep.FORMAT_VERSION, "model": ctx.fingerprint, "k": self.k_bits,
            "vb": self.v_bits, "o": self.outlier_ratio, "qn": norms,
            "ids": hashlib.sha256(torch.stack(samples).numpy().tobytes()).hexdigest()
        }).encode()).hexdigest()[:24]
        path = artefacts.cache_root("kvquant", self.cache_dir, ctx.cache_dir) / f"{key}.pt"
        self._cal = prep.load(path, ctx.info, self.k_bits, self.v_bits)
        loaded = self._cal is not None
        if not loaded:
            self._cal = prep.calibrate(ctx, samples, self, _CaptureMethod())
            prep.save(path, self._cal)
        made = artefacts.provenance("kvquant calibration", key, path, self._cal.tensors(), loaded)
        self._cal = Calibration(*(t.to(ctx.device) for t in self._cal.tensors()))
        self.set_rope(ctx.rope_inv_freq.to(ctx.device))
        return {"calibration": made, "calibration_source": source,
                "calibration_samples": len(samples),
                "calibration_tokens": int(sum(s.numel() for s in samples)),
                "kmeans_weighting": "none (official without --fisher)",
                "q_norm": {"keys": norms[0], "values": norms[1]},
                "decode_attention": decode_kernel(torch.device(ctx.device)),
                "prepare_s": round(time.time() - t0, 3)}

    def set_rope(self, inv_freq: torch.Tensor) -> None:
        """The model's RoPE frequencies `(D/2,)` fp32 (prepare sets them; tests may)."""
        self._inv_freq = inv_freq.float()
        self._rope = RopeTable(self._inv_freq)

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
            text = self._calibration_texts(path)
            ids = torch.tensor(ctx.tokenizer(text, verbose=False)["input_ids"])
            source = str(path)
        n = min(self.calibration_samples, max(1, ids.numel() // length))
        return [ids[i * length:(i + 1) * length] for i in range(n)], source

    def _calibration_file(self, data_dir) -> Path:
        return sidefiles.calibration_path(self.calibration_path, data_dir,
                                          "KVQuant's calibration text", folders=True)

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        if self._cal is None:
            raise RuntimeError("kvquant: call prepare(ctx) first (it calibrates the datatype)")
        return KVQuantLayer(layer_idx, info, self)


# Outliers: three columns `(token position int32, head * D + channel int16, value fp16)`, each
# `(n,)`, appended in token order, stored as `(1, 1, n)` rows with amortised growth (plain Rows,
# so a request snapshot forks them like the codes).
def _sparse_columns() -> list[ContiguousRows]:
    return [ContiguousRows() for _ in range(3)]


def _sparse_view(columns: list[ContiguousRows]) -> tuple[torch.Tensor, ...] | None:
    if not columns[0].length:
        return None
    return tuple(column.view()[0, 0] for column in columns)


class KVQuantLayer(KVLayer):
    """One layer of one sequence: packed key/value codes per token `(1, H_kv, T, D * bits / 8)`,
    value zero/scale `(1, 1, T, 1)` fp16, sparse outliers, and the exact first tokens
    `(1, H_kv, T_0, D)`."""

    state_fields = ("exact_k", "exact_v", "codes", "outliers", "step_cache", "pending_k",
                    "pending_v")

    def __init__(self, layer_idx: int, info: ModelInfo, method: KVQuant):
        super().__init__(layer_idx, info)
        self.method = method
        cal = method._cal
        self.key_zero = cal.key_zero[layer_idx].float()  # (H_kv, D)
        self.key_scale = cal.key_scale[layer_idx].float()
        self.key_divisor = safe(self.key_scale)[:, None]  # (H_kv, 1, D)
        # rounding uses the centroids (their midpoints); dequantization their Q-Norm'd values
        self.key_mids = prep.midpoints(cal.key_codebook[layer_idx].float())
        self.value_mids = prep.midpoints(cal.value_codebook[layer_idx].float())
        self.key_decode, self.value_decode = cal.decode_codebooks(layer_idx)
        self.constants_bytes = cal.layer_bytes()
        self.exact_k = self.exact_v = None  # (1, H_kv, T_0, D) first tokens, compute dtype
        self.codes = {name: ContiguousRows() for name in ("k", "v", "v_zero", "v_scale")}
        self.outliers = {"k": _sparse_columns(), "v": _sparse_columns()}
        self.step_cache: KVQuantCache | None = None  # what this step's attention sees
        # a prompt held exact until it is over (prefill=dense): (1, H_kv, T_p, D) each
        self.pending_k = self.pending_v = None

    # --- quantize ------------------------------------------------------------------------------
    def _quantize_keys(self, keys: torch.Tensor, positions: torch.Tensor):
        pre = rotate(keys, -positions.to(keys.device).float(), self.method._inv_freq).float()
        norm = (pre - self.key_zero[:, None]) / self.key_divisor
        outliers = (norm.abs() > 1) if self.method.outlier_ratio > 0 else None
        # official static rule: strictly beyond the thresholds
        codes = torch.bucketize(norm.contiguous(), self.key_mids)  # = nearest_centroid
        return pack_bits(codes, self.method.k_bits), _sparse(pre, outliers, positions)

    def _quantize_values(self, values: torch.Tensor, positions: torch.Tensor):
        """Per token over all KV heads (the official hook sits on the v_proj output)."""
        v = values.float()
        b, h, t, d = v.shape
        per_token = v.transpose(1, 2).reshape(b, t, h * d)
        zero, scale, outliers = value_normalise(per_token, self.method.outlier_ratio)
        zero, scale = zero[:, None], scale[:, None]  # (1, 1, T, 1)
        outliers = outliers.reshape(b, t, h, d).transpose(1, 2)
        codes = torch.bucketize(((v - zero) / safe(scale)).contiguous(), self.value_mids)
        return (pack_bits(codes, self.method.v_bits), zero.half(), scale.half(),
                _sparse(v, outliers if self.method.outlier_ratio > 0 else None, positions))

    # --- cache seam ----------------------------------------------------------------------------
    def update(self, keys, values, position_ids):
        """Store the new tokens (quantized before they attend, as the official simulation, or
        held exact while a dense prompt is fed: `holding_prompt`); returns them as given. What
        attention sees (the whole cache: exact first tokens, codes, outliers, the held prompt)
        is `self.step_cache` (+ the held rows), consumed by `attend`."""
        self.pending_k = _cat(self.pending_k, keys)
        self.pending_v = _cat(self.pending_v, values)
        self.seen_tokens += keys.shape[-2]
        if not self.holding_prompt():
            self._flush()
        self.step_cache = self._cache()
        return keys, values

    def on_prefill_end(self) -> None:
        self._flush()

    def _flush(self) -> None:
        """Quantize the held rows (the tokens after the quantized ones), in one call."""
        if self.pending_k is None:
            return
        keys, values, self.pending_k, self.pending_v = (self.pending_k, self.pending_v,
                                                        None, None)
        q_len = keys.shape[-2]
        positions = torch.arange(self.seen_tokens - q_len, self.seen_tokens)
        n_exact = max(0, min(q_len, self.method.first_fp16_tokens - int(positions[0])))
        if n_exact:
            self.exact_k = _cat(self.exact_k, keys[:, :, :n_exact])
            self.exact_v = _cat(self.exact_v, values[:, :, :n_exact])
        if n_exact < q_len:
            pos = positions[n_exact:]
            k_codes, k_sparse = self._quantize_keys(keys[:, :, n_exact:], pos)
            v_codes, v_zero, v_scale, v_sparse = self._quantize_values(values[:, :, n_exact:], pos)
            for name, part in (("k", k_codes), ("v", v_codes), ("v_zero", v_zero),
                               ("v_scale", v_scale)):
                self.codes[name].append(part)
            for name, sparse in (("k", k_sparse), ("v", v_sparse)):
                for column, part in zip(self.outliers[name], sparse or ()):
                    column.append(part[None, None])

    def _cache(self) -> KVQuantCache:
        view = {name: rows.view() for name, rows in self.codes.items()}
        cos, sin = self.method._rope.upto(self.seen_tokens)
        return KVQuantCache(
            self.exact_k, self.exact_v, view["k"], view["v"], view["v_scale"], view["v_zero"],
            self.key_scale, self.key_zero, self.key_decode, self.value_decode,
            _sparse_view(self.outliers["k"]), _sparse_view(self.outliers["v"]), self.method._inv_freq,
            cos, sin,
            self.method.k_bits, self.method.v_bits)

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        """Decode rows: attention straight from the codes; anything else (or nothing quantized
        yet): dequantize the whole cache and run the model's own attention over it."""
        cache, self.step_cache = self.step_cache, None
        if self.pending_k is not None:  # a dense prompt: its held rows exact, after the rest
            keys, values = self._with_pending(dequantize_cache(cache, query.dtype)
                                              if cache.tokens() else None)
            return base(module, query, keys, values, attention_mask, **kwargs)
        if (cache.k_codes is not None and query.shape[0] == 1
                and plain_decode_row(query, attention_mask, kwargs)):
            scaling = kwargs.get("scaling") or module.scaling
            out = decode_attention(query, cache, scaling)  # (1, H_q, 1, D)
            return out.transpose(1, 2).contiguous(), None  # as the base: (B, q_len, H_q, D)
        keys, values = dequantize_cache(cache, query.dtype)
        return base(module, query, keys, values, attention_mask, **kwargs)

    def _with_pending(self, stored):
        """`stored` (dequantized K/V or None) followed by the held exact rows."""
        if stored is None:
            return self.pending_k, self.pending_v
        return (torch.cat([stored[0], self.pending_k.to(stored[0].dtype)], -2),
                torch.cat([stored[1], self.pending_v.to(stored[1].dtype)], -2))

    def dequantized_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cache as attention reads it now, dequantized and rotated `(1, H_kv, T, D)`."""
        cache = self._cache()
        dtype = next(t for t in (self.exact_k, self.pending_k, self.key_scale) if t is not None
                     ).dtype
        stored = dequantize_cache(cache, dtype) if cache.tokens() else None
        return stored if self.pending_k is None else self._with_pending(stored)

    def kept_tokens(self) -> int:
        return self.seen_tokens  # KVQuant evicts nothing

    # --- accounting ----------------------------------------------------------------------------
    def allowed_tokens(self) -> int | None:
        return None  # bits, not tokens

    def stats(self) -> dict[str, int]:
        exact = sum(p.nbytes for p in (self.exact_k, self.exact_v, self.pending_k,
                                       self.pending_v) if p is not None)
        stores = [*self.codes.values(), *self.outliers["k"], *self.outliers["v"]]
        used = sum(s.used_bytes() for s in stores)
        allocated = sum(s.allocated_bytes() for s in stores)
        constants = self.constants_bytes if self.seen_tokens else 0
        held = exact + used + constants
        return {"kv_tokens": self.seen_tokens, "kv_bytes": int(held), "kv_bytes_used": int(held),
                "kv_bytes_allocated": int(exact + allocated + constants)}


def _sparse(x: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor):
    """COO of the outliers of x `(1, H_kv, T, D)`, token-major (sorted by position): token
    position int32, head * D + channel int16, value fp16; None when there are none."""
    if mask is None:
        return None
    _, t, h, d = mask.transpose(1, 2).nonzero(as_tuple=True)  # (token, head, channel) order
    if t.numel() == 0:
        return None
    token = positions.to(t.device)[t].to(torch.int32)
    lane = (h * x.shape[-1] + d).to(torch.int16)
    return token, lane, x[0, h, t, d].half()


def _cat(held, new):
    return new if held is None else torch.cat([held, new], dim=-2)
