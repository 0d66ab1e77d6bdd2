"""A scored-eviction layer's score reads what it declares, and nothing else.

A layer declaring `score_reads` (a ClassVar: "keys", "values") computes `score()` from the K/V it
holds alone (no attention, no state gathered in `attend`). The contract fills a fresh layer with
random K/V, then with the keys alone and with the values alone replaced: the score must change
with every declared input and stay the same under any other. A score that forgot its values, or
read the keys where it declared the values (LagKV's key and value terms), fails here.
"""

import pytest
import torch

from methods import available_methods, build_method, method_class
from methods.eviction import EvictionLayer
from methods.model import ModelInfo
from tests.methods.contract.step_checker import SEQ_TOKENS

INPUTS = ("keys", "values")
INFO = ModelInfo(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                 max_positions=4 * SEQ_TOKENS)


def declared(name: str) -> tuple[object, tuple[str, ...]] | None:
    """(the method in its compressing case, its layer's score_reads), or None."""
    method = build_method(name, **method_class(name).compressing_hyperparameters(SEQ_TOKENS))
    try:
        layer = method.make_layer(0, INFO)
    except RuntimeError:  # needs its prepared artefacts
        return None
    reads = getattr(layer, "score_reads", None)
    return None if reads is None or not isinstance(layer, EvictionLayer) else (method, reads)


def score_of(method, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    layer = method.make_layer(0, INFO)
    layer.final_tokens = keys.shape[2]
    layer.update(keys, values, None)
    return layer.score().float()


@pytest.mark.parametrize("name", available_methods())
def test_a_score_reads_what_it_declares(name):
    found = declared(name)
    if found is None:
        pytest.skip("no scored-eviction layer declaring score_reads")
    method, reads = found
    assert set(reads) <= set(INPUTS) and reads, f"{name}: score_reads={reads}; allowed: {INPUTS}"
    gen = torch.Generator().manual_seed(0)
    shape = (1, INFO.num_kv_heads, SEQ_TOKENS, INFO.head_dim)
    inputs = {k: torch.randn(shape, generator=gen) for k in INPUTS}
    base = score_of(method, **inputs)
    for changed in INPUTS:
        other = {**inputs, changed: torch.randn(shape, generator=gen)}
        moved = not torch.equal(score_of(method, **other), base)
        assert moved == (changed in reads), (
            f"method={name}: its score {'changed' if moved else 'did not change'} with the "
            f"{changed} replaced, and it declares score_reads={reads}")
