"""What a method declares, read from its knobs and its budget rule, never from its layer's hooks.

The shared contract (tests/methods/contract/test_contract.py) holds every layer to these, so a
bug inside a layer's own `budget()`, `protected()` or `allowed_tokens()` cannot certify itself:

* the budget: `BudgetedMethod.layer_budget(layer, num_layers, basis)`, the basis read through the
  base class (`KVLayer.basis_tokens`); a per-request allocation (SqueezeAttention's factors, set
  at each prompt's end) is its method's `layer_tokens(factor, basis)`, the factors averaging 1;
* the protections: the knobs named in PROTECTION_KNOBS: the first `sink_tokens` positions and the
  last `window_tokens` / `recent_tokens` / `recent_ratio` x budget positions are held (attended,
  for a selecting method) whenever a row holds fewer tokens than it has seen. A knob of that name
  meaning something else in one method is listed in NOT_PROTECTIONS with the reason.
"""

from __future__ import annotations

import torch

from methods.budget import BudgetedMethod
from methods.layer import KVLayer

# knob -> which text positions it protects: "first" N, "last" N, or the last share x the budget
PROTECTION_KNOBS = {"sink_tokens": "first", "window_tokens": "last", "recent_tokens": "last",
                    "recent_ratio": "last share"}
NOT_PROTECTIONS = {
    ("fastgen", "window_tokens"): "the query rows that profile each head's policy (its local "
                                  "policy keeps local_ratio of the prompt, per head)",
    ("kvmerger", "recent_ratio"): "a share of the prompt left unmerged, not of a budget; the "
                                  "merged sets are checked by tests/methods/test_kvmerger.py",
}


def method_of(layer, fallback):
    """The method a layer's knobs belong to (SqueezeAttention's layers: the scorer's)."""
    return getattr(layer, "method", None) or fallback


def declared_protections(method, cap: int) -> tuple[int, int]:
    """(first, last): how many of the first and of the last text positions a row of `cap` tokens
    must hold under `method`'s knobs: the sinks first, then the recent window in what is left
    (a share knob is a share of `cap`, the row's budget: H2O's recent_ratio)."""
    knobs = method.hyperparameters()
    first = last = 0
    for knob, where in PROTECTION_KNOBS.items():
        value = knobs.get(knob)
        if value is None or isinstance(value, bool) or (method.name, knob) in NOT_PROTECTIONS:
            continue
        if where == "first":
            first = max(first, min(int(value), cap))
    for knob, where in PROTECTION_KNOBS.items():
        value = knobs.get(knob)
        if value is None or isinstance(value, bool) or (method.name, knob) in NOT_PROTECTIONS:
            continue
        if where == "last":
            last = max(last, int(value))
        elif where == "last share":
            last = max(last, int(round(value * cap)))
    return first, max(0, min(last, cap - first))


def has_budget_rule(layer) -> bool:
    """The layer's method declares a per-layer budget rule (the shared `layer_budget`)."""
    return isinstance(getattr(layer, "method", None), BudgetedMethod)


def rule_budget(layer, num_layers: int) -> int | None:
    """The tokens a layer may keep now under its method's declared rule, or None where the rule
    gives no figure yet (a per-request allocation not made yet)."""
    basis = KVLayer.basis_tokens(layer)
    owner = getattr(layer, "squeeze", None)
    if owner is not None:  # SqueezeAttention: factor x the uniform budget, factors of mean 1
        factor = layer.budget_factor
        return None if factor is None else owner.layer_tokens(factor, basis)
    return layer.method.layer_budget(layer.layer_idx, num_layers, basis)


def allocation_factors(layers) -> list[float] | None:
    """SqueezeAttention's per-layer factors once every squeezed layer has one (else None)."""
    factors = [x.budget_factor for x in layers if getattr(x, "squeeze", None) is not None]
    return factors if factors and None not in factors else None


def kept_after_crafted_compression(method, scores, budget: int | None = None, layer_idx: int = 0,
                                   num_layers: int = 1, setup=None) -> list[list[int]]:
    """Per KV head, the text positions a scored-eviction layer of `method` keeps when it holds
    tokens 0..T-1 scored `scores (1, H_kv, T)` and compresses to `budget` (default: its
    `budget()` with the sequence's final length T): for hand-computed kept-set tests of
    methods whose scores are hard to craft through a model (the scores are given, the rest —
    protections, per-layer and per-head budgets, top-k — is the method's). `setup(layer)`: per-
    request state to set first (SqueezeAttention's factor)."""
    from methods.model import ModelInfo

    h, t = scores.shape[1:]
    info = ModelInfo(num_layers=num_layers, num_heads=h, num_kv_heads=h, head_dim=4,
                     max_positions=4 * t)
    layer = method.make_layer(layer_idx, info)
    if setup is not None:
        setup(layer)
    layer.final_tokens = t
    zeros = torch.zeros(1, h, t, 4)
    layer.update(zeros, zeros, None)
    layer.score = lambda: scores.clone()
    layer.compress_to(layer.budget() if budget is None else budget)
    return [sorted(p for p in row if p >= 0) for row in layer.kept_positions()[0].tolist()]
