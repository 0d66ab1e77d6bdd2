"""The tiered KV store: full K/V on the slow tier, only what a method selects moves to compute.

* `HostKVStore`: one layer's rows on the host tier, the one place any layer keeps K/V there
  (a layer gets it through `KVLayer.host_kv`): K and V, or values only (`parts`) — pinned memory
  when computing on CUDA (so copies can be asynchronous), plain CPU tensors otherwise. Stored
  token-major `(T, B, H_kv, D)` with amortised growth, so the whole layer (`fetch()`) is one
  contiguous pinned block per part; selected rows (`fetch(index)`) are gathered on the host into
  a contiguous pinned staging buffer. Either is copied host-to-device on the tier's side stream
  and handed to attention as a `(B, H_kv, T, D)` view. It keeps the one fetch in flight: started
  one layer ahead (`prefetch`), handed to the step that attends it (`take`, `past_and_new`).
* `PagedHostKVStore` (runner.kv_layout=paged): the same interface over blocks of host pools
  shared by every sequence (kvcore.paged); `host_store` picks the store of the run's layout.
* `Transfer`: an in-flight copy; the consumer calls `wait()`: the *consuming stream* waits on the
  copy's event (the host never blocks), so a prefetch issued one layer ahead overlaps that layer's
  compute. The stall is timed with events on the consuming stream (*exposed* transfer time) and
  read back only when the ledger is summarised.
* `TransferLedger`: bytes per direction per layer per decode step, number of copies, exposed ms,
  and the copies' own duration (transfer ms, timed with events on the side stream), so overlap
  is visible: exposed / transfer = the share of copy time nothing hid.

Every host-to-device copy goes through `Tier.to_device`, which refuses a non-contiguous source
(and, on CUDA, an unpinned one): `.to(device, non_blocking=True)` on such a tensor silently goes
through pageable memory and blocks the host.

On a CPU-only machine the same code path runs: host-to-host copies, done synchronously (there is
no second engine to overlap with), and every copy's time counts as exposed.
Streams, events and sync go through `torch.get_device_module(device.type)` (on CPU-only torch
`torch.cuda.Stream()` and `pin_memory()` raise).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvcore.guards import check_allocation
from kvcore.paged import PagedKV
from kvcore.storage import gather_rows


@dataclass
class TransferLedger:
    """Bytes moved between tiers, per direction, layer and decode step."""

    num_layers: int
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    copies_h2d: int = 0
    copies_d2h: int = 0
    exposed_ms_resolved: float = 0.0  # exposed ms of copies already read back
    transfer_ms_resolved: float = 0.0  # duration of host->device copies already read back
    h2d_per_layer: list[int] = field(default_factory=list)
    step_h2d: list[int] = field(default_factory=list)  # bytes host->device of each decode step
    in_decode: bool = False

    def __post_init__(self) -> None:
        self.h2d_per_layer = [0] * self.num_layers
        self.stalls: list = []  # (start, end) CUDA timing events around waits, not yet read
        self.copies: list = []  # (start, end) CUDA timing events around copies, not yet read

    def add_exposed_ms(self, ms: float) -> None:
        self.exposed_ms_resolved += ms

    def add_stall(self, start, end) -> None:
        self.stalls.append((start, end))

    @property
    def exposed_ms(self) -> float:
        """Total time consumers waited for copies. Reads back pending CUDA timings (this waits
        for them: call it between or after steps, never inside one)."""
        for start, end in self.stalls:
            end.synchronize()
            self.exposed_ms_resolved += start.elapsed_time(end)
        self.stalls.clear()
        return self.exposed_ms_resolved

    def add_copy(self, start, end) -> None:
        self.copies.append((start, end))

    @property
    def transfer_ms(self) -> float:
        """Total duration of the host->device copies themselves (overlapped or not)."""
        for start, end in self.copies:
            end.synchronize()
            self.transfer_ms_resolved += start.elapsed_time(end)
        self.copies.clear()
        return self.transfer_ms_resolved

    def begin_step(self, decode: bool) -> None:
        self.in_decode = decode
        if decode:
            self.step_h2d.append(0)

    def h2d(self, layer: int, nbytes: int) -> None:
        self.bytes_h2d += nbytes
        self.copies_h2d += 1
        self.h2d_per_layer[layer] += nbytes
        if self.in_decode and self.step_h2d:
            self.step_h2d[-1] += nbytes

    def d2h(self, nbytes: int) -> None:
        self.bytes_d2h += nbytes
        self.copies_d2h += 1

    def summary(self) -> dict:
        steps = len(self.step_h2d)
        return {
            "bytes_h2d": self.bytes_h2d,
            "bytes_d2h": self.bytes_d2h,
            "copies_h2d": self.copies_h2d,
            "copies_d2h": self.copies_d2h,
            "decode_steps": steps,
            "bytes_per_decode_step": round(sum(self.step_h2d) / steps, 1) if steps else None,
            "bytes_h2d_per_layer": self.h2d_per_layer,
            "exposed_ms": round(self.exposed_ms, 3),
            "transfer_ms": round(self.transfer_ms, 3),
        }


class Tier:
    """Per-run placement: where the full K/V lives and how it moves (one side stream), and, with
    runner.kv_layout=paged, the block pools every sequence's K/V is stored in (`paged`)."""

    def __init__(self, device: torch.device, ledger: TransferLedger, offload: bool,
                 paged: PagedKV | None = None):
        self.device, self.ledger, self.offload, self.paged = device, ledger, offload, paged
        self.cuda = device.type == "cuda"
        module = torch.get_device_module(device.type) if self.cuda else None
        self.stream = module.Stream(device) if self.cuda else None

    def host_tensor(self, shape, dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        check_allocation(nbytes, "cpu", f"a host-tier KV buffer of shape {tuple(shape)}")
        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def to_device(self, layer: int, host: torch.Tensor, after="stream") -> "Transfer":
        """Start a host-to-device copy of `host` (contiguous; pinned on CUDA) on the side stream;
        returns the in-flight transfer. `after`: what device work must finish before the copy
        reads `host` (device->host writes into it): "stream" (default) all work queued on the
        current stream so far; a CUDA event (the last write into `host`); None: nothing
        (the host wrote it, or its writes are already done). Waiting on the whole current stream
        also delays the copy behind compute queued before it, which stops it overlapping that
        compute: callers that know their writes pass them."""
        if not host.is_contiguous():
            raise ValueError(f"layer {layer}: host-to-device copy of a non-contiguous tensor "
                             f"{tuple(host.shape)} (it would be staged through pageable memory)")
        if self.cuda and not host.is_pinned():
            raise ValueError(f"layer {layer}: host-to-device copy from unpinned memory "
                             f"{tuple(host.shape)} (it would block the host)")
        self.ledger.h2d(layer, host.nbytes)
        if not self.cuda:
            t0 = time.perf_counter()
            out = host.clone()  # host-to-host: the CPU stand-in for the PCIe copy
            ms = (time.perf_counter() - t0) * 1e3
            self.ledger.transfer_ms_resolved += ms  # synchronous: all of it is also exposed
            return Transfer(self, out, None, ms)
        # the copy may read host rows the device's earlier work wrote (D2H appends)
        if after == "stream":
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        elif after is not None:
            self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            out = host.to(self.device, non_blocking=True)
            event = torch.cuda.Event(enable_timing=True)
            event.record(self.stream)
        self.ledger.add_copy(start, event)
        return Transfer(self, out, event, 0.0)


class Transfer:
    def __init__(self, tier: Tier, tensor: torch.Tensor, event, cpu_ms: float):
        self.tier, self.tensor, self.event, self.cpu_ms = tier, tensor, event, cpu_ms

    def wait(self) -> torch.Tensor:
        """Make the consuming (current) stream wait for the copy; the host does not block. The
        stall is bracketed by timing events on that stream (exposed time, read back later)."""
        if self.event is None:
            self.tier.ledger.add_exposed_ms(self.cpu_ms)
            return self.tensor
        current = torch.cuda.current_stream(self.tier.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(current)
        current.wait_event(self.event)
        end.record(current)
        self.tier.ledger.add_stall(start, end)
        self.tensor.record_stream(current)  # allocated on the side stream, used on this one
        return self.tensor


KV_PARTS = ("keys", "values")  # what a layer's host rows hold: K and V (ShadowKV: values only)


def host_capacity(rows_needed: int, capacity: int = 0) -> int:
    """Rows a growing host store allocates for `rows_needed`: twice that, at least 256 (a decode
    step appends one row: O(1) amortised copies per row)."""
    return max(256, 2 * rows_needed)


def fitted_capacity(rows_needed: int, capacity: int = 0) -> int:
    """Exactly `rows_needed` rows: for rows written once and never grown (ShadowKV's values)."""
    return rows_needed


class HostKVStore:
    """One layer's rows on the host tier: one token-major buffer `(capacity, B, H_kv, D)` per part
    (`parts`: K and V, or values only), grown by `growth(rows_needed, capacity)` (amortised: no
    per-step copy of what is held), so the valid rows `[:length]` of a part are one contiguous
    block. Methods see `(B, H_kv, T, D)`; every tuple in or out has one entry per part, in order.

    It also holds the one fetch in flight (`pending`): `prefetch` starts it (one layer ahead),
    `take` hands it to the step that attends it (else fetches every stored row then)."""

    def __init__(self, tier: Tier, layer_idx: int, parts: tuple[str, ...] = KV_PARTS,
                 growth: Callable[[int, int], int] = host_capacity):
        self.tier, self.layer_idx, self.parts, self.growth = tier, layer_idx, parts, growth
        self.buffers: dict[str, torch.Tensor] = {}  # part -> (capacity, B, H_kv, D)
        self.length = 0
        self.pending: tuple | None = None  # transfers in flight, one per part
        self._written = None  # CUDA event: device->host writes done (host reads must wait)
        # CUDA event: the last host->device copy reading the buffers is done (host writes over
        # stored rows wait for it; copies run in order on the tier's one side stream)
        self._read = None

    @property
    def keys(self) -> torch.Tensor | None:
        """The keys' buffer `(capacity, B, H_kv, D)` (None before the first append)."""
        return self.buffers.get("keys")

    @property
    def values(self) -> torch.Tensor | None:
        """The values' buffer `(capacity, B, H_kv, D)` (None before the first append)."""
        return self.buffers.get("values")

    def _host_ready(self) -> None:
        """Host-side reads (gather, growth, compaction) need the queued device->host writes."""
        if self._written is not None:
            self._written.synchronize()
            self._written = None

    def _reads_done(self) -> None:
        """Host-side writes over stored rows (compaction) must wait for the copies reading them:
        the consumer waits for a copy on its stream, so the host may be ahead of it."""
        if self._read is not None:
            self._read.synchronize()
            self._read = None

    def _reserve(self, rows_needed: int, like: tuple[torch.Tensor, ...]) -> None:
        """Buffers of at least `rows_needed` rows holding the stored ones (grown when short)."""
        capacity = self.buffers[self.parts[0]].shape[0] if self.buffers else 0
        if rows_needed <= capacity:
            return
        self._host_ready()
        rows = self.growth(rows_needed, capacity)
        for name, x in zip(self.parts, like, strict=True):
            b, h, _, d = x.shape
            grown = self.tier.host_tensor((rows, b, h, d), x.dtype)
            if name in self.buffers:
                grown[: self.length] = self.buffers[name][: self.length]
            self.buffers[name] = grown

    def append(self, *new: torch.Tensor) -> None:
        """Write new rows `(B, H_kv, t, D)`, one per part (device -> host); counted as
        device-to-host bytes."""
        t = new[0].shape[2]
        self._reserve(self.length + t, new)
        for name, x in zip(self.parts, new):
            # token-major rows: the permuted source is made contiguous on its own device first
            self.buffers[name][self.length:self.length + t].copy_(x.permute(2, 0, 1, 3),
                                                                  non_blocking=self.tier.cuda)
        self.tier.ledger.d2h(sum(x.nbytes for x in new))
        self.length += t
        if self.tier.cuda:
            self._written = torch.cuda.Event()
            self._written.record(torch.cuda.current_stream(self.tier.device))

    def all_rows(self) -> tuple[torch.Tensor, ...]:
        """The stored rows as `(B, H_kv, T, D)` views of the host buffers, one per part."""
        return tuple(self.buffers[name][: self.length].permute(1, 2, 0, 3) for name in self.parts)

    def _gather(self, index: torch.Tensor, out: dict[str, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, ...]:
        """Rows `index (B, H_kv, n)` per head, token-major `(n, B, H_kv, D)` (contiguous), one
        per part (into `out[part]` when given)."""
        index = index.to("cpu")  # the host gathers: selection indices must be on the host
        b, h, n = index.shape
        # One row copy per (token, head): the store is (T, B, H_kv, D), so row t of head (b, h)
        # is flat row t*B*H + b*H + h (an element-wise gather with an expanded index is several
        # times slower on CPU).
        flat = (index.permute(2, 0, 1) * (b * h) + torch.arange(b * h).view(b, h)).reshape(-1)
        got = []
        for name in self.parts:
            store = self.buffers[name]
            target = None if out is None else out[name].view(-1, store.shape[-1])
            rows = store[: self.length].reshape(-1, store.shape[-1])  # (T*B*H, D), a view
            got.append(torch.index_select(rows, 0, flat, out=target).view(n, b, h, -1))
        return tuple(got)

    def fetch(self, index: torch.Tensor | None = None) -> tuple["_HeadMajor", ...]:
        """Start moving rows to the device: all of them (one contiguous pinned block per part),
        or `index (B, H_kv, n)` per head (gathered on the host into a contiguous pinned staging
        buffer first). `wait()` on the transfers (one per part) gives `(B, H_kv, n, D)` views."""
        if index is None:
            # the stored rows themselves: the copy waits (on the side stream) for the last
            # device->host write only, not for everything queued on the current stream
            moves = tuple(self.tier.to_device(self.layer_idx, self.buffers[name][: self.length],
                                              self._written) for name in self.parts)
            self._read = moves[-1].event  # None on the CPU tier (synchronous copies)
            return tuple(_HeadMajor(move) for move in moves)
        self._host_ready()  # the host gathers: written rows first
        staged = {name: self.tier.host_tensor((index.shape[-1], *self.buffers[name].shape[1:]),
                                              self.buffers[name].dtype) for name in self.parts}
        return tuple(_HeadMajor(self.tier.to_device(self.layer_idx, rows, None))
                     for rows in self._gather(index, staged))

    def prefetch(self, index: torch.Tensor | None = None) -> None:
        """Start `fetch(index)` for the step that will attend it (`take`), unless a fetch is
        already in flight or nothing is stored."""
        if self.pending is None and self.length:
            self.pending = self.fetch(index)

    def take(self) -> tuple | None:
        """The rows this step attends before its new ones: the fetch in flight (handed over),
        else every stored row, fetched now; None when nothing is stored."""
        pending, self.pending = self.pending, None
        if pending is None and self.length:
            pending = self.fetch()
        return pending

    def past_and_new(self, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What attention sees this step, per part: the rows `take` gives (prefetched, else all
        stored rows) followed by the new rows `(B, H_kv, q, D)`, which are then stored."""
        past = self.take()
        self.append(*new)
        if past is None:
            return new
        return tuple(torch.cat([rows.wait(), x], dim=2) for rows, x in zip(past, new))

    def fetch_channels(self, channels: torch.Tensor) -> "_HeadMajor":
        """Start moving a few key channels of every stored token: `channels (B, H_kv, c)` per
        head, gathered on the host into a contiguous pinned staging buffer `(T, B, H_kv, c)`.
        `wait()` gives `(B, H_kv, T, c)` (TailorKV scores tokens on them before fetching rows)."""
        self._host_ready()
        keys = self.keys[: self.length]  # (T, B, H_kv, D)
        index = channels.to("cpu")[None].expand(self.length, *channels.shape)
        staged = self.tier.host_tensor(index.shape, keys.dtype)
        torch.gather(keys, 3, index, out=staged)
        return _HeadMajor(self.tier.to_device(self.layer_idx, staged, None))

    def keep(self, index: torch.Tensor) -> None:
        """Compact the store to `index (B, H_kv, n)` per head (pool eviction; host-side only)."""
        self._host_ready()
        kept = self._gather(index)
        self._reads_done()  # rows [:n] are overwritten below
        n = index.shape[-1]
        for name, rows in zip(self.parts, kept):
            self.buffers[name][:n] = rows
        self.length = n

    def nbytes(self) -> int:
        """Bytes of the stored rows (every part; the unused capacity not counted)."""
        return sum(buffer[: self.length].nbytes for buffer in self.buffers.values())

    def release(self) -> None:
        """The request is over: drop the buffers (and any fetch in flight)."""
        self._host_ready()
        self.buffers, self.length, self.pending = {}, 0, None


class PagedHostKVStore(HostKVStore):
    """One layer's rows on the host in blocks of the run's host pools (runner.kv_layout=paged,
    kvcore.paged), shared by every sequence: `HostKVStore`'s interface. Costs of paging here: a
    device->host write goes through a (synchronous) host copy before it is scattered into blocks,
    and a fetch gathers the blocks (or the selected rows) into a contiguous staging tensor (pinned
    on CUDA) before the host->device copy."""

    def __init__(self, tier: Tier, layer_idx: int, parts: tuple[str, ...] = KV_PARTS):
        self.tier, self.layer_idx, self.parts = tier, layer_idx, parts
        self.pending = None
        self.rows = {name: tier.paged.rows(layer_idx, name, "host", tier.host_tensor)
                     for name in parts}

    @property
    def length(self) -> int:
        return self.rows[self.parts[0]].length

    def append(self, *new: torch.Tensor) -> None:
        for name, x in zip(self.parts, new, strict=True):
            self.rows[name].append(x.to("cpu"))
        self.tier.ledger.d2h(sum(x.nbytes for x in new))

    def all_rows(self) -> tuple[torch.Tensor, ...]:
        """The stored rows `(B, H_kv, T, D)`, gathered from the blocks."""
        return tuple(self.rows[name].view() for name in self.parts)

    def fetch(self, index: torch.Tensor | None = None) -> tuple[Transfer, ...]:
        transfers = []
        for name in self.parts:
            rows = self.rows[name].view()  # (B, H_kv, T, D)
            if index is not None:
                rows = gather_rows(rows, index.to("cpu"))
            staged = self.tier.host_tensor(rows.shape, rows.dtype)
            staged.copy_(rows)  # on the host: nothing on the device writes it
            transfers.append(self.tier.to_device(self.layer_idx, staged, None))
        return tuple(transfers)

    def fetch_channels(self, channels: torch.Tensor) -> Transfer:
        keys = self.rows["keys"].view()  # (B, H_kv, T, D)
        index = channels.to("cpu")[:, :, None].expand(*keys.shape[:3], channels.shape[-1])
        staged = self.tier.host_tensor(index.shape, keys.dtype)
        torch.gather(keys, 3, index, out=staged)  # (B, H_kv, T, c)
        return self.tier.to_device(self.layer_idx, staged, None)

    def keep(self, index: torch.Tensor) -> None:
        for rows in self.rows.values():
            rows.keep(index.to("cpu"))

    def nbytes(self) -> int:
        return sum(rows.used_bytes() for rows in self.rows.values())

    def release(self) -> None:
        self.pending = None
        for rows in self.rows.values():
            rows.release()


def host_store(tier: Tier, layer_idx: int, parts: tuple[str, ...] = KV_PARTS,
               growth: Callable[[int, int], int] = host_capacity) -> HostKVStore:
    """A layer's host store in the run's layout (runner.kv_layout; `growth` sizes the contiguous
    layout's buffers, blocks size themselves)."""
    if tier.paged is not None:
        return PagedHostKVStore(tier, layer_idx, parts)
    return HostKVStore(tier, layer_idx, parts, growth)


class _HeadMajor:
    """A transfer of token-major rows `(n, B, H_kv, D)`, waited on as a `(B, H_kv, n, D)` view."""

    def __init__(self, transfer: Transfer):
        self.transfer = transfer

    def wait(self) -> torch.Tensor:
        return self.transfer.wait().permute(1, 2, 0, 3)
