"""Paged KV storage (PagedAttention: Kwon et al., SOSP 2023, arXiv 2309.06180).

* `BlockPool`: one layer's blocks of one tensor (K or V) on one tier, `(num_blocks, H_kv,
  block_tokens, D)`, a free list, and growth in whole blocks when no block is free. Every
  sequence of an engine draws from the same pool per layer (`PagedKV.pool`), so blocks a
  sequence frees (an eviction, or the end of its request) are reused by any other.
* `PagedRows` (kvcore.storage.Rows): one sequence's tensor as a block table per batch row;
  token t of row b lives in block `table[b][t // block_tokens]` at offset `t % block_tokens`.
  Reading it (`view`) gathers the blocks into a contiguous `(B, H_kv, T, D)` tensor: that copy
  is what paging costs where attention does not read blocks itself.
* `PagedKV`: the engine's pools (one per tier, layer and tensor) and their figures.

Memory: a sequence holds ceil(T / block_tokens) blocks, so at most block_tokens - 1 slots per
sequence and layer are unused; the pool itself grows by half its size at a time (a whole number
of blocks), and its free blocks are reported separately (`PagedKV.summary`).

A device limit (`DeviceBudget`, runner.kv_device_limit_mib) caps the bytes of blocks held on the
compute device at once, over every layer's pools together: an allocation beyond it raises
`DeviceMemoryExceeded` instead of growing (the serving scheduler, harness.serving, admits requests
so that it never does; the check makes the limit a fact rather than a plan).
"""

from __future__ import annotations

import math
import weakref
from typing import Callable

import torch

from kvcore.guards import check_allocation, check_stop
from kvcore.storage import Rows, gather_rows

DEFAULT_BLOCK_TOKENS = 16


class DeviceMemoryExceeded(RuntimeError):
    """A device block allocation beyond runner.kv_device_limit_mib."""


class DeviceBudget:
    """Bytes of device blocks held now, over all pools sharing it, against a fixed limit."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.held_bytes = 0
        self.peak_bytes = 0

    def take(self, nbytes: int) -> None:
        if self.held_bytes + nbytes > self.limit_bytes:
            raise DeviceMemoryExceeded(
                f"device KV blocks would hold {(self.held_bytes + nbytes) / 2**20:.2f} MiB, over "
                f"runner.kv_device_limit_mib={self.limit_bytes / 2**20:g}")
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def give(self, nbytes: int) -> None:
        self.held_bytes -= nbytes


class BlockPool:
    """Blocks `(num_blocks, H, block_tokens, ...)` of one tensor; shape and dtype fixed by the first
    allocation (every sequence of a layer stores the same kind of rows)."""

    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 empty: Callable[[tuple, torch.dtype], torch.Tensor] | None = None,
                 budget: DeviceBudget | None = None):
        if block_tokens <= 0:
            raise ValueError(f"block_tokens={block_tokens} must be positive")
        self.block_tokens = block_tokens
        self.empty = empty  # (shape, dtype) -> tensor; None: on the rows' own device
        self.budget = budget  # the device limit shared with the other device pools (or None)
        self.data: torch.Tensor | None = None  # (num_blocks, H, block_tokens, ...)
        self.free: list[int] = []  # free block ids (reused last-freed first)
        self.held = 0  # blocks handed out now
        self.peak_held = 0
        self.grow_events = 0

    @property
    def num_blocks(self) -> int:
        return 0 if self.data is None else self.data.shape[0]

    def block_bytes(self) -> int:
        if self.data is None:
            return 0
        return math.prod(self.data.shape[1:]) * self.data.element_size()  # also with 0 blocks

    def allocate(self, n: int, like: torch.Tensor) -> list[int]:
        """`n` free block ids for rows like `like (B, H, q, ...)`; grows the pool when short."""
        if self.data is None:
            shape = (0, like.shape[1], self.block_tokens, *like.shape[3:])
            self.data = self.empty(shape, like.dtype) if self.empty else like.new_empty(shape)
        if self.budget is not None:
            self.budget.take(n * self.block_bytes())  # raises before anything is handed out
        if len(self.free) < n:
            self._grow(n - len(self.free))
        ids = [self.free.pop() for _ in range(n)]
        self.held += n
        self.peak_held = max(self.peak_held, self.held)
        return ids

    def _grow(self, short: int) -> None:
        old = self.num_blocks
        new = old + max(short, old // 2)  # whole blocks; amortised copies of the pool
        shape = (new, *self.data.shape[1:])
        check_allocation(new * self.block_bytes(), self.data.device,
                         f"a paged KV pool growing to {new} blocks of {self.block_tokens} tokens")
        grown = self.empty(shape, self.data.dtype) if self.empty else self.data.new_empty(shape)
        if old:
            grown[:old].copy_(self.data)
        self.data = grown
        self.free.extend(range(new - 1, old - 1, -1))  # lowest ids handed out first
        self.grow_events += 1

    def release(self, ids: list[int]) -> None:
        self.free.extend(reversed(ids))
        self.held -= len(ids)
        if self.budget is not None:
            self.budget.give(len(ids) * self.block_bytes())


def _release_table(pool: BlockPool, table: list[list[int]]) -> None:
    for blocks in table:
        pool.release(blocks)
        blocks.clear()


class PagedRows(Rows):
    """One sequence's `(B, H, T, ...)` tensor in blocks of `pool` (see the module docstring).

    Blocks go back to the pool on `release()`, when an eviction shrinks the rows, and, as a
    backstop, when the object is garbage collected (a dropped snapshot or layer)."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.length = 0
        self.table: list[list[int]] = []  # per batch row: block ids in token order
        self._batch: int | None = None
        self._rest: tuple[int, ...] = ()  # the trailing shape (D,), for used_bytes
        self._gathered: torch.Tensor | None = None  # the last view (cleared by every write)
        self._table_t: torch.Tensor | None = None  # `table` as a tensor (cleared when it changes)
        self._finalizer = weakref.finalize(self, _release_table, pool, self.table)

    # --- block bookkeeping -------------------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.pool.block_tokens)

    def _resize(self, tokens: int, like: torch.Tensor) -> None:
        """Hold exactly the blocks `tokens` rows need (allocating or freeing at the end)."""
        if self._batch is None:
            self._batch, self._rest = like.shape[0], tuple(like.shape[3:])
            self.table.extend([] for _ in range(self._batch))
        need = self._blocks_for(tokens)
        for blocks in self.table:
            if len(blocks) != need:
                self._table_t = None
            if len(blocks) < need:
                blocks.extend(self.pool.allocate(need - len(blocks), like))
            elif len(blocks) > need:
                self.pool.release(blocks[need:])
                del blocks[need:]

    def _table_tensor(self, device) -> torch.Tensor:
        """The block table `(B, blocks)` as a tensor on `device` (built once per change)."""
        if self._table_t is None or self._table_t.device != device:
            self._table_t = torch.tensor(self.table, dtype=torch.long, device=device)
        return self._table_t

    def _locate(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token slots `(B, ...)` -> (block ids, offsets), both shaped like `slots`."""
        table = self._table_tensor(slots.device)
        rows = torch.arange(table.shape[0], device=slots.device).view(-1, *[1] * (slots.dim() - 1))
        bt = self.pool.block_tokens
        return table[rows, slots // bt], slots % bt

    # --- Rows --------------------------------------------------------------------------------
    def view(self) -> torch.Tensor | None:
        """A gather of the blocks into a fresh `(B, H, T, ...)` tensor (cached until a write)."""
        if self._batch is None:
            return None
        if self._gathered is None:
            data = self.pool.data
            table = self._table_tensor(data.device)  # (B, nb)
            b, nb = table.shape
            # index_select copies whole blocks (fast, contiguous); the head-major reshape is the
            # second pass (faster on CPU than one strided advanced-indexing pass)
            blocks = data.index_select(0, table.flatten()).view(b, nb, *data.shape[1:])
            blocks = blocks.transpose(1, 2)  # (B, H, nb, bt, ...)
            h, bt = data.shape[1], data.shape[2]
            self._gathered = blocks.reshape(b, h, nb * bt, *self._rest)[:, :, : self.length]
        return self._gathered

    def write_at(self, start: int, new: torch.Tensor) -> None:
        check_stop()
        q = new.shape[2]
        if q == 0:
            return
        self._gathered = None
        end = start + q
        self._resize(max(self.length, end), new)
        data, bt = self.pool.data, self.pool.block_tokens
        # one slice copy per block touched (plain indexing: no index tensors for a decode row)
        for b, blocks in enumerate(self.table):
            t = start
            while t < end:
                offset = t % bt
                n = min(bt - offset, end - t)
                data[blocks[t // bt], :, offset:offset + n].copy_(new[b, :, t - start:t - start + n])
                t += n
        self.length = max(self.length, end)

    def assign(self, tensor: torch.Tensor | None) -> None:
        """Free the blocks beyond the new length and rewrite the rest (after an eviction)."""
        if tensor is None:
            self.release()
            self._batch = None
            self.table.clear()
            return
        self._gathered = None
        self.length = 0
        self._resize(tensor.shape[2], tensor)
        self.write_at(0, tensor)

    def keep(self, index: torch.Tensor, headroom: int = 0) -> None:
        # headroom is the contiguous buffer's spare slot; blocks give their own
        self.assign(gather_rows(self.view(), index))

    def drop_one(self, slot: torch.Tensor, last: torch.Tensor | None = None) -> None:
        # `last` is not needed: the source is gathered out of the pool (a copy) anyway
        self._gathered = None
        data = self.pool.data
        end = self.length - 1
        b, h = slot.shape
        heads = torch.arange(h, device=data.device).expand(b, h)
        src_block, src_offset = self._locate(torch.full((b, h), end, device=data.device))
        dst_block, dst_offset = self._locate(slot.to(data.device))
        src = data[src_block, heads, src_offset].clone()  # (B, H, ...)
        data[dst_block, heads, dst_offset] = src
        self.length = end
        self._resize(end, data)

    def used_bytes(self) -> int:
        if self._batch is None:
            return 0
        per_token = self.pool.block_bytes() // self.pool.block_tokens
        return self._batch * self.length * per_token

    def allocated_bytes(self) -> int:
        return sum(len(blocks) for blocks in self.table) * self.pool.block_bytes()

    def release(self) -> None:
        _release_table(self.pool, self.table)
        self.length, self._gathered, self._table_t = 0, None, None

    def fork(self) -> "PagedRows":
        """New blocks holding a copy of these rows (a snapshot; freed when it is dropped)."""
        copy = PagedRows(self.pool)
        if self._batch is not None:
            copy.assign(self.view())  # the gather is already a copy
        return copy


class PagedKV:
    """The engine's block pools: one per (tier, layer, tensor name), shared by all its sequences.
    Device pools live where the rows come from; host pools (kvcore.offload.PagedHostKVStore) are
    allocated by the tier's `host_tensor` (pinned on CUDA)."""

    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 device_limit_bytes: int | None = None):
        self.block_tokens = block_tokens
        self.pools: dict[tuple[str, int, str], BlockPool] = {}
        self.budget = None if device_limit_bytes is None else DeviceBudget(device_limit_bytes)

    def pool(self, layer_idx: int, name: str, tier: str = "device",
             empty: Callable[[tuple, torch.dtype], torch.Tensor] | None = None) -> BlockPool:
        key = (tier, layer_idx, name)
        if key not in self.pools:
            budget = self.budget if tier == "device" else None
            self.pools[key] = BlockPool(self.block_tokens, empty, budget)
        return self.pools[key]

    def rows(self, layer_idx: int, name: str, tier: str = "device",
             empty: Callable[[tuple, torch.dtype], torch.Tensor] | None = None) -> PagedRows:
        return PagedRows(self.pool(layer_idx, name, tier, empty))

    def summary(self) -> dict:
        """Pool figures: blocks allocated (the pools' size), the most held at once, growths."""
        pools = list(self.pools.values())
        return {
            "block_tokens": self.block_tokens,
            "pools": len(pools),
            "blocks_allocated": sum(p.num_blocks for p in pools),
            "blocks_held_peak": sum(p.peak_held for p in pools),  # sum of each pool's peak
            "blocks_held_now": sum(p.held for p in pools),
            "pool_bytes_allocated": sum(p.num_blocks * p.block_bytes() for p in pools),
            "pool_grow_events": sum(p.grow_events for p in pools),
            "host_pools": sum(key[0] == "host" for key in self.pools),
            **({} if self.budget is None else {
                "device_limit_bytes": self.budget.limit_bytes,
                "device_bytes_held_peak": self.budget.peak_bytes}),
        }
