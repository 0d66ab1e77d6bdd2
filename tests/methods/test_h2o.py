"""H2O invariants: exactly its budget, exact accumulated scores, kept = top scores + recent."""

import pytest
import torch

from harness.core import hf_adapter
from kvcore.errors import ConfigError
from methods import build_method
from methods.h2o import H2OLayer
from methods.protocol import Protocol
from methods.scoring import group_mean
from tests.conftest import make_engine


def test_scores_are_the_accumulated_causal_attention(tiny_model):
    """With nothing evicted, a token's score = the column sum of the causal attention matrix,
    averaged over the query heads of its KV head (our documented GQA choice)."""
    torch.manual_seed(0)
    ids = torch.randint(3, 250, (1, 40))
    engine = make_engine(tiny_model, build_method("h2o", budget_tokens=64), chunk=16)
    with engine.request() as req:
        req.prefill(ids[:, :30])
        for t in range(30, 40):
            req.step(ids[:, t])
        scores = [kv.state("scores").clone() for kv in req.cache.kv_layers]
    hf_adapter.set_attention(tiny_model, "eager")
    try:
        with torch.no_grad():
            out = tiny_model(input_ids=ids, output_attentions=True)
    finally:
        hf_adapter.set_attention(tiny_model, "sdpa")
    for layer, probs in enumerate(out.attentions):  # (B, H_q, T, T)
        expected = group_mean(probs.float(), 2).sum(dim=2)
        assert torch.allclose(scores[layer], expected, atol=1e-5)


@pytest.mark.kept_set
@pytest.mark.parametrize("basis, kept_at_end", [("final", 10), ("seen", 15)])
def test_keeps_exactly_its_budget_and_the_right_tokens(basis, kept_at_end, tiny_model,
                                                       monkeypatch):
    """budget_ratio 0.25 of the final length (the 40-token prompt: 10) or of the tokens seen
    (0.25 x 60 = 15 at the end); every compression keeps the recent half and the top scores."""
    checked = []
    original = H2OLayer.compress_to

    def checking_compress_to(self, budget):
        scores, positions = self.state("scores").clone(), self.positions.clone()
        kept, seen = self.kept_tokens(), self.seen_tokens
        assert budget == self.allowed_tokens()  # the rule's budget, never what was kept
        original(self, budget)
        assert self.kept_tokens() == min(kept, budget)
        if kept > budget:
            recent = int(round(0.5 * budget))
            for h in range(scores.shape[1]):
                now = set(self.positions[0, h].tolist())
                # the most recent tokens are all kept (the cache need not be in text order)
                assert set(range(seen - recent, seen)) <= now
                # every kept older token scores at least as high as every evicted older token
                older = {p: sc for p, sc in zip(positions[0, h].tolist(), scores[0, h].tolist())
                         if p < seen - recent}
                kept_old = [p for p in older if p in now]
                evicted = [p for p in older if p not in now]
                assert len(kept_old) == budget - recent
                if evicted:
                    assert min(older[p] for p in kept_old) >= max(older[p] for p in evicted)
            checked.append(kept)

    monkeypatch.setattr(H2OLayer, "compress_to", checking_compress_to)
    torch.manual_seed(1)
    ids = torch.randint(3, 250, (1, 60))
    engine = make_engine(tiny_model, build_method("h2o", budget_ratio=0.25), chunk=20,
                         protocol=Protocol(budget_basis=basis))
    with engine.request() as req:
        req.prefill(ids[:, :40])
        for t in range(40, 60):
            req.step(ids[:, t])
    # 2 layers: once at the prompt's end, then at every decode step ("seen": as the budget allows)
    assert len(checked) == 2 * 21 if basis == "final" else len(checked) > 20
    assert engine.ledger.samples[-1]["tokens_per_layer"] == [kept_at_end] * 2


def test_heads_keep_different_tokens(stories):
    model, tok = stories
    ids = torch.tensor(tok("Once upon a time there was a little dog. " * 12)["input_ids"][:120])
    engine = make_engine(model, build_method("h2o", budget_tokens=24), tok)
    with engine.request() as req:
        req.prefill(ids)
        pos = req.cache.kv_layers[2].positions[0]
    assert pos.shape == (4, 24)
    assert len({tuple(p.tolist()) for p in pos}) > 1  # per-KV-head selection


@pytest.mark.parametrize("kw, key", [
    ({"budget_ratio": 0.0}, "method.budget_ratio=0.0 must be in (0, 1]"),
    ({"budget_ratio": 1.2}, "method.budget_ratio=1.2"),
    ({"budget_tokens": -4}, "method.budget_tokens=-4 must be a positive integer"),
    ({"recent_ratio": 2}, "method.recent_ratio=2"),
    ({"budget_ratio": None}, "method.budget_ratio or method.budget_tokens"),
])
def test_bad_hyperparameters(kw, key):
    with pytest.raises(ConfigError) as err:
        build_method("h2o", **kw)
    assert key in str(err.value)


def test_offloaded_h2o_equals_resident_and_moves_the_kept_set(tiny_model):
    """runner.kv_offload=cpu: same logits, kept set fetched every decode step (FlexGen+H2O)."""
    from harness.core import hf_adapter
    from harness.core.engine import Engine, EngineSettings

    ids = torch.randint(3, 250, (1, 50), generator=torch.Generator().manual_seed(3))
    info = hf_adapter.model_info(tiny_model.config)
    outs = {}
    for offload in ("none", "cpu"):
        engine = Engine(tiny_model, None, build_method("h2o", budget_tokens=12), info,
                        EngineSettings(prefill_chunk_tokens=16, kv_offload=offload))
        with engine.request() as req:
            logits = [req.prefill(ids[:, :30], all_logits=True)]
            logits += [req.step(ids[:, t]) for t in range(30, 50)]
        outs[offload] = (torch.cat(logits, 1), engine)
    assert (outs["none"][0] - outs["cpu"][0]).abs().max().item() < 1e-5
    ledger = outs["cpu"][1].transfers
    row = 2 * 2 * 16 * 4 * 2  # K+V, 2 KV heads, head_dim 16, fp32, 2 layers
    assert ledger.step_h2d == [12 * row] * 20  # the 12-token kept set, every step
    assert outs["none"][1].transfers.bytes_h2d == 0


def test_decode_runs_the_fused_kernel_and_equals_the_eager_path(tiny_model, monkeypatch):
    """On CPU every plain decode step of every layer runs the C kernel (attention, scores added
    in place, the victim picked from them); the eager path keeps the same tokens, same logits."""
    from harness.core import hf_adapter
    from methods import h2o
    from methods.kernels import colsum_attention_cpu as ca
    from methods.kernels import cpu_build

    if not cpu_build.compiler_available():
        pytest.skip("no C compiler here: H2O runs its eager path (tested by every other test)")
    ids = torch.randint(3, 250, (1, 70), generator=torch.Generator().manual_seed(5))
    method = build_method("h2o", budget_tokens=24)
    assert hf_adapter.prepare(method, tiny_model, None) == {"decode_attention": "c"}
    calls, guarded = [], []
    real_kernel, real_guard = ca.decode_attention, H2OLayer.guarded_scores
    monkeypatch.setattr(ca, "decode_attention", lambda *a: calls.append(a[-1]) or real_kernel(*a))
    monkeypatch.setattr(H2OLayer, "guarded_scores",
                        lambda self, budget: guarded.append(1) or real_guard(self, budget))

    def run():
        engine = make_engine(tiny_model, method, chunk=16)
        with engine.request() as req:
            logits = [req.prefill(ids[:, :40], all_logits=True)]
            guarded.clear()  # the prompt's chunks evict several tokens at once (top-k)
            logits += [req.step(ids[:, t]) for t in range(40, 70)]
            kept = [kv.positions.clone() for kv in req.cache.kv_layers]
        return torch.cat(logits, 1), kept

    fused, fused_kept = run()
    layers = tiny_model.config.num_hidden_layers
    assert len(calls) == 30 * layers and all(evict is not None for evict in calls)
    assert len(guarded) == 0  # the steady-state victim came from the kernel: nothing recomputed
    monkeypatch.setattr(h2o.colsum_attention_cpu, "applies", lambda *a: False)
    eager, eager_kept = run()
    assert len(calls) == 30 * layers and len(guarded) == 30 * layers
    torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(fused_kept, eager_kept))
