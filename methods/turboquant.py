"""TurboQuant: a random rotation, a Lloyd-Max scalar quantizer per rotated coordinate, and a 1-bit
QJL residual for unbiased inner products; fractional widths from an outlier-channel split.

Zandieh, Daliri, Hadian, Mirrokni, "TurboQuant: Online Vector Quantization with Near-optimal
Distortion Rate", arXiv 2504.19874 (no official code released; the quantizer:
methods/_turboquant_quant.py). The paper's KV-cache setting: 2.5 and 3.5 bits per channel
("absolute quality neutrality with 3.5 bits", "marginal degradation with 2.5 bits").

What each part does here:
  * Keys: TurboQuant_prod (Algorithm 2) at `k_bits`: Lloyd-Max codes at k_bits - 1 bits and one
    QJL sign bit per coordinate, so q.k is estimated without bias (attention scores are inner
    products); `k_quantizer=mse` uses Algorithm 1 at all k_bits instead. Values: TurboQuant_mse
    (Algorithm 1) at `v_bits` (their reconstruction is what p.V reads). Unbiased is not low
    variance: on SmolLM2 (head_dim 64; streaming perplexity, 896-token prompt + 128 scored,
    full 24.2) prod keys give 26.5 at 3.5 bits but 1854 at 2.5 bits (1-bit codes + QJL on 75 %
    of the channels: the estimate's noise swamps the softmax), mse keys 25.0 and 25.6.
  * Fractional widths (the paper's outlier split, §4.3): `outlier_ratio` of the channels are
    outliers and the two sets are quantized by independent instances, the outliers at the width
    that makes the average exactly the stated one: 2.5 = 25 % of the channels at 4 bits + 75 %
    at 2; 3.5 = 25 % at 5 + 75 % at 3. The paper's own example, "32 outlier channels at 3 bits
    and 96 at 2 bits ... (32 x 3 + 96 x 2) / 128 = 2.5", does not add up (it is 2.25); we keep
    its outlier count (25 %) and its stated averages. `outlier_ratio=0.5` gives the other
    reading (half the channels at one more bit).
  * Which channels are outliers (not specified in the paper): per block of `block_tokens` tokens
    and KV head, those with the largest L2 norm over the block, the rule of the authors' QJL code
    (`QJLKeyQuantizer`: top channel norms per group of 32 tokens; it also keeps the latest 128
    tokens exact). Our block is 128 tokens by default (the query is rotated once per block in
    the decode kernel: 32 made the CPU kernel ~2x slower at 8K). Tokens wait, exact, until their
    block is full: a prompt is held exact while it is fed and quantized once it is over, from the whole
    prompt's values (whatever the prefill chunking; the remainder of its last block waits in the
    exact tail); a decode step appends to the tail and a full block is quantized before it is
    attended.
  * Rotations and QJL matrices: Haar-random orthogonal (QR of a Gaussian) and i.i.d. N(0, 1),
    one per part dimension, shared by all layers and heads, drawn from `seed` (recorded);
    codebooks: Lloyd-Max for the exact coordinate density of a rotated unit vector, computed
    (not tabulated) for each part's dimension and width.
  * Norms: every part of every token stores its norm (and, with QJL, the residual norm) in fp16.

Bytes held (`stats()`, exact): codes + signs + fp16 norms per token and head, one outlier bit
mask (D bits) per block and head, and the exact tail in the compute dtype. At D = 64, 2.5 bits:
keys 28 bytes per token and head (2.5 bits of codes and signs + 4 fp16 norms = 3.5 bits per
coordinate), values 24 (3.0 bits per coordinate); the masks add 1 / block_tokens bit per
coordinate.

Decode attention runs from the codes (methods/kernels/turboquant_attention.py): the query is
permuted and rotated once per block, each token costs D codebook lookups (and D sign reads); a C
kernel on CPU, Triton on CUDA, dequantize-then-attend in torch as the reference. Prefill chunks
(and any masked attention) dequantize the cache and run the model's attention over it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from kvcore.storage import ContiguousRows
from methods import _turboquant_quant as tq
from methods.base import KVMethod
from methods.capabilities import Capabilities
from methods.kernels import turboquant_cpu
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.protocol import PREFILL_MODES
from methods.kernels.turboquant_attention import (TQCache, TQTensor, decode_attention,
                                                  decode_kernel, dequantize_cache, pack_masks)
from methods.scoring import plain_decode_row

MIN_BITS, MAX_BITS = 2, 8  # prod keys need >= 1 code bit besides the sign; kernels read <= 8
Quantizer = Literal["prod", "mse"]  # the key quantizer: Algorithm 2, or 1


@dataclass(kw_only=True)
class TurboQuant(KVMethod):
    """TurboQuant: rotated coordinates, Lloyd-Max codes, QJL residual signs for the keys."""

    name: ClassVar[str] = "turboquant"
    provenance: ClassVar[str] = "paper"
    family: ClassVar[str] = "quantization"
    summary: ClassVar[str] = ("random rotation, Lloyd-Max codes per coordinate, a 1-bit QJL "
                              "residual for unbiased key inner products")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2504.19874"
    operating_point: ClassVar[str] = (
        "arXiv 2504.19874: Llama-3.1-8B-Instruct, Ministral-7B; 2.5 and 3.5 bits per channel "
        "(outlier split); LongBench, needle-in-a-haystack up to 104K")
    capabilities: ClassVar[Capabilities] = Capabilities(prefill_modes=PREFILL_MODES)
    axis_keys: ClassVar[tuple[str, ...]] = ("k_bits", "v_bits")
    variant_keys: ClassVar[tuple[str, ...]] = ("k_quantizer", "outlier_ratio", "block_tokens")

    k_bits: float = 3.5
    v_bits: float = 3.5
    k_quantizer: Quantizer = "prod"
    outlier_ratio: float = 0.25
    block_tokens: int = 128
    seed: int = 0

    def check_hyperparameters(self) -> list[str]:
        reasons = []
        for key in ("k_bits", "v_bits"):
            bits = getattr(self, key)
            if not isinstance(bits, (int, float)) or not MIN_BITS <= bits <= MAX_BITS \
                    or (bits * 4) % 1:
                reasons.append(f"method.{key}={bits!r} must be a multiple of 0.25 in "
                               f"[{MIN_BITS}, {MAX_BITS}] (paper: 2.5 and 3.5)")
        if not isinstance(self.outlier_ratio, (int, float)) or not 0 < self.outlier_ratio < 1:
            reasons.append(f"method.outlier_ratio={self.outlier_ratio!r} must be in (0, 1)")
        if not isinstance(self.block_tokens, int) or self.block_tokens < 1:
            reasons.append(f"method.block_tokens={self.block_tokens!r} must be an integer >= 1")
        return reasons

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict[str, Any]:
        """Blocks longer than the sequence: every token stays in the exact tail."""
        return {"block_tokens": seq_tokens + 1}

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict[str, Any]:
        """Blocks of 8 tokens, so most of a short sequence is quantized."""
        return {"block_tokens": 8}

    def validate(self, info: ModelInfo, runner: dict[str, Any]) -> list[str]:
        reasons = super().validate(info, runner)
        for key in ("k_bits", "v_bits"):
            try:
                widths = tq.split_widths(info.head_dim, getattr(self, key), self.outlier_ratio)
            except ValueError as err:
                reasons.append(f"method.{key}: {err}")
                continue
            if any(width > MAX_BITS for _, width in widths):
                reasons.append(f"method.{key}={getattr(self, key)}, method.outlier_ratio="
                               f"{self.outlier_ratio}: the outlier channels would need "
                               f"{widths[0][1]} bits (at most {MAX_BITS})")
            if any(dim < 2 for dim, _ in widths):
                reasons.append(f"method.{key}={getattr(self, key)}, method.outlier_ratio="
                               f"{self.outlier_ratio}: a part of head_dim={info.head_dim} would "
                               "have fewer than 2 channels (a rotation needs 2)")
        return reasons

    def quantizers(self, head_dim: int) -> tuple[tq.Quantizer, tq.Quantizer]:
        """(keys, values) quantizers for `head_dim`, their random matrices drawn from `seed`."""
        g = torch.Generator().manual_seed(self.seed)
        keys = tq.build_quantizer(head_dim, self.k_bits, self.outlier_ratio,
                                  self.k_quantizer == "prod", self.block_tokens, g)
        values = tq.build_quantizer(head_dim, self.v_bits, self.outlier_ratio, False,
                                    self.block_tokens, g)
        return keys, values

    artefact_names = ("_quantizers",)  # what `prepare` sets

    def prepare(self, ctx) -> dict[str, Any]:
        """Draws the rotations and QJL matrices (seeded) and computes the codebooks; records them."""
        self._quantizers = self.quantizers(ctx.info.head_dim)
        digest = hashlib.sha256()
        for q in self._quantizers:
            for p in q.parts:
                for m in (p.rotation, p.projection, p.codebook):
                    if m is not None:
                        digest.update(m.numpy().tobytes())
        return {"seed": self.seed, "matrices_sha256": digest.hexdigest()[:16],
                "parts": {name: [{"channels": p.dim, "mse_bits": p.mse_bits, "qjl": p.qjl}
                                 for p in q.parts]
                          for name, q in zip(("keys", "values"), self._quantizers)},
                "bits_per_coordinate": {name: q.bits_per_coordinate()
                                        for name, q in zip(("keys", "values"), self._quantizers)},
                **self._kernel_facts(torch.device(ctx.device))}

    @staticmethod
    def _kernel_facts(device: torch.device) -> dict[str, Any]:
        """The decode-attention implementation, and for the C kernel its built vector path
        ("avx512", "avx2", "portable": the instructions its speed depends on)."""
        kernel = decode_kernel(device)
        if kernel != "c":
            return {"decode_attention": kernel}
        return {"decode_attention": kernel, "decode_vector_path": turboquant_cpu.vector_path()}

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        quantizers = getattr(self, "_quantizers", None)
        if quantizers is None or quantizers[0].head_dim != info.head_dim:
            self._quantizers = quantizers = self.quantizers(info.head_dim)
        return TurboQuantLayer(layer_idx, info, *quantizers)


class _Store:
    """One tensor's quantized blocks, each field grown with amortised capacity `(1, H, n, ...)`."""

    FIELDS = ("codes", "signs", "norms", "rnorms")

    def __init__(self, q: tq.Quantizer):
        self.q = q
        self.rows = {name: ContiguousRows() for name in self.FIELDS}
        self.masks = ContiguousRows()

    def append(self, x: torch.Tensor) -> None:
        """Quantize whole blocks of `x (H, n * block_tokens, D)`."""
        bt = self.q.block_tokens
        for b0 in range(0, x.shape[1], bt):
            out = tq.quantize_block(x[:, b0:b0 + bt], self.q)
            for name in self.FIELDS:
                if name in out:
                    self.rows[name].append(out[name][None])
            if self.q.split:
                self.masks.append(pack_masks(out["mask"])[None, :, None])

    def tokens(self) -> int:
        return self.rows["codes"].length

    def view(self) -> TQTensor | None:
        if not self.tokens():
            return None
        get = lambda rows: rows.view()[0] if rows.length else None  # noqa: E731
        return TQTensor(*(get(self.rows[n]) for n in self.FIELDS), get(self.masks))

    def stores(self) -> list[ContiguousRows]:
        return [*self.rows.values(), self.masks]


class TurboQuantLayer(KVLayer):
    """One layer of one sequence: quantized blocks of keys and values, and the exact tail
    `(1, H_kv, T_e, D)` (T_e < block_tokens between steps)."""

    state_fields = ("k_store", "v_store", "tail_k", "tail_v", "step_cache")

    def __init__(self, layer_idx: int, info: ModelInfo, key_q: tq.Quantizer,
                 value_q: tq.Quantizer):
        super().__init__(layer_idx, info)
        self.key_q, self.value_q = key_q, value_q
        self.k_store, self.v_store = _Store(key_q), _Store(value_q)
        self.tail_k = self.tail_v = None  # (1, H_kv, T_e, D), compute dtype
        self.step_cache: TQCache | None = None

    def update(self, keys, values, position_ids):
        """Append the new tokens to the exact tail and quantize every full block (not while a
        prompt is held: `on_prefill_end`); returns them as given. What attention sees (blocks +
        tail) is `self.step_cache`, consumed by `attend`."""
        self.seen_tokens += keys.shape[-2]
        self.tail_k = keys if self.tail_k is None else torch.cat([self.tail_k, keys], -2)
        self.tail_v = values if self.tail_v is None else torch.cat([self.tail_v, values], -2)
        if not self.holding_prompt():
            self._flush()
        self.step_cache = self._cache()
        return keys, values

    def on_prefill_end(self) -> None:
        self._flush()

    def _flush(self) -> None:
        bt = self.key_q.block_tokens
        n = 0 if self.tail_k is None else self.tail_k.shape[-2] // bt * bt
        if n == 0:
            return
        self.k_store.append(self.tail_k[0, :, :n])
        self.v_store.append(self.tail_v[0, :, :n])
        rest = self.tail_k.shape[-2] - n
        self.tail_k = self.tail_k[:, :, n:].clone() if rest else None
        self.tail_v = self.tail_v[:, :, n:].clone() if rest else None

    def _cache(self) -> TQCache:
        tail = (None, None) if self.tail_k is None else (self.tail_k[0], self.tail_v[0])
        return TQCache(self.k_store.view(), self.v_store.view(), *tail, self.key_q, self.value_q)

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        """Decode rows: attention straight from the codes; anything else (or nothing quantized
        yet): dequantize the whole cache and run the model's own attention over it."""
        cache, self.step_cache = self.step_cache, None
        if (cache.keys is not None and query.shape[0] == 1
                and plain_decode_row(query, attention_mask, kwargs)):
            scaling = kwargs.get("scaling") or module.scaling
            out = decode_attention(query, cache, scaling)  # (1, H_q, 1, D)
            return out.transpose(1, 2).contiguous(), None  # as the base: (B, q_len, H_q, D)
        keys, values = dequantize_cache(cache, query.dtype)
        return base(module, query, keys, values, attention_mask, **kwargs)

    def dequantized_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cache as attention reads it now `(1, H_kv, T, D)` (keys: QJL estimates)."""
        return dequantize_cache(self._cache(), self.tail_k.dtype if self.tail_k is not None
                                else torch.float32)

    def kept_tokens(self) -> int:
        return self.seen_tokens  # nothing is evicted

    # --- accounting ----------------------------------------------------------------------------
    def allowed_tokens(self) -> int | None:
        return None  # bits, not tokens

    def quantized_tokens(self) -> int:
        return self.k_store.tokens()

    def stats(self) -> dict[str, int]:
        tail = sum(t.nbytes for t in (self.tail_k, self.tail_v) if t is not None)
        stores = self.k_store.stores() + self.v_store.stores()
        used = tail + sum(s.used_bytes() for s in stores)
        allocated = tail + sum(s.allocated_bytes() for s in stores)
        return {"kv_tokens": self.seen_tokens, "kv_bytes": int(used), "kv_bytes_used": int(used),
                "kv_bytes_allocated": int(allocated)}
