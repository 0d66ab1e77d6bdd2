"""The shared contract must catch the bugs a newcomer plausibly writes (mutation testing).

Each mutant below is a real bug planted for the duration of one test, in the scored-eviction or
the selection template (for several methods built on it) or in one method, as a newcomer would
write it. The contract (`tests/methods/contract/test_contract.py`: `check_compressing_contract`
and the knob check of `test_every_knob_acts.py`) must fail on every one. A mutant equivalent for a method (TOVA declares
no recent window, so forgetting it changes nothing) is not run for it.
"""

import dataclasses

import pytest
import torch

from kvcore.errors import BudgetViolation
from methods import build_method, method_class
from methods.eviction import EvictionLayer, keep_tokens
from tests.methods.contract.common import get_model
from tests.methods.contract.direction import beats_its_mirror, pg19_ids
from tests.methods.contract.knobs import knob_acts
from tests.methods.contract.step_checker import SEQ_TOKENS, check_compressing_contract

TEMPLATE_METHODS = ("h2o", "snapkv", "pyramidkv", "tova")
CAUGHT = (AssertionError, BudgetViolation)


# --- mutants of the template -------------------------------------------------------------------
def budget_doubled_at_prompt_end(monkeypatch):
    def doubled(self):
        budget = 2 * self.budget()
        self.compress_to(budget)
        if self.compress_at == "prefill_end":
            self.granted = (budget, self.seen_tokens)  # and it certifies itself
    monkeypatch.setattr(EvictionLayer, "on_prefill_end", doubled)


def lowest_scores_kept(monkeypatch):
    original = EvictionLayer.guarded_scores

    def lowest(self, budget):
        scores = original(self, budget)
        return torch.where(torch.isinf(scores), scores, -scores)  # protections kept, rest inverted
    monkeypatch.setattr(EvictionLayer, "guarded_scores", lowest)


def recent_window_forgotten(monkeypatch):
    def sinks_only(self, budget):
        sinks, _ = self.protected(budget)
        scores = self.score().float()
        return scores.masked_fill(self.positions < sinks, float("inf")) if sinks else scores
    monkeypatch.setattr(EvictionLayer, "guarded_scores", sinks_only)


TEMPLATE_MUTANTS = {"budget_doubled_at_prompt_end": budget_doubled_at_prompt_end,
                    "lowest_scores_kept": lowest_scores_kept,
                    "recent_window_forgotten": recent_window_forgotten}
EQUIVALENT = {("tova", "recent_window_forgotten"): "TOVA declares no recent window"}


@pytest.mark.parametrize("mutant", list(TEMPLATE_MUTANTS))
@pytest.mark.parametrize("name", TEMPLATE_METHODS)
def test_the_contract_kills_template_mutants(name, mutant, request, monkeypatch):
    if (name, mutant) in EQUIVALENT:
        pytest.skip(f"equivalent mutant: {EQUIVALENT[name, mutant]}")
    model = get_model("llama", request, layers=3)
    method = build_method(name, **method_class(name).compressing_hyperparameters(SEQ_TOKENS))
    check_compressing_contract(model, method)  # the real template passes
    TEMPLATE_MUTANTS[mutant](monkeypatch)
    with pytest.raises(CAUGHT):
        check_compressing_contract(model, method)


# --- mutants of the selection template ----------------------------------------------------------
def lowest_scores_selected(monkeypatch):
    from methods.selection import SelectionLayer

    original = SelectionLayer.choose

    def lowest(self, scores, budget, t):
        chosen = original(self, torch.where(torch.isinf(scores), scores, -scores), budget, t)
        return dataclasses.replace(chosen, scores=scores)  # it records the scores it was given
    monkeypatch.setattr(SelectionLayer, "choose", lowest)


def union_is_one_query_heads_set(monkeypatch):
    from methods import selection

    def first_head(keep, num_kv_heads):
        b, h_sel, t = keep.shape
        return keep.view(b, num_kv_heads, h_sel // num_kv_heads, t)[:, :, 0]
    monkeypatch.setattr(selection, "kv_union", first_head)


SELECTION_MUTANTS = {"lowest_scores_selected": lowest_scores_selected,
                     "union_is_one_query_heads_set": union_is_one_query_heads_set}
SELECTING_METHODS = ("oracle_topk", "quest", "tailorkv", "shadowkv", "infinigen")
EQUIVALENT.update({(name, "union_is_one_query_heads_set"): "it selects per KV head: a KV "
                   "head's union is its one set" for name in ("oracle_topk", "tailorkv", "shadowkv")})
EQUIVALENT[("infinigen", "lowest_scores_selected")] = (
    "not applicable: it chooses one layer ahead by its own count rule, not the template's "
    "`choose` (scripts/mutation_run.py plants the lowest scores in its speculation)")


@pytest.mark.parametrize("mutant", list(SELECTION_MUTANTS))
@pytest.mark.parametrize("name", SELECTING_METHODS)
def test_the_contract_kills_selection_mutants(name, mutant, request, monkeypatch):
    if (name, mutant) in EQUIVALENT:
        pytest.skip(f"equivalent mutant: {EQUIVALENT[name, mutant]}")
    model = get_model("llama", request, layers=3)
    method = build_method(name, **method_class(name).compressing_hyperparameters(SEQ_TOKENS))
    check_compressing_contract(model, method)  # the real template passes
    SELECTION_MUTANTS[mutant](monkeypatch)
    with pytest.raises(CAUGHT):
        check_compressing_contract(model, method)


# --- a newcomer's mutants, each in one method --------------------------------------------------
def own_compress_forgets_the_window(monkeypatch):
    """SnapKV with its own top-k that forgets the window it declares in protected()."""
    from methods.snapkv import SnapKVLayer

    def naive(self, budget):
        if self.kept_tokens() > budget:
            index = self.score().float().topk(budget, dim=-1).indices.sort(dim=-1).values
            self.kept_count = keep_tokens(self._token_rows(), index)
            self._views()
    monkeypatch.setattr(SnapKVLayer, "compress_to", naive)
    return "snapkv", {}


def never_evicts(monkeypatch):
    from methods.h2o import H2OLayer

    monkeypatch.setattr(H2OLayer, "compress_to", lambda self, budget: None)
    return "h2o", {}


def sign_flipped(monkeypatch):
    """KeyDiff keeping the keys most aligned with the mean key (the score's sign flipped)."""
    from methods import keydiff

    monkeypatch.setattr(keydiff.KeyDiffLayer, "score", lambda self: keydiff.anchor_cosine(self.keys))


def budget_rule_of_its_own(monkeypatch):
    """TOVA sizing a ratio budget on the tokens seen so far instead of the protocol's basis."""
    from methods.tova import TOVALayer

    monkeypatch.setattr(TOVALayer, "budget", lambda self: self.method.total_tokens(
        self.seen_tokens))
    return "tova", {"budget_ratio": 0.2}  # a ratio: an absolute budget makes it equivalent


NEWCOMER_MUTANTS = {"own_compress_forgets_the_window": own_compress_forgets_the_window,
                    "never_evicts": never_evicts, "budget_rule_of_its_own": budget_rule_of_its_own}


def test_the_direction_check_kills_a_sign_flip(stories, monkeypatch):
    model, tok = stories
    ids = pg19_ids(tok)
    assert beats_its_mirror(model, tok, "keydiff", ids)[0]
    sign_flipped(monkeypatch)
    assert not beats_its_mirror(model, tok, "keydiff", ids)[0]


@pytest.mark.parametrize("mutant", list(NEWCOMER_MUTANTS))
def test_the_contract_kills_a_newcomers_mutants(mutant, request, monkeypatch):
    model = get_model("llama", request, layers=3)
    name, settings = NEWCOMER_MUTANTS[mutant](monkeypatch)
    settings = {**method_class(name).compressing_hyperparameters(SEQ_TOKENS), **settings}
    if "budget_ratio" in settings:
        settings["budget_tokens"] = None
    method = build_method(name, **settings)
    with pytest.raises(CAUGHT):
        check_compressing_contract(model, method)


def test_the_knob_check_kills_a_uniform_split(request, monkeypatch):
    """PyramidKV whose per-layer split came out uniform: its beta then changes nothing."""
    from methods.pyramidkv import PyramidKV

    model = get_model("llama", request, layers=3)
    assert knob_acts(model, "pyramidkv", "beta")
    monkeypatch.setattr(PyramidKV, "layer_budget",
                        lambda self, layer_idx, num_layers, basis: self.total_tokens(basis))
    assert not knob_acts(model, "pyramidkv", "beta")
