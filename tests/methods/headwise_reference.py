"""An independent reference for head-wise methods: the full cache, its decode step's attention
masked per KV head to the positions the method's head kept (plus the new token), must give the
method's logits. Shared by the head-wise methods' tests (adakv, fastgen, headkv)."""

from __future__ import annotations

import torch

from methods import build_method
from tests.conftest import make_engine


def masked_full_gap(model, tok, method, monkeypatch, prompt_tokens: int = 80) -> float:
    """Max |logit difference| at the first decode step between `method` and the full cache
    masked per KV head to what `method` kept; asserts some layer's heads are ragged."""
    from methods.layer import FullLayer

    ids = tok("Once upon a time there was a little dog named Max. " * 8)["input_ids"]
    ids = ids[:prompt_tokens + 1]
    with make_engine(model, method, tok).request() as req:
        req.prefill(ids[:prompt_tokens])
        kept = [kv.kept_positions().clone() for kv in req.cache.kv_layers]
        assert any(kv.kept_lengths() is not None for kv in req.cache.kv_layers)
        got = req.step(ids[prompt_tokens])[0, -1]

    def masked(self, module, query, keys, values, attention_mask, base, **kwargs):
        if query.shape[2] > 1:
            return base(module, query, keys, values, attention_mask, **kwargs)
        b, h, t = keys.shape[:3]  # (1, H_kv, prompt + 1)
        positions = kept[self.layer_idx]  # the padding (-1) into a spare slot, then dropped:
        allowed = torch.zeros(b, h, t + 1, dtype=torch.bool)  # clamped to 0 it would collide
        allowed.scatter_(-1, positions.masked_fill(positions < 0, t), True)  # with a kept 0
        allowed = allowed[..., :t]
        allowed[..., -1] = True  # the new token
        allowed = allowed.repeat_interleave(query.shape[1] // keys.shape[1], dim=1)[:, :, None]
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        return base(module, query, keys, values, mask, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(FullLayer, "reads_in_place", lambda self, keys: False)
        patch.setattr(FullLayer, "attend", masked)
        with make_engine(model, build_method("full"), tok).request() as req:
            req.prefill(ids[:prompt_tokens])
            want = req.step(ids[prompt_tokens])[0, -1]
    return (got - want).abs().max().item()


def streaming_positions(layer) -> list[int]:
    """The text positions a head-wise layer's streaming heads hold, sorted (all of them hold the
    same): DuoAttention's and RazorAttention's sinks and window, read from `kept_positions`."""
    if not len(layer.streaming_heads):
        return []
    row = layer.kept_positions()[0, int(layer.streaming_heads[0])]
    return sorted(p for p in row.tolist() if p >= 0)
