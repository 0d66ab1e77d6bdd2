"""TidalDecode: the reusing layers attend exactly their selection layer's top-k tokens."""

import pytest
import torch

from harness.core import hf_adapter
from harness.core import models
from methods import build_method
from tests.conftest import make_engine


@pytest.fixture(scope="module")
def three_layers():
    return models.tiny_llama(num_layers=3)


def exact_group_attention(model, ids, layer: int) -> torch.Tensor:
    """The last row's attention at `layer` by the full model (eager), the group mean per KV
    head: (H_kv, T)."""
    model.set_attn_implementation("eager")  # transformers' own, which returns its weights
    try:
        with torch.no_grad():
            att = model(ids, output_attentions=True).attentions[layer][0, :, -1]  # (H_q, T)
    finally:
        hf_adapter.set_attention(model, "sdpa")
    h_kv = model.config.num_key_value_heads
    return att.view(h_kv, -1, att.shape[-1]).mean(1)


@pytest.mark.kept_set
def test_layers_after_a_selection_layer_attend_its_top_k(three_layers):
    """Selection at layers 0 and 1: layer 2 attends, per KV head, the 6 tokens layer 1's
    query attends most (the full model's own attention, computed here apart), nothing else."""
    torch.manual_seed(1)
    ids = torch.randint(3, 250, (1, 40))
    engine = make_engine(three_layers, build_method("tidaldecode", budget_tokens=6,
                                                    selection_layers=[0, 1]))
    with engine.request() as req:
        req.prefill(ids[:, :30])
        for t in range(30, 40):
            req.step(ids[:, t])
            expected = exact_group_attention(three_layers, ids[:, :t + 1], 1).topk(6).indices
            layer = req.cache.kv_layers[2]
            assert layer.selection.source_layer == 1
            got = layer.kept_positions()[0]  # (H_kv, 6)
            assert [sorted(r) for r in got.tolist()] == [sorted(r) for r in expected.tolist()]
            assert req.cache.kv_layers[1].stats()["kv_tokens"] == t + 1  # it attends all
    assert engine.ledger.samples[-1]["selected_per_layer"][2] == 6


def test_the_layers_before_the_first_selection_layer_are_dense():
    from methods.model import ModelInfo

    info = ModelInfo(num_layers=16, num_heads=4, num_kv_heads=2, head_dim=8, max_positions=64)
    method = build_method("tidaldecode")
    assert method.own_dense_layers(info) == (0, 1)
    kinds = [type(method.make_layer(i, info)).__name__ for i in range(2, 16)]
    assert kinds[0] == kinds[11] == "TidalSelectionLayer"  # layers 2 and 13
    assert kinds.count("TidalReuseLayer") == 12
    assert method.make_layer(14, info).source_layer == 13
    assert method.make_layer(12, info).source_layer == 2


@pytest.mark.parametrize("layers, message", [
    ([], "at least one"), ([3, 1], "ascending"), ([1, 1], "distinct"), ([-1], ">= 0")])
def test_bad_selection_layers_are_refused(layers, message):
    from kvcore.errors import ConfigError

    with pytest.raises(ConfigError, match="method.selection_layers"):
        build_method("tidaldecode", selection_layers=layers)


def test_a_selection_layer_beyond_the_model_is_refused(three_layers):
    reasons = build_method("tidaldecode").validate(hf_adapter.model_info(three_layers.config),
                                                   {"batch_size": 1})
    assert reasons == ["method.selection_layers=[2, 13] names a layer >= the model's 3 layers"]
