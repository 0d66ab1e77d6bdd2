"""Per-token storage of one layer: a `(B, H_kv, T, ...)` tensor that grows, shrinks, is rewritten.

A KV layer keeps its K and V (and, for the scored-eviction template, positions and per-token
state) as `Rows`; `runner.kv_layout` picks the storage behind K and V:

* `ContiguousRows` (`contiguous`): one preallocated buffer `(B, H_kv, capacity, ...)` with
  amortised growth; `view()` is a view of the valid rows (no copy) and writes to it are stored.
* `PagedRows` (`paged`, kvcore.paged): a block table into a pool shared by every sequence of the
  engine; `view()` is a gather of the blocks into a fresh contiguous tensor (read-only: writes to
  it are not stored; use `write_at`).

Both give the same values bit for bit; only where the bytes live, and how many are held, differ.
Figures: `used_bytes()` = the valid rows; `allocated_bytes()` = what the storage holds for them
(the buffer's capacity, or blocks held x block bytes); harness.core.accounting turns them into waste.

**Ragged heads** (head-wise budgets). Every `(batch row b, head h)` has its own valid length,
`lengths() (B, H)`; `length` is the longest head's (the extent `T` of `view()`). Rows are
*rectangular* while every head holds the same count (the common case: then `lengths()` is `length`
everywhere and nothing else changes or costs more) and *ragged* once an eviction keeps different
counts per head (`keep(index, valid=...)`, `drop_one(slot, heads=...)`, `assign(x, lengths=...)`).
Contract for ragged rows, both layouts:
  * head (b, h)'s tokens are its slots `0 .. lengths[b, h] - 1`; `view()` pads every head to
    `length` and the slots past a head's own length hold unspecified values (never read them;
    `ragged_view()` hands the lengths along);
  * `append(new (B, H, q, ...))` writes head (b, h)'s q rows after *its own* last token, so every
    head grows by q (a decode step: each head gets the new token); `write_at(start, new)` writes
    the same slots of every head (a head shorter than `start + q` grows to it);
  * `used_bytes()` counts each head's own tokens only; `allocated_bytes()` what the layout holds:
    contiguous, the padded buffer (the short heads' padding is waste, reported as such); paged,
    the blocks each head holds (per-head block tables: a short head holds fewer blocks);
  * a head may hold zero tokens (a budget of 0); attention over it outputs zeros
    (methods.kernels.ragged_attention).
Rows become rectangular again when an operation leaves every head the same count through
`keep`/`assign` (not after `append`/`drop_one`, which would need a device sync every step).

`in_place()` reads the rows where they are, as `HeadBlocks` (per-head block tables over the
storage itself, no copy): what attention kernels read instead of `view()`'s gather.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from kvcore.guards import check_allocation, check_stop

KV_LAYOUTS = ("contiguous", "paged")

GROWTH_MIN_ROWS = 256  # smallest buffer / headroom: a short decode never reallocates


def grown_capacity(rows_needed: int, capacity: int = 0) -> int:
    """Rows to allocate for `rows_needed`: 1.5x (at least +256), rounded up to 256, so growing
    one row at a time costs O(1) amortised copies per row and at most ~50% unused capacity."""
    want = rows_needed + max(GROWTH_MIN_ROWS, rows_needed // 2)
    return -(-want // GROWTH_MIN_ROWS) * GROWTH_MIN_ROWS


def doubled_capacity(rows_needed: int, capacity: int = 0) -> int:
    """Rows to allocate for `rows_needed`: twice the old capacity (at least what is needed)."""
    return max(rows_needed, 2 * capacity)


def slot_index(index: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`index (B, H, k)` broadcast over x's trailing dims: the index `gather`/`scatter_` along
    dim 2 of `x (B, H, T, ...)` take."""
    return index.reshape(*index.shape, *([1] * (x.dim() - 3))).expand(*index.shape, *x.shape[3:])


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x `(B, H, T, ...)`, index `(B, H, k)` -> `(B, H, k, ...)`: per-head token gather."""
    return x.gather(2, slot_index(index, x))


def uniform_lengths(batch: int, heads: int, length: int, device) -> torch.Tensor:
    """`(B, H)` int64 filled with `length`: the lengths of rectangular rows (a fresh tensor)."""
    return torch.full((batch, heads), length, dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=64)
def _identity_table(heads: int, device: torch.device) -> torch.Tensor:
    return torch.arange(heads, device=device).view(heads, 1)


@dataclass(frozen=True)
class HeadBlocks:
    """Rows read where they are stored (no copy), as per-head block tables.

    Head r = b * H + h (batch row b, head h) holds `lengths[b, h]` tokens; its token t is
    `data[table[r, t // block_tokens], t % block_tokens]`. A contiguous buffer `(B, H, capacity,
    ...)` is one block per head (`table[r] = [r]`, `block_tokens` = its capacity); paged rows are
    their blocks seen one head at a time (vLLM's block tables, one level finer). Entries of
    `table` past a head's last block are valid block ids that must not be read. Valid until the
    rows are next written.

    data:         `(N, block_tokens, ...)` the storage itself (a view; rows are unit-strided)
    table:        `(B * H, max_blocks)` int64 block ids in token order, on data's device
    block_tokens: tokens per block
    length:       the longest head's length (`view()`'s T)
    heads:        `(B, H)`
    per_head:     `(B, H)` int64 lengths on data's device when ragged; None: every head holds
                  `length` (rectangular rows: kernels take the one count, no tensor is built)
    """

    data: torch.Tensor
    table: torch.Tensor
    block_tokens: int
    length: int
    heads: tuple[int, int]
    per_head: torch.Tensor | None = None

    @classmethod
    def of(cls, x: torch.Tensor) -> "HeadBlocks":
        """A plain `(B, H, T, ...)` tensor as one block per head (a view when B and H merge)."""
        b, h, t = x.shape[:3]
        data = x.reshape(b * h, t, *x.shape[3:])
        return cls(data, _identity_table(b * h, x.device), max(t, 1), t, (b, h))

    @property
    def lengths(self) -> torch.Tensor:
        """Valid tokens per head `(B, H)` int64."""
        if self.per_head is not None:
            return self.per_head
        return uniform_lengths(*self.heads, self.length, self.data.device)

    @property
    def shape(self) -> tuple[int, ...]:
        """`(B, H, T, ...)` as `view()` would give."""
        return (*self.heads, self.length, *self.data.shape[2:])

    def gather(self) -> torch.Tensor:
        """A copy `(B, H, length, ...)` (slots past a head's length unspecified): the torch
        reference of what a kernel reads; layers use `Rows.view()` (cheaper on contiguous)."""
        nb = max(1, -(-self.length // self.block_tokens))
        table = self.table[:, :nb]
        blocks = self.data.index_select(0, table.flatten())  # (BH * nb, bt, ...)
        rest = self.data.shape[2:]
        out = blocks.reshape(*self.heads, table.shape[1] * self.block_tokens, *rest)
        return out[:, :, : self.length]


class Rows:
    """One per-token tensor `(B, H, T, ...)` of a layer (the interface both layouts implement).

    See the module docstring for ragged rows (per-head lengths): every method below keeps that
    contract; `length` is the longest head's length."""

    length: int  # valid tokens T (the longest head's, when ragged)

    def view(self) -> torch.Tensor | None:
        """The valid rows `(B, H, T, ...)`; None before anything was written. Ragged rows: every
        head padded to `length` (slots past a head's own length unspecified)."""
        raise NotImplementedError

    def lengths(self) -> torch.Tensor | None:
        """Valid tokens per head `(B, H)` int64 (a tensor the caller must not modify); None
        before anything was written."""
        raise NotImplementedError

    @property
    def ragged(self) -> bool:
        """Whether heads hold different counts (False: every head holds `length`)."""
        return False

    def ragged_view(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`(view(), lengths())`: the padded rows `(B, H, T, ...)` and `(B, H)` valid counts."""
        return self.view(), self.lengths()

    def in_place(self) -> HeadBlocks | None:
        """The rows where they are stored, as per-head block tables (no copy; None when empty).
        Valid until the next write."""
        raise NotImplementedError

    def append(self, new: torch.Tensor) -> None:
        """Write `new (B, H, q, ...)` after the valid rows (ragged: after each head's own)."""
        self.write_at(self.length, new)

    def write_at(self, start: int, new: torch.Tensor) -> None:
        """Overwrite (or extend) rows `start .. start + q` with `new (B, H, q, ...)`."""
        raise NotImplementedError

    def assign(self, tensor: torch.Tensor | None, lengths: torch.Tensor | None = None) -> None:
        """Replace the whole content by `tensor (B, H, T', ...)` (None: empty). `lengths (B, H)`:
        head (b, h) holds only its first `lengths[b, h]` rows of `tensor` (ragged)."""
        raise NotImplementedError

    def keep(self, index: torch.Tensor, headroom: int = 0,
             valid: torch.Tensor | None = None) -> None:
        """Keep the tokens at `index (B, H, k)` per head, in that order (an eviction).

        `valid (B, H)` (head-wise budgets): head (b, h) keeps only `index[b, h, :valid[b, h]]`
        (0 <= valid <= k); the entries past it are ignored but must be slots of the padded
        extent, `[0, length)`. The rows are ragged after it unless every head keeps the same
        count. One device sync (the counts' range)."""
        raise NotImplementedError

    def drop_one(self, slot: torch.Tensor, last: torch.Tensor | None = None,
                 heads: torch.Tensor | None = None) -> None:
        """Evict one token per head, `slot (B, H)`: the head's last token moves into its place.
        `last`: the last token's rows `(B, H, 1, ...)` when the caller still holds them (the
        token it appended this step), so they need not be copied out of the buffer first.
        `heads (B, H)` bool: only those heads drop a token (the others keep theirs; their `slot`
        is ignored) and the rows become ragged; None: every head drops one."""
        raise NotImplementedError

    def used_bytes(self) -> int:
        """Bytes of the valid rows (ragged: each head's own tokens only)."""
        raise NotImplementedError

    def allocated_bytes(self) -> int:
        """Bytes this storage holds for the rows (valid or not)."""
        raise NotImplementedError

    def release(self) -> None:
        """Give the memory back (the rows become empty)."""
        raise NotImplementedError

    def fork(self) -> "Rows":
        """An independent copy (Request.snapshot)."""
        raise NotImplementedError


def split_valid(valid: torch.Tensor | None, k: int) -> tuple[int, torch.Tensor | None]:
    """`keep`'s `valid (B, H)` as (rows to keep per head in the storage, per-head lengths or None
    when every head keeps the same count: rectangular). One device sync (a compression, not a
    decode step)."""
    if valid is None:
        return k, None
    valid = valid.to(torch.int64)
    lo, hi = (int(x) for x in torch.aminmax(valid))
    if lo < 0 or hi > k:
        raise ValueError(f"valid counts in [{lo}, {hi}] outside [0, {k}] (index has {k} slots)")
    return hi, None if lo == hi else valid.clone()


class ContiguousRows(Rows):
    """A preallocated buffer `(B, H, capacity, ...)`; `growth(needed, capacity)` sizes it.

    Ragged rows keep a `(B, H)` lengths tensor beside the buffer (rectangular: none)."""

    def __init__(self, growth: Callable[[int, int], int] = grown_capacity):
        self.growth = growth
        self.buffer: torch.Tensor | None = None
        self.length = 0
        self._lengths: torch.Tensor | None = None  # (B, H) int64 when ragged

    def view(self) -> torch.Tensor | None:
        return None if self.buffer is None else self.buffer[:, :, : self.length]

    def lengths(self) -> torch.Tensor | None:
        if self.buffer is None:
            return None
        if self._lengths is not None:
            return self._lengths
        return uniform_lengths(*self.buffer.shape[:2], self.length, self.buffer.device)

    @property
    def ragged(self) -> bool:
        return self._lengths is not None

    def in_place(self) -> HeadBlocks | None:
        if self.buffer is None:
            return None
        b, h, capacity = self.buffer.shape[:3]
        data = self.buffer.reshape(b * h, capacity, *self.buffer.shape[3:])  # a view when it can
        return HeadBlocks(data, _identity_table(b * h, data.device), capacity, self.length,
                          (b, h), self._lengths)

    def _reserve(self, end: int, like: torch.Tensor) -> None:
        """Capacity for `end` rows (a grown buffer holding the valid rows when short)."""
        if self.buffer is None or end > self.buffer.shape[2]:
            old = 0 if self.buffer is None else self.buffer.shape[2]
            shape = (*like.shape[:2], self.growth(end, old), *like.shape[3:])
            check_allocation(math.prod(shape) * like.element_size(), like.device,
                             f"a KV buffer of {shape[0]} x {shape[2]} tokens")
            grown = like.new_empty(*shape)
            if self.length:
                grown[:, :, : self.length].copy_(self.buffer[:, :, : self.length])
            self.buffer = grown

    def append(self, new: torch.Tensor) -> None:
        if self._lengths is None:
            return self.write_at(self.length, new)
        check_stop()
        q = new.shape[2]  # ragged: head (b, h) writes at its own length
        self._reserve(self.length + q, new)
        slots = self._lengths[..., None] + torch.arange(q, device=new.device)  # (B, H, q)
        self.buffer.scatter_(2, slot_index(slots, self.buffer), new)
        self._lengths += q
        self.length += q

    def write_at(self, start: int, new: torch.Tensor) -> None:
        check_stop()
        end = start + new.shape[2]
        self._reserve(end, new)
        self.buffer[:, :, start:end].copy_(new)
        self.length = max(self.length, end)
        if self._lengths is not None:
            self._lengths.clamp_(min=end)

    def assign(self, tensor: torch.Tensor | None, lengths: torch.Tensor | None = None) -> None:
        self._lengths = None
        if tensor is not None and lengths is not None:
            length, ragged = split_valid(lengths, tensor.shape[2])
            if ragged is not None:  # a copy: later appends write past the heads' lengths
                self.buffer, self.length, self._lengths = tensor.clone(), length, ragged
                return
            tensor = tensor[:, :, :length]
        # The tensor becomes the buffer as is (no copy); its capacity is its length, so the next
        # append grows into a fresh buffer and never writes into the caller's tensor.
        self.buffer, self.length = tensor, 0 if tensor is None else tensor.shape[2]

    def keep(self, index: torch.Tensor, headroom: int = 0,
             valid: torch.Tensor | None = None) -> None:
        # fresh fitted buffer: a long prompt compressed to its budget frees its memory
        k, self._lengths = split_valid(valid, index.shape[-1])
        kept = gather_rows(self.view(), index[..., :k])
        self.buffer = kept.new_empty(*kept.shape[:2], k + headroom, *kept.shape[3:])
        self.buffer[:, :, :k] = kept
        self.length = k

    def drop_one(self, slot: torch.Tensor, last: torch.Tensor | None = None,
                 heads: torch.Tensor | None = None) -> None:
        buf = self.buffer
        if heads is None and self._lengths is None:
            end = self.length - 1
            # the last token, unless the caller holds it: a copy, as it may overlap its target
            src = buf[:, :, end:end + 1].clone() if last is None else last
            buf.scatter_(2, slot_index(slot[..., None], buf), src)
            self.length = end
            return
        ends = self.lengths() - 1  # (B, H) each head's last slot
        src = gather_rows(buf, ends[..., None]) if last is None else last  # (B, H, 1, ...)
        target = slot if heads is None else torch.where(heads, slot, ends)  # others: in place
        buf.scatter_(2, slot_index(target[..., None], buf), src)
        if heads is None:
            self._lengths -= 1
            self.length -= 1
        else:
            self._lengths = ends + 1 - heads.to(torch.int64)
            self.length = int(self._lengths.max())  # a sync: only partial drops pay it

    def used_bytes(self) -> int:
        if self.buffer is None:
            return 0
        if self._lengths is None:
            return self.buffer[:, :, : self.length].nbytes
        row_bytes = math.prod(self.buffer.shape[3:]) * self.buffer.element_size()
        return int(self._lengths.sum()) * row_bytes

    def allocated_bytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.nbytes

    def release(self) -> None:
        self.buffer, self.length, self._lengths = None, 0, None

    def fork(self) -> "ContiguousRows":
        copy = ContiguousRows(self.growth)
        if self.buffer is not None:  # the same capacity; only the rows held are copied
            copy.buffer = self.buffer.new_empty(self.buffer.shape)
            copy.buffer[:, :, : self.length].copy_(self.buffer[:, :, : self.length])
        copy.length = self.length
        copy._lengths = None if self._lengths is None else self._lengths.clone()
        return copy


class TokenMajorRows(Rows):
    """Rows stored token-major, a buffer `(capacity, B, H, ...)` with amortised growth: the valid
    rows `[:length]` are one contiguous block (`block()`), what a host-to-device copy needs, and
    an append writes its rows instead of copying what is held. `view()` is the `(B, H, T, ...)`
    view of that block (no copy). `pinned`: allocate in pinned host memory (a host tier feeding
    CUDA). Rectangular only (ragged heads are refused: the host tier stores whole rows)."""

    def __init__(self, pinned: bool = False, growth: Callable[[int, int], int] = grown_capacity):
        self.pinned, self.growth = pinned, growth
        self.buffer: torch.Tensor | None = None
        self.length = 0

    def block(self) -> torch.Tensor | None:
        """The valid rows, token-major `(T, B, H, ...)`, contiguous."""
        return None if self.buffer is None else self.buffer[: self.length]

    @staticmethod
    def heads_first(block: torch.Tensor) -> torch.Tensor:
        """`(T, B, H, ...)` -> `(B, H, T, ...)` (a view)."""
        return block.movedim(0, 2)

    def view(self) -> torch.Tensor | None:
        return None if self.buffer is None else self.heads_first(self.block())

    def lengths(self) -> torch.Tensor | None:
        if self.buffer is None:
            return None
        return uniform_lengths(*self.buffer.shape[1:3], self.length, self.buffer.device)

    def in_place(self) -> HeadBlocks | None:
        return None  # token-major: a head's rows are strided by B * H rows, not blocks

    def _allocate(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        shape = (rows, *like.shape[:2], *like.shape[3:])
        check_allocation(math.prod(shape) * like.element_size(), like.device,
                         f"a token-major KV buffer of {like.shape[0]} x {rows} tokens")
        return torch.empty(shape, dtype=like.dtype, device=like.device,
                           pin_memory=self.pinned and like.device.type == "cpu")

    def write_at(self, start: int, new: torch.Tensor) -> None:
        check_stop()
        end = start + new.shape[2]
        if self.buffer is None or end > self.buffer.shape[0]:
            grown = self._allocate(self.growth(end, 0 if self.buffer is None
                                               else self.buffer.shape[0]), new)
            if self.length:
                grown[: self.length].copy_(self.buffer[: self.length])
            self.buffer = grown
        self.buffer[start:end].copy_(new.movedim(2, 0))
        self.length = max(self.length, end)

    def assign(self, tensor: torch.Tensor | None, lengths: torch.Tensor | None = None) -> None:
        self.release()
        if tensor is not None:
            self.append(tensor[:, :, :_rectangular(lengths, tensor.shape[2])])

    def keep(self, index: torch.Tensor, headroom: int = 0,
             valid: torch.Tensor | None = None) -> None:
        kept = gather_rows(self.view(), index[..., :_rectangular(valid, index.shape[-1])])
        self.release()
        self.append(kept)

    def drop_one(self, slot: torch.Tensor, last: torch.Tensor | None = None,
                 heads: torch.Tensor | None = None) -> None:
        if heads is not None:
            raise ValueError("TokenMajorRows holds rectangular rows: every head drops (heads=None)")
        end = self.length - 1
        # (1, B, H, ...): a copy unless the caller holds it, as it may overlap its target
        src = self.buffer[end:end + 1].clone() if last is None else last.movedim(2, 0)
        index = slot.reshape(1, *slot.shape, *([1] * (src.dim() - 3)))
        self.buffer.scatter_(0, index.expand(*src.shape), src)
        self.length = end

    def used_bytes(self) -> int:
        return 0 if self.buffer is None else self.block().nbytes

    def allocated_bytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.nbytes

    def release(self) -> None:
        self.buffer, self.length = None, 0

    def fork(self) -> "TokenMajorRows":
        copy = TokenMajorRows(self.pinned, self.growth)
        if self.buffer is not None:
            copy.buffer = self._allocate(self.buffer.shape[0], self.heads_first(self.buffer))
            copy.buffer[: self.length].copy_(self.block())
        copy.length = self.length
        return copy


def _rectangular(valid: torch.Tensor | None, k: int) -> int:
    """The one count every head keeps, for storage that holds rectangular rows only."""
    k, ragged = split_valid(valid, k)
    if ragged is not None:
        raise ValueError("TokenMajorRows holds rectangular rows: every head must keep the same "
                         "count (ragged heads need ContiguousRows or PagedRows)")
    return k
