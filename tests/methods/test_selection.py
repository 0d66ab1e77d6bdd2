"""The selection template (methods/selection.py): the chosen set by hand (units, protections),
each KV head serving the union of its query heads' sets, the attention and the accounting."""

import torch

from methods.budget import BudgetedMethod
from methods.model import ModelInfo
from methods.scoring import attention_with_probs
from methods.selection import SelectionLayer, kv_union


class GivenScores(SelectionLayer):
    """A selecting layer whose scores `(B, H_sel, q, U)` are handed in."""

    def __init__(self, scores, budget, unit=1, protect=(0, 0), heads=(2, 1)):
        info = ModelInfo(num_layers=1, num_heads=heads[0], num_kv_heads=heads[1], head_dim=4,
                         max_positions=64)
        super().__init__(0, info, BudgetedMethod(budget_tokens=budget))
        self.scores, self.unit_tokens, self.protect = scores, unit, protect

    def selection_scores(self, query, keys, attention_mask, scaling):
        return self.scores

    def protected(self, budget, t):
        return self.protect


def plain(module, query, keys, values, mask, **kwargs):
    return attention_with_probs(query, keys, values, mask, kwargs["scaling"])


def test_the_set_is_the_protections_and_the_top_units():
    # 9 tokens in units of 2 (the last holds one); the first token and the last 2 protected;
    # budget 7: (7 - 3) // 2 = 2 units, those scoring 9 and 7 (tokens 2, 3 and 6, 7)
    scores = torch.tensor([3., 9., 1., 7., 5.]).view(1, 1, 1, 5)
    layer = GivenScores(scores, budget=7, unit=2, protect=(1, 2), heads=(1, 1))
    keep = layer.choose(scores, 7, 9).keep
    assert keep[0, 0, 0].nonzero().flatten().tolist() == [0, 2, 3, 6, 7, 8]
    # -inf never chosen while a finite unit is left
    masked = scores.clone()
    masked[..., 1] = float("-inf")
    assert layer.choose(masked, 7, 9).keep[0, 0, 0].nonzero().flatten().tolist() == [
        0, 6, 7, 8]  # units 3 (7) and 4 (5, token 8 already protected)


def test_each_query_head_attends_its_own_set_of_its_kv_heads_union():
    torch.manual_seed(0)
    # 4 query heads over 2 KV heads, 6 tokens; budget 2 per query head
    scores = torch.tensor([[9., 8., 0., 0., 0., 0.],   # head 0 -> {0, 1}
                           [0., 0., 9., 8., 0., 0.],   # head 1 -> {2, 3} (same KV head 0)
                           [0., 0., 0., 0., 9., 8.],   # head 2 -> {4, 5}
                           [0., 0., 0., 0., 8., 9.]]).view(1, 4, 1, 6)  # head 3 -> {4, 5}
    layer = GivenScores(scores, budget=2, heads=(4, 2))
    query, keys, values = torch.randn(1, 4, 1, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    layer.seen_tokens = 6
    out, _ = layer.attend(None, query, keys, values, None, plain, scaling=0.5)
    keep = layer.selection.keep[:, :, 0]  # (1, 4, 6)
    assert kv_union(keep, 2)[0].int().tolist() == [[1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1]]
    for h, want in enumerate([[0, 1], [2, 3], [4, 5], [4, 5]]):
        w = torch.softmax(keys[0, h // 2, want] @ query[0, h, 0] * 0.5, -1)
        assert torch.allclose(out[0, 0, h], w @ values[0, h // 2, want], atol=1e-6)
    assert layer.kept_positions()[0].tolist() == [[0, 1], [2, 3], [4, 5], [4, 5]]
    assert layer.stats()["selected_tokens"] == 2 == layer.allowed_tokens()
    assert layer.attended_tokens() == 2


def test_a_dense_forward_reports_no_selection():
    layer = GivenScores(torch.zeros(1, 1, 2, 6), budget=2, heads=(1, 1))
    layer.prompt_open = True  # a prompt held under runner.prefill=dense
    query, keys = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 6, 4)
    layer.attend(None, query, keys, keys, None, plain, scaling=1.0)
    assert layer.selection is None and layer.allowed_tokens() is None
    assert layer.attended_tokens() == 6 and "selected_tokens" not in layer.stats()
