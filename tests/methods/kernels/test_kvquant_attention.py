"""KVQuant decode attention from the codes (methods/kernels/kvquant_attention.py): the C kernel and
the Triton kernel (CPU interpreter here) against the torch reference on small irregular shapes
(2/3/4 bits, exact first tokens or none, GQA g = 1 and 3, spans and tiles cut mid-way, strided
views), and checks that the cases are sensitive to what a kernel could get wrong (outliers,
rotation), so the comparisons can fail."""

import pytest
import torch

from methods.kernels import cpu_build
from methods.kernels import kvquant_attention as ka  # imported under the interpreter (conftest)
from methods.kernels import kvquant_cpu
from tests.methods.kernels.kvquant_cases import random_cache

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 sums of terms up to ~20 (outliers: 6 sigma values)
SHAPES = [  # h, g, d, t0, tq, k_bits, v_bits, k_outliers, v_outliers
    (3, 3, 16, 1, 37, 3, 2, 9, 7),
    (1, 1, 8, 0, 20, 2, 4, 5, 4),
    (2, 3, 24, 3, 300, 4, 3, 40, 30),  # > one 256-token span, d = 24: 3-bit rows of 9 bytes
    (2, 2, 16, 1, 1, 4, 4, 1, 0),  # one quantized token
    (3, 1, 32, 2, 61, 2, 2, 0, 12),  # no key outliers
    (3, 3, 64, 1, 300, 4, 4, 600, 500),  # SmolLM2's heads (AVX-512 path: D % 32 == 0)
    (2, 4, 128, 0, 70, 3, 2, 300, 200),  # Llama's head_dim, 3-bit keys
]


def query(h, g, d, seed=1):
    return torch.randn(1, h * g, 1, d, generator=torch.Generator().manual_seed(seed))


def case(h, g, d, t0, tq, kb, vb, ko, vo):
    return random_cache(h=h, d=d, t0=t0, tq=tq, k_bits=kb, v_bits=vb, k_outliers=ko,
                        v_outliers=vo), query(h, g, d)


def need_c_kernel():
    if not cpu_build.compiler_available():
        pytest.skip("no C compiler here: KVQuant's CPU kernel cannot be built (torch path instead)")
    assert kvquant_cpu.library() is not None, kvquant_cpu.build_error()


def test_reference_is_dequantize_rotate_attend():
    """The torch path by hand on a tiny case: keys from codebook * scale + zero, the outlier
    element replaced, rotated at its position; softmax over all tokens."""
    cache, q = case(1, 1, 8, 1, 3, 2, 2, 1, 0)
    keys, values = ka.dequantize_cache(cache, torch.float32)
    codes = ka.unpack_bits(cache.k_codes, 2)[0, 0]  # (3, 8)
    pre = cache.key_codebook[codes] * cache.key_scale[0] + cache.key_zero[0]
    token, lane, value = cache.k_outliers
    pre[token.item() - 1, lane.item()] = value.float()
    half = 4
    for i in range(3):
        p = i + 1  # after one exact token
        angle = p * cache.inv_freq
        x, y = pre[i, :half], pre[i, half:]
        want = torch.cat([x * angle.cos() - y * angle.sin(), y * angle.cos() + x * angle.sin()])
        torch.testing.assert_close(keys[0, 0, 1 + i], want, **TOL)
    scores = (q[0, :, 0] @ keys[0, 0].T) * 0.3
    want = scores.softmax(-1) @ values[0, 0]
    torch.testing.assert_close(ka.decode_attention_torch(q, cache, 0.3)[0, :, 0], want, **TOL)


@pytest.mark.parametrize("vector", [True, False], ids=["vector", "portable"])
@pytest.mark.parametrize("shape", SHAPES)
def test_c_kernel_equals_torch_reference(shape, vector):
    """Both C paths: AVX-512 (where built and D % 32 == 0; outliers added as corrections) and
    the portable one (outliers written into L1 blocks)."""
    need_c_kernel()
    cache, q = case(*shape)
    torch.testing.assert_close(kvquant_cpu.decode_attention(q, cache, 0.3, vector=vector),
                               ka.decode_attention_torch(q, cache, 0.3), **TOL)


def test_the_vector_path_runs_where_it_applies():
    """Its sums run in another order: not bit-identical to the portable path (so it ran)."""
    need_c_kernel()
    if not kvquant_cpu.vector_path():
        pytest.skip("built without AVX-512: the portable path serves every shape")
    cache, q = case(*SHAPES[5])
    vec = kvquant_cpu.decode_attention(q, cache, 0.3)
    assert not torch.equal(vec, kvquant_cpu.decode_attention(q, cache, 0.3, vector=False))


@pytest.mark.parametrize("shape,splits", [(SHAPES[0], 3), (SHAPES[1], 1), (SHAPES[3], 1),
                                          (SHAPES[4], 2)])
def test_triton_kernel_equals_torch_reference(shape, splits):
    """Interpreter: tiles of 16 tokens cut mid-way, the exact tokens inside the first tile, split-K
    partials merged; outliers across tile boundaries."""
    cache, q = case(*shape)
    assert ka.decode_kernel(q.device) == "triton"  # TRITON_INTERPRET=1 (conftest)
    torch.testing.assert_close(ka.decode_attention_triton(q, cache, 0.3, splits=splits),
                               ka.decode_attention_torch(q, cache, 0.3), **TOL)


def test_cases_are_sensitive_to_outliers_and_rotation():
    """A kernel that skipped the outliers, wrote them into a neighbouring channel, or attended the keys
    unrotated would differ from the reference by far more than the tolerance."""
    cache, q = case(*SHAPES[0])
    want = ka.decode_attention_torch(q, cache, 0.3)
    token, lane, value = cache.k_outliers
    variants = {
        "no key outliers": cache._replace(k_outliers=None),
        "no value outliers": cache._replace(v_outliers=None),
        "key outlier channel off by one": cache._replace(k_outliers=(token, lane ^ 1, value)),
        "unrotated keys": cache._replace(rope_cos=torch.ones_like(cache.rope_cos),
                                         rope_sin=torch.zeros_like(cache.rope_sin),
                                         inv_freq=torch.zeros_like(cache.inv_freq)),
    }
    for name, wrong in variants.items():
        assert (ka.decode_attention_torch(q, wrong, 0.3) - want).abs().max() > 1e-3, name


def test_c_kernel_reads_strided_views_and_ignores_the_thread_count():
    """Codes and scales as views into larger buffers (as the layer's growing storage hands them),
    and the same result on 1 and 2 threads (a fixed split of the token sums)."""
    need_c_kernel()
    cache, q = case(2, 3, 64, 1, 600, 4, 2, 240, 200)
    grown = {}
    for name in ("k_codes", "v_codes", "v_scale", "v_zero"):
        x = getattr(cache, name)
        buffer = torch.zeros(*x.shape[:2], x.shape[2] + 40, *x.shape[3:], dtype=x.dtype)
        buffer[:, :, :x.shape[2]] = x
        grown[name] = buffer[:, :, :x.shape[2]]
    strided = cache._replace(**grown)
    assert not strided.k_codes.is_contiguous()
    threads = torch.get_num_threads()
    want = ka.decode_attention_torch(q, cache, 0.2)
    for vector in (True, False):
        try:
            torch.set_num_threads(1)
            one = kvquant_cpu.decode_attention(q, strided, 0.2, vector=vector)
            torch.set_num_threads(2)
            two = kvquant_cpu.decode_attention(q, strided, 0.2, vector=vector)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, two)
        torch.testing.assert_close(one, want, **TOL)


def test_dispatch_without_the_interpreter_takes_the_c_kernel(monkeypatch):
    need_c_kernel()
    cache, q = case(*SHAPES[0])
    monkeypatch.delenv("TRITON_INTERPRET")
    assert ka.decode_kernel(q.device) == "c"
    calls = []
    real = kvquant_cpu.decode_attention
    monkeypatch.setattr(kvquant_cpu, "decode_attention", lambda *a: calls.append(1) or real(*a))
    ka.decode_attention(q, cache, 0.3)
    assert calls == [1]


@pytest.mark.gpu
def test_triton_kernel_on_cuda_at_long_context():
    """Llama-3-8B-like KV heads (8, g = 4, D = 128), 16K tokens, 1 % outliers: compiled kernel ==
    torch reference (fp32 cache, fp16 query)."""
    tq, lanes = 16383, 8 * 128
    cache = random_cache(h=8, d=128, t0=1, tq=tq, k_bits=4, v_bits=2,
                         k_outliers=tq * lanes // 100, v_outliers=tq * lanes // 100)
    cache = ka.KVQuantCache(*(tuple(p.cuda() for p in x) if isinstance(x, tuple)
                              else x.cuda() if isinstance(x, torch.Tensor) else x for x in cache))
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.float16)
    got = ka.decode_attention(q, cache, 128 ** -0.5)
    want = ka.decode_attention_torch(q, cache, 128 ** -0.5)
    assert got.is_cuda and got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
