"""KVQuant: packing (KIVI's layout at 2/4 bits), the nuq codebook, Q-Norm, pre-RoPE keys un-rotated
and re-rotated exactly, per-token values, sparse outliers kept exactly, bytes held, calibration
cache, and decode attention from the codes in a model (the kernels themselves:
tests/methods/kernels/test_kvquant_attention.py)."""

import logging

import pytest
import torch

from harness.core import hf_adapter
from kvcore.errors import ConfigError
from methods import build_method
from methods.kernels import cpu_build
from methods.kernels import kivi_quant as kq
from methods.model import ModelInfo
from methods.protocol import Protocol
from methods import kvquant
from methods.kvquant import (Calibration, KVQuantLayer, kmeans_1d, nearest_centroid, pack_bits,
                             q_norm, unpack_bits)
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


def test_q_norm_hand_case():
    """Official Q-Norm: points 0, 0.2, 0.4, 1 round to centroids 0, 0, 0, 1 (mean 0.25, std
    sqrt(0.1875)); the points have mean 0.4, std sqrt(0.14): scale = sqrt(0.14 / 0.1875),
    offset = 0.4 - 0.25 * scale, and the re-normed quantized points have the points' mean/std."""
    points, codebook = torch.tensor([0.0, 0.2, 0.4, 1.0]), torch.tensor([0.0, 1.0])
    scale, offset = q_norm(points, codebook)
    assert scale == pytest.approx((0.14 / 0.1875) ** 0.5, abs=1e-7)  # fp32 points
    assert offset == pytest.approx(0.4 - 0.25 * (0.14 / 0.1875) ** 0.5, abs=1e-7)
    assert (scale, offset) == pytest.approx((0.864099, 0.183975), abs=1e-6)
    deq = (codebook * scale + offset)[nearest_centroid(points, codebook)]
    assert deq.mean().item() == pytest.approx(0.4, abs=1e-6)
    assert deq.std(unbiased=False).item() == pytest.approx(0.14 ** 0.5, abs=1e-6)


def test_layer_dequantizes_through_the_q_norm_table():
    """Rounding uses the centroids, dequantization centroid * norm_scale + norm_offset; position 0
    is not rotated, so the stored key is zero + scale * (normed centroid) exactly."""
    method, _ = _layer(outlier_ratio=0)
    method._cal.key_norm = torch.tensor([[2.0, 0.5]])
    layer = KVQuantLayer(0, INFO, method)
    centroids = torch.linspace(-0.75, 0.75, 4).half().float()
    key = (0.5 + 2.0 * centroids[[0, 1, 2, 3, 3, 2, 1, 0]])[None, None, None]  # on the grid
    layer.update(key, torch.randn(1, 1, 1, D), None)
    k, _ = layer.dequantized_kv()
    want = 0.5 + 2.0 * (centroids[[0, 1, 2, 3, 3, 2, 1, 0]] * 2.0 + 0.5)
    torch.testing.assert_close(k[0, 0, 0], want)


@pytest.mark.parametrize("bits,q_norm_knob,want", [(2, None, True), (4, None, False),
                                                   (4, True, True), (2, False, False)])
def test_q_norm_defaults_to_the_official_2_bit_setting(tiny_model, tmp_path, bits, q_norm_knob,
                                                       want):
    method = build_method("kvquant", k_bits=bits, v_bits=4, q_norm=q_norm_knob,
                          calibration_tokens=64, calibration_samples=1, cache_dir=str(tmp_path))
    facts = hf_adapter.prepare(method, tiny_model, None)
    assert facts["q_norm"] == {"keys": want, "values": bool(q_norm_knob)}
    norm = method._cal.key_norm
    if want:
        assert not torch.allclose(norm, torch.tensor([1.0, 0.0]).expand_as(norm))
    else:
        assert torch.equal(norm, torch.tensor([1.0, 0.0]).expand_as(norm))
    assert torch.equal(method._cal.value_norm[:, 0] == 1, torch.full((2,), not q_norm_knob))


def _layer(k_bits=2, v_bits=2, outlier_ratio=0.01, first=0):
    method = build_method("kvquant", k_bits=k_bits, v_bits=v_bits, outlier_ratio=outlier_ratio,
                          first_fp16_tokens=first)
    no_norm = torch.tensor([[1.0, 0.0]])
    method._cal = Calibration(key_zero=torch.full((1, 1, D), 0.5).half(),
                              key_scale=torch.full((1, 1, D), 2.0).half(),
                              key_codebook=torch.linspace(-0.75, 0.75, 1 << k_bits)[None].half(),
                              value_codebook=torch.linspace(-1, 1, 1 << v_bits)[None].half(),
                              key_norm=no_norm, value_norm=no_norm)
    method.set_rope(1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
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
    layer.update(post[:, :, :7], values[:, :, :7], None)
    layer.update(post[:, :, 7:], values[:, :, 7:], None)  # positions continue at 7
    keys, _ = layer.dequantized_kv()
    assert (keys - post).abs().max() < 1e-5
    k_out, v_out = (kvquant._sparse_view(layer.outliers[n]) for n in ("k", "v"))
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
    layer.update(torch.zeros(1, 1, 2, D), values, None)
    _, out = layer.dequantized_kv()
    assert (out - values).abs().max() < 1e-3  # fp16 zero/scale
    assert layer.codes["v_scale"].view().flatten().tolist() == pytest.approx([2.0, 0.25], abs=1e-3)
    assert kvquant._sparse_view(layer.outliers["v"]) is None


def test_first_tokens_exact_then_quantized():
    _, layer = _layer(first=3)
    keys, values = torch.randn(1, 1, 5, D), torch.randn(1, 1, 5, D)
    layer.update(keys, values, None)
    k, v = layer.dequantized_kv()
    assert torch.equal(k[:, :, :3], keys[:, :, :3]) and torch.equal(v[:, :, :3], values[:, :, :3])
    assert layer.exact_k.shape[-2] == 3 and layer.codes["k"].view().shape[-2] == 2


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
        assert facts["calibration_samples"] == 2
        # prefill=chunked: the prompt's rows attend quantized K/V (the official simulation);
        # under prefill=dense a prompt is attended exact and quantized once it is over
        engine = make_engine(tiny_model, method, protocol=Protocol(prefill="chunked"))
        with torch.no_grad(), engine.request() as req:
            errs[bits] = (req.prefill(ids, all_logits=True) - want).abs().max().item()
            held = req.cache.kv_layers[0].stats()["kv_bytes"]
            # one value zero/scale per token over both KV heads (the v_proj output)
            assert req.cache.kv_layers[0].codes["v_scale"].view().shape == (1, 1, 64, 1)
        full_bytes = 2 * 64 * 2 * 16 * 4  # K and V, 64 tokens, 2 KV heads, D 16, fp32
        assert held < full_bytes * (bits / 32 + 0.2)
    assert errs[4] < errs[3] < errs[2], errs


def test_calibration_is_cached_and_recorded_alike_cold_and_warm(stories, tmp_path, caplog):
    model = stories[0]
    kw = dict(calibration_tokens=128, calibration_samples=2, cache_dir=str(tmp_path))
    with caplog.at_level(logging.INFO, logger="methods._artefacts"):
        first = hf_adapter.prepare(build_method("kvquant", **kw), model, None)
        again = hf_adapter.prepare(build_method("kvquant", **kw), model, None)
    told = [r.message for r in caplog.records if r.name == "methods._artefacts"]
    assert ["computed" in m for m in told] == [True, False] and "loaded from the cache" in told[1]
    # what the artefact is, not how it was had: a cold machine records what a warm one does
    drop = {"prepare_s"}
    assert {k: v for k, v in first.items() if k not in drop} == {
        k: v for k, v in again.items() if k not in drop}
    assert len(first["calibration"]["sha256"]) == 64


@pytest.mark.parametrize("kw, key", [
    ({"k_bits": 8}, "method.k_bits=8; allowed: 2, 3, 4"),
    ({"v_bits": 1}, "method.v_bits=1"),
    ({"outlier_ratio": 0.7}, "method.outlier_ratio=0.7"),
    ({"first_fp16_tokens": -1}, "method.first_fp16_tokens=-1"),
    ({"calibration_samples": 0}, "method.calibration_samples=0"),
    ({"q_norm": "maybe"}, "method.q_norm"),
])
def test_bad_hyperparameters(kw, key):
    with pytest.raises(ConfigError) as err:
        build_method("kvquant", **kw)
    assert key in str(err.value)


@pytest.fixture
def c_path(monkeypatch):
    """Plain CPU dispatch, as a CPU run: without TRITON_INTERPRET decode attention takes the C
    kernel (methods/kernels/kvquant_cpu.c; torch without a compiler)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def stream_logits(model, method, ids, prefill_tokens):
    engine = make_engine(model, method, chunk=32)
    with torch.no_grad(), engine.request() as req:
        out = [req.prefill(ids[:, :prefill_tokens], all_logits=True)]
        out += [req.step(ids[:, t]) for t in range(prefill_tokens, ids.shape[1])]
    return torch.cat(out, 1)[0]


@pytest.mark.parametrize("bits", [2, 3])
def test_decode_reads_the_codes_and_matches_dequantize_then_attend(tiny_model, tmp_path, c_path,
                                                                   monkeypatch, bits):
    """Every decode step of every layer runs the packed path (the C kernel here); the logits equal
    those of the dequantize-rotate-attend path; prefill chunks take the dequantized path."""
    ids = torch.randint(3, 250, (1, 90), generator=torch.Generator().manual_seed(3))
    method = build_method("kvquant", k_bits=bits, v_bits=bits, calibration_tokens=64,
                          calibration_samples=1, cache_dir=str(tmp_path))
    calls = []
    real = kvquant.decode_attention
    monkeypatch.setattr(kvquant, "decode_attention", lambda *a: calls.append(1) or real(*a))
    fused = stream_logits(tiny_model, method, ids, prefill_tokens=70)
    assert len(calls) == 20 * tiny_model.config.num_hidden_layers
    if cpu_build.compiler_available():
        assert kvquant.decode_kernel(torch.device("cpu")) == "c"
    monkeypatch.setattr(kvquant, "plain_decode_row", lambda *a: False)
    dense = stream_logits(tiny_model, method, ids, prefill_tokens=70)
    torch.testing.assert_close(fused, dense, rtol=1e-4, atol=1e-4)
