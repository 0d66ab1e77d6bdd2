"""The host tier: every host-to-device copy reads one contiguous (pinned, on CUDA) block; the
consumer waits on an event on its own stream (never the host); exposed ms are measured."""

import time

import pytest
import torch

from kvcore.offload import HostKVStore, Tier, TransferLedger


def store_with(tokens, device="cpu", b=2, h=3, d=4):
    tier = Tier(torch.device(device), TransferLedger(num_layers=1), offload=True)
    store = HostKVStore(tier, 0)
    k = torch.arange(b * h * tokens * d, dtype=torch.float32).view(b, h, tokens, d).to(device)
    for start in range(0, tokens, 7):  # several appends (growth included)
        store.append(k[:, :, start:start + 7], -k[:, :, start:start + 7])
    return store, k


def spy_sources(monkeypatch):
    sources = []
    real = Tier.to_device

    def spy(self, layer, host, *args):
        sources.append(host)
        return real(self, layer, host, *args)

    monkeypatch.setattr(Tier, "to_device", spy)
    return sources


def test_whole_layer_and_selected_fetches_copy_contiguous_blocks(monkeypatch):
    store, k = store_with(300)
    sources = spy_sources(monkeypatch)
    keys, values = (t.wait() for t in store.fetch())
    assert torch.equal(keys, k) and torch.equal(values, -k)  # (B, H, T, D) as stored
    index = torch.randint(0, 300, (2, 3, 17), generator=torch.Generator().manual_seed(0))
    keys, values = (t.wait() for t in store.fetch(index))
    want = k.gather(2, index[..., None].expand(2, 3, 17, 4))
    assert torch.equal(keys, want) and torch.equal(values, -want)
    assert len(sources) == 4 and all(s.is_contiguous() for s in sources)
    assert sources[0].shape == (300, 2, 3, 4)  # the whole layer: one token-major block
    ledger = store.tier.ledger
    assert ledger.bytes_h2d == 2 * k.nbytes + 2 * want.nbytes
    assert ledger.exposed_ms >= 0 and ledger.copies_h2d == 4
    # on the CPU tier copies are synchronous: all of the transfer time is exposed
    assert ledger.transfer_ms == pytest.approx(ledger.exposed_ms) and ledger.transfer_ms > 0


def test_keep_compacts_and_refuses_nothing_unsafe():
    store, k = store_with(40)
    index = torch.tensor([0, 5, 39]).expand(2, 3, 3).contiguous()
    store.keep(index)
    assert store.length == 3 and store.nbytes() == 2 * 3 * 2 * 3 * 4 * 4
    keys, _ = store.all_rows()
    assert torch.equal(keys, k[:, :, [0, 5, 39]])
    with pytest.raises(ValueError, match="non-contiguous"):
        store.tier.to_device(0, torch.zeros(4, 6)[:, ::2])


# --- on a GPU -------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_fetch_is_pinned_overlapped_and_exposed_time_measured(monkeypatch):
    """The source is pinned and contiguous; the copy runs on the side stream while the current
    stream computes; the wait does not block the host; exposed ms are read back later."""
    store, k = store_with(8192, device="cuda", b=1, h=8, d=128)
    assert store.keys.is_pinned()
    sources = spy_sources(monkeypatch)
    big = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    for _ in range(2):  # queue tens of ms of fp32 compute on the current stream
        big = big @ big / 64
    compute_done = torch.cuda.Event()
    compute_done.record()
    t0 = time.perf_counter()
    pending = store.fetch()
    assert all(s.is_pinned() and s.is_contiguous() for s in sources)
    copy_done = pending[0].transfer.event
    keys, values = (t.wait() for t in pending)
    host_ms = (time.perf_counter() - t0) * 1e3
    # the host issued the copies and the waits without blocking: the compute is still running
    assert not compute_done.query() and host_ms < 10
    assert len(store.tier.ledger.stalls) == 2  # timings recorded, not read yet (no host sync)
    torch.cuda.synchronize()
    assert copy_done.query()
    assert torch.equal(keys, k) and torch.equal(values, -k)
    # the matmuls were ahead of the wait, so the copy was hidden behind them
    assert 0 <= store.tier.ledger.exposed_ms < 5.0
    assert store.tier.ledger.transfer_ms > store.tier.ledger.exposed_ms  # the copy took time


@pytest.mark.gpu
def test_cuda_exposed_time_when_nothing_overlaps():
    store, k = store_with(65536, device="cuda", b=1, h=8, d=128)  # 256 MiB per side
    torch.cuda.synchronize()
    pending = store.fetch()
    keys, _ = (t.wait() for t in pending)  # nothing to overlap with: the stall is the copy
    torch.cuda.synchronize()
    exposed = store.tier.ledger.exposed_ms
    assert exposed > 0.5  # 512 MiB at <= ~55 GB/s takes several ms
    assert store.tier.ledger.transfer_ms >= 0.5 * exposed  # the stall was mostly the copy
    assert torch.equal(keys, k)
