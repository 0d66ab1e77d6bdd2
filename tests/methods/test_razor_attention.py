"""RazorAttention: the |D|-weighted compensation token, the probe and its cache, the budget.
(The per-head attention by hand, with and without compensation, is in test_duo_attention.py.)"""

import logging
from types import SimpleNamespace

import pytest
import torch

from harness.core import hf_adapter
from kvcore.errors import ConfigError
from methods import build_method
from methods._head_probe import _ProbeLayer, probe_period, probe_tokens, select_union
from methods._headwise import HeadwiseLayer
from methods.model import ModelInfo
from tests.conftest import make_engine
from tests.methods.headwise_reference import streaming_positions

INFO = ModelInfo(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, max_positions=512)


def _dense(q, k, v):
    probs = torch.softmax((q @ k.transpose(-1, -2)) * 8 ** -0.5, -1)
    return (probs @ v).transpose(1, 2)


@pytest.mark.kept_set
@pytest.mark.parametrize("weighted", [True, False])
def test_compensation_token_is_exact_when_dropped_keys_are_identical(weighted):
    """By hand: identical dropped keys (any values) -> the |D|-weighted compensation token
    reproduces exact attention; without the weighting (a plain extra token) it does not."""
    torch.manual_seed(0)
    method = SimpleNamespace(sink_tokens=2, compensate=True, stream_slots=lambda seen: 6)
    layer = HeadwiseLayer(0, INFO, method, torch.tensor([False]))
    k = torch.randn(1, 1, 20, 8, dtype=torch.float64)
    k[:, :, 2:16] = torch.randn(8, dtype=torch.float64)  # the tokens that will be dropped
    v = torch.randn(1, 1, 20, 8, dtype=torch.float64)
    layer.update(k[:, :, :19], v[:, :, :19], None)
    layer.after_forward()  # keeps 0, 1 | compensation of 2..15 | 16, 17, 18
    assert layer.comp_count == 14 and streaming_positions(layer) == [0, 1, 16, 17, 18]
    if not weighted:
        layer.comp_count = 1  # a plain extra token: weight 1 instead of |D|
    q = torch.randn(1, 2, 1, 8, dtype=torch.float64)
    keys, values = layer.update(k[:, :, 19:], v[:, :, 19:], None)
    module = SimpleNamespace(scaling=8 ** -0.5, num_key_value_groups=2)
    out, _ = layer.attend(module, q, keys, values, None, base=hf_adapter.eager_attention)
    err = (out - _dense(q, k.expand(1, 2, 20, 8), v.expand(1, 2, 20, 8))).abs().max()
    assert (err < 1e-6) if weighted else (err > 1e-3)


def test_probe_scores_echo_and_induction_by_hand():
    """BOS + a block of P = 4 tokens repeated 3 times; head 0 attends from every query of a later
    repetition to the token after its previous occurrence (induction), head 1 to that occurrence
    (echo). Huawei's score: the attention on *every* earlier occurrence (or the token after it),
    summed and divided by S^2."""
    p, reps = 4, 3
    s = 1 + p * reps
    layer = _ProbeLayer(0, ModelInfo(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=s,
                                     max_positions=64), p, offset=1, block_rows=5)
    keys = torch.eye(s)[None, None]  # one-hot keys per position
    q = torch.zeros(1, 2, s, s)
    for i in range(1 + p, s):
        q[0, 0, i, i - p + 1] = 1e4
        q[0, 1, i, i - p] = 1e4
    module = SimpleNamespace(scaling=1.0)
    layer.attend(module, q, keys, keys, None, base=lambda *a, **k: (None, None))
    # rows 5..12 (8 rows) each put weight 1 on one key: the previous occurrence's successor (head 0)
    # or the previous occurrence (head 1); for rows of the third repetition that key is also the
    # successor / the occurrence *two* repetitions back only when it coincides, which it does not
    assert layer.induction.tolist() == pytest.approx([8 / s ** 2, 0.0], abs=1e-6)
    assert layer.echo.tolist() == pytest.approx([0.0, 8 / s ** 2], abs=1e-6)
    # a head attending to the occurrence two repetitions back scores there too (every occurrence)
    q = torch.zeros(1, 2, s, s)
    q[0, :, :, 0] = 1e4  # every other row looks at the BOS only (never an occurrence)
    for i in range(1 + 2 * p, s):
        q[0, 1, i, 0], q[0, 1, i, i - 2 * p] = 0.0, 1e4
    layer.attend(module, q, keys, keys, None, base=lambda *a, **k: (None, None))
    assert layer.echo[1].item() == pytest.approx(4 / s ** 2, abs=1e-6)


def test_probe_sequence_is_huaweis():
    ids = probe_tokens(2500, 4, 49152, seed=0, bos=1)
    assert ids.numel() == 1 + 4 * 2500 and ids[0] == 1
    block = ids[1:2501]
    assert all((ids[1 + k * 2500:1 + (k + 1) * 2500] == block).all() for k in range(4))
    assert 10000 <= int(block.min()) and int(block.max()) <= 12500
    small = probe_tokens(16, 4, 300, seed=0)  # a small vocabulary: ids from [3, vocab)
    assert small.numel() == 64 and small.min() >= 3 and small.max() < 300
    assert probe_period(2500, 4, 8192, 1) == 2047  # SmolLM2: 1 + 4 x 2047 <= 8192 positions
    assert probe_period(2500, 4, 131072, 1) == 2500


def test_union_of_the_best_echo_and_induction_heads():
    """Huawei's selection: top echo heads and top induction heads, united (overlap: fewer)."""
    echo = torch.tensor([[0.9, 0.0], [0.1, 0.2]])
    induction = torch.tensor([[0.0, 0.3], [0.8, 0.1]])
    assert select_union(echo, induction, 1, 2).tolist() == [[True, True], [True, False]]
    assert select_union(echo, echo, 1, 2).tolist() == [[True, False], [False, True]]  # overlap


def test_prepare_records_identification_and_caches(stories, tmp_path, caplog):
    model = stories[0]
    method = build_method("razor_attention", cache_dir=str(tmp_path))
    with caplog.at_level(logging.INFO, logger="methods._artefacts"):
        first = hf_adapter.prepare(method, model, None)
        again = hf_adapter.prepare(build_method("razor_attention", cache_dir=str(tmp_path)),
                                   model, None)
    assert first["head_identification"] == "echo/induction probe (Huawei's tool)"
    assert ["loaded from the cache" in r.message for r in caplog.records
            if r.name == "methods._artefacts"] == [False, True]
    assert first["probe_scores"] == again["probe_scores"]  # cold = warm
    assert first["probe_period_tokens"] == 128 and first["probe_repeats"] == 4  # 512 positions
    info = hf_adapter.model_info(model.config)
    n = info.num_layers * info.num_kv_heads
    assert round(0.14 * n) <= first["retrieval_heads"] <= round(0.14 * n) + round(0.01 * n)


def test_razor_within_budget_on_a_model(tiny_model):
    method = build_method("razor_attention", induction_head_ratio=0.25, echo_head_ratio=0.0,
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
                held = lay.kept_lengths()[0, lay.streaming_heads]
                assert (lay.comp_count + held == 90).all()


@pytest.mark.parametrize("kw, key", [
    ({"echo_head_ratio": 1.5}, "method.echo_head_ratio=1.5"),
    ({"probe_repeats": 1}, "method.probe_repeats=1"),
    ({"compression_ratio": 0.5}, "method.compression_ratio=0.5"),
    ({"min_window_tokens": 0}, "method.min_window_tokens=0"),
    ({"budget_ratio": 0.1}, "must be below method.budget_ratio"),
])
def test_bad_hyperparameters(kw, key):
    with pytest.raises(ConfigError) as err:
        build_method("razor_attention", **kw)
    assert key in str(err.value)


def test_the_compensation_slot_lives_in_the_shared_rows():
    """The compensation token is one slot of each streaming head in the layer's rows: the mean of
    the dropped keys and values, no text position (kept_positions skips it; virtual_slots
    counts it), attended with +log|D| (the template's `slot_bias`) and nowhere else."""
    from methods._headwise import COMP_POSITION, read_slots

    torch.manual_seed(1)
    method = SimpleNamespace(sink_tokens=2, compensate=True, stream_slots=lambda seen: 6)
    info = ModelInfo(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, max_positions=512)
    layer = HeadwiseLayer(0, info, method, torch.tensor([True, False]))
    k, v = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    layer.update(k[:, :, :12], v[:, :, :12], None)
    layer.after_forward()  # streaming head: 0, 1 | mean of 2..8 | 9, 10, 11
    for t in range(12, 20):
        keys, values = layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1], None)
        bias = layer.slot_bias()[0]  # (H_kv, T) the additive logit per slot
        slot = layer._comp_slot()[0, 1]
        assert torch.allclose(bias[1, slot], torch.tensor(t - 5.0).log())  # |D| = 2 .. t - 4
        others = torch.ones(keys.shape[2], dtype=torch.bool)
        others[slot] = False
        assert (bias[1, others] == 0).all()
        assert (bias[0] == 0).all()  # retrieval: no bias
        layer.after_forward()
        dropped = list(range(2, t - 2))
        assert layer.comp_count == len(dropped)
        assert layer.token_state["positions"].view()[0, 1, layer._comp_slot()[0, 1]] == \
            COMP_POSITION
        comp_k = read_slots(layer._kv["keys"], layer._comp_slot())[0, 1, 0]
        comp_v = read_slots(layer._kv["values"], layer._comp_slot())[0, 1, 0]
        assert torch.allclose(comp_k, k[0, 1, dropped].mean(0), atol=1e-6)
        assert torch.allclose(comp_v, v[0, 1, dropped].mean(0), atol=1e-6)
        assert streaming_positions(layer) == [0, 1, t - 2, t - 1, t]
        assert layer.virtual_slots().tolist() == [[0, 1]]
        assert layer.kept_lengths().tolist() == [[t + 1, 5]]
