"""A bounded pool for a selecting layer: fewer tokens held than seen (a host pool smaller than
the context), evicted by how the selection used them.

Per KV head the pool keeps, for every token it holds, its text position, how many steps
selected it and the step of its last selection (`touch_pool`). Past `capacity` x the tokens
seen, `fit_pool` drops tokens before new ones are kept: `counter` (fewest past selections) or
`lru` (oldest last selection), both among the older half so that new tokens are protected, or
`fifo` (oldest first). The layer drops the same rows from what it stores (`keep_rows`).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from kvcore.storage import ContiguousRows
from methods.scoring import gather_tokens

Eviction = Literal["counter", "lru", "fifo"]
POOL_ROWS = ("positions", "counter", "last_used")


def _pool_row(name: str, doc: str) -> property:
    """A per-token row `(B, H_kv, T)`: reading gives a view of the valid rows (in-place updates
    are stored), assigning replaces them."""
    return property(lambda self: self.meta[name].view(),
                    lambda self, tensor: self.meta[name].assign(tensor), doc=doc)


class PooledLayer:
    """Mixin of a selecting layer whose held tokens form a pool; the layer names its policy
    (`eviction_policy`, an Eviction) and drops rows from its stores (`keep_rows`)."""

    positions = _pool_row("positions", "(B, H_kv, T) text positions held")
    counter = _pool_row("counter", "(B, H_kv, T) steps that selected the token")
    last_used = _pool_row("last_used", "(B, H_kv, T) step of the last selection")
    eviction_policy = "counter"

    def init_pool(self) -> None:
        self.meta: dict[str, ContiguousRows] = {name: ContiguousRows() for name in POOL_ROWS}
        self.step = 0

    def stored(self) -> int:
        return self.meta["positions"].length

    def kept_tokens(self) -> int:
        return self.stored()

    def at_positions(self, rows: torch.Tensor, fill) -> torch.Tensor:
        """`rows (B, H, T)` over the held tokens (H a multiple of H_kv) -> `(B, H, seen)` at
        their text positions, `fill` where a token was evicted."""
        if self.stored() == self.seen_tokens:
            return rows
        pos = self.positions.long().repeat_interleave(rows.shape[1] // self.positions.shape[1], 1)
        out = rows.new_full((*rows.shape[:2], self.seen_tokens), fill)
        return out.scatter_(2, pos, rows)

    def pool_append(self, keys: torch.Tensor, seen_tokens: int) -> None:
        """Rows for the new tokens `keys (B, H_kv, q, D)`, the last of `seen_tokens`, grown in
        place (no copy of what is held)."""
        b, h, q_len, _ = keys.shape
        new_pos = torch.arange(seen_tokens - q_len, seen_tokens, device=keys.device)
        zeros = torch.zeros(b, h, q_len, device=keys.device)
        for name, new in zip(POOL_ROWS, (new_pos.expand(b, h, q_len), zeros, zeros + self.step)):
            self.meta[name].append(new)

    def touch_pool(self, used: torch.Tensor) -> None:
        """One selecting step: `used (B, H_kv, T)` the tokens some head reading the KV head
        selected."""
        self.step += 1
        self.counter += used.to(self.counter.dtype)
        self.last_used.masked_fill_(used, float(self.step))

    def fit_pool(self, capacity: float) -> None:
        limit = max(1, math.ceil(capacity * self.seen_tokens))
        if self.stored() > limit:
            self._evict(self.stored() - limit)

    def _evict(self, n: int) -> None:
        t = self.stored()
        if self.eviction_policy == "fifo":
            drop_score, candidates = -self.positions.float(), t  # oldest first
        else:  # counter / lru among the older half, so new tokens are protected
            drop_score = -(self.counter if self.eviction_policy == "counter" else self.last_used)
            candidates = max(n, t // 2)
        drop = drop_score[:, :, :candidates].topk(n, dim=-1).indices
        keep_mask = torch.ones_like(self.positions, dtype=torch.bool).scatter_(2, drop, False)
        index = keep_mask.nonzero()[:, 2].view(*self.positions.shape[:2], t - n)
        for name in POOL_ROWS:
            setattr(self, name, gather_tokens(getattr(self, name), index))
        self.keep_rows(index)

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep only the stored rows `index (B, H_kv, T')` (ascending)."""
        raise NotImplementedError
