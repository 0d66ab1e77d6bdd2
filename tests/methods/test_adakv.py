"""AdaKV: SnapKV's votes, the layer's budget split across KV heads by a flattened top-k with the
official safeguard floor; heads stored ragged (no padding held). The shared contract
(tests/methods/contract/test_contract.py) runs it too: budget >= the sequence == full, batch ==
alone, every compression per head against its own scores, paged == contiguous
(contract/test_paged_layout.py)."""

import pytest
import torch

from methods import build_method
from methods.adakv import adaptive_budgets
from tests.conftest import make_engine
from tests.methods.headwise_reference import masked_full_gap
from tests.methods.contract.rules import kept_after_crafted_compression

WINDOW, BUDGET, ALPHA = 4, 14, 0.2  # prefix budget 10, floor int(0.2 x 10) = 2


def crafted_scores():
    """4 KV heads over 30 tokens (the last WINDOW protected, +inf): head 0 dispersed (every vote
    near 1), head 1 concentrated (one vote of 10, the rest near 0), heads 2 and 3 in between."""
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(1, 4, 30, generator=g) * 0.01
    scores[0, 0] += 1.0
    scores[0, 1, 3] = 10.0
    scores[0, 2, :8] += 0.5
    scores[0, 3, ::3] += 0.7
    scores[..., -WINDOW:] = float("inf")
    return scores


def official_counts(scores, budget, window, alpha):
    """AdaptiveSnapKVCluster's allocation written out (FFY0/AdaKV): one top-k of H x base over
    every head's prefix scores, each head's wins c, then round(c (1 - alpha) + int(base alpha)),
    plus the window."""
    h, t = scores.shape[1:]
    base = budget - window
    flat = sorted(((float(scores[0, i, j]), i) for i in range(h) for j in range(t - window)),
                  reverse=True)[:h * base]
    wins = [sum(1 for _, i in flat if i == head) for head in range(h)]
    return [round(c * (1 - alpha) + int(base * alpha)) + window for c in wins]


def test_counts_are_the_official_flattened_top_k_with_the_floor():
    scores = crafted_scores()
    counts = adaptive_budgets(scores, BUDGET, ALPHA)[0].tolist()
    official = official_counts(scores, BUDGET, WINDOW, ALPHA)
    assert sum(official) == 4 * BUDGET  # alpha x base is an integer: no rounding drift
    assert counts == official
    assert counts[0] > BUDGET > counts[1]  # the dispersed head takes the concentrated one's share
    assert sum(counts) == 4 * BUDGET  # the layer holds what the uniform split holds
    assert min(counts) >= WINDOW + int(ALPHA * (BUDGET - WINDOW))  # the safeguard floor
    assert counts[1] == WINDOW + 2 + round(0.8 * 1)  # floor + 80 % of its one win


@pytest.mark.parametrize("budget", [7, 9, 13, 17, 22])
def test_the_split_always_sums_to_the_rule_and_keeps_the_floor(budget):
    """Budgets where alpha x base is fractional: the adaptive part scaled to what the floor
    leaves, rounded by largest remainder, so the total is exact (the official per-head round of
    c (1 - alpha) drifts: at budget 7 it holds 26 of 28 tokens)."""
    scores = crafted_scores()
    counts = adaptive_budgets(scores, budget, ALPHA)[0]
    assert int(counts.sum()) == 4 * budget
    base = budget - WINDOW
    floor = int(ALPHA * base)
    assert int(counts.min()) >= WINDOW + floor
    wins = torch.tensor(official_counts(scores, budget, WINDOW, 0.0)) - WINDOW
    exact = WINDOW + floor + wins * (base - floor) / base
    assert float((counts - exact).abs().max()) < 1


def test_alpha_one_is_uniform_and_alpha_zero_the_pure_flattened_top_k():
    scores = crafted_scores()
    assert adaptive_budgets(scores, BUDGET, 1.0).tolist() == [[BUDGET] * 4]
    flat = scores[0, :, :-WINDOW].reshape(-1).topk(4 * (BUDGET - WINDOW)).indices // 26
    wins = torch.bincount(flat, minlength=4) + WINDOW
    assert adaptive_budgets(scores, BUDGET, 0.0)[0].tolist() == wins.tolist()


def test_floor_alpha_is_checked():
    with pytest.raises(Exception, match="floor_alpha"):
        build_method("adakv", floor_alpha=1.5)


def prefill_and_decode(model, tok, name, steps=6, **knobs):
    ids = torch.tensor(tok("Once upon a time there was a little dog named Max. " * 8)["input_ids"])
    engine = make_engine(model, build_method(name, budget_tokens=24, window_tokens=8, **knobs),
                         tok, chunk=32)
    with engine.request() as req:
        logits = [req.prefill(ids[:80])[0, -1]]
        layers = req.cache.kv_layers
        after_prompt = [(None if kv.kept_lengths() is None else kv.kept_lengths().clone(),
                         kv.kept_positions().clone(), kv.stats())
                        for kv in layers]
        for t in ids[80:80 + steps]:
            logits.append(req.step(t.view(1))[0, -1])
        after_decode = [kv.stats() for kv in layers]
    return torch.stack(logits), after_prompt, after_decode


def test_heads_hold_their_own_budgets_and_nothing_is_padded(stories):
    """Same budget as SnapKV: some layer's heads differ, the token figure and the bytes held
    equal SnapKV's (ragged rows hold only each head's own tokens), before and after decoding."""
    model, tok = stories
    _, ada, ada_decoded = prefill_and_decode(model, tok, "adakv")
    _, snap, snap_decoded = prefill_and_decode(model, tok, "snapkv")
    ragged = [lengths for lengths, _, _ in ada if lengths is not None]
    assert ragged, "no layer split its budget unevenly"
    for (lengths, positions, stats), (_, snap_positions, snap_stats) in zip(ada, snap):
        h_kv = positions.shape[1]
        if lengths is not None:
            assert int(lengths.sum()) == h_kv * 24 and int(lengths.min()) >= 8 + int(0.2 * 16)
            held = [set(r) - {-1} for r in positions[0].tolist()]
            assert held != [set(r) for r in snap_positions[0].tolist()]  # other tokens kept
            assert [len(r) for r in held] == lengths[0].tolist()
        assert stats["kv_tokens"] == snap_stats["kv_tokens"] == 24
        assert stats["kv_bytes"] == snap_stats["kv_bytes"]
    for stats, snap_stats in zip(ada_decoded, snap_decoded):
        assert stats["kv_tokens"] == snap_stats["kv_tokens"] == 30
        assert stats["kv_bytes"] == snap_stats["kv_bytes"]


def test_floor_one_equals_snapkv_bit_for_bit(stories):
    model, tok = stories
    ada, _, _ = prefill_and_decode(model, tok, "adakv", floor_alpha=1.0)
    snap, _, _ = prefill_and_decode(model, tok, "snapkv")
    assert torch.equal(ada, snap)


def test_ragged_kernel_equals_the_masked_model_attention(stories, monkeypatch):
    """Each head over its own tokens, two ways: the ragged kernels (plain calls) and the model's
    attention with a per-head mask over the padded rows (calls the kernels do not serve)."""
    model, tok = stories
    kernel, _, _ = prefill_and_decode(model, tok, "adakv")
    monkeypatch.setattr("methods.eviction.plain_attention", lambda kwargs: False)
    masked, _, _ = prefill_and_decode(model, tok, "adakv")
    assert (kernel - masked).abs().max().item() <= 1e-5
    snap, _, _ = prefill_and_decode(model, tok, "snapkv")
    assert (kernel - snap).abs().max().item() > 1e-4  # the split changed what was attended


def two_turns(model, tok):
    """A second prompt fed over ragged heads (chunks attend each head's own tokens), compressed
    again at its end (its padded slots no candidates)."""
    ids = tok("Once upon a time there was a little dog named Max. " * 8)["input_ids"]
    engine = make_engine(model, build_method("adakv", budget_tokens=24, window_tokens=8), tok,
                         chunk=16)
    with engine.request() as req:
        logits = [req.prefill(ids[:60])[0, -1]]
        for t in ids[60:64]:
            logits.append(req.step(t)[0, -1])
        logits.append(req.prefill(ids[64:100])[0, -1])
        layers = req.cache.kv_layers
        second = [(None if kv.kept_lengths() is None else kv.kept_lengths().clone(),
                   held_positions(kv)) for kv in layers]
        logits.append(req.step(ids[100])[0, -1])
    return torch.stack(logits), second


def held_positions(kv):
    return [sorted(set(r) - {-1}) for r in kv.kept_positions()[0].tolist()]


def test_a_second_prompt_over_ragged_heads(stories, monkeypatch):
    model, tok = stories
    kernel, second = two_turns(model, tok)
    assert any(lengths is not None for lengths, _ in second)
    for lengths, held in second:
        if lengths is not None:
            assert [len(h) for h in held] == lengths[0].tolist()
            assert int(lengths.sum()) <= lengths.shape[1] * 24  # each head clamped to its own
            assert all(100 - 8 <= min(h[-8:]) and h[-1] == 99 for h in held)  # window kept
    monkeypatch.setattr("methods.eviction.plain_attention", lambda kwargs: False)
    masked, _ = two_turns(model, tok)
    assert (kernel - masked).abs().max().item() <= 1e-5


def test_decode_equals_the_full_cache_masked_to_each_heads_kept_tokens(stories, monkeypatch):
    """An independent reference: the full cache, its decode step's attention masked per KV head
    to the positions AdaKV's head kept (plus the new token), gives AdaKV's logits."""
    model, tok = stories
    method = build_method("adakv", budget_tokens=24, window_tokens=8)
    assert masked_full_gap(model, tok, method, monkeypatch) <= 1e-4


@pytest.mark.kept_set
def test_kept_set_by_hand():
    """Two KV heads over 10 tokens, window 2, budget 5 per head, floor_alpha 0.5: prefix budget
    3, floor int(1.5) = 1. The flattened top-6 of the prefix scores are all head 0's (9..4), so
    head 0 wins 6 and head 1 none; the adaptive part (3 - 1 of 3 prefix tokens) gives head 0
    6 x 2/3 = 4: head 0 keeps window + floor + 4 = 7 tokens (its five best and the window),
    head 1 window + floor = 3 (its best, position 0, and the window): 10 = 2 x 5 in all."""
    scores = torch.tensor([[[9.0, 8, 7, 6, 5, 4, 3, 2, 0, 0],
                            [1.5, 1, 0.5, 0.4, 0.3, 0.2, 0.1, 0, 0, 0]]])
    method = build_method("adakv", budget_tokens=5, window_tokens=2, floor_alpha=0.5)
    kept = kept_after_crafted_compression(method, scores)
    assert kept == [[0, 1, 2, 3, 4, 8, 9], [0, 8, 9]]
