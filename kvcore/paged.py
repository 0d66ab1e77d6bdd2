"""Paged KV storage (PagedAttention: Kwon et al., SOSP 2023, arXiv 2309.06180).

* `BlockPool`: one layer's blocks of one tensor (K or V) on one tier, `(num_blocks, H_kv,
  block_tokens, D)`, a free list, and growth in whole blocks when no block is free. Every
  sequence of an engine draws from the same pool per layer (`PagedKV.pool`), so blocks a
  sequence frees (an eviction, or the end of its request) are reused by any other.
* `PagedRows` (kvcore.storage.Rows): one sequence's tensor as a block table per batch row;
  token t of row b lives in block `table[b][t // block_tokens]` at offset `t % block_tokens`.
  Reading it (`view`) gathers the blocks into a contiguous `(B, H_kv, T, D)` tensor: that copy
  is what paging costs where attention does not read blocks itself; `in_place()` hands the
  blocks to a kernel instead (kvcore.storage.HeadBlocks: per-head block tables, no copy).
  Ragged rows (per-head lengths, kvcore.storage) keep one block table per (batch row, head) into
  a pool of one-head blocks (vLLM's block tables, one level finer): a head holds only the blocks
  its own tokens need.
* `PagedKV`: the engine's pools (one per tier, layer and tensor) and their figures.

Memory: a sequence holds ceil(T / block_tokens) blocks, so at most block_tokens - 1 slots per
sequence and layer are unused; the pool itself grows by half its size at a time (a whole number
of blocks), and its free blocks are reported separately (`PagedKV.summary`).

A device limit (`DeviceBudget`, runner.kv_device_limit_mib) caps the bytes of blocks held on the
compute device at once, over every layer's pools together: an allocation beyond it raises
`DeviceMemoryExceeded` instead of growing (the serving scheduler, harness.core.serving, admits requests
so that it never does; the check makes the limit a fact rather than a plan).
"""

from __future__ import annotations

import math
import weakref
from typing import Callable

import torch

from kvcore.guards import check_allocation, check_stop
from kvcore.storage import HeadBlocks, Rows, gather_rows, split_valid, uniform_lengths

DEFAULT_BLOCK_TOKENS = 16
HEAD_POOL_SUFFIX = "/heads"  # PagedKV's pool of one-head blocks for tensor `name`: name + this


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

    Rectangular rows (every head holds `length` tokens) keep one block table per batch row into
    `pool`, whose blocks hold all H heads. Ragged rows (per-head lengths, kvcore.storage) keep one
    table per (batch row, head) into `head_pool`, whose blocks hold one head (same block_tokens):
    a head holds ceil(its length / block_tokens) blocks, so a short head holds fewer bytes. Rows
    move between the two when they become ragged or rectangular (a rewrite of their blocks, at an
    eviction that changes the per-head counts, never at a plain decode step).

    Blocks go back to their pool on `release()`, when an eviction shrinks the rows, and, as a
    backstop, when the object is garbage collected (a dropped snapshot or layer). `head_pool` is
    a callable giving the pool of one-head blocks (created on first use; default: a private pool
    sharing `pool`'s device budget)."""

    def __init__(self, pool: BlockPool, head_pool: Callable[[], BlockPool] | None = None):
        self.pool = pool
        self._head_pool_for = head_pool
        self.head_pool: BlockPool | None = None  # resolved when the rows first become ragged
        self.length = 0
        self.table: list[list[int]] = []  # rectangular: per batch row, block ids in token order
        self.head_table: list[list[int]] = []  # ragged: per head r = b * H + h, in head_pool
        self._head_lengths: list[int] | None = None  # ragged: tokens per head r (None: rectangular)
        self._lengths: torch.Tensor | None = None  # ragged: the same as (B, H) int64 on the device
        self._batch: int | None = None
        self._heads = 0
        self._rest: tuple[int, ...] = ()  # the trailing shape (D,), for used_bytes
        self._gathered: torch.Tensor | None = None  # the last view (cleared by every write)
        self._table_t: torch.Tensor | None = None  # `table` as a tensor (cleared when it changes)
        self._head_table_t: torch.Tensor | None = None  # per-head table as a tensor (either kind)
        self._finalizer = weakref.finalize(self, _release_table, pool, self.table)

    # --- block bookkeeping -------------------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.pool.block_tokens)

    def _tables_changed(self) -> None:
        self._table_t = self._head_table_t = None

    def _resize(self, tokens: int, like: torch.Tensor) -> None:
        """Hold exactly the blocks `tokens` rows need (allocating or freeing at the end)."""
        if self._batch is None:
            self._batch, self._heads, self._rest = like.shape[0], like.shape[1], tuple(like.shape[3:])
        if not self.table:
            self.table.extend([] for _ in range(self._batch))
        need = self._blocks_for(tokens)
        for blocks in self.table:
            if len(blocks) != need:
                self._tables_changed()
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

    # --- ragged rows: per-head tables into the one-head pool ---------------------------------
    @property
    def ragged(self) -> bool:
        return self._head_lengths is not None

    def _heads_pool(self) -> BlockPool:
        if self.head_pool is None:
            pool = self.pool
            self.head_pool = (self._head_pool_for() if self._head_pool_for is not None
                              else BlockPool(pool.block_tokens, pool.empty, pool.budget))
            weakref.finalize(self, _release_table, self.head_pool, self.head_table)
        return self.head_pool

    def _head_resize(self, counts: list[int], like: torch.Tensor | None) -> None:
        """Hold exactly the one-head blocks head r's `counts[r]` tokens need (like: rows
        `(1, 1, q, ...)` of the dtype and device to allocate for)."""
        pool = self._heads_pool()
        if not self.head_table:
            self.head_table.extend([] for _ in counts)
        for blocks, tokens in zip(self.head_table, counts):
            need = self._blocks_for(tokens)
            if len(blocks) != need:
                self._head_table_t = None
            if len(blocks) < need:
                blocks.extend(pool.allocate(need - len(blocks), like))
            elif len(blocks) > need:
                pool.release(blocks[need:])
                del blocks[need:]

    def _head_tensor(self, device) -> torch.Tensor:
        """Ragged: the per-head table `(B * H, max blocks)` (short heads padded with a valid id)."""
        if self._head_table_t is None or self._head_table_t.device != device:
            width = max(1, max(len(blocks) for blocks in self.head_table))
            pad = next((blocks[0] for blocks in self.head_table if blocks), 0)
            rows = [blocks + [pad] * (width - len(blocks)) for blocks in self.head_table]
            self._head_table_t = torch.tensor(rows, dtype=torch.long, device=device)
        return self._head_table_t

    def _head_locate(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Ragged: token slots `(B, H)` -> (one-head block ids, offsets), each `(B * H,)`."""
        table = self._head_tensor(slots.device)
        flat, bt = slots.reshape(-1), self.pool.block_tokens
        return table[torch.arange(flat.shape[0], device=slots.device), flat // bt], flat % bt

    def _to_rectangular(self) -> None:
        if self.ragged:
            _release_table(self.head_pool, self.head_table)
            self.head_table.clear()
            self._head_lengths = self._lengths = None
            self._tables_changed()

    def _assign_ragged(self, tensor: torch.Tensor, lengths: torch.Tensor) -> None:
        """Rewrite the rows as ragged: head (b, h) holds `tensor[b, h, :lengths[b, h]]`."""
        _release_table(self.pool, self.table)
        self.table.clear()
        self._tables_changed()
        b, h, k = tensor.shape[:3]
        self._batch, self._heads, self._rest = b, h, tuple(tensor.shape[3:])
        counts = lengths.reshape(-1).tolist()
        self._head_resize(counts, tensor[:1, :1])
        bt, pool = self.pool.block_tokens, self.head_pool
        self._head_lengths, self.length, self._gathered = counts, k, None
        if pool.data is None:  # every head empty: nothing allocated yet
            self._lengths = lengths.to(device=tensor.device, dtype=torch.int64).clone()
            return
        table = self._head_tensor(pool.data.device)  # (BH, nb)
        nb = table.shape[1]
        padded = tensor.new_empty(b * h, nb * bt, *self._rest)  # whole blocks, tails unspecified
        padded[:, :k] = tensor.reshape(b * h, k, *self._rest)
        held = torch.tensor([len(blocks) for blocks in self.head_table], device=table.device)
        used = torch.arange(nb, device=table.device)[None, :] < held[:, None]  # (BH, nb)
        blocks = padded.view(b * h, nb, bt, *self._rest)[used]
        pool.data[table[used], 0] = blocks.to(pool.data.device)  # one scatter of every block
        self._lengths = lengths.to(device=pool.data.device, dtype=torch.int64).clone()

    def _ragged_write(self, new: torch.Tensor, starts: list[int]) -> None:
        """Ragged: head r's rows `new[b, h]` at its slots `starts[r] ..` (blocks already held)."""
        data, bt = self.head_pool.data, self.pool.block_tokens
        q = new.shape[2]
        if q == 1:  # a decode step: one indexed write of every head's row
            slots = torch.tensor(starts, device=data.device).view(new.shape[:2])
            block, offset = self._head_locate(slots)
            data[block, 0, offset] = new[:, :, 0].reshape(-1, *self._rest).to(data.device)
            return
        heads = new.reshape(-1, q, *self._rest)
        for blocks, start, rows in zip(self.head_table, starts, heads):
            t = start
            while t < start + q:
                offset, n = t % bt, min(bt - t % bt, start + q - t)
                data[blocks[t // bt], 0, offset:offset + n].copy_(rows[t - start:t - start + n])
                t += n

    # --- Rows --------------------------------------------------------------------------------
    def lengths(self) -> torch.Tensor | None:
        if self._batch is None:
            return None
        if self.ragged:
            return self._lengths
        device = self.pool.data.device if self.pool.data is not None else "cpu"
        return uniform_lengths(self._batch, self._heads, self.length, device)

    def in_place(self) -> HeadBlocks | None:
        """The blocks themselves, one head at a time: rectangular rows' blocks `(H, bt, ...)`
        are H one-head blocks (block id x H + head), ragged rows' are their own."""
        if self._batch is None:
            return None
        bt = self.pool.block_tokens
        if self.ragged:
            if self.head_pool.data is None:
                return None
            data = self.head_pool.data.view(self.head_pool.num_blocks, bt, *self._rest)
            return HeadBlocks(data, self._head_tensor(data.device), bt, self.length,
                              (self._batch, self._heads), self._lengths)
        if self.pool.data is None:
            return None
        n, h = self.pool.data.shape[:2]
        data = self.pool.data.view(n * h, bt, *self._rest)
        if self._head_table_t is None or self._head_table_t.device != data.device:
            table = self._table_tensor(data.device)  # (B, nb)
            heads = torch.arange(h, device=data.device).view(1, h, 1)
            self._head_table_t = (table[:, None, :] * h + heads).reshape(self._batch * h, -1)
        return HeadBlocks(data, self._head_table_t, bt, self.length, (self._batch, h))

    def view(self) -> torch.Tensor | None:
        """A gather of the blocks into a fresh `(B, H, T, ...)` tensor (cached until a write)."""
        if self._batch is None:
            return None
        if self._gathered is None and self.ragged:
            blocks = self.in_place()
            self._gathered = (blocks.gather() if blocks is not None else self.pool.data.new_empty(
                self._batch, self._heads, 0, *self._rest))
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

    def append(self, new: torch.Tensor) -> None:
        if not self.ragged:
            return self.write_at(self.length, new)
        q = new.shape[2]  # ragged: head r writes after its own last token
        if q == 0:
            return
        self._gathered = None
        starts = self._head_lengths
        counts = [n + q for n in starts]
        self._head_resize(counts, new[:1, :1])
        self._ragged_write(new, starts)
        self._head_lengths = counts
        self._lengths += q
        self.length += q

    def write_at(self, start: int, new: torch.Tensor) -> None:
        check_stop()
        q = new.shape[2]
        if q == 0:
            return
        self._gathered = None
        end = start + q
        if self.ragged:  # the same slots of every head; shorter heads grow to `end`
            counts = [max(n, end) for n in self._head_lengths]
            self._head_resize(counts, new[:1, :1])
            self._ragged_write(new, [start] * len(counts))
            self._head_lengths = counts
            self._lengths = torch.tensor(counts, device=self._lengths.device).view(
                self._lengths.shape)
            self.length = max(self.length, end)
            return
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

    def assign(self, tensor: torch.Tensor | None, lengths: torch.Tensor | None = None) -> None:
        """Free the blocks beyond the new length and rewrite the rest (after an eviction);
        `lengths (B, H)`: ragged (per-head tables)."""
        if tensor is None:
            self.release()
            self._batch = None
            self.table.clear()
            return
        k, ragged = split_valid(lengths, tensor.shape[2])
        self._assign(tensor[:, :, :k], ragged)

    def _assign(self, tensor: torch.Tensor, ragged: torch.Tensor | None) -> None:
        self._gathered = None
        if ragged is not None:
            return self._assign_ragged(tensor, ragged)
        self._to_rectangular()
        self.length = 0
        self._resize(tensor.shape[2], tensor)
        self.write_at(0, tensor)

    def keep(self, index: torch.Tensor, headroom: int = 0,
             valid: torch.Tensor | None = None) -> None:
        # headroom is the contiguous buffer's spare slot; blocks give their own
        k, ragged = split_valid(valid, index.shape[-1])
        self._assign(gather_rows(self.view(), index[..., :k]), ragged)

    def drop_one(self, slot: torch.Tensor, last: torch.Tensor | None = None,
                 heads: torch.Tensor | None = None) -> None:
        # `last` is not needed: the source is gathered out of the pool (a copy) anyway
        if self.ragged or heads is not None:
            return self._drop_one_ragged(slot, heads)
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

    def _drop_one_ragged(self, slot: torch.Tensor, heads: torch.Tensor | None) -> None:
        if not self.ragged:  # a partial drop makes rectangular rows ragged: one rewrite
            self._assign_ragged(self.view(), self.lengths())
        self._gathered = None
        data = self.head_pool.data
        ends = self._lengths - 1  # (B, H) each head's last slot
        src_block, src_offset = self._head_locate(ends)
        dst_block, dst_offset = self._head_locate(slot.to(data.device))
        if heads is not None:  # only the dropping heads move a row (a sync: partial drops only)
            rows = heads.reshape(-1).to(data.device).nonzero().squeeze(1)
            src_block, src_offset = src_block[rows], src_offset[rows]
            dst_block, dst_offset = dst_block[rows], dst_offset[rows]
        data[dst_block, 0, dst_offset] = data[src_block, 0, src_offset].clone()
        if heads is None:
            self._head_lengths = [n - 1 for n in self._head_lengths]
            self._lengths -= 1
        else:
            drops = heads.reshape(-1).tolist()
            self._head_lengths = [n - int(d) for n, d in zip(self._head_lengths, drops)]
            self._lengths = ends + 1 - heads.to(device=data.device, dtype=torch.int64)
        self.length = max(self._head_lengths)
        self._head_resize(self._head_lengths, None)  # frees the blocks that emptied

    def used_bytes(self) -> int:
        if self._batch is None:
            return 0
        if self.ragged:
            per_head_token = self.head_pool.block_bytes() // self.pool.block_tokens
            return sum(self._head_lengths) * per_head_token
        per_token = self.pool.block_bytes() // self.pool.block_tokens
        return self._batch * self.length * per_token

    def allocated_bytes(self) -> int:
        held = sum(len(blocks) for blocks in self.table) * self.pool.block_bytes()
        if self.head_pool is not None:
            held += sum(len(blocks) for blocks in self.head_table) * self.head_pool.block_bytes()
        return held

    def release(self) -> None:
        _release_table(self.pool, self.table)
        self._to_rectangular()
        self.length, self._gathered = 0, None
        self._tables_changed()

    def fork(self) -> "PagedRows":
        """New blocks holding a copy of these rows (a snapshot; freed when it is dropped)."""
        shared = self.head_pool
        copy = PagedRows(self.pool, self._head_pool_for if shared is None else lambda: shared)
        if self._batch is not None:
            copy.assign(self.view(), self._lengths)  # the gather is already a copy
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
        """A sequence's rows of `name`; ragged rows draw from the pool of one-head blocks
        `name + HEAD_POOL_SUFFIX` (made when a first sequence goes ragged)."""
        return PagedRows(self.pool(layer_idx, name, tier, empty),
                         lambda: self.pool(layer_idx, name + HEAD_POOL_SUFFIX, tier, empty))

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
            # pools of one-head blocks (ragged rows; their blocks are 1/H_kv of a block's bytes)
            "head_pools": sum(key[2].endswith(HEAD_POOL_SUFFIX) for key in self.pools),
            **({} if self.budget is None else {
                "device_limit_bytes": self.budget.limit_bytes,
                "device_bytes_held_peak": self.budget.peak_bytes}),
        }
