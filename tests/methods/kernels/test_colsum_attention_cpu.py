"""methods/kernels/colsum_attention_cpu.c: H2O's decode step (attention + column sums + the
eviction pick) against the eager path, whatever the thread count."""

import pytest
import torch

from methods.kernels import colsum_attention_cpu as ca
from methods.kernels import cpu_build
from methods.scoring import attention_with_probs, group_column_sums


def need_c_kernel():
    if not cpu_build.compiler_available():
        pytest.skip("no C compiler here: the kernel cannot be built (H2O runs its eager path)")
    assert ca.library() is not None, ca.build_error()


def case(b, hq, h, t, d, seed):
    """A query, strided K/V/accumulator/positions views (slices of larger buffers, as the
    eviction template holds them)."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(b, hq, 1, d, generator=gen) * 3  # sharp rows: a real max to subtract
    keys = torch.randn(b, h, t + 5, d, generator=gen)[:, :, :t]
    values = torch.randn(b, h, t + 9, d, generator=gen)[:, :, :t]
    acc = torch.rand(b, h, t + 7, generator=gen)[:, :, :t]
    positions = torch.stack([torch.randperm(t, generator=gen) for _ in range(b * h)]).view(b, h, t)
    return query, keys, values, acc, positions


def eager(query, keys, values, acc, positions, lo, hi):
    out, probs = attention_with_probs(query, keys, values, None, 0.125)
    acc = acc + group_column_sums(probs, keys.shape[1])
    guarded = acc.masked_fill((positions < lo) | (positions >= hi), float("inf"))
    return out, acc, guarded.argmin(dim=-1)  # the template's lowest_slot


@pytest.mark.parametrize("b,hq,h,t,d", [(1, 9, 3, 1025, 64), (2, 6, 2, 37, 16),
                                        (1, 4, 4, 600, 128), (1, 2, 1, 1, 8), (1, 6, 2, 257, 32)])
def test_equals_eager_attention_column_sums_and_argmin(b, hq, h, t, d):
    """GQA (g = 3, 2, 1), one and several token spans, batch 2, a single token."""
    need_c_kernel()
    query, keys, values, acc, positions = case(b, hq, h, t, d, seed=t)
    lo, hi = min(2, t - 1), max(t - 3, 1)
    want_out, want_acc, want_slot = eager(query, keys, values, acc, positions, lo, hi)
    out, slot = ca.decode_attention(query, keys, values, 0.125, acc, (positions, lo, hi))
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(acc, want_acc, rtol=1e-5, atol=1e-6)  # updated in place
    # the pick is exactly the argmin of the scores the kernel wrote
    assert torch.equal(slot, acc.masked_fill((positions < lo) | (positions >= hi),
                                             float("inf")).argmin(dim=-1))
    assert torch.equal(slot, want_slot)


def test_ties_take_the_first_slot_and_nothing_eligible_gives_slot_zero():
    need_c_kernel()
    query, keys, values, _, _ = case(1, 4, 2, 300, 16, seed=1)
    acc = torch.zeros(1, 2, 300)
    values = torch.zeros_like(values)
    positions = torch.arange(300).expand(1, 2, 300).contiguous()
    query = torch.zeros_like(query)  # uniform attention: every token's score is the same
    _, slot = ca.decode_attention(query, keys, values, 0.125, acc, (positions, 40, 280))
    assert slot.tolist() == [[40, 40]]  # torch's argmin: the first minimum
    _, slot = ca.decode_attention(query, keys, values, 0.125, acc, (positions, 300, 300))
    assert slot.tolist() == [[0, 0]]  # all protected: argmin over all +inf is slot 0


def test_result_does_not_depend_on_the_thread_count():
    need_c_kernel()
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            query, keys, values, acc, positions = case(2, 6, 3, 1500, 32, seed=7)
            out, slot = ca.decode_attention(query, keys, values, 0.2, acc, (positions, 0, 1200))
            results.append((out, acc, slot))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(x, y) for x, y in zip(*results))


def test_applies_only_to_fp32_decode_rows_and_plain_calls():
    from methods.scoring import plain_decode_row

    need_c_kernel()
    query, keys, values, acc, _ = case(1, 4, 2, 50, 16, seed=2)
    assert ca.applies(query, keys, values, acc)
    assert not ca.applies(query, keys.half(), values.half(), acc)
    assert not ca.applies(query.expand(1, 4, 2, 16), keys, values, acc)  # two rows
    assert not ca.applies(query, keys, values, acc.double())
    assert ca.kernel_name(torch.device("cpu")) == "c"
    assert plain_decode_row(query, None, {"scaling": 0.25})
    assert not plain_decode_row(query, torch.zeros(1, 1, 1, 50), {})  # a mask
    assert not plain_decode_row(query, None, {"softcap": 30.0})
    assert not plain_decode_row(query.expand(1, 4, 2, 16), None, {})


def test_an_empty_cache_raises_instead_of_returning_unwritten_outputs():
    need_c_kernel()
    query, keys, values, acc, _ = case(1, 4, 2, 5, 16, seed=3)
    with pytest.raises(ValueError, match="sizes the kernel cannot serve"):
        ca.decode_attention(query, keys[:, :, :0], values[:, :, :0], 0.25, acc[:, :, :0])
