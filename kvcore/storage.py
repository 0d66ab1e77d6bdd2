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
(the buffer's capacity, or blocks held x block bytes); harness.accounting turns them into waste.
"""

from __future__ import annotations

from typing import Callable

import math

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


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x `(B, H, T, ...)`, index `(B, H, k)` -> `(B, H, k, ...)`: per-head token gather."""
    idx = index.reshape(*index.shape, *([1] * (x.dim() - 3))).expand(*index.shape, *x.shape[3:])
    return x.gather(2, idx)


class Rows:
    """One per-token tensor `(B, H, T, ...)` of a layer (the interface both layouts implement)."""

    length: int  # valid tokens T

    def view(self) -> torch.Tensor | None:
        """The valid rows `(B, H, T, ...)`; None before anything was written."""
        raise NotImplementedError

    def append(self, new: torch.Tensor) -> None:
        """Write `new (B, H, q, ...)` after the valid rows."""
        self.write_at(self.length, new)

    def write_at(self, start: int, new: torch.Tensor) -> None:
        """Overwrite (or extend) rows `start .. start + q` with `new (B, H, q, ...)`."""
        raise NotImplementedError

    def assign(self, tensor: torch.Tensor | None) -> None:
        """Replace the whole content by `tensor (B, H, T', ...)` (None: empty)."""
        raise NotImplementedError

    def keep(self, index: torch.Tensor, headroom: int = 0) -> None:
        """Keep the tokens at `index (B, H, k)` per head, in that order (an eviction)."""
        raise NotImplementedError

    def drop_one(self, slot: torch.Tensor, last: torch.Tensor | None = None) -> None:
        """Evict one token per head, `slot (B, H)`: the last token moves into its place. `last`:
        the last token's rows `(B, H, 1, ...)` when the caller still holds them (the token it
        appended this step), so they need not be copied out of the buffer first."""
        raise NotImplementedError

    def used_bytes(self) -> int:
        """Bytes of the valid rows."""
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


class ContiguousRows(Rows):
    """A preallocated buffer `(B, H, capacity, ...)`; `growth(needed, capacity)` sizes it."""

    def __init__(self, growth: Callable[[int, int], int] = grown_capacity):
        self.growth = growth
        self.buffer: torch.Tensor | None = None
        self.length = 0

    def view(self) -> torch.Tensor | None:
        return None if self.buffer is None else self.buffer[:, :, : self.length]

    def write_at(self, start: int, new: torch.Tensor) -> None:
        check_stop()
        end = start + new.shape[2]
        if self.buffer is None or end > self.buffer.shape[2]:
            old = 0 if self.buffer is None else self.buffer.shape[2]
            shape = (*new.shape[:2], self.growth(end, old), *new.shape[3:])
            check_allocation(math.prod(shape) * new.element_size(), new.device,
                             f"a KV buffer of {shape[0]} x {shape[2]} tokens")
            grown = new.new_empty(*shape)
            if self.length:
                grown[:, :, : self.length].copy_(self.buffer[:, :, : self.length])
            self.buffer = grown
        self.buffer[:, :, start:end].copy_(new)
        self.length = max(self.length, end)

    def assign(self, tensor: torch.Tensor | None) -> None:
        # The tensor becomes the buffer as is (no copy); its capacity is its length, so the next
        # append grows into a fresh buffer and never writes into the caller's tensor.
        self.buffer, self.length = tensor, 0 if tensor is None else tensor.shape[2]

    def keep(self, index: torch.Tensor, headroom: int = 0) -> None:
        # fresh fitted buffer: a long prompt compressed to its budget frees its memory
        kept = gather_rows(self.view(), index)
        k = index.shape[-1]
        self.buffer = kept.new_empty(*kept.shape[:2], k + headroom, *kept.shape[3:])
        self.buffer[:, :, :k] = kept
        self.length = k

    def drop_one(self, slot: torch.Tensor, last: torch.Tensor | None = None) -> None:
        end = self.length - 1
        buf = self.buffer
        # the last token, unless the caller holds it: a copy, as it may overlap its target
        src = buf[:, :, end:end + 1].clone() if last is None else last
        index = slot.reshape(*slot.shape, 1, *([1] * (buf.dim() - 3)))
        buf.scatter_(2, index.expand(*src.shape), src)
        self.length = end

    def used_bytes(self) -> int:
        return 0 if self.buffer is None else self.buffer[:, :, : self.length].nbytes

    def allocated_bytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.nbytes

    def release(self) -> None:
        self.buffer, self.length = None, 0

    def fork(self) -> "ContiguousRows":
        copy = ContiguousRows(self.growth)
        copy.buffer = None if self.buffer is None else self.buffer.clone()
        copy.length = self.length
        return copy


class TokenMajorRows(Rows):
    """Rows stored token-major, a buffer `(capacity, B, H, ...)` with amortised growth: the valid
    rows `[:length]` are one contiguous block (`block()`), what a host-to-device copy needs, and
    an append writes its rows instead of copying what is held. `view()` is the `(B, H, T, ...)`
    view of that block (no copy). `pinned`: allocate in pinned host memory (a host tier feeding
    CUDA)."""

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

    def assign(self, tensor: torch.Tensor | None) -> None:
        self.release()
        if tensor is not None:
            self.append(tensor)

    def keep(self, index: torch.Tensor, headroom: int = 0) -> None:
        kept = gather_rows(self.view(), index)
        self.release()
        self.append(kept)

    def drop_one(self, slot: torch.Tensor, last: torch.Tensor | None = None) -> None:
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
