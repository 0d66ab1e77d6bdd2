"""Head-permutation equivariance, for every method that keeps or attends a subset of tokens.

The `heads` model (tests/models.py) has heads that attend differently (local, content-addressed
on a different token class per query head, sink-like). Its attention heads are reordered in the
weights (`permute_heads`: KV heads with their query groups, and the query heads inside every
group), which leaves the model's function unchanged; so at every forward, a method's kept or
attended sets must come out reordered the same way and otherwise unchanged. A method declares its
grouping by its rows (`kept_positions()`, a selecting layer's `selection.keep`): a row per KV head
says its query heads are interchangeable (the group's sets must not move when they are swapped),
a row per query head that each selects its own (its sets follow its query head). A method that
pairs a query head with the wrong KV head, averages over the wrong group or reads one query head
for its group breaks this.
"""

import pytest

from harness import hf_adapter
from methods import available_methods, build_method, method_class
from tests.methods.contract.permutation import first_difference, permuted_sets, record_sets
from tests.methods.contract.step_checker import SEQ_TOKENS
from tests.models import heads_model, permute_heads, query_order

KV_ORDER, GROUP_ORDER = [2, 0, 3, 1], [1, 0]  # every KV head moves; the group's two heads swap
# method -> (settings under which its rule is equivariant, why its defaults are not)
EQUIVARIANT_SETTINGS = {
    "infinigen": ({"head0_threshold": False}, "head0_threshold=true (the official Llama "
                  "simulation's): every head's count threshold is head 0's max, so which head "
                  "comes first matters by design"),
}


@pytest.fixture(scope="module")
def heads_pair():
    """(the heads model, the same model with its heads reordered by KV_ORDER and GROUP_ORDER)."""
    permuted = heads_model()
    permute_heads(permuted, KV_ORDER, GROUP_ORDER)
    return heads_model(), permuted


SELECTING = [name for name in available_methods()
             if method_class(name).capabilities.selects_tokens]


@pytest.mark.parametrize("name", SELECTING)
def test_kept_sets_follow_a_permutation_of_the_heads(name, heads_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model, permuted = heads_pair
    settings = method_class(name).compressing_hyperparameters(SEQ_TOKENS)
    method = build_method(name, **{**settings, **EQUIVARIANT_SETTINGS.get(name, ({},))[0]})
    reasons = method.validate(hf_adapter.model_info(model.config), {"batch_size": 1})
    if reasons:
        pytest.skip(f"refused: {'; '.join(reasons)}")
    expected = permuted_sets(record_sets(model, method), KV_ORDER,
                             query_order(KV_ORDER, GROUP_ORDER))
    differs = first_difference(record_sets(permuted, method), expected)
    assert differs is None, (
        f"method={name}: with the heads reordered (KV heads {KV_ORDER}, each group's query "
        f"heads {GROUP_ORDER}) its sets did not follow: {differs} (a query head paired with the "
        "wrong KV head, or a group averaged over the wrong heads?)")
