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

Head locality: a statistic taken over every head at once (an anchor, a range, a threshold) is
symmetric, so it survives a permutation; so one KV head of the first layer is changed in the
weights, and at that layer every other head's sets must stay as they were (the first layer's
input does not depend on it). A method whose rule couples its heads by design (one set for the
whole layer; a budget split across heads) says so below or by its rows.
"""

import pytest

from harness.core import hf_adapter
from methods import available_methods, build_method, method_class
from tests.methods.contract.permutation import first_difference, permuted_sets, record_sets
from tests.methods.contract.step_checker import SEQ_TOKENS
from tests.models import HEADS_GROUP, alter_kv_head, heads_model, permute_heads, query_order

KV_ORDER, GROUP_ORDER = [2, 0, 3, 1], [1, 0]  # every KV head moves; the group's two heads swap
# method -> (settings under which its rule is equivariant, why its defaults are not)
EQUIVARIANT_SETTINGS = {
    "infinigen": ({"head0_threshold": False}, "head0_threshold=true (the official Llama "
                  "simulation's): every head's count threshold is head 0's max, so which head "
                  "comes first matters by design"),
}


_REFERENCE: dict[tuple[str, str], list] = {}


def reference_sets(model, method) -> list:
    """`record_sets` on the unchanged heads model, once per method and settings (both tests)."""
    key = (method.name, repr(sorted(method.hyperparameters().items())))
    if key not in _REFERENCE:
        _REFERENCE[key] = record_sets(model, method)
    return _REFERENCE[key]


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
    expected = permuted_sets(reference_sets(model, method), KV_ORDER,
                             query_order(KV_ORDER, GROUP_ORDER))
    differs = first_difference(record_sets(permuted, method), expected)
    assert differs is None, (
        f"method={name}: with the heads reordered (KV heads {KV_ORDER}, each group's query "
        f"heads {GROUP_ORDER}) its sets did not follow: {differs} (a query head paired with the "
        "wrong KV head, or a group averaged over the wrong heads?)")


# method -> (settings under which each KV head's choice is its own, or None: coupled by design)
COUPLED_HEADS = {
    "infinigen": ({"head0_threshold": False, "shared_count": False},
                  "its defaults share head 0's threshold and the mean count over heads"),
}


@pytest.fixture(scope="module")
def altered_pair():
    """(the heads model, the same with KV head 0 of layer 0 changed)."""
    altered = heads_model()
    alter_kv_head(altered)
    return heads_model(), altered


def other_heads(rows: list, h_kv: int) -> list:
    """The rows of every head but KV head 0 (its query heads, where rows are per query head)."""
    per = 1 if len(rows) == h_kv else HEADS_GROUP
    return rows[per:]


@pytest.mark.parametrize("name", SELECTING)
def test_a_heads_choice_is_its_own(name, altered_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model, altered = altered_pair
    cls = method_class(name)
    if getattr(cls, "allocates_per_head", lambda: False)():
        pytest.skip("splits the layer's budget across its heads (head_budgets): coupled")
    settings = cls.compressing_hyperparameters(SEQ_TOKENS)
    settings.update(COUPLED_HEADS.get(name, ({},))[0] or {})
    method = build_method(name, **settings)
    reasons = method.validate(hf_adapter.model_info(model.config), {"batch_size": 1})
    if reasons:
        pytest.skip(f"refused: {'; '.join(reasons)}")
    h_kv = model.config.num_key_value_heads
    ref = [step[0] for step in reference_sets(model, method)]  # layer 0, every forward
    if all(len(set(rows)) <= 1 for rows in ref):
        pytest.skip("the first layer holds one set for all its heads at every forward (its "
                    "rule's, e.g. TOVA's, or a layer it leaves dense)")
    got = [step[0] for step in record_sets(altered, method)]
    for step, (want, have) in enumerate(zip(ref, got)):
        assert other_heads(have, h_kv) == other_heads(want, h_kv), (
            f"method={name}: with KV head 0 of layer 0 changed, the other heads' sets at that "
            f"layer moved at forward {step}: a statistic over every head (an anchor, a range, "
            "a threshold) where each head's own is meant?")
