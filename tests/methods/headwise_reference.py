"""An independent reference for head-wise methods: the full cache, its attention after the prompt
masked per KV head to the positions the method's head kept (plus the new tokens), must give the
method's logits. Shared by the head-wise methods' tests (adakv, fastgen, headkv)."""

from __future__ import annotations

import torch

from methods import build_method
from tests.conftest import make_engine


def masked_full_gap(model, tok, method, monkeypatch, prompt_tokens: int = 80,
                    query_tokens: int = 6) -> float:
    """Max |logit difference| between `method` and the full cache masked per KV head to what
    `method` kept at the prompt's end (plus the tokens fed since, causally), over two
    continuations of the compressed prompt: a decode step, and a question of `query_tokens`
    fed in one chunk (`prompt_ends=False`: each head attends its own tokens with the chunk's
    last, none of its padding). Asserts some layer's heads are ragged."""
    from methods.layer import FullLayer

    ids = tok("Once upon a time there was a little dog named Max. " * 8)["input_ids"]
    ids = ids[:prompt_tokens + query_tokens]
    prompt, after = ids[:prompt_tokens], [ids[prompt_tokens:prompt_tokens + 1],
                                          ids[prompt_tokens:]]
    got, kept = [], None  # kept: what the method held at the prompt's end (the same prompt:
    for more in after:    # the same kept sets in both requests)
        with make_engine(model, method, tok).request() as req:
            req.prefill(prompt)
            kept = [kv.kept_positions().clone() for kv in req.cache.kv_layers]
            assert any(kv.kept_lengths() is not None for kv in req.cache.kv_layers)
            got.append(_continue(req, more))

    def masked(self, module, query, keys, values, attention_mask, base, **kwargs):
        if keys.shape[2] <= prompt_tokens:  # the prompt: held whole
            return base(module, query, keys, values, attention_mask, **kwargs)
        b, h, t = keys.shape[:3]  # (1, H_kv, prompt + q)
        q = query.shape[2]
        positions = kept[self.layer_idx]  # the padding (-1) into a spare slot, then dropped:
        allowed = torch.zeros(b, h, t + 1, dtype=torch.bool)  # clamped to 0 it would collide
        allowed.scatter_(-1, positions.masked_fill(positions < 0, t), True)  # with a kept 0
        allowed = allowed[..., :t, None].transpose(2, 3).repeat(1, 1, q, 1)  # (B, H_kv, q, T)
        allowed[..., t - q:] = torch.ones(q, q, dtype=torch.bool).tril()  # the new tokens
        allowed = allowed.repeat_interleave(query.shape[1] // keys.shape[1], dim=1)
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        return base(module, query, keys, values, mask, **kwargs)

    gap = 0.0
    with monkeypatch.context() as patch:
        patch.setattr(FullLayer, "reads_in_place", lambda self, keys: False)
        patch.setattr(FullLayer, "attend", masked)
        for more, mine in zip(after, got):
            with make_engine(model, build_method("full"), tok).request() as req:
                req.prefill(prompt)
                want = _continue(req, more)
            gap = max(gap, (mine - want).abs().max().item())
    return gap


def _continue(req, ids: list[int]) -> torch.Tensor:
    """Logits `(q, V)` of `ids` fed after the compressed prompt: one token as a decode step,
    more as one chunk of input that is not prompt (a question)."""
    if len(ids) == 1:
        return req.step(ids[0])[0]
    return req.prefill(ids, all_logits=True, prompt_ends=False)[0]


def streaming_positions(layer) -> list[int]:
    """The text positions a head-wise layer's streaming heads hold, sorted (all of them hold the
    same): DuoAttention's and RazorAttention's sinks and window, read from `kept_positions`."""
    if not len(layer.streaming_heads):
        return []
    row = layer.kept_positions()[0, int(layer.streaming_heads[0])]
    return sorted(p for p in row.tolist() if p >= 0)
