"""Budgets are verified, not assumed: a method that holds more than it declares fails loudly."""

import pytest
import torch

from kvcore.errors import BudgetViolation
from methods.base import KVMethod
from methods.layer import KVLayer
from tests.conftest import make_engine


class _ClaimsButKeepsAll(KVLayer):
    def allowed_tokens(self):
        return 8  # declares 8, evicts nothing: the silent no-op this field has seen too often


class _Broken(KVMethod):
    name = "broken"

    def make_layer(self, layer_idx, info):
        return _ClaimsButKeepsAll(layer_idx, info)


class _SelectsTooMany(KVLayer):
    def allowed_tokens(self):
        return 4

    def stats(self):
        return {**super().stats(), "selected_tokens": 6}


class _BrokenSelector(KVMethod):
    name = "broken_selector"

    def make_layer(self, layer_idx, info):
        return _SelectsTooMany(layer_idx, info)


def test_holding_more_than_the_budget_raises(tiny_model):
    engine = make_engine(tiny_model, _Broken())
    with pytest.raises(BudgetViolation, match="layer 0 holds 20 KV tokens but its budget is 8"):
        with engine.request() as req:
            req.prefill(torch.arange(3, 23))


def test_selecting_more_than_the_budget_raises(tiny_model):
    engine = make_engine(tiny_model, _BrokenSelector())
    with pytest.raises(BudgetViolation, match="attends to 6 KV tokens but its budget is 4"):
        with engine.request() as req:
            req.prefill(torch.arange(3, 13))


def test_check_can_be_disabled_but_is_still_recorded(tiny_model):
    engine = make_engine(tiny_model, _Broken(), check_budget=False)
    with engine.request() as req:
        req.prefill(torch.arange(3, 23))
    summary = engine.ledger.summary()
    assert summary["tokens_per_layer"] == [20.0, 20.0] and summary["budget_tokens"] == [8.0, 8.0]
