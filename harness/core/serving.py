"""Admission under a device KV memory limit: request-level (vLLM-style) or layer-wise (LayerKV).

With runner.kv_device_limit_mib set (paged layout), `Engine.generate_many` no longer takes
`batch_size` prompts at a time: every prompt is waiting at the start (they arrive together: N
concurrent prefills), and waves of them are admitted so that the device blocks they can need
(prompt + max_new_tokens, whole blocks, K and V) fit the limit. The device pools enforce it
(kvcore.paged.DeviceBudget): an allocation beyond it raises rather than grows.

* `request` — a request is admitted only when blocks for **all** its layers fit; the others wait
  until the running wave has finished (its blocks are freed). Waiting is the queueing delay that
  dominates TTFT under load (LayerKV's finding).
* `layerkv` — Xiong et al., "LayerKV: Optimizing Large Language Model Serving with Layer-wise KV
  Cache Management", arXiv 2410.00428: blocks are allocated per (request, layer), so a request
  is admitted at once with device blocks for as many layers as are free, and its other layers
  live whole on the host tier: written there during prefill, fetched whole at every decode step
  (the method's `make_host_layer`; lossless). Up to `batch_size` requests per wave.

Simplifications, said where they matter: waves are static batches (a request joins when the wave
before it ends; with equal lengths and no stop token, as in the throughput benchmark, that is what
continuous batching does too); offloaded layers stay on the host until their request ends (no
migration back when blocks free up); no SLO-aware scheduler (the paper's predicts whether an
admission would break the running decodes' TPOT; here TPOT is measured and reported instead).
TTFT is measured from the moment every request has arrived (the call) to its first token.
Reservations assume the full cache (prompt + new tokens), so a compressing method is admitted
as conservatively as full; the pools' check counts what it really holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvcore.errors import ConfigError
from methods.model import ModelInfo

ADMISSIONS = ("request", "layerkv")


def check_admission(runner: dict[str, Any]) -> None:
    """runner.kv_device_limit_mib / runner.kv_admission: the one check, for the runner and for
    an Engine built directly (benchmarks)."""
    limit, admission = runner.get("kv_device_limit_mib"), runner.get("kv_admission", "request")
    if admission not in ADMISSIONS:
        raise ConfigError(f"runner.kv_admission={admission!r}; allowed: {', '.join(ADMISSIONS)}")
    if limit is None:
        if admission != "request":
            raise ConfigError(f"runner.kv_admission={admission} needs a device limit to admit "
                              "under (runner.kv_device_limit_mib, MiB of device KV)")
        return
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0:
        raise ConfigError(f"runner.kv_device_limit_mib={limit!r} must be a positive number of "
                          "MiB (or null: no limit)")
    if runner.get("kv_layout", "contiguous") != "paged":
        raise ConfigError(f"runner.kv_device_limit_mib={limit} needs runner.kv_layout=paged "
                          "(the limit counts device blocks)")


def layer_bytes(info: ModelInfo, tokens: int, block_tokens: int, dtype_bytes: int) -> int:
    """Device bytes one layer of one request holds at most: K and V, whole blocks."""
    blocks = -(-tokens // block_tokens)
    return 2 * blocks * block_tokens * info.num_kv_heads * info.head_dim * dtype_bytes


@dataclass
class Wave:
    """Requests admitted together, and per request the layers placed on the host tier."""

    seqs: list[int]
    host_layers: list[frozenset[int]] = field(default_factory=list)


def plan_wave(waiting: list[int], tokens: list[int], info: ModelInfo, limit_bytes: int,
              block_tokens: int, dtype_bytes: int, admission: str, max_batch: int) -> Wave:
    """The next wave from `waiting` (arrival order); `tokens[i]`: request i's prompt + new tokens;
    `admission` one of ADMISSIONS (validated by `check_admission`)."""
    layers = info.num_layers
    if admission == "request":
        seqs, used = [], 0
        for i in waiting[:max_batch]:
            need = layers * layer_bytes(info, tokens[i], block_tokens, dtype_bytes)
            if used + need > limit_bytes:
                break
            seqs.append(i)
            used += need
        if not seqs:
            first = waiting[0]
            need = layers * layer_bytes(info, tokens[first], block_tokens, dtype_bytes)
            raise ConfigError(
                f"runner.kv_device_limit_mib={limit_bytes / 2**20:g} cannot hold one request of "
                f"{tokens[first]} tokens with runner.kv_admission=request (it needs "
                f"{need / 2**20:.2f} MiB of device KV); raise the limit or use "
                "runner.kv_admission=layerkv")
        return Wave(seqs, [frozenset()] * len(seqs))
    seqs, host, free = waiting[:max_batch], [], limit_bytes
    for i in seqs:  # earlier arrivals get device layers first; layer order within a request
        per_layer = layer_bytes(info, tokens[i], block_tokens, dtype_bytes)
        on_device = min(layers, free // per_layer)
        free -= on_device * per_layer
        host.append(frozenset(range(on_device, layers)))
    return Wave(seqs, host)
