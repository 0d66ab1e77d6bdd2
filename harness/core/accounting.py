"""One accounting of what a method holds and attends, the same for every method.

Every figure that compares methods is defined here, once:

* **KV held** (`kv.held_ratio`): bytes the method keeps on every tier (device + host, codes and
  scales included) / bytes of the full cache in the model dtype for the same tokens. Quantization
  counts here; a selection method that keeps everything is at 1.0.
* **Attended fraction** (`kv.attended_fraction_*`): at each decode step and layer, tokens attended /
  tokens seen (the new token included). Averaged as a ratio of sums over decode steps, per layer
  (`..._per_layer`), over the sparse layers (`..._sparse_layers`: every layer not in the run's
  effective dense layers — the figure "matched density" comparisons use) and over all layers.
* `kv.paper_relative_kv_size`: InfiniGen's Fig. 11 transform of the sparse-layer attended
  fraction, 1 - sqrt(1 - f) (the fixed ratio r whose causal-mask density 1 - (1 - r)^2 equals f) —
  a labelled extra column, never a default axis.
* **Active**: a compressing method that, over the whole run, neither held less than the full cache
  nor attended less than every token did not act (prompts shorter than its window, a prefill-only
  compressor with no prefill, a budget above the text); `kv.method_active=false` and the reason.
* **Storage waste** (`kv.storage_*`, both `runner.kv_layout`s): when each request ends, over the
  layers whose K/V live in the harness's storage (kvcore.storage `Rows`: the default layer and
  the scored-eviction template), *used* = bytes of the valid tokens' K and V; *allocated* = what
  the storage holds for them: the contiguous buffers' capacity, or blocks held x block bytes
  (paged); `storage_waste_ratio` = 1 - used / allocated (`waste_ratio`; a ratio of sums over
  samples and layers). Layers keeping K/V in storage of their own (codes, host stores) report
  neither and are left out (`storage_layers_accounted`). A paged pool's free blocks (held by no
  sequence, reusable by any) are a pool figure, `kv.paged_pools` (kvcore.paged.PagedKV.summary).

Budgets are checked after every forward (`check_step`), not only when a request ends.
"""

from __future__ import annotations

from kvcore.errors import BudgetViolation
from methods.model import ModelInfo

ACTIVE_TOLERANCE = 1e-6  # below 1 - this, a method held or attended less than everything


def budget_use(stats: dict) -> tuple[int, str]:
    """The tokens counted against a layer's budget: attended ones for selection methods (which keep
    everything and report `selected_tokens`), held ones otherwise."""
    if stats.get("selected_tokens") is not None:
        return int(stats["selected_tokens"]), "attends to"
    return int(stats["kv_tokens"]), "holds"


def check_layer_budget(layer_idx: int, stats: dict, budget: int | None, seen: int) -> None:
    used, what = budget_use(stats)
    if budget is not None and used > budget:
        raise BudgetViolation(
            f"layer {layer_idx} {what} {used} KV tokens but its budget is {budget} after {seen} "
            "tokens seen: the method does not enforce its budget")


class KVLedger:
    """KV tokens/bytes per layer, recorded at the end of each request (sample)."""

    def __init__(self, info: ModelInfo):
        self.info = info
        self.samples: list[dict] = []

    def check_step(self, layers) -> None:
        """After every forward: each layer within its budget now (cheap: no tensor work)."""
        for i, kv in enumerate(layers):
            budget = kv.allowed_tokens()
            if budget is not None:
                check_layer_budget(i, kv.stats(), budget, kv.seen_tokens)

    def record(self, layers, check: bool) -> dict:
        stats = [kv.stats() for kv in layers]
        budgets = [kv.allowed_tokens() for kv in layers]
        seen = layers[0].seen_tokens
        sample = {
            "seen_tokens": seen,
            "tokens_per_layer": [s["kv_tokens"] for s in stats],
            "bytes_per_layer": [s["kv_bytes"] for s in stats],
            "device_bytes_per_layer": [s.get("kv_bytes_device", s["kv_bytes"]) for s in stats],
            "budget_per_layer": budgets,
            "selected_per_layer": [s.get("selected_tokens") for s in stats],
            "storage_used_per_layer": [s.get("kv_bytes_used") for s in stats],
            "storage_allocated_per_layer": [s.get("kv_bytes_allocated") for s in stats],
            "method_facts": summed_facts(layers),
        }
        if check:
            for i, (s, b) in enumerate(zip(stats, budgets)):
                check_layer_budget(i, s, b, seen)
        self.samples.append(sample)
        return sample

    def summary(self) -> dict:
        if not self.samples:
            return {}
        n = len(self.samples)
        layers = len(self.samples[0]["tokens_per_layer"])
        mean = lambda key, i: sum(s[key][i] for s in self.samples) / n  # noqa: E731
        bytes_total = [sum(s["bytes_per_layer"]) for s in self.samples]
        device_total = [sum(s["device_bytes_per_layer"]) for s in self.samples]
        seen = [s["seen_tokens"] for s in self.samples]
        full_bytes = [t * self.info.kv_bytes_per_token() for t in seen]
        budgets = [s["budget_per_layer"] for s in self.samples]
        has_budget = any(b is not None for bl in budgets for b in bl)
        return {
            "samples": n,
            "seen_tokens_mean": sum(seen) / n,
            "tokens_per_layer": [round(mean("tokens_per_layer", i), 3) for i in range(layers)],
            "bytes_per_layer": [round(mean("bytes_per_layer", i), 1) for i in range(layers)],
            "bytes_total": round(sum(bytes_total) / n, 1),
            "bytes_total_max": max(bytes_total),
            "bytes_device_total": round(sum(device_total) / n, 1),
            "budget_tokens": ([round(sum((b[i] or 0) for b in budgets) / n, 3) for i in range(layers)]
                              if has_budget else None),
            "full_cache_bytes": round(sum(full_bytes) / n, 1),
            # held / full only: a "compression ratio" (full / held) would read as compression
            # for a method holding more than the full cache (InfiniGen's host copy + partial keys).
            "held_ratio": round(sum(bytes_total) / sum(full_bytes), 6) if sum(full_bytes) else None,
            **self.storage_summary(),
            "method_facts": self.facts_summary(),
        }

    def facts_summary(self) -> dict | None:
        """`KVLayer.facts()`, summed over each request's layers, mean per request (None: none)."""
        keys = sorted({k for s in self.samples for k in s["method_facts"]})
        n = len(self.samples)
        return {k: round(sum(s["method_facts"].get(k, 0) for s in self.samples) / n, 3)
                for k in keys} or None

    def storage_summary(self) -> dict:
        """Storage waste (module docstring): means per sample over the accounted layers."""
        n = len(self.samples)
        pairs = [(u, a) for s in self.samples
                 for u, a in zip(s["storage_used_per_layer"], s["storage_allocated_per_layer"])
                 if u is not None and a is not None]
        used, allocated = sum(u for u, _ in pairs), sum(a for _, a in pairs)
        layers = sum(u is not None for u in self.samples[0]["storage_used_per_layer"])
        return {
            "storage_layers_accounted": layers,
            "storage_bytes_used": round(used / n, 1) if pairs else None,
            "storage_bytes_allocated": round(allocated / n, 1) if pairs else None,
            "storage_waste_ratio": waste_ratio(used, allocated) if pairs else None,
        }


def summed_facts(layers) -> dict[str, float]:
    """One request's `KVLayer.facts()`, summed over its layers."""
    total: dict[str, float] = {}
    for kv in layers:
        for key, value in kv.facts().items():
            total[key] = total.get(key, 0) + value
    return total


def waste_ratio(used_bytes: int, allocated_bytes: int) -> float | None:
    """Share of allocated KV storage that holds no valid token: 1 - used / allocated."""
    return round(1 - used_bytes / allocated_bytes, 6) if allocated_bytes else None


class AttendedFraction:
    """Tokens attended / tokens seen at decode steps, per layer (ratio of sums over steps)."""

    def __init__(self, num_layers: int, dense_layers: tuple[int, ...] = ()):
        self.dense = set(dense_layers)
        self.attended = [0] * num_layers
        self.causal = [0] * num_layers
        self.steps = 0

    def add_step(self, layers) -> None:
        self.steps += 1
        for i, kv in enumerate(layers):
            self.attended[i] += kv.attended_tokens()
            self.causal[i] += kv.seen_tokens

    def summary(self) -> dict:
        if not self.steps:
            return {"decode_steps_accounted": 0}
        sparse = [i for i in range(len(self.causal)) if i not in self.dense]
        frac = lambda idx: (sum(self.attended[i] for i in idx)  # noqa: E731
                            / max(1, sum(self.causal[i] for i in idx)))
        sparse_frac = frac(sparse) if sparse else None
        return {
            "decode_steps_accounted": self.steps,
            "attended_fraction_per_layer": [round(a / c, 6) if c else None
                                            for a, c in zip(self.attended, self.causal)],
            "attended_fraction_all_layers": round(frac(range(len(self.causal))), 6),
            "attended_fraction_sparse_layers": (round(sparse_frac, 6)
                                                if sparse_frac is not None else None),
            "paper_relative_kv_size": (round(1 - (1 - min(sparse_frac, 1.0)) ** 0.5, 6)
                                       if sparse_frac is not None else None),
        }


def layer_held_less(kv: dict) -> bool:
    """Whether some layer held less than its own full cache: a method that keeps a full copy on
    the host tier beside its compressed layers (TailorKV: KIVI-quantized layers plus offloaded
    sparse ones) holds more than the full cache in total, yet its quantized layers act. Every
    layer's full cache is the same share of `full_cache_bytes` (ModelInfo.kv_bytes_per_token)."""
    per_layer, full = kv.get("bytes_per_layer"), kv.get("full_cache_bytes")
    if not per_layer or not full:
        return False
    layer_full = full / len(per_layer)
    return any(b < (1 - ACTIVE_TOLERANCE) * layer_full - 1 for b in per_layer)  # 1: rounding


def activity(compresses: bool, kv: dict) -> dict:
    """Whether a compressing method acted over the run, from the two figures above."""
    if not compresses:
        return {"method_active": None, "inactive_reason": None}  # a reference, never "inactive"
    held = kv.get("held_ratio")
    attended = kv.get("attended_fraction_sparse_layers")
    held_less = held is not None and held < 1 - ACTIVE_TOLERANCE
    attended_less = attended is not None and attended < 1 - ACTIVE_TOLERANCE
    if held_less or attended_less or layer_held_less(kv):
        return {"method_active": True, "inactive_reason": None}
    seen = kv.get("seen_tokens_mean")
    steps = kv.get("decode_steps_accounted", 0)
    why = (f"held the full cache in every layer ({held if held is not None else 'n/a'} of the "
           f"full bytes) and attended every token at all {steps} decode steps (mean {seen} "
           "tokens per sample): "
           "the data are too short for this budget/window, or the task has no phase in which "
           "the method compresses")
    return {"method_active": False, "inactive_reason": why}
