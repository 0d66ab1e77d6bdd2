"""The tiered KV store: full K/V on the slow tier, only what a method selects moves to compute.

* `HostKVStore`: one layer's K/V on the host — pinned memory when computing on CUDA (so copies
  can be asynchronous), plain CPU tensors otherwise. New rows are written device-to-host; selected
  rows are gathered on the host into a staging buffer and copied host-to-device on a side stream.
* `Transfer`: an in-flight copy; the consumer calls `wait()` (an event wait on CUDA, measured as
  *exposed* transfer time), so a prefetch issued one layer ahead overlaps that layer's compute.
* `TransferLedger`: bytes per direction per layer per decode step, number of copies, exposed ms.

On a CPU-only machine the same code path runs: host-to-host copies, done synchronously (there is
no second engine to overlap with), and every copy's time counts as exposed.
Streams, events and sync go through `torch.get_device_module(device.type)` (stack.md §8).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class TransferLedger:
    """Bytes moved between tiers, per direction, layer and decode step."""

    num_layers: int
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    copies_h2d: int = 0
    copies_d2h: int = 0
    exposed_ms: float = 0.0
    h2d_per_layer: list[int] = field(default_factory=list)
    step_h2d: list[int] = field(default_factory=list)  # bytes host->device of each decode step
    in_decode: bool = False

    def __post_init__(self) -> None:
        self.h2d_per_layer = [0] * self.num_layers

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
        }


class Tier:
    """Per-run placement: where the full K/V lives and how it moves (one side stream)."""

    def __init__(self, device: torch.device, ledger: TransferLedger, offload: bool):
        self.device, self.ledger, self.offload = device, ledger, offload
        self.cuda = device.type == "cuda"
        module = torch.get_device_module(device.type) if self.cuda else None
        self.stream = module.Stream(device) if self.cuda else None

    def host_tensor(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def to_device(self, layer: int, host: torch.Tensor) -> "Transfer":
        """Start a host-to-device copy of `host` (pinned on CUDA); returns the in-flight transfer."""
        self.ledger.h2d(layer, host.nbytes)
        if not self.cuda:
            t0 = time.perf_counter()
            out = host.clone()  # host-to-host: the CPU stand-in for the PCIe copy
            return Transfer(self, out, None, (time.perf_counter() - t0) * 1e3)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            out = host.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return Transfer(self, out, event, 0.0)


class Transfer:
    def __init__(self, tier: Tier, tensor: torch.Tensor, event, cpu_ms: float):
        self.tier, self.tensor, self.event, self.cpu_ms = tier, tensor, event, cpu_ms

    def wait(self) -> torch.Tensor:
        """Make the current stream wait for the copy; the wait itself is the exposed time."""
        if self.event is None:
            self.tier.ledger.exposed_ms += self.cpu_ms
            return self.tensor
        current = torch.cuda.current_stream(self.tier.device)
        if not self.event.query():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(current)
            current.wait_event(self.event)
            end.record(current)
            end.synchronize()
            self.tier.ledger.exposed_ms += start.elapsed_time(end)
        else:
            current.wait_event(self.event)
        self.tensor.record_stream(current)
        return self.tensor


class HostKVStore:
    """One layer's K/V on the host, `(B, H_kv, T, D)` with amortised growth."""

    def __init__(self, tier: Tier, layer_idx: int):
        self.tier, self.layer_idx = tier, layer_idx
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0
        self._written = None  # CUDA event: device->host writes done (host reads must wait)

    def _host_ready(self) -> None:
        if self._written is not None:
            self._written.synchronize()
            self._written = None

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write new rows (device -> host); counted in the ledger as device-to-host bytes."""
        b, h, t, d = keys.shape
        if self.keys is None or self.length + t > self.keys.shape[2]:
            cap = max(256, 2 * (self.length + t))
            grown_k = self.tier.host_tensor((b, h, cap, d), keys.dtype)
            grown_v = self.tier.host_tensor((b, h, cap, d), values.dtype)
            if self.keys is not None:
                grown_k[:, :, : self.length] = self.keys[:, :, : self.length]
                grown_v[:, :, : self.length] = self.values[:, :, : self.length]
            self.keys, self.values = grown_k, grown_v
        self.keys[:, :, self.length:self.length + t].copy_(keys, non_blocking=self.tier.cuda)
        self.values[:, :, self.length:self.length + t].copy_(values, non_blocking=self.tier.cuda)
        self.tier.ledger.d2h(keys.nbytes + values.nbytes)
        self.length += t
        if self.tier.cuda:
            self._written = torch.cuda.Event()
            self._written.record(torch.cuda.current_stream(self.tier.device))

    def all_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def fetch(self, index: torch.Tensor | None = None) -> tuple["Transfer", "Transfer"]:
        """Start moving rows to the device: all of them, or `index (B, H_kv, n)` per head
        (gathered on the host into a staging buffer first)."""
        self._host_ready()
        keys, values = self.all_rows()
        if index is not None:
            index = index.to("cpu")
            gather = index[..., None].expand(*index.shape, keys.shape[-1])
            staged_k = self.tier.host_tensor(gather.shape, keys.dtype)
            staged_v = self.tier.host_tensor(gather.shape, values.dtype)
            torch.gather(keys, 2, gather, out=staged_k)
            torch.gather(values, 2, gather, out=staged_v)
            keys, values = staged_k, staged_v
        return (self.tier.to_device(self.layer_idx, keys),
                self.tier.to_device(self.layer_idx, values))

    def keep(self, index: torch.Tensor) -> None:
        """Compact the store to `index (B, H_kv, n)` per head (pool eviction; host-side only)."""
        self._host_ready()
        keys, values = self.all_rows()
        gather = index.to("cpu")[..., None].expand(*index.shape, keys.shape[-1])
        kept_k, kept_v = keys.gather(2, gather), values.gather(2, gather)
        n = index.shape[-1]
        self.keys[:, :, :n] = kept_k
        self.values[:, :, :n] = kept_v
        self.length = n

    def past_and_new(self, pending, keys: torch.Tensor, values: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention sees this step: the rows fetched earlier (`pending`, else all stored
        rows fetched now) followed by the new K/V, which are then written to the host."""
        past = pending or (self.fetch() if self.length else None)
        self.append(keys, values)
        if past is None:
            return keys, values
        return (torch.cat([past[0].wait(), keys], dim=2), torch.cat([past[1].wait(), values], dim=2))

    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return 2 * self.keys[:, :, : self.length].nbytes
