"""KIVI: tuning-free asymmetric 2-bit KV-cache quantization.

Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024,
arXiv 2402.02750 (official code github.com/jy-yuan/KIVI).

Keys are quantized per channel, values per token, each with a full-precision residual of recent
tokens (paper §3.3):

* Keys: a quantized part (whole blocks of `residual_tokens`, each quantized per head-dim channel in
  groups of `group_size` tokens) + a full-precision residual K_r. New keys go to K_r; when K_r
  reaches `residual_tokens` tokens the block is quantized and K_r emptied. A prefill of n tokens
  therefore quantizes floor(n/R)*R keys and keeps n mod R exact.
* Values: the last `residual_tokens` values stay full precision (a FIFO); older ones are quantized
  per token in groups of `group_size` head-dim channels, each token independently.
* Attention: softmax([q Q(K)^T, q K_r^T]) [Q(V); V_r]. The token(s) of the current step are attended
  exactly, before they are flushed into the quantized part (as the official code): a prompt is
  attended exact and quantized once it is over (`runner.prefill=dense`, whatever the chunking;
  under `runner.prefill=chunked` each chunk is flushed after its forward, so later chunks see
  earlier ones quantized); decode steps see earlier tokens through their stored, quantized form.

Hyperparameters (units in the names):
  k_bits, v_bits    bits per key / value code, in {2, 4, 8} (KIVI-2, KIVI-4; 8: near-lossless)
  group_size        elements per quantization group: tokens for keys, head-dim channels for values
                    (paper: G = 32); values use min(group_size, head_dim) channels, so a model with
                    head_dim < group_size (stories260K: 8) quantizes each token's head as one group
  residual_tokens   R, tokens kept in full precision (paper: R = 128; a multiple of group_size)

Where this differs from the paper, deliberately:
  * Decode attention runs straight from the packed cache (methods/kernels/kivi_attention.py): a
    fused Triton kernel on CUDA (our own version of KIVI's `cuda_bmm_fA_qB_outer` gemv: codes
    unpacked and dequantized in registers, online softmax, split-K), a small C kernel on CPU
    (methods/kernels/kivi_cpu.c, built on first use; blockwise torch without a compiler); none
    materialises the dequantized cache, and metrics.json records which one ran
    (`prepare.decode_attention`). Prefill chunks (and any step with an attention mask or other
    attention options) dequantize the stored part and run the model's own attention.
    `update()` therefore returns only the full-precision tails; `attend()` sees the whole cache
    (`mask_sizes` describes all of it).
  * The quantized values grow by one token per decode step: they are stored token-major with
    amortised growth (kvcore.storage.TokenMajorRows), never concatenated; keys grow a whole
    block of R tokens at a time.
  * The residual is kept in the compute dtype (fp32 on CPU) rather than fp16, so that 8 bits with
    R >= sequence length reproduces the full cache exactly; `stats()` counts its real bytes.
  * Codes are packed 8/bits per uint8 byte (the official code packs into int32 words): same bytes,
    and groups as small as head_dim 8 still pack; scale and zero point are fp16 as in the paper.
  * Rounding is floor(x + 0.5) (half up) in both the kernel and the torch reference, so codes match.

With `runner.kv_offload=cpu` the quantized part lives on the host tier and is fetched (codes,
scales, zeros) every decode step, one layer ahead, then dequantized on the device: the
FlexGen+INT4 baseline of InfiniGen's Fig. 14 (`--compress-cache`); the small full-precision
residual stays on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvcore.storage import TokenMajorRows
from methods.base import KVMethod
from methods.capabilities import Capabilities
from methods.kernels import kivi_quant as kq
from methods.layer import KVLayer, exact_attention
from methods.model import ModelInfo, PrepareContext
from methods.protocol import PREFILL_MODES
from methods.kernels.kivi_attention import (KIVICache, decode_attention, decode_kernel,
                                            dequantize_cache)
from methods.scoring import plain_decode_row


@dataclass(kw_only=True)
class KIVI(KVMethod):
    """KIVI: per-channel keys, per-token values, a full-precision residual of recent tokens."""

    name: ClassVar[str] = "kivi"
    provenance: ClassVar[str] = "official code"
    family: ClassVar[str] = "quantization"
    summary: ClassVar[str] = (
        "keys quantized per channel, values per token, a full-precision recent residual")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2402.02750"
    code_url: ClassVar[str | None] = "https://github.com/jy-yuan/KIVI"
    operating_point: ClassVar[str] = (
        "jy-yuan/KIVI: Llama-2-7B/13B, Falcon-7B, Mistral-7B; 2-bit, group 32, residual "
        "128; LongBench, lm-eval"
    )
    # Nothing is evicted and every sequence holds the same token count: batch-agnostic.
    # its `prepare` records which decode-attention kernel the run uses.
    capabilities: ClassVar[Capabilities] = Capabilities(
        prefill_modes=PREFILL_MODES, offloads_kv=True)

    axis_keys: ClassVar[tuple[str, ...]] = ("k_bits", "v_bits")
    variant_keys: ClassVar[tuple[str, ...]] = ("group_size", "residual_tokens")
    k_bits: kq.KiviBits = 2
    v_bits: kq.KiviBits = 2
    group_size: int = 32
    residual_tokens: int = 128

    def check_hyperparameters(self) -> list[str]:
        return quantization_reasons(self)

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict[str, Any]:
        """A residual covering the sequence: nothing is ever quantized, so K/V stay exact."""
        group = cls.group_size
        return {"residual_tokens": max(1, -(-seq_tokens // group)) * group}

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict[str, Any]:
        """Small groups and residual, so most of a short sequence is stored quantized."""
        return {"group_size": 8, "residual_tokens": 8}

    def value_group_channels(self, head_dim: int) -> int:
        """Head-dim channels per value group: group_size, clamped to head_dim."""
        return min(self.group_size, head_dim)

    def validate(self, info: ModelInfo, runner: dict[str, Any]) -> list[str]:
        return super().validate(info, runner) + value_group_reasons(self, info)

    def prepare(self, ctx: PrepareContext) -> dict[str, Any]:
        """Records which decode-attention implementation the run uses (its speed depends on it)."""
        return {"decode_attention": decode_kernel(ctx.device)}

    def make_layer(self, layer_idx: int, info: ModelInfo) -> "KIVILayer":
        return KIVILayer(layer_idx, info, self)


# Checks shared with the methods that quantize layers with KIVI's scheme (TailorKV): `method` has
# k_bits, v_bits (their allowed widths are the fields' Literal types, checked with every knob's
# type), group_size, residual_tokens and value_group_channels(head_dim).
def quantization_reasons(method) -> list[str]:
    """Reasons the quantization knobs are invalid, each naming its key."""
    reasons = []
    if method.group_size <= 0:
        reasons.append(f"method.group_size={method.group_size} must be a positive integer")
    elif (method.group_size * min(method.k_bits, method.v_bits)) % 8:
        reasons.append(f"method.group_size={method.group_size}: a group of "
                       f"{min(method.k_bits, method.v_bits)}-bit codes must fill whole bytes "
                       f"(use a multiple of {8 // min(method.k_bits, method.v_bits)})")
    if method.residual_tokens <= 0:
        reasons.append(f"method.residual_tokens={method.residual_tokens} must be a positive "
                       f"integer")
    elif method.group_size > 0 and method.residual_tokens % method.group_size:
        reasons.append(f"method.residual_tokens={method.residual_tokens} must be a multiple of "
                       f"method.group_size={method.group_size} (keys are quantized in whole "
                       f"groups)")
    return reasons


def value_group_reasons(method, info: ModelInfo) -> list[str]:
    """Reasons this model's head_dim cannot hold the value groups (per token, head-dim channels)."""
    reasons, channels = [], method.value_group_channels(info.head_dim)
    if info.head_dim % channels:
        reasons.append(f"method.group_size={method.group_size} does not divide head_dim="
                       f"{info.head_dim} (values are quantized per token in groups of "
                       f"head-dim channels)")
    elif (channels * method.v_bits) % 8:
        reasons.append(f"method.v_bits={method.v_bits}: value groups of {channels} channels "
                       f"(head_dim={info.head_dim}) do not fill whole bytes")
    return reasons


class KIVILayer(KVLayer):
    """One layer's KIVI cache. Shapes: residuals `(B, H_kv, T, D)`; quantized keys are stored
    transposed `(B, H_kv, D, T)` so their token groups lie along the last axis."""

    state_fields = ("k_quant", "v_store", "k_residual", "v_residual", "pending", "step_cache")

    def __init__(self, layer_idx: int, info: ModelInfo, method: KIVI):
        # `method`: KIVI, or any method with its quantization knobs (TailorKV's quantized layers)
        super().__init__(layer_idx, info)
        self.k_bits, self.v_bits = method.k_bits, method.v_bits
        self.key_group_tokens = method.group_size
        self.value_group_channels = method.value_group_channels(info.head_dim)
        self.residual_tokens = method.residual_tokens
        self.k_quant: kq.Quantized | None = None  # codes (B, H_kv, D, T_q * k_bits / 8)
        # the quantized values grow by one token per decode step: codes, scale, zero stored
        # token-major with amortised growth (`v_quant` is their `(B, H_kv, T_q, ...)` view)
        self.v_store: list[TokenMajorRows] | None = None
        self.k_residual: torch.Tensor | None = None  # (B, H_kv, T_kr, D), T_kr < R between steps
        self.v_residual: torch.Tensor | None = None  # (B, H_kv, T_vr, D), T_vr <= R
        self.pending: list | None = None  # in-flight host->device copies of the quantized parts
        self.step_cache: KIVICache | None = None  # what this step's attention sees (set by update)

    @property
    def v_quant(self) -> kq.Quantized | None:
        """The quantized values: codes `(B, H_kv, T_q, D * v_bits / 8)`, scale/zero
        `(B, H_kv, T_q, D / G)` (views of the token-major store)."""
        if self.v_store is None:
            return None
        return kq.Quantized(*(part.view() for part in self.v_store))

    # --- host tier (runner.kv_offload=cpu) ----------------------------------------------------
    def offloaded(self) -> bool:
        return self.tier is not None and self.tier.offload

    def prefetch(self, hidden_states, position_ids, ahead: bool) -> None:
        if self.offloaded() and hidden_states.shape[1] == 1 and self.pending is None:
            self.pending = self._fetch()

    def _fetch(self) -> list:
        """Start the copies of the quantized parts: the keys' tensors, then the values' token-major
        blocks (each one contiguous host block)."""
        parts = [] if self.k_quant is None else [list(self.k_quant)]
        if self.v_store is not None:
            parts.append([part.block() for part in self.v_store])
        return [[self.tier.to_device(self.layer_idx, t) for t in q] for q in parts]

    def _quantized_for_attention(self) -> tuple[kq.Quantized | None, kq.Quantized | None]:
        """The quantized parts on the compute device (fetched from the host when offloaded)."""
        if not self.offloaded():
            return self.k_quant, self.v_quant
        pending, self.pending = self.pending or self._fetch(), None
        fetched = iter([t.wait() for t in q] for q in pending)
        k_quant = kq.Quantized(*next(fetched)) if self.k_quant is not None else None
        v_quant = (kq.Quantized(*map(TokenMajorRows.heads_first, next(fetched)))
                   if self.v_store is not None else None)
        return k_quant, v_quant

    def _to_host(self, new: kq.Quantized) -> kq.Quantized:
        """Newly quantized blocks go to the host tier once (device -> host), when offloaded."""
        if not self.offloaded():
            return new
        self.tier.ledger.d2h(new.nbytes)
        return kq.Quantized(*(t.to("cpu") for t in new))

    def _store_keys(self, new: kq.Quantized) -> None:
        # Keys arrive in whole blocks of R tokens (one append per R decode steps): concatenated.
        new = self._to_host(new)
        out = new if self.k_quant is None else self.k_quant.cat(new, dim=-1)
        if self.offloaded() and self.tier.cuda:
            out = kq.Quantized(*(t.pin_memory() for t in out))
        self.k_quant = out

    def _store_values(self, new: kq.Quantized) -> None:
        new = self._to_host(new)
        if self.v_store is None:
            pinned = self.offloaded() and self.tier.cuda
            self.v_store = [TokenMajorRows(pinned) for _ in new]
        for part, tensor in zip(self.v_store, new):
            part.append(tensor)

    # --- sizes --------------------------------------------------------------------------------
    @staticmethod
    def _tokens(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.shape[-2]

    def quantized_key_tokens(self) -> int:
        return 0 if self.k_quant is None else self.k_quant.codes.shape[-1] * 8 // self.k_bits

    def quantized_value_tokens(self) -> int:
        return 0 if self.v_store is None else self.v_store[0].length

    def kept_tokens(self) -> int:
        return self.quantized_key_tokens() + self._tokens(self.k_residual)  # KIVI evicts nothing

    # --- cache seam ---------------------------------------------------------------------------
    def update(self, keys: torch.Tensor, values: torch.Tensor, position_ids: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens; returns the full-precision tails (keys, values) `(B, H_kv, n, D)`,
        this step's tokens last. The whole cache attention sees (stored tokens as stored, i.e.
        quantized, this step's tokens exact) is `self.step_cache`, consumed by `attend`."""
        self.seen_tokens += keys.shape[-2]
        if self.k_residual is None:
            self.k_residual, self.v_residual = keys, values
        else:  # the residual holds < R + q_len tokens: a small copy
            self.k_residual = torch.cat([self.k_residual, keys], -2)
            self.v_residual = torch.cat([self.v_residual, values], -2)
        k_quant, v_quant = self._quantized_for_attention()
        self.step_cache = KIVICache(k_quant, v_quant, self.k_residual, self.v_residual,
                                    self.k_bits, self.v_bits, self.key_group_tokens,
                                    self.value_group_channels)
        if not self.holding_prompt():  # a prompt is quantized once it is over (dense prefill)
            self._flush()
        return self.step_cache.k_res, self.step_cache.v_res

    def on_prefill_end(self) -> None:
        self._flush()

    def _flush(self) -> None:
        self._flush_keys()
        self._flush_values()

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        """Decode rows: attention straight from the packed cache; anything else (or nothing
        quantized yet): dequantize the stored part and run the model's own attention over the
        whole cache through the full cache's own attention (`exact_attention`), so with nothing
        quantized KIVI equals the full cache bit for bit."""
        cache, self.step_cache = self.step_cache, None
        quantized = cache.k_quant is not None or cache.v_quant is not None
        if quantized and plain_decode_row(query, attention_mask, kwargs):
            scaling = kwargs.get("scaling") or module.scaling
            out = decode_attention(query, cache, scaling)  # (B, H_q, 1, D)
            return out.transpose(1, 2).contiguous(), None  # as the base: (B, q_len, H_q, D)
        keys, values = dequantize_cache(cache, query.dtype)
        return exact_attention(module, query, keys, values, attention_mask, base, **kwargs)

    def dequantized_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cache attention saw at the last update, dequantized `(B, H_kv, T, D)`."""
        return dequantize_cache(self.step_cache, self.k_residual.dtype)

    def _flush_keys(self) -> None:
        """Quantize whole blocks of R residual keys, per channel in groups of G tokens."""
        n = self._tokens(self.k_residual) // self.residual_tokens * self.residual_tokens
        if n == 0:
            return
        block, self.k_residual = self.k_residual[..., :n, :], self.k_residual[..., n:, :]
        quant = kq.quantize_pack(block.transpose(-1, -2), self.k_bits, self.key_group_tokens)
        self._store_keys(quant)
        # A view of the old residual would keep its whole storage alive: hold a compact copy.
        self.k_residual = self.k_residual.clone()

    def _flush_values(self) -> None:
        """Quantize the values that fell out of the R-token FIFO, per token (each independent)."""
        n = self._tokens(self.v_residual) - self.residual_tokens
        if n <= 0:
            return
        old, self.v_residual = self.v_residual[..., :n, :], self.v_residual[..., n:, :].clone()
        quant = kq.quantize_pack(old, self.v_bits, self.value_group_channels)
        self._store_values(quant)

    # --- accounting ---------------------------------------------------------------------------
    def allowed_tokens(self) -> int | None:
        return None  # KIVI compresses bytes, not tokens

    def stats(self) -> dict[str, int]:
        parts = (self.k_quant, self.v_quant, self.k_residual, self.v_residual)
        held = int(sum(part.nbytes for part in parts if part is not None))
        allocated = held - (0 if self.v_quant is None else self.v_quant.nbytes) + sum(
            part.allocated_bytes() for part in self.v_store or ())
        out = {"kv_tokens": self.kept_tokens(), "kv_bytes": held, "kv_bytes_used": held,
               "kv_bytes_allocated": int(allocated)}
        if self.offloaded():
            out["kv_bytes_device"] = int(sum(p.nbytes for p in parts[2:] if p is not None))
        return out
