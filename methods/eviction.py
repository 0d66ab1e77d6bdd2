"""The scored-eviction template: what every evicting method shares, so a method writes only its score.

A method on this template (H2O, StreamingLLM, TOVA, SnapKV, PyramidKV) provides:
  * `score()` on its layer: the importance of every kept token per KV head, `(B, H_kv, T)` fp32,
    higher = keep (attention-based methods gather what they need in `attend`, usually into a
    per-token state declared by `new_state`, which the template moves along with the K/V);
  * `protected(budget)`: how many sink tokens (the first positions) and recent tokens (the last
    positions) are kept whatever their score;
  * when it acts: after every forward (`compress_at = "forward"`: each decode step and each
    prefill chunk) or once per prompt (`compress_at = "prefill_end"`: SnapKV-like compressors,
    called by the engine through `on_prefill_end`, whatever the chunking; decode then appends);
  * optionally a per-layer budget: `BudgetedMethod.layer_budget` (PyramidKV, SqueezeAttention).
    Budgets are per layer; every KV head of a layer keeps the same number of tokens (a per-head
    allocation needs ragged caches, which this storage does not provide).

The template does the rest: text positions `(B, H_kv, T)`, the protection, top-k per KV head,
compaction of K, V, positions and state, the budget that the engine checks after every forward
(`allowed_tokens`), the optional host tier (`runner.kv_offload=cpu`), and the accounting.

Budget rule (the one rule of every method, methods/base.py): `budget_tokens`, when set, takes
precedence over `budget_ratio` (a fraction of the tokens seen so far).

Storage is preallocated per layer (`append_tokens`, amortised growth), so a decode step costs no copy
of the cache: the new token is written at the end, and when exactly one token must go (the steady
state of a per-step method) the last slot moves into the evicted slot, per KV head. The cache is
therefore *not* in text order; nothing depends on it: attention over old tokens is order-free (a
chunk's own tokens are always the last ones, in order, so causal masks hold) and positions travel
with the tokens. Larger evictions gather the kept tokens in slot order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcore.offload import HostKVStore
from methods.base import KVLayer, KVMethod, ModelInfo, budget_for, check_budget
from methods.scoring import gather_tokens


@dataclass(kw_only=True)
class BudgetedMethod(KVMethod):
    """The shared budget knobs and their one rule; `layer_budget` is the per-layer allocation hook."""

    budget_ratio: float | None = 0.2
    budget_tokens: int | None = None
    min_budget_tokens: ClassVar[int] = 1  # a ratio budget never goes below this

    def check_hyperparameters(self) -> list[str]:
        return check_budget(self.budget_ratio, self.budget_tokens)

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict:
        return {"budget_tokens": seq_tokens}

    def total_tokens(self, seen: int) -> int:
        """Tokens one layer keeps after `seen` tokens under a uniform allocation."""
        return budget_for(seen, self.budget_ratio, self.budget_tokens, minimum=self.min_budget_tokens)

    def layer_budget(self, layer_idx: int, num_layers: int, seen: int) -> int:
        """Per-layer allocation hook: tokens layer `layer_idx` of `num_layers` keeps after `seen`
        tokens (uniform by default; PyramidKV's pyramid, SqueezeAttention's clusters)."""
        return self.total_tokens(seen)


# Aligned per-token buffers `(B, H_kv, capacity, ...)` (K, V, positions and a method's state) are
# a plain dict of tensors + a length on the layer, so `Request.snapshot` can clone them.
def append_tokens(buffers: dict[str, torch.Tensor], length: int, new: dict[str, torch.Tensor]) -> int:
    """Write each `(B, H_kv, q, ...)` tensor after the first `length` tokens (amortised growth);
    returns the new length."""
    q = next(iter(new.values())).shape[2]
    need = length + q
    for name, x in new.items():
        buf = buffers.get(name)
        if buf is None or buf.shape[2] < need:
            cap = max(need, 2 * (0 if buf is None else buf.shape[2]))
            grown = x.new_empty(*x.shape[:2], cap, *x.shape[3:])
            if buf is not None:
                grown[:, :, :length] = buf[:, :, :length]
            buffers[name] = buf = grown
        buf[:, :, length:need] = x
    return need


def keep_tokens(buffers: dict[str, torch.Tensor], length: int, index: torch.Tensor) -> int:
    """Keep the tokens at `index (B, H_kv, k)` per head, in that order, in fresh fitted buffers (a
    long prompt compressed to its budget frees its memory; one slot of decode headroom)."""
    k = index.shape[-1]
    for name, buf in buffers.items():
        kept = gather_tokens(buf[:, :, :length], index)
        buffers[name] = kept.new_empty(*kept.shape[:2], k + 1, *kept.shape[3:])
        buffers[name][:, :, :k] = kept
    return k


def drop_one_token(buffers: dict[str, torch.Tensor], length: int, slot: torch.Tensor) -> int:
    """Evict one token per head, `slot (B, H_kv)`: the last token moves into its place."""
    last = length - 1
    for buf in buffers.values():
        src = buf[:, :, last:last + 1].clone()  # one token; it may overlap its target
        index = slot.reshape(*slot.shape, 1, *([1] * (buf.dim() - 3)))
        buf.scatter_(2, index.expand(*src.shape), src)
    return last


class EvictionLayer(KVLayer):
    """Per-request, per-layer state of a scored-eviction method (see the module docstring)."""

    compress_at: ClassVar[str] = "forward"  # "forward" | "prefill_end"

    def __init__(self, layer_idx: int, info: ModelInfo, method: BudgetedMethod):
        super().__init__(layer_idx, info)
        self.method = method
        self.buffers: dict[str, torch.Tensor] = {}  # per-token buffers, see append_tokens
        self.kept_count = 0  # tokens kept
        self.positions: torch.Tensor | None = None  # (B, H_kv, T) text positions of kept tokens
        self.store: HostKVStore | None = None  # the kept K/V on the host tier (runner.kv_offload=cpu)
        self.pending = None  # (Transfer, Transfer): the kept set prefetched one layer ahead
        self.granted: tuple[int, int] | None = None  # prefill_end: (tokens kept, seen) at compression

    # --- what a method writes ---------------------------------------------------------------
    def score(self) -> torch.Tensor:
        """Importance of every kept token, `(B, H_kv, T)` (higher = keep)."""
        raise NotImplementedError

    def protected(self, budget: int) -> tuple[int, int]:
        """(sink tokens, recent tokens) kept whatever their score."""
        return 0, 0

    def new_state(self, b: int, h: int, q: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Per-token state of `q` new tokens, `(B, H_kv, q, ...)`; moved along with the K/V."""
        return {}

    def state(self, name: str) -> torch.Tensor:
        """A per-token state of the kept tokens, `(B, H_kv, T, ...)` (a view: add to it in place)."""
        return self.buffers[name][:, :, : self.kept_count]

    # --- cache seam -------------------------------------------------------------------------
    def offloaded(self) -> bool:
        return self.tier is not None and self.tier.offload

    def prefetch(self, hidden_states, position_ids, ahead: bool) -> None:
        if (self.offloaded() and hidden_states.shape[1] == 1 and self.store is not None
                and self.store.length and self.pending is None):
            self.pending = self.store.fetch()

    def update(self, keys, values, position_ids):
        b, h, q, _ = keys.shape
        text_pos = torch.arange(self.seen_tokens, self.seen_tokens + q, device=keys.device)
        new = {"positions": text_pos.expand(b, h, q), **self.new_state(b, h, q, keys.device)}
        self.seen_tokens += q
        if self.offloaded():
            self.kept_count = append_tokens(self.buffers, self.kept_count, new)
            self._views()
            self.store = self.store or HostKVStore(self.tier, self.layer_idx)
            pending, self.pending = self.pending, None
            return self.store.past_and_new(pending, keys, values)
        self.kept_count = append_tokens(self.buffers, self.kept_count, {"keys": keys, "values": values, **new})
        self._views()
        return self.keys, self.values

    def _views(self) -> None:
        self.positions = self.state("positions")
        if "keys" in self.buffers:
            self.keys, self.values = self.state("keys"), self.state("values")

    def kept_tokens(self) -> int:
        return self.kept_count

    def kept_positions(self) -> torch.Tensor:
        return self.positions if self.positions is not None else super().kept_positions()

    # --- eviction ---------------------------------------------------------------------------
    def budget(self) -> int:
        return self.method.layer_budget(self.layer_idx, self.info.num_layers, self.seen_tokens)

    def allowed_tokens(self) -> int | None:
        if self.compress_at == "forward":
            return self.budget()
        if self.granted is None:  # the prompt is held in full until it is over
            return None
        kept, seen = self.granted
        return kept + self.seen_tokens - seen  # decode appends without eviction

    def after_forward(self) -> None:
        if self.compress_at == "forward":
            self.compress_to(self.budget())

    def on_prefill_end(self) -> None:
        if self.compress_at == "prefill_end":
            self.compress_to(self.budget())
            self.granted = (self.kept_tokens(), self.seen_tokens)

    def compress_to(self, budget: int) -> None:
        """Keep `budget` tokens per KV head: the protected ones, then the top scores."""
        kept = self.kept_tokens()
        if kept <= budget:
            return
        if kept - budget == 1 and not self.offloaded():  # steady state: no copy of the cache
            self.kept_count = drop_one_token(self.buffers, self.kept_count, self.lowest_slot(budget))
        else:
            index = self.guarded_scores(budget).topk(budget, dim=-1).indices.sort(dim=-1).values
            if self.offloaded():
                self.store.keep(index)
            self.kept_count = keep_tokens(self.buffers, self.kept_count, index)
        self._views()

    def guarded_scores(self, budget: int) -> torch.Tensor:
        """Scores `(B, H_kv, T)` fp32 with the protected tokens at +inf."""
        sinks, recent = self.protected(budget)
        guard = self.positions < sinks
        if recent:
            guard |= self.positions >= self.seen_tokens - recent
        return self.score().float().masked_fill(guard, float("inf"))

    def lowest_slot(self, budget: int) -> torch.Tensor:
        """The slot to evict when exactly one token must go, `(B, H_kv)`."""
        return self.guarded_scores(budget).argmin(dim=-1)

    # --- accounting -------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        if self.offloaded():
            held = 0 if self.store is None else self.store.nbytes()
            return {"kv_tokens": self.kept_tokens(), "kv_bytes": held, "kv_bytes_device": 0}
        if not self.kept_tokens():
            return {"kv_tokens": 0, "kv_bytes": 0}
        return {"kv_tokens": self.kept_tokens(), "kv_bytes": int(self.keys.nbytes + self.values.nbytes)}
