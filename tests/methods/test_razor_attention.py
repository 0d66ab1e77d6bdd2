"""RazorAttention: the |D|-weighted compensation token, the probe and its cache, the budget.
(The per-head attention by hand, with and without compensation, is in test_duo_attention.py.)"""

from types import SimpleNamespace

import pytest
import torch

from harness import hf_adapter
from kvcore.errors import ConfigError
from methods import build_method
from methods._headwise import HeadwiseLayer, _ProbeLayer, probe_tokens
from methods.base import ModelInfo
from tests.conftest import make_engine

INFO = ModelInfo(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, max_positions=512)


def _dense(q, k, v):
    probs = torch.softmax((q @ k.transpose(-1, -2)) * 8 ** -0.5, -1)
    return (probs @ v).transpose(1, 2)


@pytest.mark.parametrize("weighted", [True, False])
def test_compensation_token_is_exact_when_dropped_keys_are_identical(weighted):
    """methods-2.md §8: identical dropped keys (any values) -> the |D|-weighted compensation token
    reproduces exact attention; without the weighting (a plain extra token) it does not."""
    torch.manual_seed(0)
    method = SimpleNamespace(sink_tokens=2, compensate=True, stream_slots=lambda seen: 6)
    layer = HeadwiseLayer(0, INFO, method, torch.tensor([False]))
    k = torch.randn(1, 1, 20, 8, dtype=torch.float64)
    k[:, :, 2:16] = torch.randn(8, dtype=torch.float64)  # the tokens that will be dropped
    v = torch.randn(1, 1, 20, 8, dtype=torch.float64)
    layer.update(k[:, :, :19], v[:, :, :19], None)
    layer.after_forward()  # keeps 0, 1 | compensation of 2..15 | 16, 17, 18
    assert layer.comp_count == 14 and layer.s_positions.tolist() == [0, 1, 16, 17, 18]
    if not weighted:
        layer.comp_count = 1  # a plain extra token: weight 1 instead of |D|
    q = torch.randn(1, 2, 1, 8, dtype=torch.float64)
    keys, values = layer.update(k[:, :, 19:], v[:, :, 19:], None)
    module = SimpleNamespace(scaling=8 ** -0.5, num_key_value_groups=2)
    out, _ = layer.attend(module, q, keys, values, None, base=hf_adapter.eager_attention)
    err = (out - _dense(q, k.expand(1, 2, 20, 8), v.expand(1, 2, 20, 8))).abs().max()
    assert (err < 1e-6) if weighted else (err > 1e-3)


def test_probe_scores_echo_and_induction_by_hand():
    """A head that attends from i to i - P + 1 (induction) and one to i - P (echo)."""
    p = 4
    layer = _ProbeLayer(0, ModelInfo(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2 * p,
                                     max_positions=64), p)
    n = 2 * p
    # one-hot keys per position; queries point at the wanted key with a huge logit
    keys = torch.eye(n)[None, None]  # (1, 1, n, n)
    q = torch.zeros(1, 2, n, n)
    for i in range(p, n):
        q[0, 0, i, i - p + 1] = 1e4
        q[0, 1, i, i - p] = 1e4
    module = SimpleNamespace(scaling=1.0)
    layer.attend(module, q, keys, keys, None, base=None)
    assert layer.induction.tolist() == pytest.approx([1.0, 0.0], abs=1e-6)
    assert layer.echo.tolist() == pytest.approx([0.0, 1.0], abs=1e-6)


def test_probe_sequence_repeats():
    ids = probe_tokens(16, 300, seed=0)
    assert ids.numel() == 32 and (ids[:16] == ids[16:]).all() and ids.min() >= 3


def test_prepare_records_identification_and_caches(stories, tmp_path):
    model = stories[0]
    method = build_method("razor_attention", cache_dir=str(tmp_path))
    first = hf_adapter.prepare(method, model, None)
    again = hf_adapter.prepare(build_method("razor_attention", cache_dir=str(tmp_path)), model,
                               None)
    assert first["head_identification"] == "razor_probe"
    assert first["probe_scores"] == "computed" and again["probe_scores"] == "loaded"
    assert first["probe_period_tokens"] == 256  # stories260K: 512 positions = 2 x 256
    info = hf_adapter.model_info(model.config)
    assert first["retrieval_heads"] == round(0.15 * info.num_layers * info.num_kv_heads)


def test_razor_within_budget_on_a_model(tiny_model):
    method = build_method("razor_attention", retrieval_head_ratio=0.25, echo_head_ratio=0.0,
                          budget_ratio=0.5, probe_period_tokens=16)
    engine = make_engine(tiny_model, method, chunk=16)  # budget checked after every forward
    torch.manual_seed(2)
    ids = torch.randint(3, 250, (90,))
    with torch.no_grad(), engine.request() as req:
        req.prefill(ids[:30])
        for t in range(30, 90):
            req.step(ids[t:t + 1])
        layers = req.cache.kv_layers
        held = sum(lay.stats()["kv_bytes"] for lay in layers)
        assert held <= 0.5 * 90 * engine.info.kv_bytes_per_token()
        assert any(lay.comp_count for lay in layers)
        for lay in layers:
            if len(lay.streaming_heads):
                assert lay.comp_count + lay.s_keys.shape[-2] == 90


@pytest.mark.parametrize("kw, key", [
    ({"echo_head_ratio": 0.5}, "method.echo_head_ratio=0.5"),
    ({"compression_ratio": 0.5}, "method.compression_ratio=0.5"),
    ({"min_window_tokens": 0}, "method.min_window_tokens=0"),
    ({"budget_ratio": 0.1}, "must be below method.budget_ratio"),
])
def test_bad_hyperparameters(kw, key):
    with pytest.raises(ConfigError) as err:
        build_method("razor_attention", **kw)
    assert key in str(err.value)
