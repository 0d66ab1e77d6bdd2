"""benchmarks/kernel_bandwidth.py's cases on CPU (Triton interpreter, tiny sizes): the kernels it
times agree with their torch references and the bytes it divides by are the bytes read."""

import torch

from benchmarks import kernel_bandwidth as kb


def test_sparse_case_checks_the_kernel_and_counts_selected_rows():
    fn, nbytes = kb.sparse_case(b=1, t=64, ratio=0.25, dtype=torch.float32, device="cpu")
    assert fn().shape == (1, kb.H_Q, kb.HEAD_DIM)
    rows = 2 * 1 * kb.H_KV * 16 * kb.HEAD_DIM * 4  # K and V: 16 selected rows per KV head, fp32
    index = kb.H_KV * 16 * 4  # int32
    query_and_out = 2 * kb.H_Q * kb.HEAD_DIM * 4
    assert nbytes == rows + index + query_and_out


def test_kivi_case_checks_the_fused_kernel_and_counts_packed_bytes():
    fn, nbytes = kb.kivi_case(b=1, t=192, dtype=torch.float32, device="cpu", residual=64)
    assert fn().shape == (1, kb.H_Q, 1, kb.HEAD_DIM)
    t_q = 128  # (192 - 64) // 32 * 32 quantized tokens, 2 bits each: 4 per byte
    codes = 2 * kb.H_KV * kb.HEAD_DIM * t_q // 4
    scales = 2 * 2 * kb.H_KV * kb.HEAD_DIM * t_q // 32 * 2  # scale + zero, fp16, per group of 32
    residual = 2 * kb.H_KV * 64 * kb.HEAD_DIM * 4
    assert nbytes == codes + scales + residual + 2 * kb.H_Q * kb.HEAD_DIM * 4


def test_kvquant_case_checks_the_fused_kernel_and_counts_what_it_reads():
    """The case itself checks the kernel against the torch reference (one interpreted call)."""
    fn, nbytes = kb.kvquant_case(t=20, dtype=torch.float32, device="cpu", outlier_ratio=0.001)
    assert callable(fn)
    codes = 2 * kb.H_KV * 19 * kb.HEAD_DIM // 2  # 4-bit keys and values, 19 quantized tokens
    scales = 2 * 19 * 2  # value scale + zero per token, fp16
    outliers = 2 * int(0.001 * 19 * kb.H_KV * kb.HEAD_DIM) * 8  # token, lane, value
    offsets = 2 * 21 * 4
    rope = 2 * 20 * kb.HEAD_DIM // 2 * 4  # cos and sin rows of every position, fp32
    exact = 2 * kb.H_KV * kb.HEAD_DIM * 4
    assert nbytes == codes + scales + outliers + offsets + rope + exact + 2 * kb.H_Q * kb.HEAD_DIM * 4


def test_ragged_case_checks_the_kernel_and_counts_each_heads_rows():
    fn, nbytes = kb.ragged_case(b=1, t=32, dtype=torch.float32, device="cpu", block_tokens=16)
    assert fn().shape == (1, 1, kb.H_Q, kb.HEAD_DIM)
    lengths = (torch.linspace(0.25, 1.75, kb.H_KV) * 32).long()  # per-head tokens, mean 32
    rows = 2 * int(lengths.sum()) * kb.HEAD_DIM * 4  # K and V: each head's own rows, fp32
    tables = 2 * kb.H_KV * -(-int(lengths.max()) // 16) * 8  # int64 block ids, K and V
    assert nbytes == rows + tables + kb.H_KV * 8 + 2 * kb.H_Q * kb.HEAD_DIM * 4
