"""HeadKV: one budget pool over every KV head of every layer, split by static head scores (the
official formula), SnapKV's selection per head. The shared contract
(tests/methods/contract/test_contract.py) runs it too: budget >= the sequence == full, batch == alone, every compression per head against
its own scores; paged == contiguous (contract/test_paged_layout.py)."""

import json
from pathlib import Path

import pytest
import torch

from harness.core import hf_adapter
from kvcore.errors import ConfigError
from methods import build_method
from methods.headkv import head_shares, load_head_scores
from tests.conftest import make_engine
from tests.helpers.validation import head_scores, one_reason
from tests.methods.headwise_reference import masked_full_gap
from tests.methods.contract.rules import kept_after_crafted_compression

FIXTURE = Path(__file__).parent / "data" / "headkv_tiny_llama.json"  # 2 layers x 4 query heads
WINDOW = 8


def official_capacities(path, budget, window, beta, temp, layers, heads, group):
    """ReasonSnapKVCluster.__init__ written out (FYYFU/HeadKV, per query head): the mean of each
    head's list, s / sum, ** temp, / sum; pool (base // beta) x L x H_q, floor base - base // beta;
    unrounded. A KV head's capacity: the mean over its query group (repeat_kv), window added."""
    table = json.loads(open(path).readline())
    means = [sum(v) / len(v) for v in table.values()]
    s = [m / sum(means) for m in means]
    s = [x ** temp for x in s]
    s = [x / sum(s) for x in s]
    base = budget - window
    pool, floor = (base // beta) * layers * heads, base - base // beta
    q = [[s[l * heads + h] * pool + floor for h in range(heads)] for l in range(layers)]
    return [[window + sum(q[l][k * group:(k + 1) * group]) / group for k in range(heads // group)]
            for l in range(layers)]


def prepared(model, **knobs):
    method = build_method("headkv", window_tokens=WINDOW, **knobs)
    hf_adapter.prepare(method, model, None)
    return method


def counts(method, layer, budget, tokens=100):
    """head_budgets on a layer holding `tokens` per head, the last WINDOW protected."""
    scores = torch.rand(1, method._shares.shape[1], tokens, generator=torch.Generator().manual_seed(0))
    scores[..., -WINDOW:] = float("inf")
    return method.head_budgets(scores, budget, layer)[0].tolist()


def test_the_official_file_allocation_by_hand(tiny_model):
    """Query-head means l0 [.1, .1, 0, 0], l1 [.2, 0, .4, .8] (sum 1.6); KV shares (query pairs
    summed) [.125, 0], [.125, .75]; B 28, window 8, beta 1: base 20, pool 20 x 2 x 2 = 80, floor 0:
    capacities 8 + [10, 0], 8 + [10, 60]; layer budgets 8 + 5, 8 + 35."""
    method = prepared(tiny_model, head_scores_path=str(FIXTURE), budget_tokens=28, beta=1.0)
    assert method.provenance_label() == "official code"
    budgets = [method.layer_budget(layer, 2, 100) for layer in range(2)]
    assert budgets == [13, 43]
    split = [counts(method, layer, budgets[layer]) for layer in range(2)]
    assert split == [[18, 8], [18, 68]]
    assert split == official_capacities(FIXTURE, 28, WINDOW, 1.0, 1.0, 2, 4, 2)
    assert sum(map(sum, split)) == 2 * 2 * 28  # the pool: every layer and head together


def test_the_official_default_beta_within_a_token_and_exact_in_total(tiny_model):
    """beta 1.005: base // beta = 19, floor 1, pool 19 x 2 x 4 per query head; the capacities
    10.5, 1, 10.5, 58 (+ 8): ours rounded to whole tokens per head, summing exactly to L x H x B
    (the official per-head round gives 10 + 1 + 10 + 58 + 32 = 111, one short of 112)."""
    method = prepared(tiny_model, head_scores_path=str(FIXTURE), budget_tokens=28)
    official = official_capacities(FIXTURE, 28, WINDOW, 1.005, 1.0, 2, 4, 2)
    assert official == [[18.5, 9.0], [18.5, 66.0]]
    split = [counts(method, layer, method.layer_budget(layer, 2, 100)) for layer in range(2)]
    assert sum(map(sum, split)) == 112
    assert max(abs(a - b) for r, o in zip(split, official) for a, b in zip(r, o)) < 1


@pytest.mark.parametrize("budget", [9, 12, 28, 41, 77])
@pytest.mark.parametrize("beta", [1.0, 1.005, 1.5, 10.0])
def test_budgets_sum_to_the_rule_over_every_layer_and_head(budget, beta):
    """Random scores, 5 layers x 4 KV heads: the layer budgets sum to L x B, each layer's heads
    to H x its budget, no head below the window, each within 2 of its official capacity."""
    method = build_method("headkv", budget_tokens=budget, window_tokens=WINDOW, beta=beta)
    method._shares = head_shares(torch.rand(5, 4, generator=torch.Generator().manual_seed(1)),
                                 1.0, 4)
    budgets = [method.layer_budget(layer, 5, 200) for layer in range(5)]
    assert sum(budgets) == 5 * budget
    base = budget - WINDOW
    official = WINDOW + (base - base // beta) + method._shares * (base // beta) * 20
    for layer, layer_budget in enumerate(budgets):
        split = counts(method, layer, layer_budget, tokens=200)
        assert sum(split) == 4 * layer_budget and min(split) >= WINDOW
        assert (torch.tensor(split) - official[layer]).abs().max() < 2


def test_a_head_cannot_take_more_than_it_holds_the_rest_goes_to_the_others(tiny_model):
    """Layer 1 (budget 43, 86 tokens): its second head's 68 capped at the 30 it holds, the excess
    to the first head (official: lost); the layer still holds H x its budget."""
    method = prepared(tiny_model, head_scores_path=str(FIXTURE), budget_tokens=28, beta=1.0)
    assert method.layer_budget(1, 2, 100) == 43
    split = counts(method, 1, 43, tokens=30)
    assert split == [30, 30]  # 60 of 86: all there is
    split = counts(method, 1, 43, tokens=50)
    assert split == [36, 50] and sum(split) == 86


def test_the_official_file_loads_and_bad_files_are_refused(tiny_model, tmp_path):
    info = hf_adapter.model_info(tiny_model.config)
    scores = load_head_scores(FIXTURE, info)
    assert torch.allclose(scores, torch.tensor([[0.1, 0.1, 0, 0], [0.2, 0, 0.4, 0.8]]).double())
    shares = head_shares(scores, 1.0, 2)  # query pairs (0, 1), (2, 3) summed: repeat_kv's groups
    assert torch.allclose(shares, torch.tensor([[0.125, 0.0], [0.125, 0.75]]).double())
    assert torch.allclose(head_shares(scores, 0.0, 2), torch.full((2, 2), 0.25).double())
    bad = tmp_path / "bad.json"
    bad.write_text("not json\n")
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"0-0": [1.0]}) + "\n")
    for path in (bad, short, tmp_path / "absent.json"):
        reasons = build_method("headkv", head_scores_path=str(path)).validate(info, {})
        assert len(reasons) == 1 and f"method.head_scores_path={path}" in reasons[0]


def test_without_a_file_the_proxy_is_the_probes_induction_score(tiny_model, monkeypatch):
    induction = torch.tensor([[1.0, 3.0], [0.0, 4.0]])
    monkeypatch.setattr("methods.headkv.probe_scores",
                        lambda *a: (torch.ones(2, 2), induction, {"probe_scores": "stub"}))
    method = prepared(tiny_model)
    assert method.provenance_label().startswith("reconstruction (proxy head scores")
    assert torch.allclose(method._shares, torch.tensor([[0.125, 0.375], [0.0, 0.5]]).double())


@pytest.mark.parametrize("knob, value", [("beta", 0.5), ("temp", -1), ("beta", True)])
def test_beta_and_temp_are_checked(knob, value):
    with pytest.raises(ConfigError, match=f"method.{knob}"):
        build_method("headkv", **{knob: value})


def stories_file(tmp_path, hot=None):
    """An official-format file for stories260K (5 layers x 8 query heads): every score 1, or
    `hot` = (layer, query heads) at 50."""
    table = {f"{l}-{h}": [50.0 if hot and l == hot[0] and h in hot[1] else 1.0, 1.0]
             for l in range(5) for h in range(8)}
    path = tmp_path / "scores.json"
    path.write_text(json.dumps(table) + "\n")
    return str(path)


def run_stories(model, tok, name, steps=4, **knobs):
    ids = torch.tensor(tok("Once upon a time there was a little dog named Max. " * 8)["input_ids"])
    engine = make_engine(model, build_method(name, budget_tokens=24, window_tokens=WINDOW,
                                             **knobs), tok, chunk=32)
    with engine.request() as req:
        logits = [req.prefill(ids[:80])[0, -1]]
        lengths = [kv.kept_lengths() for kv in req.cache.kv_layers]
        lengths = [None if n is None else n.clone() for n in lengths]
        tokens = [kv.stats()["kv_tokens"] for kv in req.cache.kv_layers]
        for t in ids[80:80 + steps]:
            logits.append(req.step(t.view(1))[0, -1])
    return torch.stack(logits), lengths, tokens


def test_uniform_scores_equal_snapkv_bit_for_bit(stories, tmp_path):
    model, tok = stories
    got, lengths, tokens = run_stories(model, tok, "headkv", head_scores_path=stories_file(tmp_path))
    want, _, snap_tokens = run_stories(model, tok, "snapkv")
    assert lengths == [None] * 5 and tokens == snap_tokens == [24] * 5
    assert torch.equal(got, want)


def test_a_much_higher_scoring_head_holds_more(stories, tmp_path):
    """Query heads 0 and 1 of layer 2 (KV head 0) at mean 25.5, the rest 1: that head's share
    51 / 89 of the pool (budget 24, window 8: 15 x 5 x 4 = 300 tokens), capacity 181, capped at
    the 80 tokens it holds (the excess to its layer's other heads); the layer's budget 57, the
    others' 16; the model still holds 5 x 4 x 24 tokens."""
    model, tok = stories
    _, lengths, tokens = run_stories(model, tok, "headkv",
                                     head_scores_path=stories_file(tmp_path, (2, (0, 1))))
    hot = lengths[2][0].tolist()
    assert hot[0] == 80 and hot[0] > max(hot[1:])
    held = sum(int(n.sum()) if n is not None else 4 * t for n, t in zip(lengths, tokens))
    assert held == 5 * 4 * 24
    assert tokens == [16, 16, 57, 16, 15] and sum(tokens) == 5 * 24  # largest remainder


def test_decode_equals_the_full_cache_masked_to_each_heads_kept_tokens(stories, tmp_path,
                                                                       monkeypatch):
    """An independent reference over ragged heads: the full cache, its decode step's attention
    masked per KV head to the positions HeadKV's head kept (plus the new token), gives HeadKV's
    logits (each head attends its own tokens, never another head's padding)."""
    model, tok = stories
    path = stories_file(tmp_path, (2, (0, 1)))
    method = build_method("headkv", budget_tokens=24, window_tokens=WINDOW, head_scores_path=path)
    assert masked_full_gap(model, tok, method, monkeypatch) <= 1e-4


def test_a_layer_share_above_the_sequence_goes_to_the_other_layers():
    """One layer holding nearly every score: its budget is capped at the budget basis (the whole
    sequence, 30 tokens; uncapped 8 + 1 + 33 = 42), the rest spread over the other layers (uncapped
    8 + 1 each); the total exact."""
    method = build_method("headkv", budget_tokens=20, window_tokens=WINDOW)
    method._shares = head_shares(torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]), 1.0, 2)
    budgets = [method.layer_budget(layer, 3, 30) for layer in range(3)]
    assert budgets == [30, 15, 15]


@pytest.mark.kept_set
def test_kept_set_by_hand():
    """One layer, two KV heads of shares 3/4 and 1/4 (as `prepare` leaves them), budget 6,
    window 2, beta 2: prefix budget 4, pooled 4 // 2 = 2, prefix capacities 2 + (3/4, 1/4) x 2
    x 1 x 2 = (5, 3). Head 0 keeps the window (8, 9) and its top 5 of positions 0..7 (scores
    rising: 3..7); head 1 the window and its top 3 (scores falling: 0..2): 12 = 2 x 6."""
    method = build_method("headkv", budget_tokens=6, window_tokens=2, beta=2.0)
    method._shares = head_shares(torch.tensor([[3.0, 1.0]]), 1.0, 2)
    scores = torch.stack([torch.arange(10.0), 9 - torch.arange(10.0)])[None]
    kept = kept_after_crafted_compression(method, scores)
    assert kept == [[3, 4, 5, 6, 7, 8, 9], [0, 1, 2, 8, 9]]


@pytest.mark.parametrize("value_of, expect", [
    (lambda l, h: [float("nan"), 0.5], "score 0 of head (0, 0) is nan"),
    (lambda l, h: [float("inf")], "score 0 of head (0, 0) is inf"),
    (lambda l, h: [1e308, 1e308], "a head's mean score overflows"),
    (lambda l, h: [-0.5], "every head's score is <= 0"),
])
def test_headkv_scores_checked_like_a_knob(value_of, expect, tmp_path):
    path = head_scores(tmp_path / "scores.json", value_of)
    reason = one_reason(build_method("headkv", budget_tokens=16, head_scores_path=str(path)))
    assert f"method.head_scores_path={path}" in reason and expect in reason
