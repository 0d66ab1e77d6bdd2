"""FastGen: per-head policies chosen by the recovery threshold on hand-built attention maps, applied
at every decode step; T = 1 is the full cache; no budget knob. The shared contract
(tests/methods/contract/test_contract.py: batch == alone, budget-free like kvmerger) and paged ==
contiguous (contract/test_paged_layout.py) run it too."""

import pytest
import torch

from harness.core import hf_adapter
from kvcore.errors import UnsupportedCombination
from methods import build_method
from methods.fastgen import POLICIES
from tests.conftest import make_engine
from tests.methods.headwise_reference import masked_full_gap

N, W = 20, 4  # prompt tokens, profiling rows
PUNCTS = [4, 9, 14]  # positions of punctuation in the unit tests' prompts


BOS, DOT, WORD = 1, 2, 10  # the unit tests' ids: a special one, a punctuation one, a plain one


def unit_method(**knobs):
    """FastGen with the unit tests' token kinds (as `prepare` builds them from a tokenizer)."""
    from methods.fastgen import PUNCT, SPECIAL

    method = build_method("fastgen", **knobs)
    method.token_kinds = torch.zeros(64, dtype=torch.uint8)
    method.token_kinds[BOS], method.token_kinds[DOT] = SPECIAL, PUNCT
    return method


def profiled_layer(mass, recovery=0.95, local=0.3, frequent=0.3, scores=None, ids=None):
    """A layer holding N tokens `ids` (default: BOS then plain words) of one sequence whose 4 KV
    heads' window attention is `mass` (4, N) (each row sums to 1): the profile of
    on_prefill_end, with window_votes replaced by it."""
    info = hf_adapter.model_info(_config())
    method = unit_method(recovery_ratio=recovery, local_ratio=local, frequent_ratio=frequent,
                         window_tokens=W)
    layer = method.make_layer(0, info)
    k = torch.randn(1, 4, N, 8)
    layer.observe_token_ids(torch.tensor([[BOS] + [WORD] * (N - 1)]) if ids is None else ids)
    layer.update(k, k.clone(), None)
    layer.state("scores").copy_(mass[None] if scores is None else scores[None])
    layer.window_queries = torch.zeros(1, 4, W, 8)
    import methods.fastgen as fg
    original = fg.window_votes
    fg.window_votes = lambda *a: mass[None].clone() * W
    try:
        layer.on_prefill_end()
    finally:
        fg.window_votes = original
    return layer


def _config():
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                       num_hidden_layers=1, vocab_size=64, intermediate_size=64)


def crafted_mass():
    """Head 0 attends only to position 0 (special); head 1 to the last 6 tokens (local: r_l 0.3
    x 20 = 6); head 2 to position 0 and 5 scattered heavy hitters (frequent); head 3 uniformly."""
    mass = torch.zeros(4, N)
    mass[0, 0] = 1.0
    mass[1, 0], mass[1, -6:] = 0.02, 0.98 / 6
    mass[2, 0], mass[2, [2, 5, 8, 11, 13]] = 0.1, 0.9 / 5
    mass[3] = 1.0 / N
    return mass


@pytest.mark.kept_set
def test_each_head_takes_its_cheapest_policy():
    scores = crafted_mass()  # accumulated attention: as the window's, but head 1's heavy
    scores[1] = 0.0  # hitters are early tokens, neither the first nor its window
    scores[1, 1:7] = 1.0
    layer = profiled_layer(crafted_mass(), scores=scores)
    assert [POLICIES[p] for p in layer.policy[0].tolist()] == [
        "special", "special+punct+frequent+local", "special+punct+frequent", "full"]
    held = [sorted(p for p in row if p >= 0) for row in layer.kept_positions()[0].tolist()]
    assert held[0] == [0]
    assert {0, *range(14, 20)} <= set(held[1])  # special + the window
    assert {0, 2, 5, 8, 11, 13} <= set(held[2]) and len(held[2]) <= 1 + 6  # special + r_f x N
    assert held[3] == list(range(N))
    assert layer.kept_lengths()[0].tolist() == [len(h) for h in held]


def test_a_head_on_punctuation_takes_special_punct():
    """Hand-computed, T = 0.95: head 0 puts 0.06 on BOS, 0.3 on each of the 3 punctuation tokens
    and 0.04 over the 16 others: special recovers 0.06, special+punct 0.96 >= 0.95 (dropped 0.04
    <= 0.05): its cheapest. Head 1 attends to BOS only (special), heads 2-3 uniformly (full).
    Then decode steps: a punctuation token joins head 0's set, a plain one does not."""
    ids = torch.full((1, N), WORD)
    ids[0, 0], ids[0, PUNCTS] = BOS, DOT
    mass = torch.full((4, N), 1.0 / N)
    mass[0] = 0.04 / 16
    mass[0, 0], mass[0, PUNCTS] = 0.06, 0.3
    mass[1] = 0.0
    mass[1, 0] = 1.0
    layer = profiled_layer(mass, ids=ids)
    assert [POLICIES[p] for p in layer.policy[0].tolist()] == [
        "special+punct", "special", "full", "full"]
    held = [sorted(p for p in row if p >= 0) for row in layer.kept_positions()[0].tolist()]
    assert held[:2] == [[0, *PUNCTS], [0]]
    for token in (DOT, WORD):  # positions N, N + 1
        layer.observe_token_ids(torch.tensor([[token]]))
        k = torch.randn(1, 4, 1, 8)
        layer.update(k, k.clone(), None)
        layer.after_forward()
    held = [sorted(p for p in row if p >= 0) for row in layer.kept_positions()[0].tolist()]
    assert held[:2] == [[0, *PUNCTS, N], [0]] and held[2] == list(range(N + 2))
    assert layer.facts() == {"heads_special": 1, "heads_special_punct": 1,
                             "heads_special_punct_frequent": 0,
                             "heads_special_punct_frequent_local": 0, "heads_full": 2,
                             "special_fallback_heads": 0}


def test_no_special_id_in_the_prompt_makes_the_first_token_special():
    """A prompt without special ids (SmolLM2 adds no BOS): its first token is the special set.
    Every head on a plain token (0.99) and a punctuation one: special+punct+frequent, which
    keeps position 0 too."""
    mass = torch.zeros(4, N)
    mass[:, 3], mass[:, 4] = 0.99, 0.01
    ids = torch.full((1, N), WORD)
    ids[0, 4] = DOT
    layer = profiled_layer(mass, ids=ids)  # no BOS: position 0 is the special token
    assert all(POLICIES[p] == "special+punct+frequent" for p in layer.policy[0].tolist())
    assert layer.facts()["special_fallback_heads"] == 4
    assert all(0 in row and 4 in row for row in layer.kept_positions()[0].tolist())
    with_bos = profiled_layer(mass, ids=torch.tensor([[BOS] + [WORD] * (N - 1)]))
    assert with_bos.facts()["special_fallback_heads"] == 0


def test_token_kinds_from_the_tokenizer(stories):
    """prepare(ctx): special = the tokenizer's special ids; punctuation = the ids whose decoded
    text is punctuation only (the rule in methods/fastgen.py)."""
    from methods.fastgen import PUNCT, SPECIAL, is_punctuation

    assert [is_punctuation(t) for t in (" .", "?!", ",", "$", "\n", "a.", "", " ", "\ufffd")] == [
        True, True, True, True, False, False, False, False, False]
    model, tok = stories
    method = build_method("fastgen")
    facts = hf_adapter.prepare(method, model, tok)
    kinds = method.token_kinds
    assert kinds.shape == (len(tok),) and facts["special_ids"] == len(set(tok.all_special_ids))
    assert all(kinds[i] == SPECIAL for i in tok.all_special_ids)
    punct = [i for i in range(len(tok)) if kinds[i] & PUNCT]
    assert len(punct) == facts["punctuation_ids"] > 0
    assert {tok.convert_tokens_to_ids(t) for t in (".", ",", "!", "?")} <= set(punct)
    assert all(is_punctuation(tok.decode([i])) for i in punct)
    words = tok("Once upon a time there was a dog", add_special_tokens=False)["input_ids"]
    assert not any(kinds[i] for i in words)


def test_the_run_reports_heads_per_policy(stories):
    """metrics.json kv.method_facts: per request, the (layer, KV head) pairs of each policy (all
    of them, the protocol's dense layers aside), next to kv.held_ratio."""
    from methods.protocol import Protocol

    model, tok = stories
    ids = tok("Once upon a time, there was a little dog named Max. " * 8)["input_ids"][:80]
    method = build_method("fastgen", recovery_ratio=0.5, window_tokens=8)
    engine = make_engine(model, method, tok, chunk=32, protocol=Protocol(dense_layers=(0,)))
    for _ in range(2):
        list(engine.generate_many([ids], 4))
    facts = engine.ledger.summary()["method_facts"]
    info = hf_adapter.model_info(model.config)
    pairs = (info.num_layers - 1) * info.num_kv_heads
    assert sum(v for k, v in facts.items() if k.startswith("heads_")) == pairs
    assert facts["special_fallback_heads"] == 0  # stories' tokenizer adds BOS
    with engine.request() as req:
        req.prefill(ids)
        chosen = [POLICIES[p] for kv in req.cache.kv_layers[1:] for p in kv.policy.flatten()]
    assert all(facts[f"heads_{name.replace('+', '_')}"] == chosen.count(name) for name in POLICIES)


def recovered(mass, sets):
    return (mass * sets).sum(-1)  # (P, H): mass each policy keeps


def test_the_chosen_policy_recovers_t_and_the_cheaper_one_does_not():
    g = torch.Generator().manual_seed(1)
    mass = torch.softmax(torch.randn(4, N, generator=g) * 2.5, dim=-1)
    mass[:, 0] += torch.tensor([4.0, 1.0, 0.3, 0.0])  # first tokens of different strengths
    mass[:, PUNCTS] += torch.tensor([0.0, 1.5, 0.3, 0.0])[:, None]  # and punctuation
    mass /= mass.sum(-1, keepdim=True)
    ids = torch.full((1, N), WORD)
    ids[0, 0], ids[0, PUNCTS] = BOS, DOT
    full = profiled_layer(mass.clone(), recovery=1.0, ids=ids)  # every head full: all N tokens
    kept = recovered(mass, full.policy_sets()[:, 0].float())  # (P, H) what each policy would keep
    chosen = set()
    for recovery in (0.5, 0.8, 0.9, 0.95, 0.99):
        layer = profiled_layer(mass.clone(), recovery=recovery, ids=ids)
        for head, p in enumerate(layer.policy[0].tolist()):
            assert kept[p, head] >= recovery - 1e-9, (recovery, head, p, kept[:, head])
            if p > 0:
                assert kept[p - 1, head] < recovery, (recovery, head, p, kept[:, head])
            chosen.add(p)
    assert chosen == set(range(len(POLICIES)))  # every policy was somebody's cheapest


@pytest.mark.parametrize("recovery", [0.3, 0.9])  # stories260K: frequent/local, local/full heads
def test_the_policy_applies_at_every_decode_step(stories, recovery):
    """After the prompt each head keeps its policy's set, decode steps included: special heads
    the BOS, punctuation heads also every punctuation token (those generated too), local heads
    the sliding window, frequency heads grow by r_f per token."""
    from methods.fastgen import PUNCT, SPECIAL

    model, tok = stories
    ids = torch.tensor(tok("Once upon a time, there was a little dog named Max. " * 8)["input_ids"])
    method = build_method("fastgen", recovery_ratio=recovery, window_tokens=8)
    engine = make_engine(model, method, tok, chunk=32)
    kinds = method.token_kinds[ids[:90]]
    special = {i for i, k in enumerate(kinds.tolist()) if k & SPECIAL}
    cheap = special | {i for i, k in enumerate(kinds.tolist()) if k & PUNCT}
    assert special == {0} and len(cheap) > 10  # BOS; the commas and full stops
    with engine.request() as req:
        req.prefill(ids[:80])
        for t in ids[80:90]:
            req.step(t.view(1))
        layers = req.cache.kv_layers
        policies = torch.cat([kv.policy.flatten() for kv in layers]).tolist()
        assert len(set(policies)) > 1, policies  # heads differ (special heads: the unit test)
        for kv in layers:
            seen, held = kv.seen_tokens, kv.kept_positions()[0].tolist()
            scores = kv.score()[0]
            for head, (p, row) in enumerate(zip(kv.policy[0].tolist(), held)):
                row = sorted(x for x in row if x >= 0)
                if POLICIES[p] == "special":
                    assert row == sorted(special)
                if POLICIES[p] == "special+punct":
                    assert row == sorted(cheap)
                if "local" in POLICIES[p]:
                    assert set(range(seen - kv.local_tokens, seen)) <= set(row)
                    assert kv.local_tokens == int(0.3 * 80)
                if POLICIES[p] == "full":
                    assert row == list(range(seen))
                    # frequencies kept up to date: every prompt and decode row gave it mass 1
                    assert abs(float(scores[head].sum()) - seen) < 1e-3
                if "frequent" in POLICIES[p]:  # the heavy hitters grow with the length
                    assert len(row) >= int(0.3 * seen)
                if "punct" in POLICIES[p]:
                    assert cheap <= set(row)
                if POLICIES[p] != "full":
                    assert len(row) <= len(cheap) + int(0.3 * seen) + (kv.local_tokens if "local" in
                                                                       POLICIES[p] else 0)
        stats = [kv.stats()["kv_tokens"] for kv in layers]
    assert min(stats) < 90  # compressed


def test_recovery_one_is_the_full_cache(stories):
    model, tok = stories
    ids = torch.tensor(tok("Once upon a time there was a little dog named Max. " * 8)["input_ids"])

    def logits(method):
        with make_engine(model, method, tok, chunk=32).request() as req:
            out = [req.prefill(ids[:70])[0, -1]]
            out += [req.step(t.view(1))[0, -1] for t in ids[70:76]]
            return torch.stack(out), req.cache.kv_layers

    got, layers = logits(build_method("fastgen", recovery_ratio=1.0))
    want, _ = logits(build_method("full"))
    assert all(POLICIES[p] == "full" for kv in layers for p in kv.policy.flatten().tolist())
    assert (got - want).abs().max().item() <= 2e-5
    lossy, _ = logits(build_method("fastgen", recovery_ratio=0.5))
    assert (lossy - want).abs().max().item() > 1e-3  # a lower threshold does evict


def test_paged_ragged_heads_equal_contiguous(stories):
    """Ragged heads (the shared paged test's tiny model gives its 2 KV heads equal counts):
    per-head block tables give the contiguous layout's logits, every step."""
    from tests.methods.contract.paged import assert_paged, decode, paged_engine

    model, tok = stories
    prompt = tok("Once upon a time there was a little dog named Max. " * 8)["input_ids"][:80]
    method = build_method("fastgen", recovery_ratio=0.5, window_tokens=8)
    reference, _ = decode(paged_engine(model, method, layout="contiguous"), prompt, 8)
    got, layers = decode(paged_engine(model, method), prompt, 8)
    assert torch.equal(got, reference), (got - reference).abs().max().item()
    assert_paged(layers, "fastgen")
    assert any(kv.ragged for kv in layers)


def test_no_budget_knob_and_checked_ratios():
    for knob in ({"budget_ratio": 0.2}, {"budget_tokens": 64}):
        with pytest.raises(UnsupportedCombination, match="does not take method.budget"):
            build_method("fastgen", **knob)
    assert build_method("fastgen", budget_ratio=None).recovery_ratio == 0.95
    for key, value in (("recovery_ratio", 1.5), ("local_ratio", -0.1), ("window_tokens", 0)):
        with pytest.raises(Exception, match=key):
            build_method("fastgen", **{key: value})


def test_decode_equals_the_full_cache_masked_to_each_heads_kept_tokens(stories, monkeypatch):
    """An independent reference for the ragged heads' attention: the full cache, its decode
    step masked per KV head to the positions FastGen's head kept (plus the new token)."""
    model, tok = stories
    method = build_method("fastgen", recovery_ratio=0.5, window_tokens=8)
    assert masked_full_gap(model, tok, method, monkeypatch) <= 1e-4
