"""Q-Filters: per-head filters from an SVD of calibration queries; keep the top of -(filter . key)."""

import pytest
import torch
from safetensors.torch import save_file

from harness.core import hf_adapter
from kvcore.errors import ConfigError
from methods import build_method
from methods.model import ModelInfo
from methods.qfilters import filters_from_queries
from tests.conftest import make_engine


@pytest.mark.kept_set
def test_filter_and_kept_set_by_hand():
    """Head 0's queries lie on e1, mostly positive: filter -e1; head 1's on e2, mostly negative:
    filter +e2 (whatever sign the SVD returns); their KV head's filter is the mean (-.5, .5), so
    a key scores .5 k1 - .5 k2: [.5, -.5, 0, -2, 2] for the keys below, and a budget of 2 keeps
    tokens 4 and 0."""
    queries = torch.tensor([[[2.0, 0], [3, 0], [-1, 0]], [[0, 1.0], [0, -2], [0, -1]]])
    f = filters_from_queries(queries, num_kv_heads=1)
    assert torch.allclose(f, torch.tensor([[-0.5, 0.5]]), atol=1e-6)
    method = build_method("qfilters", budget_tokens=2)
    method._filters = f[None]  # (L, H_kv, D), what prepare computes
    info = ModelInfo(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2, max_positions=16)
    layer = method.make_layer(0, info)
    keys = torch.tensor([[1.0, 0], [0, 1], [2, 2], [-1, 3], [3, -1]]).view(1, 1, 5, 2)
    layer.update(keys, keys, None)
    assert torch.allclose(layer.score()[0, 0], torch.tensor([0.5, -0.5, 0, -2, 2]), atol=1e-6)
    layer.after_forward()
    assert sorted(layer.positions[0, 0].tolist()) == [0, 4]


def test_prepare_filters_and_decode_eviction(tiny_model):
    method = build_method("qfilters", budget_tokens=12, calibration_tokens=300, svd_samples=200)
    engine = make_engine(tiny_model, method)
    info = hf_adapter.model_info(tiny_model.config)
    filters = method.filters()
    assert filters.shape == (info.num_layers, info.num_kv_heads, info.head_dim)
    assert torch.isfinite(filters).all()
    ids = torch.randint(3, 250, (50,), generator=torch.Generator().manual_seed(1))
    with engine.request() as req:
        req.prefill(ids[:40])
        layers = req.cache.kv_layers
        for t in ids[40:]:
            before = [kv.positions[0].clone() for kv in layers]
            scores = [kv.score()[0].clone() for kv in layers]
            req.step(t.view(1))
            for kv, pos, s in zip(layers, before, scores):  # one token out: the lowest score
                assert kv.kept_tokens() == 12
                gone = set(pos[0].tolist()) | {kv.seen_tokens - 1}
                gone -= set(kv.positions[0, 0].tolist())
                new = -(kv.keys[0, 0].float() @ filters[kv.layer_idx, 0])
                assert len(gone) == 1 and (gone.pop() == kv.seen_tokens - 1 or
                                           s[0].min() <= new.min() + 1e-6)


def test_published_filters_load_by_path(tmp_path, tiny_model):
    info = hf_adapter.model_info(tiny_model.config)
    want = torch.randn(info.num_layers, info.num_kv_heads, info.head_dim)
    folder = tmp_path / "SmolThing_qfilt"
    folder.mkdir()
    save_file({"q_filters": want}, str(folder / "model.safetensors"))
    method = build_method("qfilters", filters_path=str(folder))
    assert not method.validate(info, {"batch_size": 1})
    make_engine(tiny_model, method)
    assert torch.equal(method.filters().cpu(), want)
    save_file({"q_filters": want[:, :, :2].contiguous()}, str(tmp_path / "bad.safetensors"))
    bad = build_method("qfilters", filters_path=str(tmp_path / "bad.safetensors"))
    assert "q_filters has shape" in bad.validate(info, {"batch_size": 1})[0]
    with pytest.raises(ConfigError, match="method.filters_path=.*no such file"):
        build_method("qfilters", filters_path=str(tmp_path / "absent"))
