"""The default KVLayer's storage: a preallocated buffer written in place (no whole-cache copy per
decode step), valid rows exposed as `keys`/`values`, assignment re-seats the buffer."""

import pytest
import torch

from kvcore.storage import grown_capacity
from methods.layer import KVLayer
from methods.model import ModelInfo

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


# --- decode steps read the stored rows in place (FullLayer) -----------------------------------
def decode_counting(model, monkeypatch, layout, steps=6):
    """Decode `steps` tokens with method=full in `layout`, counting gathers of paged blocks and
    in-place kernel calls during the decode steps only. Returns (logits, gathers, kernel calls)."""
    import dataclasses

    from harness.core.engine import Engine
    from kvcore.paged import PagedRows
    from methods import build_method
    from methods.kernels import ragged_attention_cpu
    from tests.conftest import make_engine

    counts = {"view": 0, "kernel": 0, "decoding": False}
    real_view, real_kernel = PagedRows.view, ragged_attention_cpu.decode_attention

    def view(self):
        counts["view"] += counts["decoding"]
        return real_view(self)

    def kernel(*args):
        counts["kernel"] += counts["decoding"]
        return real_kernel(*args)

    monkeypatch.setattr(PagedRows, "view", view)
    monkeypatch.setattr(ragged_attention_cpu, "decode_attention", kernel)
    engine = make_engine(model, build_method("full"), chunk=16)
    settings = dataclasses.replace(engine.settings, kv_layout=layout, kv_block_tokens=8)
    engine = Engine(model, None, engine.method, engine.info, settings)
    prompt = torch.randint(3, 250, (37,), generator=torch.Generator().manual_seed(0))
    with engine.request() as req:
        logits = [req.prefill(prompt)[0, -1]]
        counts["decoding"] = True
        for _ in range(steps):
            logits.append(req.step(int(logits[-1].argmax()))[0, -1])
    return torch.stack(logits), counts["view"], counts["kernel"]


def test_full_decode_reads_blocks_in_place(family_models, monkeypatch):
    """Paged decode steps of the default layer never gather the blocks: one in-place kernel call
    per layer and step, in both layouts (so they give the same bits)."""
    from methods.kernels import ragged_attention_cpu

    if ragged_attention_cpu.library() is None:
        pytest.skip(f"no C kernel: {ragged_attention_cpu.build_error()}")
    model = family_models("llama", 2)
    paged, gathers, calls = decode_counting(model, monkeypatch, "paged")
    assert gathers == 0 and calls == 2 * 6
    contiguous, _, calls = decode_counting(model, monkeypatch, "contiguous")
    assert calls == 2 * 6 and torch.equal(paged, contiguous)


def test_sliding_window_layers_take_the_model_attention(family_models, monkeypatch):
    """Mistral's window masks the cache: its layers attend through the model's function (over
    the gathered blocks when paged), never through the unmasked kernel."""
    model = family_models("mistral", 2)
    paged, gathers, calls = decode_counting(model, monkeypatch, "paged", steps=3)
    assert calls == 0 and gathers > 0
    contiguous, _, _ = decode_counting(model, monkeypatch, "contiguous", steps=3)
    assert torch.equal(paged, contiguous)


def test_in_place_decode_uses_the_models_scaling():
    """Granite scales q.k by attention_multiplier (0.05), not head_dim ** -0.5: the in-place
    decode equals transformers' own cache step by step."""
    from tests.helpers.reference import engine_logits, hf_incremental
    from tests.models import tiny_family_model

    model = tiny_family_model("granite", 2)
    ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(1))
    got = engine_logits(model, ids, prefill_end=30, chunk=16)
    ref = hf_incremental(model, ids, splits=[16, 30] + list(range(31, 40)))
    assert (got - ref).abs().max().item() <= 1e-5


def test_exact_attention_over_ragged_rows_in_place():
    """What phase-2 head-wise layers call: ragged rows read in place attend per head (a prefill
    chunk causal over each head's own tokens, a decode row) without the model's attention;
    calls it cannot honour (a sliding window) are refused, not served wrong."""
    from types import SimpleNamespace

    from kvcore.paged import BlockPool, PagedRows
    from methods.kernels.ragged_attention import ragged_attention_ref
    from methods.layer import exact_attention

    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 12, 8, generator=gen), torch.randn(1, 2, 12, 8, generator=gen)
    lengths = torch.tensor([[12, 5]])
    rows = [PagedRows(BlockPool(4)) for _ in range(2)]
    for r, x in zip(rows, (k, v)):
        r.assign(x, lengths)
    module = SimpleNamespace(scaling=0.5)

    def no_base(*args, **kwargs):
        raise AssertionError("the model's attention was called")

    for q in (3, 1):
        query = torch.randn(1, 4, q, 8, generator=gen)
        blocks = [r.in_place() for r in rows]
        out, _ = exact_attention(module, query, *blocks, None, no_base, scaling=None)
        want = ragged_attention_ref(query, k, v, lengths, 0.5)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="plain causal attention only"):
        exact_attention(module, query, *blocks, None, no_base, sliding_window=4)
