"""Quest: page bounds and upper-bound scores by hand, the page selection under the budget, the
Triton page-scoring kernel (CPU interpreter) against the torch reference, and a model-level
decode whose pages and output are recomputed by hand at every step."""

import pytest
import torch

from harness.core import hf_adapter
from kvcore.errors import ConfigError
from methods import build_method
from methods.kernels import quest_pages
from methods.model import ModelInfo
from methods.quest import QuestLayer, page_bounds, scored_allowance
from tests.conftest import make_engine
from tests.helpers.validation import HUGE_MODEL, one_reason


def attended(scores, t, budget, **knobs):
    """Per head, the token positions a Quest layer attends when its page scores over `t` tokens
    (pages of 4) are `scores (1, H, P)`: Quest's rule through the selection template."""
    h = scores.shape[1]
    info = ModelInfo(num_layers=1, num_heads=h, num_kv_heads=h, head_dim=4, max_positions=64)
    layer = QuestLayer(0, info, build_method("quest", budget_tokens=budget, page_size=4,
                                             dense_layers=[], **knobs))
    layer.page_scores = lambda query: scores.clone()
    keep = layer.choose(layer.selection_scores(None, None, None, None), budget, t).keep
    return [row.nonzero().flatten().tolist() for row in keep[0, :, 0]]


def test_page_bounds_and_scores_by_hand():
    # one head, D = 2, pages of 2 tokens, the last page partial (5 tokens)
    keys = torch.tensor([[1., -2.], [3., 0.], [-1., 4.], [0., 1.], [2., 2.]])[None, None]
    low, high = page_bounds(keys, 2)
    assert low[0, 0].tolist() == [[1., -2.], [-1., 1.], [2., 2.]]
    assert high[0, 0].tolist() == [[3., 0.], [0., 4.], [2., 2.]]
    q = torch.tensor([[[2., -1.]]])  # (B, H_q, D)
    # U = sum_d max(q_d m_d, q_d M_d): page0 max(2,6)+max(2,0)=8; page1 max(-2,0)+max(-1,-4)=-1;
    # page2 (one token) = q.k = 2
    assert quest_pages.page_scores_ref(q, low, high).tolist() == [[[8., -1., 2.]]]
    # the bound holds for every key of its page, with equality on a one-token page
    per_key = (keys[0, 0] @ q[0, 0]).tolist()  # [4, 6, -6, -1, 2]
    assert max(per_key[:2]) <= 8 and max(per_key[2:4]) <= -1 and per_key[4] == 2


def test_select_pages_keeps_the_current_page_and_fills_the_budget():
    scores = torch.tensor([[[5., 1., 9., 3., -100.]]])  # 5 pages of 4, the last (current) partial
    t = 18  # current page holds 2 tokens (16, 17)
    forced = dict(current_page="forced")
    # budget 11: 2 current + (11 - 2) // 4 = 2 pages -> pages 2 and 0 (scores 9 and 5), sorted
    assert attended(scores, t, 11, **forced) == [[0, 1, 2, 3, 8, 9, 10, 11, 16, 17]]
    # the current page is kept even when it scores lowest; budget covering all -> everything
    assert attended(scores, t, 18, **forced) == [list(range(18))]
    assert attended(scores, t, 100, **forced) == [list(range(18))]
    # below the current page: the last B tokens
    assert attended(scores, t, 1, **forced) == [[17]]
    # exactly the current page
    assert attended(scores, t, 5, **forced) == [[16, 17]]


def test_group_reduction_max_and_sum():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 8, generator=g)  # H_q = 4, H_kv = 2
    keys = torch.randn(1, 2, 12, 8, generator=g)
    low, high = page_bounds(keys, 4)
    per_head = torch.stack([quest_pages.page_scores_ref(q[:, h:h + 1], low[:, h // 2:h // 2 + 1],
                                                        high[:, h // 2:h // 2 + 1])[:, 0]
                            for h in range(4)], 1)  # (B, H_q, P), each head alone (g = 1)
    got_max = quest_pages.page_scores_ref(q, low, high, "max")
    got_sum = quest_pages.page_scores_ref(q, low, high, "sum")
    assert torch.allclose(got_max, per_head.view(1, 2, 2, 3).amax(2))
    assert torch.allclose(got_sum, per_head.view(1, 2, 2, 3).sum(2))
    # g = 1: both reductions are the MHA rule
    one = q[:, :2]
    assert torch.equal(quest_pages.page_scores_ref(one, low, high, "max"),
                       quest_pages.page_scores_ref(one, low, high, "sum"))


@pytest.mark.parametrize("b, h_q, h_kv, pages, d, reduce, dtype", [
    (1, 9, 3, 5, 64, "max", torch.float32),  # SmolLM2 heads
    (2, 4, 4, 20, 8, "sum", torch.float32),  # MHA, batch 2, two page blocks of 16
    (1, 4, 2, 3, 16, "sum", torch.bfloat16),
])
def test_kernel_equals_reference(b, h_q, h_kv, pages, d, reduce, dtype):
    if not quest_pages.use_triton(torch.empty(0)):
        pytest.skip("TRITON_INTERPRET=1 was not set before import (tests/conftest.py sets it)")
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, h_q, d, generator=g).to(dtype)
    low, high = page_bounds(torch.randn(b, h_kv, pages * 4 - 1, d, generator=g).to(dtype), 4)
    got = quest_pages.page_scores(q, low, high, reduce)
    want = quest_pages.page_scores_ref(q, low, high, reduce)
    assert got.dtype == torch.float32 and got.shape == (b, h_kv, pages)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_arguments_are_checked():
    q, low = torch.zeros(1, 3, 8), torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="multiple"):
        quest_pages.page_scores_ref(q, low, low)
    with pytest.raises(ValueError, match="reduce"):
        quest_pages.page_scores_ref(torch.zeros(1, 2, 8), low, low, "mean")


OURS = dict(select_per="kv_head", current_page="forced")  # the named variant: our selection


@pytest.mark.kept_set
def test_every_decode_step_attends_the_hand_selected_pages(tiny_model, monkeypatch):
    """Ours (`select_per=kv_head`, `current_page=forced`). Budget 21, pages of 4, no dense layer:
    at each step recompute the page bounds from the cached keys, the max-over-group bounds, the
    pages (current + the (21 - p) // 4 best), and the attention output over them, and compare
    with what the layer did."""
    steps = []
    original = QuestLayer.attend

    def spy(self, module, query, keys, values, mask, base, **kw):
        out = original(self, module, query, keys, values, mask, base, **kw)
        if query.shape[2] == 1:
            steps.append(dict(layer=self.layer_idx, q=query[0, :, 0], k=keys[0], v=values[0],
                              slots=self.kept_positions()[0].clone(), out=out[0][0, 0], scaling=kw["scaling"]))
        return out

    monkeypatch.setattr(QuestLayer, "attend", spy)
    torch.manual_seed(5)
    ids = torch.randint(3, 250, (1, 46))
    method = build_method("quest", budget_tokens=21, page_size=4, dense_layers=[], **OURS)
    engine = make_engine(tiny_model, method, chunk=16)
    with engine.request() as req:
        req.prefill(ids[:, :30])
        for t in range(30, 46):
            req.step(ids[:, t])
            for kv in req.cache.kv_layers:
                assert kv.stats()["selected_tokens"] <= kv.allowed_tokens() == 21
    assert len(steps) == 2 * 16
    for s in steps:
        q, keys, values = s["q"], s["k"], s["v"]  # (H_q, D), (H_kv, T, D)
        h_kv, t, _ = keys.shape
        groups = q.shape[0] // h_kv
        n_pages = -(-t // 4)
        current = t - (n_pages - 1) * 4
        m = (21 - current) // 4
        for h in range(h_kv):
            bounds = []
            for p in range(n_pages - 1):
                page = keys[h, p * 4:(p + 1) * 4]
                bounds.append(max(float(torch.maximum(q[j] * page.amin(0), q[j] * page.amax(0)).sum())
                                  for j in range(h * groups, (h + 1) * groups)))
            best = sorted(sorted(range(n_pages - 1), key=lambda p: -bounds[p])[:m])
            want = [p * 4 + i for p in best for i in range(4)] + list(range(t - current, t))
            assert s["slots"][h].tolist() == want
            for j in range(h * groups, (h + 1) * groups):
                w = torch.softmax(keys[h, want] @ q[j] * s["scaling"], -1)
                assert torch.allclose(s["out"][j], w @ values[h, want], atol=1e-5)
    summary = engine.attended.summary()
    assert summary["attended_fraction_all_layers"] < 21 / 31 + 1e-9  # 21 of >= 31 tokens per step


def test_dense_layers_and_held_bytes(tiny_model):
    """The default dense layers are the paper's first two; the held bytes count the page bounds."""
    method = build_method("quest", budget_tokens=8, dense_layers=[0], **OURS)
    engine = make_engine(tiny_model, method, chunk=16)
    ids = torch.randint(3, 250, (1, 40))
    with engine.request() as req:
        req.prefill(ids[:, :32])
        for t in range(32, 40):
            req.step(ids[:, t])
        dense, sparse = req.cache.kv_layers
        assert not isinstance(dense, QuestLayer) and isinstance(sparse, QuestLayer)
        stats = sparse.stats()
    assert engine.dense_layers == (0,)
    kv_bytes_full = 2 * 40 * 2 * 16 * 4  # K and V, 2 KV heads, D 16, fp32
    assert stats["kv_bytes"] == kv_bytes_full + 2 * 3 * 2 * 16 * 4  # + min/max of 3 pages
    assert stats["selected_tokens"] == 8  # the current page (8 tokens: 32..39) fills the budget
    assert build_method("quest").own_dense_layers(engine.info) == (0, 1)


def test_bad_hyperparameters_name_the_key(tiny_model):
    with pytest.raises(ConfigError, match="method.page_size"):
        build_method("quest", page_size=0)
    with pytest.raises(ConfigError, match="method.group_reduce"):
        build_method("quest", group_reduce="mean")
    info = hf_adapter.model_info(tiny_model.config)
    reasons = build_method("quest", dense_layers=[5]).validate(info, {})
    assert any("method.dense_layers" in r for r in reasons)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernel_on_cuda_equals_reference(dtype):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 32, 128, generator=g).to(dtype).cuda()  # Llama-3-8B heads: 32 / 8
    low, high = page_bounds(torch.randn(2, 8, 16 * 300 - 5, 128, generator=g).to(dtype).cuda(), 16)
    for reduce in quest_pages.REDUCTIONS:
        got = quest_pages.page_scores(q, low, high, reduce)
        want = quest_pages.page_scores_ref(q, low, high, reduce)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-3)


# --- the official accuracy path's selection (evaluation/quest_attention.py) ----------------------

def test_scored_pages_by_hand():
    """K = min(max(3, min(T, B) // page), P) best pages per head; the partial current page is one
    page among the others (counted, never forced); a budget below 3 pages still gets 3."""
    scores = torch.tensor([[[5., 1., 9., 3., -100.],  # head 0: the current page scores lowest
                            [5., 1., 9., 3., 100.]]])  # head 1: the current page scores highest
    t = 18  # 5 pages of 4; the current page (16, 17) holds 2 tokens
    keep = attended(scores, t, 11)  # 11 // 4 = 2 pages, raised to the minimum of 3
    assert keep[0] == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15]
    assert keep[1] == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17]
    assert scored_allowance(t, 4, 11, 3) == 12  # 3 pages of 4: above the budget, by design
    # 16 // 4 = 4 pages: head 0 drops only its current page, head 1 page 1
    keep = attended(scores, t, 16)
    assert keep[0] == list(range(16))
    assert keep[1] == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    # a budget above the cache: min(T, B) // 4 = 4 of the 5 pages (the official rule drops one)
    assert len(attended(scores, t, 1000)[0]) == 16
    # fewer pages than the minimum: all of them
    assert attended(scores[..., :2], 6, 1) == [list(range(6))] * 2


def test_per_query_head_pages_make_the_union_per_kv_head(tiny_model, monkeypatch):
    """The default (the official accuracy path, K/V expanded): each query head of a group picks
    its own pages from its own bounds and attends only them; the KV head serves the union. At
    every step and head recompute the bounds by hand, the heads' page sets, and the outputs."""
    steps = []
    original = QuestLayer.attend

    def spy(self, module, query, keys, values, mask, base, **kw):
        out = original(self, module, query, keys, values, mask, base, **kw)
        if query.shape[2] == 1:
            steps.append(dict(q=query[0, :, 0], k=keys[0], v=values[0], out=out[0][0, 0],
                              scaling=kw["scaling"], stats=self.stats(),
                              allowed=self.allowed_tokens(), pos=self.kept_positions()))
        return out

    monkeypatch.setattr(QuestLayer, "attend", spy)
    torch.manual_seed(5)
    ids = torch.randint(3, 250, (1, 46))
    method = build_method("quest", budget_tokens=13, page_size=4, dense_layers=[])
    engine = make_engine(tiny_model, method, chunk=16)
    with engine.request() as req:
        req.prefill(ids[:, :30])
        for t in range(30, 46):
            req.step(ids[:, t])
    unions_differ = False
    for s in steps:
        q, keys, values = s["q"], s["k"], s["v"]  # (H_q, D), (H_kv, T, D)
        h_kv, t, _ = keys.shape
        g = q.shape[0] // h_kv
        n_pages = -(-t // 4)
        k = max(3, min(t, 13) // 4)  # 13 // 4 = 3 pages (12 tokens) per query head
        sizes = []
        for h in range(h_kv):
            sets = []
            for j in range(h * g, (h + 1) * g):
                bounds = [float(torch.maximum(q[j] * keys[h, p * 4:(p + 1) * 4].amin(0),
                                              q[j] * keys[h, p * 4:(p + 1) * 4].amax(0)).sum())
                          for p in range(n_pages)]  # the partial last page included
                best = sorted(range(n_pages), key=lambda p: -bounds[p])[:k]
                want = [i for p in sorted(best) for i in range(p * 4, min(t, p * 4 + 4))]
                sets.append(set(want))
                w = torch.softmax(keys[h, want] @ q[j] * s["scaling"], -1)
                assert torch.allclose(s["out"][j], w @ values[h, want], atol=1e-5)
                assert set(s["pos"][0, j].tolist()) >= set(want)
            union = set().union(*sets)
            unions_differ |= len(union) > max(len(x) for x in sets)
            sizes.append(max(len(x) for x in sets))
        assert s["stats"]["selected_tokens"] == max(sizes) <= s["allowed"] == 12
    assert unions_differ  # the group's heads chose different pages: the KV head read their union


def test_official_selection_is_the_default():
    method = build_method("quest")
    assert (method.select_per, method.current_page, method.min_pages) == ("query_head", "scored", 3)


def test_quest_page_size_is_estimated_before_the_weights(eight_gib):
    reason = one_reason(build_method("quest", budget_tokens=64, page_size=1_000_000_000),
                        HUGE_MODEL)
    assert "method.page_size=1000000000: one padded page of keys per layer" in reason
