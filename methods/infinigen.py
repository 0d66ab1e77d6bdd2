"""InfiniGen: speculate which KV rows layer i needs from layer i-1's input, fetch only those.

Lee, Lee, Seo, Sim, "InfiniGen: Efficient Generative Inference of Large Language Models with
Dynamic KV Cache Management", OSDI 2024, arXiv 2406.19707. Spec, defaults and official-code quirks:
reference/methods.md §1. Components:

* Offline skewing (`prepare`): one forward over a calibration text (default the first 2048 tokens
  of PG-19's first book, the official file) captures post-RoPE Q and K per layer; per KV head,
  the SVD of the stacked query heads of its group (g*n x d) gives A = V_q, its columns ordered by
  sigma_q * sigma_k (cosmetic: partial columns are chosen by magnitude). A is orthogonal, so
  (QA)(KA)^T = QK^T; after skewing most of Q's energy sits in few columns. RoPE sits between the
  projection and the dot product, so A is applied at run time to the rotated q and k (§1.9).
  Partial columns per KV head: the top k = int(d * partial_ratio) columns by sum |Q A| over the
  calibration tokens and the group's query heads (`partial_index=calibration`), or over the
  request's own prompt at prefill (`partial_index=prefill`, the official system; falls back to
  calibration when a request starts without a prefill, e.g. streaming perplexity). Artefacts are
  cached on disk per model and settings (atomic write, validated by hash and shape on load).
* Speculation (at layer i-1, for layer i >= first sparse layer): q = W_q[i] x_{i-1} (the full
  projection; RoPE forbids folding A into W_q), rotated at the current position, skewed, its k
  partial columns scored against layer i's partial key cache (skewed post-RoPE keys, k columns,
  kept on the compute device and appended every step). GQA: scores of a group's query heads are
  reduced by max to one score per KV head (`group_reduce`). Tokens with score > max - alpha are
  counted per KV head; ONE count n' = mean over heads, capped at budget_ratio * T, is shared by
  all heads (one fixed-size gather buffer: the official design); each KV head fetches its own
  top-n' tokens. Thresholds are per head (the official Llama simulation used head 0's max for
  every head: `head0_threshold=true` reproduces it).
* Dense layers (`dense_layers`, default 0 and 1) always use the full KV.
* `mode=system`: the full K/V lives in a host store (kvcore.offload); the selected rows are
  gathered on the host and copied to the device on a side stream while layer i-1 computes; layer i
  waits on the copy's event and attends over the fetched rows + the new token.
  `mode=simulate` keeps the full K/V on the device and masks the attention to the same selection
  (how the paper measured accuracy); both give the same logits (tested).
* CPU pool limit (`pool_capacity`, 1.0 = unlimited): past capacity * tokens seen, tokens are
  evicted per KV head before new ones are kept: `counter` (the paper's: fewest past selections),
  `lru` (oldest last selection) — both among the older half so new tokens are protected — or
  `fifo`. Real eviction of the host pool (an extension: the official code only simulates it).

Hyperparameters:
    alpha: logit margin below the max that still counts as needed (Llama default 5; OPT 4).
    partial_ratio: share of head_dim columns in the partial query/key (code 0.2; paper 0.3).
    budget_ratio: cap on fetched tokens per step as a share of the context (default 0.2).
    dense_layers: layers that always use the full cache (default [0, 1]).
    pool_capacity: host pool size as a share of tokens seen (1.0 = unlimited).
    eviction: counter | lru | fifo (pool eviction policy).
    mode: system | simulate.
    skewing: apply the skewing matrices (false = identity, for the Fig. 13 ablation).
    partial_index: calibration | prefill (where partial columns come from).
    group_reduce: max | mean (GQA: query-head scores -> one KV-head score).
    head0_threshold: reproduce the official Llama simulation's head-0 threshold quirk.
    calibration_path: text file for skewing (default: PG-19 first book from the data folder).
    calibration_tokens: tokens of it used (default 2048).
    cache_dir: where prepared artefacts are cached (default ~/.cache/kv-harness/infinigen).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvcore.offload import HostKVStore
from methods._infinigen_prep import SkewingArtefacts, calibration_file, prepare_skewing
from methods.base import Capabilities, KVLayer, KVMethod, ModelInfo
from methods.kernels import sparse_attention
from methods.rope import rotate
from methods.scoring import attention_with_probs, expand_kv, gather_tokens

EVICTIONS = ("counter", "lru", "fifo")


def _use_kernel(query: torch.Tensor) -> bool:
    """The Triton sparse-attention kernel serves simulate-mode decode on CUDA. On CPU the
    interpreter would be exact but ~100 ms a call, so model-level CPU runs keep the torch path
    (the kernel has its own tests, and one InfiniGen test forces it through the interpreter)."""
    return query.is_cuda and sparse_attention.use_triton(query)


@dataclass(kw_only=True)
class InfiniGen(KVMethod):
    name: ClassVar[str] = "infinigen"
    capabilities: ClassVar[Capabilities] = Capabilities(
        needs_prepare=True, modes=("system", "simulate"), offloads_kv=True, lookahead=True,
        needs_rope=True, selects_tokens=True)
    alpha: float = 5.0
    partial_ratio: float = 0.2
    budget_ratio: float = 0.2
    dense_layers: list[int] = field(default_factory=lambda: [0, 1])
    pool_capacity: float = 1.0
    eviction: str = "counter"
    mode: str = "system"
    skewing: bool = True
    partial_index: str = "calibration"
    group_reduce: str = "max"
    head0_threshold: bool = False
    calibration_path: str | None = None
    calibration_tokens: int = 2048
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.dense_layers = list(self.dense_layers)
        self._art: SkewingArtefacts | None = None

    def check_hyperparameters(self) -> list[str]:
        r = []
        if not isinstance(self.alpha, (int, float)) or self.alpha <= 0:
            r.append(f"method.alpha={self.alpha!r} must be > 0 (a logit margin)")
        if not isinstance(self.partial_ratio, (int, float)) or not 0 < self.partial_ratio <= 1:
            r.append(f"method.partial_ratio={self.partial_ratio!r} must be in (0, 1]")
        if not isinstance(self.budget_ratio, (int, float)) or not 0 < self.budget_ratio <= 1:
            r.append(f"method.budget_ratio={self.budget_ratio!r} must be in (0, 1]")
        if not isinstance(self.pool_capacity, (int, float)) or not 0 < self.pool_capacity <= 1:
            r.append(f"method.pool_capacity={self.pool_capacity!r} must be in (0, 1]")
        choices = {"eviction": EVICTIONS, "mode": self.capabilities.modes,
                   "partial_index": ("calibration", "prefill"), "group_reduce": ("max", "mean")}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                r.append(f"method.{key}={getattr(self, key)!r}; allowed: {', '.join(allowed)}")
        if not all(isinstance(i, int) and i >= 0 for i in self.dense_layers):
            r.append(f"method.dense_layers={self.dense_layers!r} must be layer indices >= 0")
        if not isinstance(self.calibration_tokens, int) or self.calibration_tokens < 16:
            r.append(f"method.calibration_tokens={self.calibration_tokens!r} must be >= 16")
        return r

    def validate(self, info: ModelInfo, runner) -> list[str]:
        reasons = super().validate(info, runner)
        if self.calibration_path:  # the default text is located at prepare (runner's data dir)
            try:
                calibration_file(self, None)
            except Exception as exc:  # ConfigError naming method.calibration_path
                reasons.append(str(exc))
        if any(i >= info.num_layers for i in self.dense_layers):
            reasons.append(f"method.dense_layers={self.dense_layers} names a layer >= the model's "
                           f"{info.num_layers} layers")
        return reasons

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict:
        return {"alpha": 1e9, "budget_ratio": 1.0, "mode": "simulate"}

    def prepare(self, ctx) -> dict:
        self._art, facts = prepare_skewing(self, ctx)
        return facts

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        if self._art is None:
            raise RuntimeError("infinigen: call prepare(model, tokenizer, ...) first")
        return InfiniGenLayer(layer_idx, info, self)

    def own_dense_layers(self, info: ModelInfo) -> tuple[int, ...]:
        # Layer 0 has no previous layer to speculate from; the rest are the paper's choice.
        return tuple(sorted({0, *self.dense_layers}))

    def make_dense_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        # Dense layers still keep their K/V on the host tier and prefetch it whole (system mode).
        layer = self.make_layer(layer_idx, info)
        layer.dense = True
        return layer


class InfiniGenLayer(KVLayer):
    def __init__(self, layer_idx: int, info: ModelInfo, method: InfiniGen):
        super().__init__(layer_idx, info)
        self.m = method
        self.art = method._art
        self.dense = layer_idx in method.dense_layers or layer_idx == 0
        self.system = method.mode == "system"
        self.store = None  # HostKVStore (system mode)
        self.partial_keys: torch.Tensor | None = None  # (B, H_kv, T, k) on the compute device
        self.positions: torch.Tensor | None = None  # (B, H_kv, T) text positions stored
        self.counter: torch.Tensor | None = None  # (B, H_kv, T) times selected
        self.last_used: torch.Tensor | None = None  # (B, H_kv, T) decode step of last selection
        self.selected: torch.Tensor | None = None  # (B, H_kv, n) this step's fetched slots
        self.pending = None  # (Transfer, Transfer)
        self.columns: torch.Tensor | None = None  # (H_kv, k) partial columns of this request
        self.step = 0
        self._attended = 0
        self._decode_selected: int | None = None  # tokens attended at the last sparse decode step
        self._decode_budget: int | None = None  # its cap: int(budget_ratio * T) + the new token

    # --- speculation (run one layer ahead) ---------------------------------------------------
    def prefetch(self, hidden_states, position_ids, ahead: bool) -> None:
        if hidden_states.shape[1] != 1 or self.stored() == 0 or self.pending is not None:
            return
        if self.dense:
            if self.system and (ahead or self.layer_idx == 0):
                self.pending = self.store.fetch()
            return
        if not ahead:
            return
        self.selected = self.speculate(hidden_states, position_ids)
        self.touch(self.selected)
        if self.system:
            self.pending = self.store.fetch(self.selected)

    def speculate(self, x: torch.Tensor, position_ids) -> torch.Tensor:
        """Indices `(B, H_kv, n')` of stored tokens layer i will need, from x_{i-1} `(B, 1, hidden)`."""
        art, i, info = self.art, self.layer_idx, self.info
        b = x.shape[0]
        q = art.project_query(i, x)  # (B, H_q, 1, D) pre-RoPE
        pos = (position_ids if position_ids is not None else torch.tensor([[self.seen_tokens]]))
        q = rotate(q, pos.to(q.device).view(b, 1, 1), art.inv_freq)  # RoPE at the current position
        groups = info.group_size
        skew = art.skew[i].to(q.device).repeat_interleave(groups, dim=0)  # (H_q, d, d)
        cols = self.partial_columns().repeat_interleave(groups, dim=0)  # (H_q, k)
        q_partial = torch.einsum("bhqd,hde->bhqe", q.float(), skew)
        q_partial = q_partial.gather(-1, cols[None, :, None, :].expand(b, -1, 1, -1))
        keys = expand_kv(self.partial_keys, groups).float()  # (B, H_q, T, k)
        scores = (q_partial @ keys.transpose(2, 3))[:, :, 0] / math.sqrt(info.head_dim)
        scores = scores.view(b, info.num_kv_heads, groups, -1)
        scores = scores.amax(2) if self.m.group_reduce == "max" else scores.mean(2)  # (B, H_kv, T)
        top = scores.amax(-1, keepdim=True)
        if self.m.head0_threshold:
            top = top[:, :1].expand_as(top)
        count = (scores > top - self.m.alpha).sum(-1).float().mean()
        t = scores.shape[-1]
        cap = max(1, int(self.m.budget_ratio * t))
        n = max(1, min(int(count), cap, t))
        self._decode_selected, self._decode_budget = n + 1, cap + 1
        return scores.topk(n, dim=-1).indices.sort(-1).values

    def partial_columns(self) -> torch.Tensor:
        return self.columns if self.columns is not None else self.art.columns[self.layer_idx]

    def touch(self, index: torch.Tensor) -> None:
        self.step += 1
        self.counter.scatter_add_(2, index, torch.ones_like(index, dtype=self.counter.dtype))
        self.last_used.scatter_(2, index, torch.full_like(index, self.step, dtype=self.last_used.dtype))

    # --- cache seam --------------------------------------------------------------------------
    def stored(self) -> int:
        return 0 if self.positions is None else self.positions.shape[-1]

    def update(self, keys, values, position_ids):
        q_len = keys.shape[2]
        past = self._past(q_len)
        self.seen_tokens += q_len
        self._append(keys, values)
        if past is None:
            out = (keys, values)
        else:
            out = (torch.cat([past[0], keys], dim=2), torch.cat([past[1], values], dim=2))
        self._attended = out[0].shape[2]
        return out

    def _past(self, q_len: int):
        """What this step attends to before the new tokens (system mode: fetched rows)."""
        if not self.system:
            return (self.keys, self.values) if self.keys is not None else None
        pending, self.pending = self.pending, None
        if pending is None and self.stored():  # prefill over a stored cache, or no speculation
            if q_len == 1 and not self.dense and self.selected is not None:
                pending = self.store.fetch(self.selected)
            else:
                pending = self.store.fetch()
                self.selected = None
        if pending is None:
            return None
        return pending[0].wait(), pending[1].wait()

    def _append(self, keys, values):
        b, h, q_len, _ = keys.shape
        new_pos = torch.arange(self.seen_tokens - q_len, self.seen_tokens,
                               device=keys.device).expand(b, h, q_len)
        zeros = torch.zeros(b, h, q_len, device=keys.device)
        if self.positions is None:
            self.positions, self.counter, self.last_used = new_pos.clone(), zeros, zeros.clone()
        else:
            self.positions = torch.cat([self.positions, new_pos], 2)
            self.counter = torch.cat([self.counter, zeros], 2)
            self.last_used = torch.cat([self.last_used, zeros + self.step], 2)
        if self.system:
            self.store = self.store or HostKVStore(self.tier, self.layer_idx)
            self.store.append(keys, values)
        else:
            self.keys = keys if self.keys is None else torch.cat([self.keys, keys], 2)
            self.values = values if self.values is None else torch.cat([self.values, values], 2)
        if not self.dense:
            self._append_partial(keys)

    def _append_partial(self, keys):
        if self.m.partial_index == "prefill" and self.columns is None and keys.shape[2] > 1:
            return  # the prompt's columns are chosen in attend(); keys are added there
        skewed = torch.einsum("bhtd,hde->bhte", keys.float(), self.art.skew[self.layer_idx].to(keys.device))
        cols = self.partial_columns()
        part = skewed.gather(-1, cols[None, :, None, :].expand(*skewed.shape[:3], -1))
        self.partial_keys = part if self.partial_keys is None else torch.cat([self.partial_keys, part], 2)

    # --- attention seam ----------------------------------------------------------------------
    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        q_len = query.shape[2]
        if q_len > 1:
            if not self.dense and self.m.partial_index == "prefill" and self.columns is None:
                self.columns = self.art.columns_from(query, self.layer_idx)
                self._append_partial(keys)
            return base(module, query, keys, values, attention_mask, **kwargs)
        if self.dense or self.selected is None:
            self._attended = keys.shape[2]
            return base(module, query, keys, values, None, **kwargs)
        if self.system:  # fetched rows + the new token
            return base(module, query, keys, values, None, **kwargs)
        if _use_kernel(query):  # gather in the kernel: no (B, H, T) keep-mask
            selected = self.selected.to(keys.device)  # unique top-k slots, all < the new slot
            index = torch.cat([selected, torch.full_like(selected[..., :1], keys.shape[2] - 1)], 2)
            self._attended = index.shape[2]
            out = sparse_attention.sparse_decode_attention(query[:, :, 0], keys, values, index,
                                                           kwargs["scaling"])
            return out[:, None], None  # (B, 1, H_q, D), as attention_with_probs returns
        keep = torch.zeros(keys.shape[0], keys.shape[1], keys.shape[2], dtype=torch.bool,
                           device=keys.device)
        keep.scatter_(2, self.selected.to(keys.device), True)
        keep[:, :, -1] = True  # the new token
        self._attended = int(keep[0, 0].sum())
        keep = expand_kv(keep[..., None], query.shape[1] // keys.shape[1])[..., 0][:, :, None]
        out, _ = attention_with_probs(query, keys, values, None, kwargs["scaling"], keep=keep)
        return out, None

    def after_forward(self) -> None:
        limit = max(1, math.ceil(self.m.pool_capacity * self.seen_tokens))
        if self.stored() > limit:
            self._evict(self.stored() - limit)
        self.selected = None

    def _evict(self, n: int) -> None:
        t = self.stored()
        if self.m.eviction == "fifo":
            drop_score = -self.positions.float()  # oldest first
            candidates = t
        else:  # counter / lru among the older half, so new tokens are protected
            drop_score = -(self.counter if self.m.eviction == "counter" else self.last_used)
            candidates = max(n, t // 2)
        drop = drop_score[:, :, :candidates].topk(n, dim=-1).indices
        keep_mask = torch.ones_like(self.positions, dtype=torch.bool).scatter_(2, drop, False)
        index = keep_mask.nonzero()[:, 2].view(*self.positions.shape[:2], t - n)
        self.positions = gather_tokens(self.positions, index)
        self.counter = gather_tokens(self.counter, index)
        self.last_used = gather_tokens(self.last_used, index)
        if self.partial_keys is not None:
            self.partial_keys = gather_tokens(self.partial_keys, index.to(self.partial_keys.device))
        if self.system:
            self.store.keep(index)
        else:
            self.keys = gather_tokens(self.keys, index.to(self.keys.device))
            self.values = gather_tokens(self.values, index.to(self.values.device))

    # --- accounting --------------------------------------------------------------------------
    def kept_tokens(self) -> int:
        return self.stored()

    def attended_tokens(self) -> int:
        return self._attended

    def kept_positions(self) -> torch.Tensor:
        if self.selected is None:
            return self.positions if self.positions is not None else super().kept_positions()
        chosen = gather_tokens(self.positions, self.selected.to(self.positions.device))
        return torch.cat([chosen, self.positions[:, :, -1:]], dim=2)

    def budget_tokens(self) -> int | None:
        """The fetch cap of the last sparse decode step (None for dense layers / no decode)."""
        return None if self.dense else self._decode_budget

    def stats(self) -> dict[str, int]:
        held = self.store.nbytes() if self.store is not None else (
            0 if self.keys is None else self.keys.nbytes + self.values.nbytes)
        partial = 0 if self.partial_keys is None else self.partial_keys.nbytes
        out = {"kv_tokens": self.stored(), "kv_bytes": held + partial,
               "kv_bytes_device": partial + (0 if self.system else held)}
        if not self.dense and self._decode_selected is not None:
            out["selected_tokens"] = self._decode_selected
        return out
