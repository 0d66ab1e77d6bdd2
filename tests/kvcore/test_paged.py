"""The paged KV allocator (kvcore.paged): block tables, pool growth in whole blocks, reuse of freed
blocks, per-head evictions, and the storage waste figures (harness.core.accounting) on a hand case."""

import torch

from harness.core.accounting import KVLedger, waste_ratio
from kvcore.paged import BlockPool, PagedKV, PagedRows
from kvcore.storage import ContiguousRows, grown_capacity
from methods.layer import KVLayer
from methods.model import ModelInfo

INFO = ModelInfo(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, max_positions=4096)


def tokens(t, start=0, heads=2, dim=8):
    """(1, heads, t, dim): token i holds the value start + i everywhere (head h: negated if odd)."""
    x = torch.arange(start, start + t, dtype=torch.float32).view(1, 1, t, 1)
    x = x.expand(1, heads, t, dim)
    sign = torch.tensor([1.0, -1.0] * (heads // 2)).view(1, heads, 1, 1)
    return (x * sign).contiguous()


def test_block_table_addresses_tokens_and_view_gathers_them():
    pool = BlockPool(block_tokens=4)
    rows = PagedRows(pool)
    rows.append(tokens(6))
    rows.append(tokens(5, start=6))
    assert rows.length == 11 and [len(b) for b in rows.table] == [3]  # ceil(11 / 4)
    assert torch.equal(rows.view(), tokens(11))
    block, offset = rows.table[0][2], 10 % 4  # token 10: third block, offset 2
    assert torch.equal(pool.data[block, :, offset], tokens(1, start=10)[0, :, 0])
    assert pool.data.shape[1:] == (2, 4, 8)  # (num_blocks, H_kv, block_tokens, D)


def test_pool_grows_in_whole_blocks_and_records_it():
    pool = BlockPool(block_tokens=16)
    rows = PagedRows(pool)
    rows.append(tokens(16))
    assert pool.num_blocks == 1 and pool.grow_events == 1
    rows.append(tokens(1, start=16))  # block 2
    rows.append(tokens(16, start=17))  # block 3
    assert pool.held == 3 and pool.num_blocks >= 3 and pool.grow_events <= 3
    assert torch.equal(rows.view(), tokens(33))  # growth copied the old blocks
    for _ in range(40):  # one token at a time: amortised, not a growth per block
        rows.append(tokens(16, start=rows.length))
    assert pool.grow_events <= 12 and pool.num_blocks < 2 * pool.held
    assert torch.equal(rows.view(), tokens(33 + 640))


def test_freed_blocks_are_reused_by_other_sequences():
    pool = BlockPool(block_tokens=4)
    first, second = PagedRows(pool), PagedRows(pool)
    first.append(tokens(12))
    held = list(first.table[0])
    first.keep(torch.arange(4).expand(1, 2, 4))  # an eviction down to one block
    assert first.table[0] == held[:1] and pool.held == 1
    second.append(tokens(8, start=100))  # draws the two freed blocks, no growth
    assert sorted(second.table[0]) == sorted(held[1:]) and pool.num_blocks == 3
    assert torch.equal(first.view(), tokens(4)) and torch.equal(second.view(), tokens(8, 100))
    second.release()
    assert pool.held == 1 and second.length == 0 and second.allocated_bytes() == 0
    del first  # dropped without release (e.g. a snapshot): its blocks come back too
    assert pool.held == 0 and len(pool.free) == pool.num_blocks


def test_per_head_eviction_and_assignment_rewrite_blocks():
    pool = BlockPool(block_tokens=2)
    rows = PagedRows(pool)
    rows.append(tokens(5))
    rows.drop_one(torch.tensor([[0, 4]]))  # head 0 drops token 0 (4 moves in); head 1 the last
    assert rows.view()[0, 0, :, 0].tolist() == [4, 1, 2, 3]
    assert rows.view()[0, 1, :, 0].tolist() == [-0.0, -1, -2, -3]
    assert [len(b) for b in rows.table] == [2] and pool.held == 2  # the emptied block was freed
    rows.assign(tokens(1, start=7))
    assert pool.held == 1 and torch.equal(rows.view(), tokens(1, 7))
    rows.write_at(0, tokens(1, start=9))  # in place (StreamingLLM's re-rotated sinks)
    assert torch.equal(rows.view(), tokens(1, 9))


def test_pools_are_per_layer_and_tensor_and_shared_by_sequences():
    paged = PagedKV(block_tokens=16)
    assert paged.pool(0, "keys") is paged.pool(0, "keys")
    assert paged.pool(0, "keys") is not paged.pool(1, "keys")
    assert paged.pool(0, "keys") is not paged.pool(0, "values")
    a, b = paged.rows(0, "keys"), paged.rows(0, "keys")
    a.append(tokens(20))
    b.append(tokens(3))
    summary = paged.summary()
    assert summary["blocks_held_now"] == 3 and summary["blocks_allocated"] >= 3
    assert summary["block_tokens"] == 16 and summary["pools"] == 3


def test_waste_figures_on_a_hand_computed_case():
    """37 tokens, 2 KV heads x 8 dims fp32 (64 bytes per token per tensor): paged with blocks of
    16 holds 3 blocks = 48 token slots; contiguous holds grown_capacity(37) = 512 slots."""
    per_token = 2 * 8 * 4
    paged_layer, contiguous_layer = KVLayer(0, INFO), KVLayer(0, INFO)

    class Tier:
        paged = PagedKV(block_tokens=16)

    paged_layer.tier = Tier()
    for layer in (paged_layer, contiguous_layer):
        layer.update(tokens(37), tokens(37), None)
    assert isinstance(paged_layer._kv["keys"], PagedRows)
    assert isinstance(contiguous_layer._kv["keys"], ContiguousRows)
    paged_stats, contiguous_stats = paged_layer.stats(), contiguous_layer.stats()
    assert paged_stats["kv_bytes_used"] == contiguous_stats["kv_bytes_used"] == 2 * 37 * per_token
    assert paged_stats["kv_bytes_allocated"] == 2 * 48 * per_token
    assert grown_capacity(37) == 512  # 37 + 256 headroom, rounded up to 256
    assert contiguous_stats["kv_bytes_allocated"] == 2 * 512 * per_token
    for layer, slots in ((paged_layer, 48), (contiguous_layer, 512)):
        ledger = KVLedger(INFO)
        ledger.record([layer], check=True)
        kv = ledger.summary()
        assert kv["storage_bytes_used"] == 2 * 37 * per_token
        assert kv["storage_bytes_allocated"] == 2 * slots * per_token
        assert kv["storage_waste_ratio"] == round(1 - 37 / slots, 6)
        assert kv["storage_layers_accounted"] == 1
    assert waste_ratio(37, 48) == round(11 / 48, 6) and waste_ratio(0, 0) is None
