"""The default KVLayer's storage: a preallocated buffer written in place (no whole-cache copy per
decode step), valid rows exposed as `keys`/`values`, assignment re-seats the buffer."""

import torch

from kvcore.storage import grown_capacity
from methods.base import KVLayer, ModelInfo

INFO = ModelInfo(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, max_positions=4096)


def rows(t, start=0):
    x = torch.arange(start, start + t, dtype=torch.float32).view(1, 1, t, 1).expand(1, 2, t, 8)
    return x.contiguous(), -x.contiguous()


def test_decode_writes_in_place_and_grows_amortised():
    layer = KVLayer(0, INFO)
    layer.update(*rows(100), None)
    buffer = layer._kv["keys"].buffer
    assert buffer.shape[2] == grown_capacity(100) >= 356  # headroom for decoding
    reallocations = 0
    for t in range(100, 2000):
        k, v = layer.update(*rows(1, t), None)
        assert k.shape[2] == v.shape[2] == t + 1
        assert k[0, 1, -1, 0].item() == t and v[0, 0, -1, 3].item() == -t
        if layer._kv["keys"].buffer is not buffer:
            reallocations += 1
            buffer = layer._kv["keys"].buffer
        # the returned K/V are views of the buffer: nothing was concatenated
        assert k.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    assert reallocations <= 6  # 1.5x growth: O(log T) reallocations, not one per step
    assert torch.equal(layer.keys[0, 0, :, 0], torch.arange(2000.0))
    stats = layer.stats()
    assert stats["kv_tokens"] == 2000 and layer.kept_tokens() == 2000
    assert stats["kv_bytes"] == 2 * 2000 * 2 * 8 * 4  # valid rows only
    assert stats["kv_bytes_allocated"] == 2 * buffer.shape[2] * 2 * 8 * 4 >= stats["kv_bytes"]


def test_assignment_reseats_and_never_writes_into_the_assigned_tensor():
    layer = KVLayer(0, INFO)
    layer.update(*rows(10), None)
    kept_k, kept_v = layer.keys[:, :, 4:].clone(), layer.values[:, :, 4:].clone()
    mine = kept_k.clone()
    layer.keys, layer.values = kept_k, kept_v  # what evicting subclasses do
    assert layer.kept_tokens() == 6 and layer.keys is not None
    k, _ = layer.update(*rows(1, 10), None)
    assert torch.equal(kept_k, mine)  # the caller's tensor was not appended into
    assert k[0, 0, :, 0].tolist() == [4.0, 5, 6, 7, 8, 9, 10]
    layer.keys = layer.values = None
    assert layer.kept_tokens() == 0 and layer.stats()["kv_bytes"] == 0
