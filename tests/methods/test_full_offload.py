"""Full offload: exact logits, the whole KV moved every decode step, prefetch one layer ahead."""

import torch

from methods import build_method
from tests.conftest import make_engine


def test_exact_and_moves_everything(tiny_model):
    ids = torch.randint(3, 250, (1, 50), generator=torch.Generator().manual_seed(0))
    outs = {}
    for name in ("full", "full_offload"):
        engine = make_engine(tiny_model, build_method(name), chunk=16)
        with engine.request() as req:
            logits = [req.prefill(ids[:, :30], all_logits=True)]
            logits += [req.step(ids[:, t]) for t in range(30, 50)]
        outs[name] = (torch.cat(logits, 1), engine)
    assert torch.equal(outs["full"][0], outs["full_offload"][0])
    ledger = outs["full_offload"][1].transfers
    row = 2 * 2 * 16 * 4 * 2  # K+V x 2 KV heads x head_dim 16 x fp32 x 2 layers
    assert ledger.step_h2d == [t * row for t in range(30, 50)]
    assert ledger.bytes_d2h == 50 * row  # every token written to the host once


def test_prefetch_runs_one_layer_ahead(tiny_model, monkeypatch):
    from methods.full_offload import FullOffloadLayer

    calls = []
    original = FullOffloadLayer.prefetch

    def spy(self, hidden_states, position_ids, ahead):
        calls.append((self.layer_idx, ahead))
        return original(self, hidden_states, position_ids, ahead)

    monkeypatch.setattr(FullOffloadLayer, "prefetch", spy)
    engine = make_engine(tiny_model, build_method("full_offload"))
    with engine.request() as req:
        req.prefill(torch.arange(3, 20))
        calls.clear()
        req.step(21)
    # layer 0 is fetched at its own input, layer 1 at layer 0's input (overlapping layer 0)
    assert calls[:2] == [(0, False), (1, True)]
