"""KVQuant: packing (KIVI's layout at 2/4 bits), the nuq codebook, pre-RoPE keys un-rotated and
re-rotated exactly, per-token values, sparse outliers kept exactly, bytes held, calibration cache."""

import pytest
import torch

from harness import hf_adapter
from kvcore.errors import ConfigError
from methods import build_method
from methods.base import ModelInfo
from methods.kernels import kivi_quant as kq
from methods.kvquant import (Calibration, KVQuantLayer, kmeans_1d, nearest_centroid, pack_bits,
                             unpack_bits)
from methods.rope import rotate
from tests.conftest import make_engine

D = 8
INFO = ModelInfo(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=D, max_positions=512)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_pack_roundtrip_and_kivi_layout(bits):
    torch.manual_seed(0)
    codes = torch.randint(0, 1 << bits, (3, 5, 16))
    packed = pack_bits(codes, bits)
    assert packed.shape == (3, 5, 16 * bits // 8) and packed.dtype == torch.uint8
    assert (unpack_bits(packed, bits) == codes).all()
    if bits in kq.ALLOWED_BITS:  # groups spanning 0..2^b-1 give scale 1, zero 0: codes as is
        codes[..., 0], codes[..., 1] = 0, (1 << bits) - 1
        kivi = kq.quantize_pack_ref(codes.float(), bits, 16)
        assert (kivi.codes == pack_bits(codes, bits)).all()


def test_codebook_hand_cases():
    assert kmeans_1d(torch.tensor([-1.0, -0.9, 0.9, 1.0]), 2).tolist() == pytest.approx([-0.95, 0.95])
    cents = torch.tensor([-1.0, 0.0, 0.5, 1.0])
    assert nearest_centroid(torch.tensor([-0.6, -0.4, 0.3, 0.2, 0.9]), cents).tolist() == [0, 1, 2,
                                                                                           1, 3]


def _layer(k_bits=2, v_bits=2, outlier_ratio=0.01, first=0):
    method = build_method("kvquant", k_bits=k_bits, v_bits=v_bits, outlier_ratio=outlier_ratio,
                          first_fp16_tokens=first)
    method._cal = Calibration(key_zero=torch.full((1, 1, D), 0.5).half(),
                              key_scale=torch.full((1, 1, D), 2.0).half(),
                              key_codebook=torch.linspace(-0.75, 0.75, 1 << k_bits)[None].half(),
                              value_codebook=torch.linspace(-1, 1, 1 << v_bits)[None].half())
    method._inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    return method, KVQuantLayer(0, INFO, method)


def test_pre_rope_keys_on_the_grid_come_back_exactly_and_outliers_are_exact():
    """Pre-RoPE keys = zero + scale * centroid (grid points of the 2-bit codebook) survive
    un-rotation, quantization and re-rotation; a key beyond the calibrated range (an outlier) is
    kept exactly in the sparse list; the held bytes are codes + outliers + constants."""
    method, layer = _layer()
    torch.manual_seed(1)
    grid = 0.5 + 2.0 * torch.linspace(-0.75, 0.75, 4).half().float()  # the codebook as held (fp16)
    pre = grid[torch.randint(0, 4, (1, 1, 12, D))]
    pre[0, 0, 5, 3] = 9.0  # beyond zero + scale = 2.5: outlier
    post = rotate(pre, torch.arange(12).float(), method._inv_freq)
    values = torch.randn(1, 1, 12, D)
    keys, _ = layer.update(post[:, :, :7], values[:, :, :7], None)
    keys, _ = layer.update(post[:, :, 7:], values[:, :, 7:], None)  # positions continue at 7
    assert (keys - post).abs().max() < 1e-5
    k_out, v_out = layer.outliers["k"], layer.outliers["v"]
    assert k_out[0].tolist() == [5] and k_out[1].tolist() == [3] and k_out[2].item() == 9.0
    codes = 2 * 12 * D * 2 // 8  # keys + values, 2 bits
    expected = (codes + 2 * 2 * 12 + 8 * (1 + v_out[0].numel()) + layer.constants_bytes)
    assert layer.stats()["kv_bytes"] == expected
    assert layer.stats()["kv_tokens"] == 12


def test_values_per_token_hand_case():
    """outlier_ratio 0 (min-max per token): a value vector on its own 4-level min-max grid is
    exact; each token has its own zero/scale."""
    _, layer = _layer(outlier_ratio=0)
    base = torch.tensor([0.0, 1, 2, 3, 3, 2, 1, 0]) / 3  # levels of [0, 1] in thirds
    values = torch.stack([base * 4 - 1, base * 0.5 + 7])[None, None]  # (1, 1, 2, D)
    _, out = layer.update(torch.zeros(1, 1, 2, D), values, None)
    assert (out - values).abs().max() < 1e-3  # fp16 zero/scale
    assert layer.v_scale.flatten().tolist() == pytest.approx([2.0, 0.25], abs=1e-3)
    assert layer.outliers["v"] is None


def test_first_tokens_exact_then_quantized():
    _, layer = _layer(first=3)
    keys, values = torch.randn(1, 1, 5, D), torch.randn(1, 1, 5, D)
    k, v = layer.update(keys, values, None)
    assert torch.equal(k[:, :, :3], keys[:, :, :3]) and torch.equal(v[:, :, :3], values[:, :, :3])
    assert layer.exact_k.shape[-2] == 3 and layer.k_codes.shape[-2] == 2


def test_on_a_model_error_falls_with_bits_and_bytes_are_counted(tiny_model, tmp_path):
    torch.manual_seed(4)
    ids = torch.randint(3, 250, (1, 64))
    with torch.no_grad(), make_engine(tiny_model, build_method("full")).request() as ref:
        want = ref.prefill(ids, all_logits=True)
    errs = {}
    for bits in (2, 3, 4):
        method = build_method("kvquant", k_bits=bits, v_bits=bits, first_fp16_tokens=0,
                              calibration_tokens=128, calibration_samples=2,
                              cache_dir=str(tmp_path))
        facts = hf_adapter.prepare(method, tiny_model, None)
        assert facts["calibration"] == "computed" and facts["calibration_samples"] == 2
        engine = make_engine(tiny_model, method)
        with torch.no_grad(), engine.request() as req:
            errs[bits] = (req.prefill(ids, all_logits=True) - want).abs().max().item()
            held = req.cache.kv_layers[0].stats()["kv_bytes"]
        full_bytes = 2 * 64 * 2 * 16 * 4  # K and V, 64 tokens, 2 KV heads, D 16, fp32
        assert held < full_bytes * (bits / 32 + 0.2)
    assert errs[4] < errs[3] < errs[2], errs


def test_calibration_is_cached(stories, tmp_path):
    model = stories[0]
    kw = dict(calibration_tokens=128, calibration_samples=2, cache_dir=str(tmp_path))
    first = hf_adapter.prepare(build_method("kvquant", **kw), model, None)
    again = hf_adapter.prepare(build_method("kvquant", **kw), model, None)
    assert (first["calibration"], again["calibration"]) == ("computed", "loaded")


@pytest.mark.parametrize("kw, key", [
    ({"k_bits": 8}, "method.k_bits=8; allowed: 2, 3, 4"),
    ({"v_bits": 1}, "method.v_bits=1"),
    ({"outlier_ratio": 0.7}, "method.outlier_ratio=0.7"),
    ({"first_fp16_tokens": -1}, "method.first_fp16_tokens=-1"),
    ({"calibration_samples": 0}, "method.calibration_samples=0"),
])
def test_bad_hyperparameters(kw, key):
    with pytest.raises(ConfigError) as err:
        build_method("kvquant", **kw)
    assert key in str(err.value)
