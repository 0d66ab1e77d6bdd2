"""TurboQuant: Lloyd-Max codebooks against independent computations, the MSE distortion of the
rotate-quantize-unrotate round trip, unbiased QJL inner products (and that a halved QJL scale is
caught), exact bits and bytes at 2.5 and 3.5 bits, the prompt quantized from the whole prompt
whatever the chunking, and decode attention from the codes in a model (the kernels themselves:
tests/methods/kernels/test_turboquant_attention.py)."""

import math

import pytest
import torch

from methods import _turboquant_quant as tq
from methods import build_method
from methods.model import ModelInfo
from tests.conftest import make_engine


# --- codebooks -------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 3])
def test_codebook_for_d3_is_the_uniform_grid(bits):
    """A coordinate of a uniform point on the 2-sphere is uniform on [-1, 1] (Archimedes): its
    Lloyd-Max quantizer is the uniform grid -1 + (2i + 1) / 2^b."""
    want = [-1 + (2 * i + 1) / 2 ** bits for i in range(2 ** bits)]
    assert tq.lloyd_max(3, bits).tolist() == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("d", [2, 8, 64])
def test_one_bit_codebook_is_the_mean_of_the_absolute_coordinate(d):
    """1 bit: the centroids are +-E|x| = +-Gamma(d/2) / (sqrt(pi) Gamma((d+1)/2))."""
    mean_abs = math.exp(math.lgamma(d / 2) - 0.5 * math.log(math.pi) - math.lgamma((d + 1) / 2))
    assert tq.lloyd_max(d, 1).tolist() == pytest.approx([-mean_abs, mean_abs], rel=1e-5)


def test_codebook_for_large_d_is_max_gaussian_quantizer():
    """d -> infinity: sqrt(d) x -> N(0, 1), whose Lloyd-Max levels are Max's (1960) table."""
    d = 4096
    assert (tq.lloyd_max(d, 2) * math.sqrt(d)).tolist() == pytest.approx(
        [-1.5104, -0.4528, 0.4528, 1.5104], abs=2e-3)
    assert (tq.lloyd_max(d, 3) * math.sqrt(d))[4:].tolist() == pytest.approx(
        [0.2451, 0.7560, 1.3440, 2.1520], abs=2e-3)


@pytest.mark.parametrize("d, bits", [(16, 2), (48, 3), (5, 4)])
def test_codebook_equals_lloyd_with_exact_beta_integrals(d, bits):
    """Independently: (x + 1) / 2 ~ Beta(a, a), a = (d - 1) / 2, so a cell's mass and first
    moment are regularized incomplete beta functions (scipy); Lloyd's iteration on them."""
    special = pytest.importorskip("scipy.special")
    a = (d - 1) / 2
    c = torch.linspace(-0.5, 0.5, 2 ** bits, dtype=torch.float64).numpy() * 4 / math.sqrt(d)
    for _ in range(5000):
        edges = [0.0] + [((c[i] + c[i + 1]) / 2 + 1) / 2 for i in range(len(c) - 1)] + [1.0]
        mass = [special.betainc(a, a, hi) - special.betainc(a, a, lo)
                for lo, hi in zip(edges, edges[1:])]
        first = [0.5 * (special.betainc(a + 1, a, hi) - special.betainc(a + 1, a, lo))
                 for lo, hi in zip(edges, edges[1:])]  # E[Y 1{lo < Y < hi}]
        c = [2 * f / m - 1 for f, m in zip(first, mass)]
    assert tq.lloyd_max(d, bits).tolist() == pytest.approx(c, abs=2e-6)


# --- the round trip ----------------------------------------------------------------------------
def _quantizer(d, bits, qjl, seed=0, ratio=0.25, block=64):
    return tq.build_quantizer(d, bits, ratio, qjl, block, torch.Generator().manual_seed(seed))


def _round_trip(x, q):
    out = tq.quantize_block(x, q)
    perm = tq.permutation(out["mask"])[:, None, :].expand_as(x)
    return tq.dequantize(out["codes"], out.get("signs"), out["norms"], out.get("rnorms"), perm, q)


@pytest.mark.parametrize("bits, paper", [(1, 0.36), (2, 0.117), (3, 0.03), (4, 0.009)])
def test_mse_distortion_is_the_codebooks_and_the_papers(bits, paper):
    """Unit vectors, d = 64: the mean |x - x_hat|^2 equals d times the codebook's own expected
    squared error (computed from f_d), within 4 standard errors of 4096 vectors, and is within
    20 % of the paper's D_mse (0.36, 0.117, 0.03, 0.009; its values are asymptotic in d). A
    rotation that were not inverted gives ~2."""
    d = 64
    q = _quantizer(d, bits, qjl=False)
    x = torch.randn(1, 4096, d, generator=torch.Generator().manual_seed(1))
    x = x / x.norm(dim=-1, keepdim=True)
    err = ((_round_trip(x, q) - x) ** 2).sum(-1).flatten().double()
    grid = torch.linspace(-1, 1, 400001, dtype=torch.float64)[1:-1]
    f = tq.coordinate_density(grid, d)
    c = tq.lloyd_max(d, bits)
    nearest = c[torch.bucketize(grid, tq.midpoints(c))]
    expected = d * float(((grid - nearest) ** 2 * f).sum() / f.sum())
    assert abs(err.mean() - expected) < 4 * err.std() / math.sqrt(err.numel())
    assert err.mean() == pytest.approx(paper, rel=0.2)


def _qjl_estimates(x, y, draws):
    """<y, x_prod> for `draws` independent (Pi, S) at 2 bits (1-bit codes + QJL), d = 16, and
    the same with the planted bug: the QJL scale sqrt(pi/2)/d halved."""
    right, halved = [], []
    for seed in range(draws):
        q = _quantizer(x.shape[-1], 2, qjl=True, seed=seed)
        p = q.parts[0]
        bug = tq.Quantizer(q.head_dim, (tq.Part(p.dim, p.mse_bits, True, p.rotation,
                                                p.projection * 0.5, p.codebook),), 64)
        for out, quantizer in ((right, q), (halved, bug)):
            out.append(float(_round_trip(x[None, None], quantizer)[0, 0] @ y))
    return torch.tensor(right, dtype=torch.float64), torch.tensor(halved, dtype=torch.float64)


def test_qjl_inner_products_are_unbiased_and_a_halved_scale_is_caught():
    """TurboQuant_prod: E_{Pi,S} <y, x_prod> = <y, x>. Over 1000 seeded draws the mean is within
    4 standard errors of the truth (a fixed seed set: deterministic; 4 SE is a two-sided 6e-5
    false-alarm rate for a correct estimator). The MSE-only estimate (no QJL) is biased, and
    the QJL scale sqrt(pi/2)/d halved is caught by the same check (both far beyond 4 SE)."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, generator=g), torch.randn(16, generator=g)
    truth = float(x @ y)
    est, halved = _qjl_estimates(x, y, 1000)
    assert abs(float(est.mean()) - truth) < 4 * float(est.std()) / math.sqrt(est.numel())
    assert abs(float(halved.mean()) - truth) > 4 * float(halved.std()) / math.sqrt(1000)
    mse_only = []
    for seed in range(300):
        q = _quantizer(16, 1, qjl=False, seed=seed)
        mse_only.append(float(_round_trip(x[None, None], q)[0, 0] @ y))
    mse_only = torch.tensor(mse_only, dtype=torch.float64)
    assert abs(float(mse_only.mean()) - truth) > 4 * float(mse_only.std()) / math.sqrt(300)


# --- bits and bytes ------------------------------------------------------------------------------
@pytest.mark.parametrize("d, bits, parts", [
    (128, 2.5, [(32, 4), (96, 2)]), (128, 3.5, [(32, 5), (96, 3)]),
    (64, 2.5, [(16, 4), (48, 2)]), (64, 3.5, [(16, 5), (48, 3)]), (64, 3, [(64, 3)])])
def test_outlier_split_gives_exactly_the_stated_bits(d, bits, parts):
    assert tq.split_widths(d, bits, 0.25) == parts
    for qjl in (True, False):
        q = _quantizer(d, bits, qjl)
        assert q.bits_per_coordinate() == bits
        assert [(p.dim, p.mse_bits + qjl) for p in q.parts] == parts


def test_bytes_held_are_counted_exactly():
    """D = 64, 2.5 bits, blocks of 32, 70 tokens: 64 quantized + a 6-token fp32 tail. Keys: codes
    16 x 3 + 48 x 1 bits = 12 bytes, signs 8, norms 4 x fp16 = 8: 28 bytes per token and head
    (3.5 bits per coordinate); values: 16 x 4 + 48 x 2 bits = 20 bytes + 2 norms = 24 (3.0);
    per block and head an 8-byte outlier mask for each tensor."""
    info = ModelInfo(num_layers=1, num_heads=6, num_kv_heads=3, head_dim=64, max_positions=512)
    layer = build_method("turboquant", k_bits=2.5, v_bits=2.5, block_tokens=32).make_layer(0, info)
    layer.update(torch.randn(1, 3, 70, 64), torch.randn(1, 3, 70, 64), None)
    want = 3 * (64 * (28 + 24) + 2 * 2 * 8 + 6 * 64 * 4 * 2)
    assert layer.stats()["kv_bytes"] == want
    assert layer.key_q.token_bytes() * 8 / 64 == 3.5 and layer.value_q.token_bytes() * 8 / 64 == 3


def test_validate_refuses_splits_that_are_not_whole_channels():
    method = build_method("turboquant", k_bits=2.5, outlier_ratio=0.3)
    info = ModelInfo(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=64, max_positions=64)
    reasons = method.validate(info, {"batch_size": 1})
    assert reasons and "method.k_bits" in reasons[0] and "outlier_ratio=0.3" in reasons[0]
    with pytest.raises(Exception, match="method.k_bits=2.7"):
        build_method("turboquant", k_bits=2.7)
    too_wide = build_method("turboquant", k_bits=3.75, outlier_ratio=0.125)  # outliers at 9 bits
    assert "at most 8" in too_wide.validate(info, {"batch_size": 1})[0]


# --- the protocol ----------------------------------------------------------------------------
def test_prompt_is_quantized_from_the_whole_prompt_whatever_the_chunking():
    """Under dense prefill the prompt is held exact and quantized at its end: the stored codes
    are the same bytes for chunks of 5 and of the whole prompt (the outlier channels of a block
    come from all of its tokens, never from a chunk)."""
    info = ModelInfo(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, max_positions=512)
    method = build_method("turboquant", block_tokens=8)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 1, 30, 16, generator=g), torch.randn(1, 1, 30, 16, generator=g)
    stored = []
    for chunk in (5, 30):
        layer = method.make_layer(0, info)
        layer.prompt_open = True
        for s in range(0, 30, chunk):
            layer.update(k[:, :, s:s + chunk], v[:, :, s:s + chunk], None)
            assert layer.quantized_tokens() == 0  # held while the prompt is fed
        layer.on_prefill_end()
        stored.append(layer._cache())
    assert stored[0].keys.codes.shape[1] == 24 and stored[0].exact_k.shape[1] == 6
    for a, b in zip(stored[0].keys + stored[0].values, stored[1].keys + stored[1].values):
        assert (a is None and b is None) or torch.equal(a, b)


def test_decode_from_the_codes_equals_dequantize_then_attend_in_a_model(tiny_model, monkeypatch):
    """Greedy decoding on the tiny model: the fused path (C kernel, or torch without a compiler)
    gives the logits of the model's own attention over the dequantized cache."""
    from methods import turboquant

    ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(2))

    def run():
        engine = make_engine(tiny_model, build_method("turboquant", block_tokens=8), chunk=16)
        with engine.request() as req:
            out = [req.prefill(ids[:, :30])[0, -1]]
            out += [req.step(ids[:, i])[0, -1] for i in range(30, 40)]
        return torch.stack(out)

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    fused = run()
    monkeypatch.setattr(turboquant, "plain_decode_row", lambda *a: False)
    torch.testing.assert_close(fused, run(), rtol=1e-4, atol=1e-4)
