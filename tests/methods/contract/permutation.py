"""What a method keeps or attends, head by head, at every forward of the compressing case on
the `heads` model (tests/models.py), so that two orderings of the same heads can be compared."""

import torch

from harness.core import hf_adapter
from methods.selection import SelectionLayer
from tests.conftest import make_engine
from tests.methods.contract.step_checker import CHUNK_TOKENS, PREFILL_TOKENS, SEQ_TOKENS, held_rows


def head_sets(layer) -> list[frozenset[int]]:
    """Per row (a KV head, or a query head where the layer selects per query head): the text
    positions it holds, or attended at its last step (a selecting layer)."""
    if isinstance(layer, SelectionLayer) and layer.selection is not None:
        keep = layer.selection.keep[0, :, -1]  # (H_sel, T)
        return [frozenset(row.nonzero().flatten().tolist()) for row in keep]
    return [frozenset(row) for row in held_rows(layer.kept_positions()[:1])]


def record_sets(model, method) -> list[list[list[frozenset[int]]]]:
    """Per forward, per layer: `head_sets` after the forward (eager attention, chunked prompt,
    then decode steps over the contract's tokens)."""
    ids = torch.randint(3, 250, (1, SEQ_TOKENS), generator=torch.Generator().manual_seed(7))
    steps: list[list[list[frozenset[int]]]] = []
    hf_adapter.set_attention(model, "eager")
    try:
        engine = make_engine(model, method, chunk=CHUNK_TOKENS)
        with engine.request() as req:
            layers = req.cache.kv_layers
            last = layers[-1]
            after = last.after_forward

            def recorded():
                after()
                steps.append([head_sets(kv) for kv in layers])
            last.after_forward = recorded
            req.prefill(ids[:, :PREFILL_TOKENS])
            for i in range(PREFILL_TOKENS, SEQ_TOKENS):
                req.step(ids[:, i])
    finally:
        hf_adapter.set_attention(model, "sdpa")
    return steps


def permuted_sets(sets, kv_order: list[int], query_order: list[int]):
    """`sets` as the permuted model must give them: a row per KV head reordered by `kv_order`,
    a row per query head by `query_order`, a row for the whole layer left as it is."""
    out = []
    for step in sets:
        layers = []
        for rows in step:
            order = (kv_order if len(rows) == len(kv_order)
                     else query_order if len(rows) == len(query_order) else range(len(rows)))
            layers.append([rows[i] for i in order])
        out.append(layers)
    return out


def first_difference(got, expected) -> str | None:
    """Where two recordings first differ (forward, layer, row, positions only in each)."""
    for step, (g_layers, e_layers) in enumerate(zip(got, expected)):
        for layer, (g_rows, e_rows) in enumerate(zip(g_layers, e_layers)):
            for row, (g, e) in enumerate(zip(g_rows, e_rows)):
                if g != e:
                    return (f"forward {step}, layer {layer}, row {row}: only in the permuted "
                            f"model's {sorted(g - e)}, only in the expected {sorted(e - g)}")
    return None if len(got) == len(expected) else f"{len(got)} forwards vs {len(expected)}"
