"""kvcore.storage: token-major rows behave as the contiguous layout, with a contiguous prefix."""

import torch

from kvcore.storage import ContiguousRows, TokenMajorRows


def rows_pair():
    return ContiguousRows(), TokenMajorRows()


def test_token_major_rows_match_contiguous_rows_through_every_operation():
    g = torch.Generator().manual_seed(0)
    ref, tm = rows_pair()
    for rows in (ref, tm):
        rows.assign(torch.arange(2 * 3 * 5 * 4, dtype=torch.float32).reshape(2, 3, 5, 4))
    ops = [("append", 1), ("append", 300), ("drop_one", None), ("write_at", 2),
           ("keep", 40), ("append", 7), ("drop_one", None)]
    for op, arg in ops:
        if op == "append":
            new = torch.randn(2, 3, arg, 4, generator=g)
            ref.append(new), tm.append(new)
        elif op == "write_at":
            new = torch.randn(2, 3, 3, 4, generator=g)
            ref.write_at(arg, new), tm.write_at(arg, new)
        elif op == "drop_one":
            slot = torch.randint(0, ref.length - 1, (2, 3), generator=g)
            ref.drop_one(slot), tm.drop_one(slot)
        else:
            index = torch.stack([torch.randperm(ref.length, generator=g)[:arg]
                                 for _ in range(6)]).reshape(2, 3, arg)
            ref.keep(index), tm.keep(index)
        assert tm.length == ref.length
        assert torch.equal(tm.view(), ref.view())
        assert tm.block().is_contiguous()  # one block: what a host-to-device copy needs
        assert tm.used_bytes() == ref.used_bytes() <= tm.allocated_bytes()
    fork = tm.fork()
    tm.append(torch.zeros(2, 3, 1, 4))
    assert torch.equal(fork.view(), ref.view())  # the fork is independent
    tm.release()
    assert tm.view() is None and tm.used_bytes() == tm.allocated_bytes() == 0


def test_appends_write_in_place_with_amortised_growth():
    tm = TokenMajorRows()
    pointers = set()
    for _ in range(1000):
        tm.append(torch.ones(1, 2, 1, 3, dtype=torch.uint8))
        pointers.add(tm.buffer.data_ptr())
    assert tm.length == 1000 and len(pointers) <= 4  # 256 -> 512 -> 1024 rows
    assert tm.view().shape == (1, 2, 1000, 3)
