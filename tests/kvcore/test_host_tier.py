"""The host tier every host-resident layer uses (kvcore.offload.HostKVStore, reached through
KVLayer.host_kv): appends grow amortised, fetches (all rows, selected rows, key channels) give the
stored values and count exactly their bytes, values-only stores, the fetch in flight
(prefetch/take), and the paged layout giving the same rows and bytes."""

import pytest
import torch

from kvcore.offload import (HostKVStore, PagedHostKVStore, Tier, TransferLedger, fitted_capacity,
                            host_capacity, host_store)
from kvcore.paged import PagedKV
from methods.layer import KVLayer
from methods.model import ModelInfo

B, H, D = 2, 3, 4


def tier(paged: bool = False) -> Tier:
    return Tier(torch.device("cpu"), TransferLedger(num_layers=1), offload=True,
                paged=PagedKV(block_tokens=8) if paged else None)


def rows(t: int, start: int = 0) -> torch.Tensor:
    """`(B, H, t, D)`: tokens start .. start + t - 1 of one sequence, every element distinct."""
    head = torch.arange(B * H, dtype=torch.float32).view(B, H, 1, 1) * 1e5
    token = torch.arange(start, start + t, dtype=torch.float32).view(1, 1, t, 1) * D
    return head + token + torch.arange(D, dtype=torch.float32)


def index(n: int, stored: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, stored, (B, H, n), generator=torch.Generator().manual_seed(seed))


def test_appends_grow_amortised_and_every_row_is_kept():
    store = HostKVStore(tier(), 0)
    capacities = []
    for t in range(1000):  # one decode row at a time
        store.append(rows(1, t), -rows(1, t))
        if store.keys.shape[0] not in capacities:
            capacities.append(store.keys.shape[0])
        assert store.length == t + 1 and store.keys.shape[0] >= t + 1
    # capacity doubles (at least 256 rows): a handful of reallocations, not one per row
    assert capacities == [256, host_capacity(257), host_capacity(515)] == [256, 514, 1030]
    keys, values = store.all_rows()
    assert torch.equal(keys, rows(1000)) and torch.equal(values, -rows(1000))
    assert store.nbytes() == 2 * rows(1000).nbytes  # the valid rows, not the capacity
    ledger = store.tier.ledger
    assert ledger.bytes_d2h == 2 * rows(1000).nbytes and ledger.copies_d2h == 1000
    assert ledger.bytes_h2d == 0  # appending moves nothing to the device


@pytest.mark.parametrize("paged", [False, True])
def test_fetches_give_the_stored_rows_and_count_their_bytes(paged):
    store = host_store(tier(paged), 0)
    assert isinstance(store, PagedHostKVStore) == paged
    for start in range(0, 50, 7):
        store.append(rows(min(7, 50 - start), start), -rows(min(7, 50 - start), start))
    ledger = store.tier.ledger
    keys, values = (t.wait() for t in store.fetch())
    assert torch.equal(keys, rows(50)) and torch.equal(values, -rows(50))
    assert ledger.bytes_h2d == 2 * rows(50).nbytes and ledger.copies_h2d == 2
    chosen = index(9, 50)
    keys, values = (t.wait() for t in store.fetch(chosen))
    want = rows(50).gather(2, chosen[..., None].expand(B, H, 9, D))
    assert torch.equal(keys, want) and torch.equal(values, -want)
    assert ledger.bytes_h2d == 2 * rows(50).nbytes + 2 * want.nbytes
    channels = torch.tensor([[[3, 0]] * H] * B)  # (B, H, 2) per head
    got = store.fetch_channels(channels).wait()  # (B, H, T, 2)
    assert torch.equal(got, rows(50)[..., [3, 0]])
    assert ledger.bytes_h2d == 2 * rows(50).nbytes + 2 * want.nbytes + got.nbytes
    store.keep(chosen.sort(-1).values)
    assert store.length == 9 and store.nbytes() == 2 * want.nbytes
    kept = rows(50).gather(2, chosen.sort(-1).values[..., None].expand(B, H, 9, D))
    assert torch.equal(store.all_rows()[0], kept)


def test_a_values_only_store_holds_and_moves_the_values_alone():
    store = HostKVStore(tier(), 0, parts=("values",), growth=fitted_capacity)
    store.append(rows(40))
    assert store.keys is None and store.values.shape == (40, B, H, D)  # fitted: no spare rows
    assert store.nbytes() == rows(40).nbytes == store.tier.ledger.bytes_d2h
    (values,) = (t.wait() for t in store.fetch())
    assert torch.equal(values, rows(40))
    chosen = index(5, 40, seed=1)
    (values,) = (t.wait() for t in store.fetch(chosen))
    assert torch.equal(values, rows(40).gather(2, chosen[..., None].expand(B, H, 5, D)))
    assert store.tier.ledger.bytes_h2d == rows(40).nbytes + values.nbytes


def test_the_fetch_in_flight_is_started_once_and_taken_once():
    store = HostKVStore(tier(), 0)
    assert store.take() is None  # nothing stored: nothing to fetch
    keys, values = store.past_and_new(rows(6), -rows(6))  # a first prompt: only its own rows
    assert torch.equal(keys, rows(6)) and store.tier.ledger.bytes_h2d == 0
    store.prefetch(index(2, 6))  # one layer ahead
    store.prefetch()  # already in flight: not started again
    assert store.tier.ledger.copies_h2d == 2 and store.pending is not None
    keys, values = store.past_and_new(rows(1, 6), -rows(1, 6))  # the prefetched rows + the new
    assert keys.shape[2] == 3 and store.pending is None and store.tier.ledger.copies_h2d == 2
    keys, values = store.past_and_new(rows(1, 7), -rows(1, 7))  # nothing prefetched: all rows
    assert torch.equal(keys, rows(8)) and torch.equal(values, -rows(8))
    assert store.tier.ledger.bytes_h2d == 2 * (rows(2).nbytes + rows(7).nbytes)
    store.prefetch()
    store.release()
    assert store.pending is None and store.length == 0 and store.nbytes() == 0


def test_a_layer_gets_one_host_store_in_the_runs_layout_and_releases_it():
    info = ModelInfo(num_layers=1, num_heads=3, num_kv_heads=3, head_dim=4, max_positions=64)
    for paged in (False, True):
        layer = KVLayer(0, info)
        layer.tier = tier(paged)
        assert layer.host is None  # nothing on the host until the layer puts something there
        store = layer.host_kv()
        assert layer.host_kv() is store and isinstance(store, PagedHostKVStore) == paged
        store.append(rows(20), -rows(20))
        layer.release()
        assert store.nbytes() == 0
        if paged:
            assert layer.tier.paged.summary()["blocks_held_now"] == 0
