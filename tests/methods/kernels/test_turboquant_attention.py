"""TurboQuant decode attention from the codes (methods/kernels/turboquant_attention.py): the C
kernel (every path: AVX-512 where built and the shape fits, AVX2 from a second build without
AVX-512, and the portable one) and the Triton
kernel (CPU interpreter here) against the torch reference on small irregular shapes (with and
without an outlier split, QJL keys or MSE keys, a tail or none, GQA g = 1 and 3, several blocks),
and a check that the cases can fail (a kernel that ignored the block permutation or the QJL term
would differ)."""

import platform

import pytest
import torch

from methods import build_method
from methods.model import ModelInfo
from methods.kernels import cpu_build, turboquant_cpu
from methods.kernels import turboquant_attention as ta  # under the interpreter (conftest)

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 sums of D products of O(1) terms
CASES = [  # h, g, d, tokens, settings
    (2, 3, 16, 29, dict(block_tokens=8)),  # 3.5 bits: split, QJL keys; a 5-token tail
    (1, 1, 16, 24, dict(block_tokens=8, k_bits=2.5, v_bits=2.5)),  # no tail
    (3, 3, 64, 70, dict(block_tokens=32, k_bits=3, v_bits=2)),  # integer widths: no split
    (2, 2, 32, 41, dict(block_tokens=6, k_quantizer="mse", outlier_ratio=0.5)),  # MSE keys, 5 bits
    (1, 3, 8, 17, dict(block_tokens=4, k_bits=2.5, v_bits=3.5)),  # stories260K's head_dim
    (3, 3, 64, 200, dict(block_tokens=64, k_bits=2.5, v_bits=2.5)),  # SmolLM2: byte tables
    (3, 3, 64, 200, dict(block_tokens=64, k_bits=3.5, v_bits=3.5)),  # 4-bit and 2-bit tables
    (2, 3, 128, 70, dict(block_tokens=32, k_bits=2.5, v_bits=3.5)),  # Llama's head_dim
]


def cache(h, g, d, tokens, settings, seed=0):
    method = build_method("turboquant", **settings)
    info = ModelInfo(num_layers=1, num_heads=h * g, num_kv_heads=h, head_dim=d, max_positions=512)
    layer = method.make_layer(0, info)
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, h, tokens, d, generator=gen)
    keys[..., 1] *= 6  # an outlier channel
    layer.update(keys, torch.randn(1, h, tokens, d, generator=gen), None)
    query = torch.randn(1, h * g, 1, d, generator=gen)
    return layer._cache(), query


# build variants: the CPU's best (AVX-512 where it has it), and without AVX-512 (AVX2 on x86-64)
NO_AVX512 = ("-mno-avx512f",)
PATHS = [((), True), ((), False), (NO_AVX512, True)]  # (extra_flags, vector)
PATH_IDS = ["native", "portable", "no_avx512"]


def need_c_kernel(extra_flags=()):
    if not cpu_build.compiler_available():
        pytest.skip("no C compiler here: TurboQuant's CPU kernel cannot be built (torch path)")
    if extra_flags and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"{' '.join(extra_flags)} is an x86-64 build variant; this is "
                    f"{platform.machine()}")
    lib = turboquant_cpu.library(extra_flags)
    assert lib is not None, turboquant_cpu.build_error(extra_flags)


@pytest.mark.parametrize("extra_flags, vector", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("h, g, d, tokens, settings", CASES)
def test_c_kernel_equals_the_reference(h, g, d, tokens, settings, extra_flags, vector):
    need_c_kernel(extra_flags)
    c, q = cache(h, g, d, tokens, settings)
    ref = ta.decode_attention_torch(q, c, d ** -0.5)
    out = turboquant_cpu.decode_attention(q, c, d ** -0.5, vector=vector, extra_flags=extra_flags)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("extra_flags, path", [((), "avx512"), (NO_AVX512, "avx2")],
                         ids=["avx512", "avx2"])
@pytest.mark.parametrize("case", [CASES[5], CASES[6]], ids=["2.5bit", "3.5bit"])
def test_the_vector_path_runs_where_it_applies(case, extra_flags, path):
    """At SmolLM2's shapes its sums run in another order: not bit-identical to the portable path
    (so it ran)."""
    need_c_kernel(extra_flags)
    if turboquant_cpu.vector_path(extra_flags) != path:
        pytest.skip(f"the build has {turboquant_cpu.vector_path(extra_flags)}, not {path} "
                    "(the CPU lacks it, or KVH_KERNEL_FLAGS turned it off)")
    c, q = cache(*case)
    vec = turboquant_cpu.decode_attention(q, c, 0.3, extra_flags=extra_flags)
    portable = turboquant_cpu.decode_attention(q, c, 0.3, vector=False, extra_flags=extra_flags)
    assert not torch.equal(vec, portable)


@pytest.mark.parametrize("extra_flags, vector", PATHS, ids=PATH_IDS)
def test_c_kernel_ignores_the_thread_count(extra_flags, vector):
    """A fixed split of the blocks into work items: the same bits on 1 and 2 threads."""
    need_c_kernel(extra_flags)
    c, q = cache(3, 3, 64, 2100, dict(block_tokens=64, k_bits=2.5, v_bits=2.5))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = turboquant_cpu.decode_attention(q, c, 0.125, vector, extra_flags)
        torch.set_num_threads(2)
        two = turboquant_cpu.decode_attention(q, c, 0.125, vector, extra_flags)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("h, g, d, tokens, settings", CASES[:3])
def test_triton_kernel_equals_the_reference(h, g, d, tokens, settings):
    c, q = cache(h, g, d, tokens, settings)
    assert ta.decode_kernel(q.device) == "triton"  # TRITON_INTERPRET=1 (conftest)
    ref = ta.decode_attention_torch(q, c, d ** -0.5)
    torch.testing.assert_close(ta.decode_attention_triton(q, c, d ** -0.5), ref, **TOL)


def test_the_cases_can_fail():
    """The permutation and the QJL term change the output well beyond the tolerance: a kernel
    that ignored either would not pass."""
    c, q = cache(2, 3, 16, 29, dict(block_tokens=8))
    ref = ta.decode_attention_torch(q, c, 0.25)
    no_qjl = c._replace(keys=c.keys._replace(rnorms=torch.zeros_like(c.keys.rnorms)))
    assert (ta.decode_attention_torch(q, no_qjl, 0.25) - ref).abs().max() > 1e-3
    no_split = c._replace(keys=c.keys._replace(masks=torch.zeros_like(c.keys.masks)))
    assert (ta.decode_attention_torch(q, no_split, 0.25) - ref).abs().max() > 1e-3
