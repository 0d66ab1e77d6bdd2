"""MiniCache (Liu, Liu, Pan, He, Haffari, Zhuang; NeurIPS 2024, arXiv 2405.14366): merge the KV of
adjacent layers across depth.

From the middle of the model on, the K (and the V) of a token in two adjacent layers point in
nearly the same direction. Layers start, start+1 | start+2, start+3 | ... (start = int(L x
`start_layer_ratio`)) are merged in pairs: per token and KV head, separately for K and V, the pair
stores one direction, the SLERP of the two unit vectors at `interpolation_ratio` toward the upper
layer, and each layer's own magnitude; a layer restores its past as magnitude x direction. Tokens
whose two directions are far apart (normalised angle delta = Omega / pi) are retained unmerged in
both layers. Paper: with 4-bit KIVI, up to 5.02x compression and about 5x throughput on ShareGPT
(LLaMA-2-7B), 41 % less memory than the FP16 full cache, near-lossless (abstract).

No official code (github.com/AkideLiu/MiniCache is a project page); this reconstructs the paper's
abstract and project page, with the merge formula and the top-ceil(gamma n) retention reading of
KVCache-Factory's `pyramidkv/minicache.py`:
  * when: the first prompt is merged at its end (the engine's `on_prefill_end`); from then on the
    tokens of every forward are merged once both layers computed them (after the forward), so the
    cache holds the merged form between steps and attention sees the restored K/V;
  * retention: at the prompt, the top ceil(`retain_ratio` x n) tokens by delta per KV head (K and V
    apart); afterwards a token is retained when its delta exceeds the largest delta merged at the
    prompt (that prompt's angular-distance threshold, per pair, KV head and tensor);
  * SLERP of parallel directions (sin Omega ~ 0) falls back to linear interpolation; the direction
    is renormalised. Merging post-RoPE keys (as cached) equals merging pre-RoPE ones: both layers
    rotate a token by the same angle;
  * memory (stats): the shared directions counted once (half on each layer of the pair), the two
    magnitudes, the retained tokens of both layers and their indices; per merged pair and tensor
    ~ T*d + 2T + 2*gamma*T*d instead of 2*T*d (~0.55 at gamma = 0.05, before quantisation);
  * no token budget (no eviction): `budget_ratio` / `budget_tokens` are not knobs of this method.
A pair whose other layer is dense (runner.dense_layers) is left unmerged.

Hyperparameters:
    start_layer_ratio: depth at which merging begins, as a fraction of the layers (paper: half).
    interpolation_ratio: SLERP parameter t toward the upper layer (paper: 0.6).
    retain_ratio: share of prompt tokens retained unmerged, gamma (paper: 0.05).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcore.storage import ContiguousRows
from methods.base import KVMethod
from methods.capabilities import Capabilities, ServingNeeds
from methods.layer import KVLayer, exact_attention
from methods.model import ModelInfo

KINDS = ("k", "v")


@dataclass(kw_only=True)
class MiniCache(KVMethod):
    name: ClassVar[str] = "minicache"
    provenance: ClassVar[str] = "paper"
    family: ClassVar[str] = "merging"
    summary: ClassVar[str] = (
        "merge the K/V of adjacent layers from half depth (shared direction, own magnitudes)")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2405.14366"
    code_url: ClassVar[str | None] = None
    operating_point: ClassVar[str] = (
        "arXiv 2405.14366 (project page, no code): Llama-2/3-7B..8B, Mistral-7B; layers "
        "from L/2 merged in pairs, t 0.6, gamma 0.05"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(prefill_modes=("dense",))
    serving_needs: ClassVar[ServingNeeds] = ServingNeeds(granularity="layer")
    axis_keys: ClassVar[tuple[str, ...]] = ("start_layer_ratio", "retain_ratio")
    variant_keys: ClassVar[tuple[str, ...]] = ("interpolation_ratio",)
    start_layer_ratio: float = 0.5
    interpolation_ratio: float = 0.6
    retain_ratio: float = 0.05

    def check_hyperparameters(self) -> list[str]:
        reasons = []
        for key, low, high in (("start_layer_ratio", 0, 1), ("interpolation_ratio", 0, 1),
                               ("retain_ratio", 0, 1)):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not low <= value <= high:
                reasons.append(f"method.{key}={value!r} must be in [{low}, {high}]")
        return reasons

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict:
        return {"retain_ratio": 1.0}

    def role(self, layer_idx: int, num_layers: int) -> str | None:
        """'lower' / 'upper' for the two layers of a merged pair, None for a layer on its own."""
        offset = layer_idx - int(num_layers * self.start_layer_ratio)
        if offset < 0:
            return None
        if offset % 2:
            return "upper"
        return "lower" if layer_idx + 1 < num_layers else None

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return MiniCacheLayer(layer_idx, info, self, self.role(layer_idx, info.num_layers))


class MiniCacheLayer(KVLayer):
    """Unmerged tokens in KVLayer's own buffers; the upper layer of a pair also holds the merged
    store of both layers, which the lower layer reads and fills through `next_layer`."""

    state_fields = ("merged_tokens", "store", "retained", "threshold")

    def __init__(self, layer_idx: int, info: ModelInfo, method: MiniCache, role: str | None):
        super().__init__(layer_idx, info)
        self.method, self.role = method, role
        self.merged_tokens = 0  # text positions 0 .. merged_tokens-1 are in the store
        # "{k,v}_dir" (B, H_kv, cap, D) shared directions; "{k,v}_norm" (B, H_kv, cap, 2)
        # magnitudes [lower, upper]; amortised growth (merged_tokens valid rows)
        self.store: dict[str, ContiguousRows] = {}
        # retained tokens, per kind: "{k,v}_row" (N,) = b * H_kv + h, "{k,v}_at" (N,) token index,
        # "{k,v}_exact" (N, 2, D) the exact vectors [lower, upper]
        self.retained: dict[str, torch.Tensor] = {}
        # lower layer: (2, B, H_kv) the delta above which a K / V token is retained
        self.threshold: torch.Tensor | None = None

    def partner(self) -> MiniCacheLayer | None:
        upper = self.next_layer
        if self.role == "lower" and isinstance(upper, MiniCacheLayer) and upper.role == "upper":
            return upper
        return None

    def holder(self) -> tuple[MiniCacheLayer | None, int]:
        """The layer holding this layer's merged tokens and this layer's side (0 lower, 1 upper)."""
        return (self.partner(), 0) if self.role == "lower" else (self, 1)

    # --- cache seam -------------------------------------------------------------------------
    def update(self, keys, values, position_ids):
        raw_keys, raw_values = super().update(keys, values, position_ids)
        holder, side = self.holder()
        if holder is None or not holder.merged_tokens:
            return raw_keys, raw_values
        past_keys, past_values = (holder.restore(kind, side) for kind in KINDS)
        return torch.cat([past_keys, raw_keys], dim=2), torch.cat([past_values, raw_values], dim=2)

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        # attention over every token held (restored): the full cache's own arithmetic, so
        # retaining everything equals the full cache bit for bit
        return exact_attention(module, query, keys, values, attention_mask, base, **kwargs)

    def kept_tokens(self) -> int:
        holder, _ = self.holder()
        return super().kept_tokens() + (holder.merged_tokens if holder is not None else 0)

    def on_prefill_end(self) -> None:
        if self.partner() is not None and super().kept_tokens():
            self.merge_unmerged()

    def after_forward(self) -> None:
        if self.partner() is not None and self.threshold is not None:
            self.merge_unmerged()

    # --- merging (driven by the lower layer) ------------------------------------------------
    def merge_unmerged(self) -> None:
        upper = self.partner()
        prompt = self.threshold is None
        thresholds = []
        for i, (kind, lower_x, upper_x) in enumerate(zip(KINDS, (self.keys, self.values),
                                                         (upper.keys, upper.values))):
            direction, norms, delta = slerp_merge(upper_x, lower_x, self.method.interpolation_ratio)
            if prompt:
                keep = top_share(delta, self.method.retain_ratio)
                thresholds.append(delta.masked_fill(keep, float("-inf")).amax(dim=-1))
            else:
                keep = delta > self.threshold[i, :, :, None]
            upper.add_merged(kind, direction.to(lower_x.dtype), norms.to(lower_x.dtype), keep,
                             torch.stack([lower_x, upper_x], dim=-2))
        if prompt:
            self.threshold = torch.stack(thresholds)
        upper.merged_tokens += self.keys.shape[2]
        for layer in (self, upper):  # every unmerged token is in the store now
            layer.keys = layer.values = None

    def add_merged(self, kind: str, direction, norms, keep, exact) -> None:
        """Append merged tokens `(B, H, n, ...)`; `keep (B, H, n)` marks the retained ones, whose
        `exact (B, H, n, 2, D)` vectors are stored too."""
        rows = self.merged_tokens
        for name, x in ((f"{kind}_dir", direction), (f"{kind}_norm", norms)):
            self.store.setdefault(name, ContiguousRows()).append(x)
        b, h, t = keep.nonzero(as_tuple=True)
        new = {f"{kind}_row": b * keep.shape[1] + h, f"{kind}_at": t + rows,
               f"{kind}_exact": exact[b, h, t]}
        for name, x in new.items():
            old = self.retained.get(name)
            self.retained[name] = x if old is None else torch.cat([old, x])

    def restore(self, kind: str, side: int) -> torch.Tensor:
        """The merged tokens of one layer of the pair, `(B, H_kv, merged, D)`."""
        m = self.merged_tokens
        norm = self.store[f"{kind}_norm"].view()[:, :, :m, side:side + 1]
        out = self.store[f"{kind}_dir"].view()[:, :, :m] * norm
        b, h, _, d = out.shape
        flat = out.view(b * h, m, d)
        flat[self.retained[f"{kind}_row"], self.retained[f"{kind}_at"]] = \
            self.retained[f"{kind}_exact"][:, side]
        return out

    # --- accounting -------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        raw = 0 if self.keys is None else int(self.keys.nbytes + self.values.nbytes)
        holder, side = self.holder()
        held = holder.merged_bytes(side) if holder is not None and holder.merged_tokens else 0
        return {"kv_tokens": self.kept_tokens(), "kv_bytes": raw + held}

    def merged_bytes(self, side: int) -> int:
        """One layer's share of the pair's store: half the shared directions (counted once over
        the pair), its magnitudes, its retained vectors; the upper layer holds the indices."""
        m, total = self.merged_tokens, 0
        for kind in KINDS:
            direction = self.store[f"{kind}_dir"].view()[:, :, :m].nbytes
            total += direction // 2 + (direction % 2) * side
            total += self.store[f"{kind}_norm"].view()[:, :, :m].nbytes // 2
            total += self.retained[f"{kind}_exact"].nbytes // 2
            if side:
                total += self.retained[f"{kind}_row"].nbytes + self.retained[f"{kind}_at"].nbytes
        return total


def slerp_merge(upper: torch.Tensor, lower: torch.Tensor, t: float, eps: float = 1e-6):
    """Merge two layers' vectors `(B, H, n, D)`: the SLERP direction at `t` toward `upper` (fp32,
    unit), the magnitudes `(B, H, n, 2)` [lower, upper] and the normalised angle Omega/pi
    `(B, H, n)`."""
    norm_upper = upper.float().norm(dim=-1, keepdim=True)
    norm_lower = lower.float().norm(dim=-1, keepdim=True)
    unit_upper = upper.float() / norm_upper.clamp_min(eps)
    unit_lower = lower.float() / norm_lower.clamp_min(eps)
    omega = torch.arccos((unit_upper * unit_lower).sum(dim=-1, keepdim=True).clamp(-1, 1))
    sin = torch.sin(omega)
    parallel = sin < eps  # linear interpolation there (then renormalised)
    sin = torch.where(parallel, torch.ones_like(sin), sin)
    w_lower = torch.where(parallel, torch.full_like(sin, 1 - t), torch.sin((1 - t) * omega) / sin)
    w_upper = torch.where(parallel, torch.full_like(sin, t), torch.sin(t * omega) / sin)
    direction = w_lower * unit_lower + w_upper * unit_upper
    direction = direction / direction.norm(dim=-1, keepdim=True).clamp_min(eps)
    return direction, torch.cat([norm_lower, norm_upper], dim=-1), omega.squeeze(-1) / math.pi


def top_share(delta: torch.Tensor, share: float) -> torch.Tensor:
    """Mask `(B, H, n)` of the top ceil(share * n) values of `delta` per row."""
    count = min(delta.shape[-1], math.ceil(share * delta.shape[-1]))
    keep = torch.zeros_like(delta, dtype=torch.bool)
    return keep.scatter_(-1, delta.topk(count, dim=-1).indices, True)
