"""Sparse decode attention: the Triton kernel (CPU interpreter here; tests/conftest.py sets
TRITON_INTERPRET=1) equals the torch reference; the reference equals masked dense attention on the
same selection; duplicates, dispatch and argument checks.

The interpreter costs ~10 ms per program (one per query head), so kernel checks are a handful of
single calls on small shapes; the reference-vs-dense checks are torch only.
"""

import math

import pytest
import torch

from methods.kernels import sparse_attention as sa
from methods.scoring import attention_with_probs, expand_kv


def make_inputs(b, h_q, h_kv, t, n, d, dtype=torch.float32, seed=0, token_strided=False,
                index_dtype=torch.int64):
    """query (B, H_q, D), keys/values (B, H_kv, T, D), index (B, H_kv, N) of distinct slots."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(b, h_q, d, generator=g)
    if token_strided:  # (B, T, H, D) storage seen as (B, H, T, D): token stride H * D, not D
        keys = torch.randn(b, t, h_kv, d, generator=g).transpose(1, 2)
        values = torch.randn(b, t, h_kv, d, generator=g).transpose(1, 2)
    else:
        keys = torch.randn(b, h_kv, t, d, generator=g)
        values = torch.randn(b, h_kv, t, d, generator=g)
    index = torch.stack([torch.randperm(t, generator=g)[:n] for _ in range(b * h_kv)])
    index = index.view(b, h_kv, n).to(index_dtype)
    return query.to(dtype), keys.to(dtype), values.to(dtype), index


def poison_unselected(keys, values, index):
    """NaN in every cache row the index does not name: a kernel that reads one leaks NaN."""
    chosen = torch.zeros(keys.shape[:3], dtype=torch.bool)
    chosen.scatter_(2, index.long(), True)
    keys, values = keys.clone(), values.clone()
    keys[~chosen] = float("nan")
    values[~chosen] = float("nan")
    return keys, values


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


# --- kernel == reference (interpreter) ------------------------------------------------------------
@pytest.mark.parametrize("b, h_q, h_kv, t, n, d, dtype, strided", [
    (1, 9, 3, 40, 1, 8, torch.float32, False),  # N = 1, SmolLM2's 9/3 heads
    (1, 9, 3, 64, 7, 64, torch.float32, True),  # token-strided cache
    (2, 2, 2, 50, 33, 8, torch.float32, False),  # no GQA, batch 2
    (1, 4, 2, 128, 100, 128, torch.float32, True),  # D = 128: BLOCK_N = 64, two blocks
    (1, 8, 2, 48, 33, 16, torch.float32, False),  # groups of 4
    (1, 9, 3, 120, 100, 64, torch.float16, False),
    (1, 4, 2, 40, 7, 16, torch.bfloat16, True),
])
def test_kernel_equals_reference(b, h_q, h_kv, t, n, d, dtype, strided):
    query, keys, values, index = make_inputs(b, h_q, h_kv, t, n, d, dtype, token_strided=strided,
                                             index_dtype=torch.int32 if strided else torch.int64)
    keys, values = poison_unselected(keys, values, index)
    scaling = 1 / math.sqrt(d)
    assert sa.use_triton(query)
    got = sa.sparse_decode_attention(query, keys, values, index, scaling)
    want = sa.sparse_decode_attention_ref(query, keys, values, index, scaling)
    assert got.shape == (b, h_q, d) and got.dtype == dtype
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_online_softmax_across_many_blocks(monkeypatch):
    """16-lane blocks: N=100 is 7 blocks, the last ragged; the largest score sits in a late block
    (an early-block max would be rescaled by exp(-large) -> a wrong output if mishandled)."""
    monkeypatch.setattr(sa, "_block_n", lambda n, block_d: 16)
    query, keys, values, index = make_inputs(1, 3, 1, 200, 100, 8, seed=3)
    query = query * 4  # peaked softmax: weights span many orders of magnitude
    late = index[0, 0, 90].item()
    keys[0, 0, late] = query[0, 0] / query[0, 0].norm() * 6  # head 0's best key, in block 6
    got = sa.sparse_decode_attention(query, keys, values, index, 0.5)
    want = sa.sparse_decode_attention_ref(query, keys, values, index, 0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    probs = torch.softmax((keys[0, 0, index[0, 0]] @ query[0, 0]) * 0.5, 0)
    assert probs.argmax() == 90 and probs.max() > 0.5  # the late key really dominates


def test_duplicate_indices_count_twice_like_the_reference():
    """A slot listed twice is two softmax entries (gather semantics), i.e. its logit + log 2;
    a keep-mask would count it once. The kernel agrees with the reference."""
    query, keys, values, _ = make_inputs(1, 2, 1, 10, 3, 8, seed=4)
    index = torch.tensor([[[2, 5, 2]]])
    got = sa.sparse_decode_attention(query, keys, values, index, 0.4)
    want = sa.sparse_decode_attention_ref(query, keys, values, index, 0.4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    logits = (keys[0, 0, [2, 5]] @ query[0].T).T * 0.4  # (H_q, 2 distinct slots)
    weights = torch.softmax(logits + torch.tensor([math.log(2), 0.0]), -1)
    torch.testing.assert_close(want[0], weights @ values[0, 0, [2, 5]], rtol=1e-5, atol=1e-6)
    once = sa.sparse_decode_attention_ref(query, keys, values, index[..., :2], 0.4)
    assert (once - want).abs().max() > 1e-3  # the duplicate really changes the answer


# --- reference == masked dense attention (torch only) ---------------------------------------------
@pytest.mark.parametrize("b, h_q, h_kv, t, n, d", [
    (1, 9, 3, 64, 1, 8), (2, 9, 3, 64, 33, 64), (1, 4, 4, 30, 30, 16), (1, 8, 2, 200, 100, 128)])
def test_reference_equals_masked_dense_attention(b, h_q, h_kv, t, n, d):
    query, keys, values, index = make_inputs(b, h_q, h_kv, t, n, d, seed=1)
    scaling = 1 / math.sqrt(d)
    keep = torch.zeros(b, h_kv, t, dtype=torch.bool).scatter_(2, index, True)
    keep = expand_kv(keep[..., None], h_q // h_kv)[..., 0][:, :, None]  # (B, H_q, 1, T)
    # attention_mask None with one query is "causal over everything": the mask is the selection.
    dense, _ = attention_with_probs(query[:, :, None], keys, values, None, scaling, keep=keep)
    got = sa.sparse_decode_attention_ref(query, keys, values, index, scaling)
    torch.testing.assert_close(got, dense[:, 0], rtol=1e-5, atol=1e-6)


# --- dispatch and checks --------------------------------------------------------------------------
def test_cpu_without_interpreter_takes_the_torch_path(monkeypatch):
    calls = []
    real = sa.sparse_decode_attention_ref
    monkeypatch.setattr(sa, "sparse_decode_attention_ref", lambda *a: calls.append(1) or real(*a))
    query, keys, values, index = make_inputs(1, 2, 1, 12, 4, 8, seed=2)
    with_kernel = sa.sparse_decode_attention(query, keys, values, index, 0.3)
    assert calls == []  # TRITON_INTERPRET=1 (conftest): the kernel ran in the interpreter
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not sa.use_triton(query)
    with_torch = sa.sparse_decode_attention(query, keys, values, index, 0.3)
    assert calls == [1]
    torch.testing.assert_close(with_kernel, with_torch, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change, message", [
    (lambda q, k, v, i: (q, k, v, i[..., :0]), "N = 0"),
    (lambda q, k, v, i: (q[:, :2], k, v, i), "not a multiple"),
    (lambda q, k, v, i: (q, k, v, i.float()), "index dtype"),
    (lambda q, k, v, i: (q, k, v[..., :4], i), "values"),
    (lambda q, k, v, i: (q, k, v, i[:, :1]), "is not"),
    (lambda q, k, v, i: (q, k, v, i.to("meta")), "different devices"),
])
def test_bad_arguments_are_refused(change, message, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")  # checks run before dispatch; keep this test cheap
    args = change(*make_inputs(1, 3, 3, 10, 4, 8))
    with pytest.raises(ValueError, match=message):
        sa.sparse_decode_attention(*args, 0.3)


# --- on a GPU -------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_kernel_equals_reference_on_cuda_at_llama_scale():
    """Llama-3-8B-like decode: 32 query heads over 8 KV heads, 8K cache, 20 % selected, fp16."""
    query, keys, values, index = make_inputs(1, 32, 8, 8192, 1638, 128, torch.float16, seed=7)
    query, keys, values, index = (x.cuda() for x in (query, keys, values, index))
    index = index.sort(-1).values  # InfiniGen passes sorted slots
    got = sa.sparse_decode_attention(query, keys, values, index, 1 / math.sqrt(128))
    want = sa.sparse_decode_attention_ref(query, keys, values, index, 1 / math.sqrt(128))
    assert got.is_cuda and got.dtype == torch.float16
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    # a token-strided view of a (B, T, H, D) cache gives the same answer
    strided_k = keys.transpose(1, 2).contiguous().transpose(1, 2)
    strided_v = values.transpose(1, 2).contiguous().transpose(1, 2)
    again = sa.sparse_decode_attention(query, strided_k, strided_v, index, 1 / math.sqrt(128))
    torch.testing.assert_close(again, got, rtol=0, atol=0)
