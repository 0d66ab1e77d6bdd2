"""Top-k oracle: attends to exactly k tokens per step, the true top-k, and is an upper bound."""

import pytest
import torch

from methods import build_method
from tests.conftest import make_engine


@pytest.mark.kept_set
def test_selects_the_exact_top_k_and_nothing_else(tiny_model):
    torch.manual_seed(0)
    ids = torch.randint(3, 250, (1, 50))
    engine = make_engine(tiny_model, build_method("oracle_topk", budget_tokens=7))
    with engine.request() as req:
        req.prefill(ids[:, :30])
        for t in range(30, 50):
            req.step(ids[:, t])
            layer = req.cache.kv_layers[1]
            assert layer.stats()["selected_tokens"] == 7
            assert layer.kept_positions().shape == (1, 2, 7)
    assert engine.ledger.samples[-1]["selected_per_layer"] == [7, 7]
    assert engine.ledger.samples[-1]["tokens_per_layer"] == [50, 50]  # nothing evicted
    # the attended fraction counts what was attended: 7 of T at each of the 20 decode steps
    expected = 7 * 20 / sum(range(31, 51))
    summary = engine.attended.summary()
    assert abs(summary["attended_fraction_all_layers"] - expected) < 1e-6
    assert summary["attended_fraction_per_layer"] == [round(expected, 6)] * 2


def test_attention_matches_manual_topk(tiny_model, monkeypatch):
    """Recompute one decode step by hand: scores, group mean, top-k per KV head, softmax over
    the kept set only, weighted sum of values."""
    from methods.oracle_topk import OracleTopKLayer

    k, captured = 5, {}
    original = OracleTopKLayer.attend

    def spy(self, module, query, keys, values, mask, base, **kw):
        out = original(self, module, query, keys, values, mask, base, **kw)
        if self.layer_idx == 1 and query.shape[2] == 1:
            captured.update(q=query, k=keys, v=values, scaling=kw["scaling"], out=out[0])
        return out

    monkeypatch.setattr(OracleTopKLayer, "attend", spy)
    torch.manual_seed(2)
    ids = torch.randint(3, 250, (1, 20))
    engine = make_engine(tiny_model, build_method("oracle_topk", budget_tokens=k))
    with engine.request() as req:
        req.prefill(ids[:, :19])
        req.step(ids[:, 19])
    q, keys, values = captured["q"][0, :, 0], captured["k"][0], captured["v"][0]  # (H_q,D),(H_kv,T,D)
    groups = q.shape[0] // keys.shape[0]
    expected = []
    for h in range(q.shape[0]):
        kv = h // groups
        probs_group = torch.stack([torch.softmax(keys[kv] @ q[g] * captured["scaling"], -1)
                                   for g in range(kv * groups, (kv + 1) * groups)]).mean(0)
        top = probs_group.topk(k).indices
        w = torch.softmax(keys[kv][top] @ q[h] * captured["scaling"], -1)
        expected.append(w @ values[kv][top])
    expected = torch.stack(expected)  # (H_q, D)
    assert torch.allclose(captured["out"][0, 0], expected, atol=1e-5)


def test_oracle_beats_h2o_on_streaming_nll(stories):
    """At the same budget the oracle's selection keeps more attention mass than H2O's, which
    shows as lower streaming NLL (measured on 300 PG-19 tokens, budget 10 %: see assert)."""
    from tasks.perplexity import token_nll
    from tests.conftest import DATA, need_shared

    need_shared(DATA)
    model, tok = stories
    ids = torch.tensor(tok((DATA / "pg19" / "pg19_firstbook.txt").read_text())["input_ids"][:300])

    def nll(method):
        engine = make_engine(model, method, tok)
        out = []
        with engine.request(final_tokens=ids.numel() - 1) as req:  # the stream's length
            for t in range(ids.numel() - 1):
                logits = req.step(ids[t:t + 1])[0, -1]
                out.append(float(token_nll(logits[None], ids[t + 1:t + 2])[0]))
        return sum(out) / len(out)

    full = nll(build_method("full"))
    oracle = nll(build_method("oracle_topk", budget_ratio=0.1))
    h2o = nll(build_method("h2o", budget_ratio=0.1))
    assert full <= oracle + 0.02 and oracle < h2o, (full, oracle, h2o)


def _prompt_logits(model, method, ids, prefill, chunk):
    from harness.core import hf_adapter
    from harness.core.engine import Engine, EngineSettings
    from methods.protocol import Protocol

    info = hf_adapter.model_info(model.config)
    engine = Engine(model, None, method, info, EngineSettings(
        prefill_chunk_tokens=chunk, protocol=Protocol(prefill=prefill)))
    with engine.request() as req:
        return req.prefill(ids, all_logits=True)


def test_prefill_follows_the_protocol(tiny_model):
    """dense: prompt rows attend every causal key (= the full cache); sparse: each row attends its
    own top-k, and chunks (per-row masks) equal feeding the prompt one token at a time."""
    torch.manual_seed(3)
    ids = torch.randint(3, 250, (1, 40))
    oracle = build_method("oracle_topk", budget_tokens=6)
    full = _prompt_logits(tiny_model, build_method("full"), ids, "dense", 16)
    assert torch.allclose(_prompt_logits(tiny_model, oracle, ids, "dense", 16), full, atol=1e-5)
    sparse = _prompt_logits(tiny_model, oracle, ids, "sparse", 16)
    one_by_one = _prompt_logits(tiny_model, oracle, ids, "sparse", 1)
    assert torch.allclose(sparse, one_by_one, atol=1e-5)
    assert not torch.allclose(sparse[:, 8:], full[:, 8:], atol=1e-3)  # it really selects
