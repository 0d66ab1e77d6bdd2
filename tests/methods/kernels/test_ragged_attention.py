"""Attention over ragged heads read in place (methods.kernels.ragged_attention): the Triton kernel
(CPU interpreter here), the C kernel and the packed torch path against the dense masked torch
reference, on contiguous buffers and paged per-head block tables, GQA, irregular lengths with
zero- and one-token heads; unused slots poisoned with NaN, so a kernel reading past a head's
length or outside its blocks fails; paged == contiguous bit for bit on the C path. The reference
itself against SDPA on rectangular heads. The interpreter costs ~10 ms per program: kernel
checks are a few calls on small shapes."""

import math

import pytest
import torch
import torch.nn.functional as F

from kvcore.paged import BlockPool, PagedRows
from kvcore.storage import ContiguousRows
from methods.kernels import ragged_attention as ra
from methods.kernels import ragged_attention_cpu

NAN = float("nan")


def padded(lengths, d, gen, dtype=torch.float32):
    """K and V `(B, H_kv, T, D)` with NaN in every slot past a head's length."""
    b, h = lengths.shape
    t = max(1, int(lengths.max()))
    k, v = torch.randn(b, h, t, d, generator=gen), torch.randn(b, h, t, d, generator=gen)
    dead = torch.arange(t).view(1, 1, t) >= lengths[..., None]
    k[dead], v[dead] = NAN, NAN
    return k.to(dtype), v.to(dtype)


def stored(layout, k, v, lengths, block_tokens=4):
    """K/V held as ragged rows of `layout`, as HeadBlocks. Paged: blocks drawn in a scrambled
    order from pools whose free blocks are NaN; contiguous: a buffer wider than the rows."""
    rows = []
    for seed, x in enumerate((k, v)):
        if layout == "paged":  # K and V draw their blocks in different orders: own tables
            pools = [nan_pool(block_tokens, heads, x, seed) for heads in (x.shape[1], 1)]
            r = PagedRows(pools[0], head_pool=lambda pool=pools[1]: pool)  # (rectangular, heads)
        else:
            r = ContiguousRows()
            wide = torch.full((*x.shape[:2], x.shape[2] + 37, x.shape[3]), NAN, dtype=x.dtype)
            wide[:, :, : x.shape[2]] = x
            x = wide
        r.assign(x, lengths)
        rows.append(r)
    return rows


def nan_pool(block_tokens, heads, like, seed):
    """A pool of blocks of `heads` heads, all NaN, its free list shuffled by `seed`."""
    pool = BlockPool(block_tokens)
    warm = PagedRows(pool)
    warm.append(torch.full((1, heads, 1024, like.shape[-1]), NAN, dtype=like.dtype,
                           device=like.device))
    warm.release()
    order = torch.randperm(len(pool.free), generator=torch.Generator().manual_seed(seed))
    pool.free = [pool.free[i] for i in order.tolist()]
    return pool


def blocks_of(rows):
    return [r.in_place() for r in rows]


CASES = [  # (B, H_q, H_kv, D, lengths)
    (1, 9, 3, 64, [[37, 5, 1]]),  # SmolLM2's 9/3 heads
    (2, 4, 2, 8, [[0, 19], [3, 1]]),  # a zero-length head, batch 2
    (1, 4, 4, 16, [[8, 8, 8, 8]]),  # rectangular, no GQA
    (1, 8, 2, 24, [[70, 2]]),  # D not a power of two, groups of 4
]


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("b, h_q, h_kv, d, lengths", CASES)
def test_triton_kernel_equals_reference(b, h_q, h_kv, d, lengths, layout, monkeypatch):
    monkeypatch.setattr(ra, "MAX_SPANS", 2)  # 16-token tiles, at most 2 spans: a head of 37
    monkeypatch.setattr(ra, "_block_n", lambda block_d: 16)  # is 2 spans of 2 tiles, the last
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor(lengths)
    k, v = padded(lengths, d, gen)
    query = torch.randn(b, h_q, 1, d, generator=gen)
    scaling = 1 / math.sqrt(d)
    want = ra.ragged_attention_ref(query, k, v, lengths, scaling)
    assert torch.isfinite(want).all()
    assert ra.use_triton(query)
    got = ra.ragged_decode_attention_triton(query, *blocks_of(stored(layout, k, v, lengths)),
                                            scaling)
    assert got.shape == (b, 1, h_q, d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_triton_kernel_in_half_precision():
    gen = torch.Generator().manual_seed(1)
    lengths = torch.tensor([[21, 0, 9]])
    k, v = padded(lengths, 16, gen, torch.bfloat16)
    query = torch.randn(1, 6, 1, 16, generator=gen).to(torch.bfloat16)
    want = ra.ragged_attention_ref(query, k, v, lengths, 0.25)
    got = ra.ragged_decode_attention_triton(query, *blocks_of(stored("paged", k, v, lengths)),
                                            0.25)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)


C_CASES = CASES + [(2, 9, 3, 64, [[600, 257, 0], [256, 1, 513]])]  # several 256-token spans


@pytest.mark.skipif(ragged_attention_cpu.library() is None, reason="no C compiler")
@pytest.mark.parametrize("b, h_q, h_kv, d, lengths", C_CASES)
def test_c_kernel_equals_reference_and_pages_equal_contiguous(b, h_q, h_kv, d, lengths):
    gen = torch.Generator().manual_seed(2)
    lengths = torch.tensor(lengths)
    k, v = padded(lengths, d, gen)
    query = torch.randn(b, h_q, 1, d, generator=gen)
    want = ra.ragged_attention_ref(query, k, v, lengths, 0.3)
    outs = {}
    for layout in ("contiguous", "paged"):
        kb, vb = blocks_of(stored(layout, k, v, lengths, block_tokens=16 if d == 64 else 4))
        assert ra.decode_kernel(query, kb, vb) == "c"
        outs[layout] = ra.ragged_attention(query, kb, vb, 0.3)
        torch.testing.assert_close(outs[layout], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(outs["paged"], outs["contiguous"])  # spans cut by token, not by block


@pytest.mark.skipif(ragged_attention_cpu.library() is None, reason="no C compiler")
def test_c_kernel_does_not_depend_on_the_thread_count():
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([[900, 300, 77]])
    k, v = padded(lengths, 64, gen)
    query = torch.randn(1, 9, 1, 64, generator=gen)
    kb, vb = blocks_of(stored("paged", k, v, lengths, 16))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ragged_attention_cpu.decode_attention(query, kb, vb, 0.125)
        torch.set_num_threads(2)
        two = ragged_attention_cpu.decode_attention(query, kb, vb, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("q", [1, 5])
def test_packed_torch_path_equals_reference(layout, q):
    """Heads of equal length packed into one SDPA call each (the path without a C compiler, and
    prefill chunks); a head shorter than the chunk has query rows that see nothing: zeros."""
    gen = torch.Generator().manual_seed(4)
    lengths = torch.tensor([[12, 0, 12], [3, 30, 7]])
    k, v = padded(lengths, 8, gen)
    query = torch.randn(2, 6, q, 8, generator=gen)
    want = ra.ragged_attention_ref(query, k, v, lengths, 0.5)
    got = ra.packed_attention(query, *blocks_of(stored(layout, k, v, lengths)), 0.5)
    assert got.shape == (2, q, 6, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0, :, 2:4], torch.zeros_like(got[0, :, 2:4]))  # the empty head


def test_reference_equals_sdpa_on_rectangular_heads():
    """With every head holding all its slots, the reference is plain causal attention."""
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(2, 3, 20, 16, generator=gen), torch.randn(2, 3, 20, 16, generator=gen)
    query = torch.randn(2, 6, 4, 16, generator=gen)
    lengths = torch.full((2, 3), 20)
    mask = torch.ones(4, 20, dtype=torch.bool).tril(diagonal=16)  # the chunk is the last 4
    want = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=0.25,
                                          enable_gqa=True).transpose(1, 2)
    got = ra.ragged_attention_ref(query, k, v, lengths, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    short = lengths.clone()
    short[1, 2] = 11  # one head shorter: its queries ignore slots 11.. (poisoned)
    k[1, 2, 11:] = NAN
    assert torch.isfinite(ra.ragged_attention_ref(query, k, v, short, 0.25)).all()


def test_shapes_are_checked():
    gen = torch.Generator().manual_seed(6)
    lengths = torch.tensor([[4, 4]])
    kb, vb = blocks_of(stored("contiguous", *padded(lengths, 8, gen), lengths))
    with pytest.raises(ValueError, match="H_q a multiple of H_kv"):
        ra.ragged_attention(torch.randn(1, 3, 1, 8), kb, vb, 1.0)
    with pytest.raises(ValueError, match="do not match the query's D=16"):
        ra.ragged_attention(torch.randn(1, 4, 1, 16), kb, vb, 1.0)


@pytest.mark.gpu
def test_triton_kernel_on_cuda_at_llama_scale():
    """Llama-3-8B heads (32/8, D 128), bf16, ragged heads up to 8K tokens in paged blocks of 16,
    compiled Triton against the reference."""
    gen = torch.Generator().manual_seed(7)
    lengths = torch.tensor([[8192, 1, 0, 4000, 517, 8191, 2048, 300]] * 2)
    k, v = padded(lengths, 128, gen, torch.bfloat16)
    query = torch.randn(2, 32, 1, 128, generator=gen).to(torch.bfloat16)
    want = ra.ragged_attention_ref(query.cuda(), k.cuda(), v.cuda(), lengths.cuda(), 128 ** -0.5)
    rows = stored("paged", k.cuda(), v.cuda(), lengths.cuda(), block_tokens=16)
    got = ra.ragged_attention(query.cuda(), *blocks_of(rows), 128 ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
