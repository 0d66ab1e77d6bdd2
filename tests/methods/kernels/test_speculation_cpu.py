"""methods/kernels/speculation_cpu.c: InfiniGen's speculation (group-max partial scores, count
above max - alpha, the best-scored slots) against torch, whatever the thread count."""

import pytest
import torch

from methods.kernels import cpu_build
from methods.kernels import speculation_cpu as sc


def need_c_kernel():
    if not cpu_build.compiler_available():
        pytest.skip("no C compiler here: the kernel cannot be built (torch speculation instead)")
    assert sc.library() is not None, sc.build_error()


def case(b, h, g, k, t, seed):
    """Small integers: every dot product is exact in fp32 whatever the summation order, so the
    kernel's ranking can be compared with torch's exactly (ties included)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-3, 4, (b, h, g, k), generator=gen).float()
    pk = torch.randint(-3, 4, (b, h, k, t + 11), generator=gen).float()[..., :t]  # a buffer view
    return q, pk


def reference(q, pk, cap, alpha, shared):
    scores = (q @ pk).amax(2)  # (B, H, T): the group's max logit
    count = (scores > scores.amax(-1, keepdim=True) - alpha).sum(-1)
    if shared:
        count = count.float().mean().floor().long().expand_as(count)
    return scores, count.clamp(1, cap)


@pytest.mark.parametrize("b,h,g,k,t,cap,alpha,shared", [
    (1, 3, 3, 18, 4100, 820, 5.0, True), (2, 2, 4, 7, 50, 10, 1.0, False),
    (1, 1, 1, 5, 1, 1, 5.0, True), (1, 4, 2, 16, 300, 300, 2.0, False),
    (1, 2, 5, 3, 130, 40, 100.0, False), (1, 3, 3, 9, 1000, 200, 0.5, True)])
def test_equals_torch_selection(b, h, g, k, t, cap, alpha, shared):
    """Counts equal torch's; each head's first `count` slots are its `count` best-scored tokens in
    slot order (ties at the boundary: the lower slots); the rest are other distinct slots."""
    need_c_kernel()
    q, pk = case(b, h, g, k, t, seed=t)
    scores, want_count = reference(q, pk, cap, alpha, shared)
    slots, count = sc.select(q, pk, cap, alpha, shared)
    assert torch.equal(count, want_count) and slots.shape == (b, h, cap)
    for bi in range(b):
        for hi in range(h):
            n, s = int(count[bi, hi]), scores[bi, hi]
            used = slots[bi, hi, :n].tolist()
            assert used == sorted(used) and len(set(slots[bi, hi].tolist())) == cap
            # the n best: a stable descending sort ranks equal scores by slot
            order = sorted(range(t), key=lambda i: (-s[i].item(), i))
            assert set(used) == set(order[:n])


def test_result_does_not_depend_on_the_thread_count():
    """Large enough for the kernel to use several threads (it keeps one for small work)."""
    need_c_kernel()
    q, pk = case(1, 4, 4, 16, 20000, seed=9)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(sc.select(q, pk, 4000, 3.0, False))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(x, y) for x, y in zip(*results))


def test_applies_only_where_it_computes_the_same():
    need_c_kernel()
    q, pk = case(1, 2, 3, 4, 20, seed=1)
    assert sc.applies(q, pk, 2, "max", False)
    assert not sc.applies(q, pk, 2, "mean", False)  # only the max group reduce
    assert not sc.applies(q, pk, 2, "max", True)  # the head-0 threshold quirk
    assert not sc.applies(q, pk, 1, "max", False)  # one skewing matrix per query head
    assert not sc.applies(q.double(), pk.double(), 2, "max", False)
    assert sc.kernel_name(torch.device("cpu")) == "c"


def test_sizes_it_cannot_serve_raise_instead_of_returning_unwritten_outputs():
    need_c_kernel()
    q, pk = case(1, 2, 3, 4, 20, seed=1)
    with pytest.raises(ValueError, match="sizes the kernel cannot serve"):
        sc.select(q, pk, 21, 1.0, True)  # more slots than tokens
