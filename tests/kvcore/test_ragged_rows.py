"""Ragged rows (per-head lengths, kvcore.storage) in both layouts: every operation against a per-head
reference, held and allocated bytes (paged: per-head block tables hold only what a head needs),
the rectangular special case (no per-head state, no head pool), in-place reads (no copy) and the
waste accounting on a hand case. Seconds."""

import pytest
import torch

from harness.core.accounting import KVLedger
from kvcore.paged import HEAD_POOL_SUFFIX, BlockPool, PagedKV, PagedRows
from kvcore.storage import ContiguousRows, TokenMajorRows
from methods.layer import KVLayer
from methods.model import ModelInfo

B, H, D, BT = 2, 3, 4, 4  # batch rows, heads, trailing dim, block tokens
ROW_BYTES = D * 4  # one head's token, fp32


class Reference:
    """Per-head lists of rows: what ragged rows must hold."""

    def __init__(self):
        self.heads = [[torch.empty(0, D) for _ in range(H)] for _ in range(B)]

    def lengths(self):
        return torch.tensor([[len(x) for x in row] for row in self.heads])

    def append(self, new):
        for b in range(B):
            for h in range(H):
                self.heads[b][h] = torch.cat([self.heads[b][h], new[b, h]])

    def keep(self, index, valid):
        for b in range(B):
            for h in range(H):
                self.heads[b][h] = self.heads[b][h][index[b, h, :valid[b, h]]]

    def drop_one(self, slot, heads):
        for b in range(B):
            for h in range(H):
                if heads is not None and not heads[b, h]:
                    continue
                x = self.heads[b][h].clone()
                x[slot[b, h]] = x[-1]
                self.heads[b][h] = x[:-1]


def tokens(q, gen):
    return torch.randn(B, H, q, D, generator=gen)


def check(rows, ref):
    lengths = ref.lengths()
    assert torch.equal(rows.lengths().cpu(), lengths)
    assert rows.length == int(lengths.max())
    view, in_place = rows.view(), rows.in_place().gather()
    for b in range(B):
        for h in range(H):
            n = int(lengths[b, h])
            assert torch.equal(view[b, h, :n], ref.heads[b][h]), (b, h)
            assert torch.equal(in_place[b, h, :n], ref.heads[b][h]), (b, h)
    assert rows.used_bytes() == int(lengths.sum()) * ROW_BYTES
    if isinstance(rows, PagedRows) and rows.ragged:  # a head holds ceil(n / BT) one-head blocks
        blocks = sum(-(-int(n) // BT) for n in lengths.flatten())
        assert rows.allocated_bytes() == blocks * BT * ROW_BYTES
        assert sum(len(held) for held in rows.head_table) == blocks
    assert rows.allocated_bytes() >= rows.used_bytes()


def per_head_index(lengths, gen):
    """`keep`'s (index (B, H, k), valid (B, H)): head (b, h) keeps a random subset of its own
    slots, in random order; the entries past its count are any slots of the padded extent."""
    k = int(lengths.max())
    index = torch.randint(0, k, (B, H, k), generator=gen)
    valid = torch.zeros(B, H, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            n = int(lengths[b, h])
            valid[b, h] = 0 if (b, h) == (0, 0) else n if (b, h) == (1, 2) else \
                int(torch.randint(0, n + 1, (), generator=gen))
            index[b, h, :n] = torch.randperm(n, generator=gen)
    return index, valid


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_ragged_operations_match_a_per_head_reference(layout):
    gen = torch.Generator().manual_seed(0)
    rows = ContiguousRows() if layout == "contiguous" else PagedRows(BlockPool(BT))
    ref = Reference()
    for new in (tokens(9, gen), tokens(1, gen)):
        rows.append(new)
        ref.append(new)
    check(rows, ref)
    assert not rows.ragged
    for step in range(12):
        lengths = ref.lengths()
        if step % 4 == 0:  # an eviction to per-head counts (head-wise budgets)
            index, valid = per_head_index(lengths, gen)
            rows.keep(index, headroom=1, valid=valid)
            ref.keep(index, valid)
            assert rows.ragged
        elif step % 4 == 1:
            new = tokens(1 + step % 3, gen)  # decode rows and short chunks, after each head's own
            rows.append(new)
            ref.append(new)
        else:  # one token out of some heads (the steady state), or of every head
            new = tokens(1, gen)
            rows.append(new)
            ref.append(new)
            lengths = ref.lengths()
            slot = (torch.rand(B, H, generator=gen) * lengths).long()
            heads = None if step % 4 == 3 else torch.rand(B, H, generator=gen) < 0.5
            rows.drop_one(slot, new if step % 2 else None, heads=heads)
            ref.drop_one(slot, heads)
        check(rows, ref)
    copy = rows.fork()
    check(copy, ref)
    rows.release()
    assert rows.allocated_bytes() == 0 and rows.length == 0
    check(copy, ref)  # the fork is independent
    if layout == "paged":
        assert rows.head_pool is copy.head_pool  # one pool of one-head blocks for both
        held = copy.head_pool.held
        assert held == sum(len(x) for x in copy.head_table) and rows.pool.held == 0
        copy.release()
        assert copy.head_pool.held == 0


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_uniform_counts_stay_rectangular(layout):
    """Equal per-head counts are the rectangular case: no per-head state, the batch-row tables,
    no pool of one-head blocks."""
    paged = PagedKV(block_tokens=BT)
    rows = ContiguousRows() if layout == "contiguous" else paged.rows(0, "keys")
    gen = torch.Generator().manual_seed(1)
    x = tokens(10, gen)
    rows.append(x)
    index = torch.arange(7).expand(B, H, 7)
    rows.keep(index, valid=torch.full((B, H), 5))
    assert not rows.ragged and rows.length == 5 and torch.equal(rows.view(), x[:, :, :5])
    assert torch.equal(rows.lengths(), torch.full((B, H), 5))
    rows.assign(x, lengths=torch.full((B, H), 10))
    assert not rows.ragged and torch.equal(rows.view(), x)
    if layout == "paged":
        assert paged.summary()["head_pools"] == 0 and len(rows.table) == B
        rows.assign(x, lengths=torch.tensor([[10, 3, 0], [1, 2, 10]]))  # ragged: a head pool
        assert rows.ragged and paged.summary()["head_pools"] == 1 and rows.table == []
        assert (0, 0, "keys" + HEAD_POOL_SUFFIX) not in paged.pools  # tier first: device
        rows.keep(torch.zeros(B, H, 1, dtype=torch.long))  # rectangular again: heads freed
        assert not rows.ragged and paged.pool(0, "keys" + HEAD_POOL_SUFFIX).held == 0


def test_paged_heads_hold_only_their_blocks():
    """A head kept to 3 tokens holds one block, one kept to 40 holds ten: the allocated bytes
    are those blocks, and they go back to the pool when the rows are dropped."""
    pool = BlockPool(BT)
    rows = PagedRows(pool)
    gen = torch.Generator().manual_seed(2)
    rows.append(tokens(40, gen))
    rectangular = rows.allocated_bytes()
    assert rectangular == B * 10 * H * BT * ROW_BYTES and pool.held == B * 10
    valid = torch.tensor([[3, 40, 0], [17, 4, 1]])
    rows.keep(torch.arange(40).expand(B, H, 40), valid=valid)
    blocks = 1 + 10 + 0 + 5 + 1 + 1
    assert rows.allocated_bytes() == blocks * BT * ROW_BYTES and pool.held == 0
    assert rows.used_bytes() == int(valid.sum()) * ROW_BYTES
    head_pool = rows.head_pool
    assert head_pool.held == blocks and head_pool.data.shape[1:] == (1, BT, D)
    del rows  # dropped without release (a snapshot): the head blocks come back too
    assert head_pool.held == 0


def test_in_place_reads_the_storage_itself():
    gen = torch.Generator().manual_seed(3)
    x = tokens(9, gen)
    contiguous, paged = ContiguousRows(), PagedRows(BlockPool(BT))
    for rows in (contiguous, paged):
        rows.append(x)
    blocks = contiguous.in_place()
    assert blocks.data.data_ptr() == contiguous.buffer.data_ptr()  # a view, no copy
    assert blocks.block_tokens == contiguous.buffer.shape[2] and blocks.table.shape == (B * H, 1)
    blocks = paged.in_place()
    assert blocks.data.data_ptr() == paged.pool.data.data_ptr()
    assert blocks.table.shape == (B * H, 3)  # per-head tables over blocks of all H heads
    assert torch.equal(blocks.gather(), x)
    paged.keep(torch.arange(9).expand(B, H, 9), valid=torch.tensor([[9, 1, 5], [2, 0, 8]]))
    blocks = paged.in_place()
    assert blocks.data.data_ptr() == paged.head_pool.data.data_ptr()
    assert torch.equal(blocks.lengths, torch.tensor([[9, 1, 5], [2, 0, 8]]))


def test_token_major_rows_refuse_ragged_counts():
    rows = TokenMajorRows()
    rows.append(torch.zeros(B, H, 4, D))
    with pytest.raises(ValueError, match="TokenMajorRows holds rectangular rows"):
        rows.keep(torch.zeros(B, H, 2, dtype=torch.long), valid=torch.tensor([[1, 2, 2]] * B))
    rows.keep(torch.zeros(B, H, 2, dtype=torch.long), valid=torch.full((B, H), 1))
    assert rows.length == 1
    with pytest.raises(ValueError, match="valid counts in"):
        ContiguousRows().keep(torch.zeros(B, H, 2, dtype=torch.long),
                              valid=torch.full((B, H), 3))


def test_waste_accounts_each_heads_tokens():
    """One layer, 2 KV heads x 8 dims: heads kept to 30 and 6 tokens. Used = 36 tokens' rows
    (per tensor); paged with blocks of 16 allocates 2 + 1 one-head blocks = 48 slots; contiguous
    a 30 (+1 headroom) slot buffer for both heads = 62 slots."""
    info = ModelInfo(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, max_positions=4096)
    row = 8 * 4

    class Tier:
        paged = PagedKV(block_tokens=16)

    for layout, slots in (("paged", 48), ("contiguous", 62)):
        layer = KVLayer(0, info)
        if layout == "paged":
            layer.tier = Tier()
        x = torch.randn(1, 2, 40, 8)
        layer.update(x, x, None)
        for rows in layer._kv.values():
            rows.keep(torch.arange(40).expand(1, 2, 40), headroom=1,
                      valid=torch.tensor([[30, 6]]))
        stats = layer.stats()
        assert stats["kv_bytes_used"] == stats["kv_bytes"] == 2 * 36 * row
        assert stats["kv_bytes_allocated"] == 2 * slots * row
        ledger = KVLedger(info)
        ledger.record([layer], check=True)
        kv = ledger.summary()
        assert kv["storage_waste_ratio"] == round(1 - 36 / slots, 6)
