"""Attention with probabilities, and the selection helpers score-based methods share.

Methods that rank tokens by attention (H2O, the top-k oracle, diagnostics) cannot use SDPA, which
returns no probabilities; they call `attention_with_probs`, an eager attention that also returns
the per-query-head probabilities. Shapes: query `(B, H_q, q, D)`, keys/values `(B, H_kv, T, D)`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Iterator

import torch


def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H_kv, T, D) -> (B, H_kv * g, T, D): query head h reads KV head h // g."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


def causal_allowed(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """(q, T) bool: the last q keys are the queries themselves; everything before is the past."""
    rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    return torch.arange(kv_len, device=device)[None, :] <= rows


def additive_mask(attention_mask: torch.Tensor | None, q_len: int, kv_len: int,
                  device: torch.device) -> torch.Tensor:
    """A float mask broadcastable to (B, H, q, T) from whatever the model passed (None/bool/float).

    The sdpa mask function returns None for an unpadded causal forward (causality implicit), so
    causality is rebuilt here from the in-cache layout: past keys first, then the q new ones.
    """
    if attention_mask is None:
        allowed = causal_allowed(q_len, kv_len, device)
        return torch.zeros(q_len, kv_len, device=device).masked_fill(~allowed, float("-inf"))
    mask = attention_mask[..., -kv_len:]
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, device=device).masked_fill(~mask, float("-inf"))
    return mask.float()


# Within `shared_attention()`: the last call's inputs and result (see there).
_SHARED: contextvars.ContextVar[list | None] = contextvars.ContextVar("shared_attention",
                                                                      default=None)


@contextlib.contextmanager
def shared_attention(held: list | None = None) -> Iterator[list]:
    """Inside it, `attention_with_probs` called again with inputs equal to its previous call's
    returns that call's result (the same tensors: callers read them, never write them). A sweep
    replays one recorded layer into several settings' layers inside it (harness.sweep.replay):
    the settings whose layers score a held prompt by its attention probabilities then compute
    them once per layer instead of once per setting. One result is held at a time: the list
    yielded, which a later `shared_attention(held)` starts from (the recording's own call,
    replayed into the settings as it is recorded)."""
    held = [] if held is None else held
    token = _SHARED.set(held)
    try:
        yield held
    finally:
        _SHARED.reset(token)


def _equal(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    return False


def attention_with_probs(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float,
                         keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention returning `(out (B, q, H_q, D), probs (B, H_q, q, T) fp32)`.

    `keep` (optional, broadcastable to (B, H_q, q, T) bool) further restricts which keys each
    query may attend to (selection methods); the softmax renormalises over what is kept. The g
    query heads of a KV head are stacked as rows against that head's keys, so the cache is never
    expanded to H_q heads (no g-fold copy per step).
    """
    shared = _SHARED.get()
    if shared is None:
        return _attention_with_probs(query, keys, values, attention_mask, scaling, keep)
    inputs = (query, keys, values, attention_mask, keep)
    if shared and shared[0][1] == scaling and all(map(_equal, shared[0][0], inputs)):
        return shared[0][2]
    result = _attention_with_probs(query, keys, values, attention_mask, scaling, keep)
    shared[:] = [(inputs, scaling, result)]
    return result


def _attention_with_probs(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float,
                          keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    b, h_q, q, d = query.shape
    h_kv, t = keys.shape[1], keys.shape[2]
    groups = h_q // h_kv
    # Few ops per call: a decode step runs this once per layer, and on CPU every small op pays
    # for waking the thread pool. The scale goes on the query (g*q*D values, not g*q*T scores).
    rows = (query.float() * scaling).reshape(b, h_kv, groups * q, d)
    scores = torch.matmul(rows, keys.float().transpose(2, 3)).view(b, h_kv, groups, q, t)
    if attention_mask is not None or q > 1:  # one unmasked query row is the newest key: all allowed
        scores += _grouped(additive_mask(attention_mask, q, t, query.device), h_kv, groups)
    if keep is not None:
        scores.masked_fill_(~_grouped(keep, h_kv, groups), float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # (B, H_kv, g, q, T)
    out = torch.matmul(probs.view(b, h_kv, groups * q, t).to(values.dtype), values)
    out = out.view(b, h_q, q, d).transpose(1, 2).contiguous().to(query.dtype)
    return out, probs.view(b, h_q, q, t)


# keyword arguments of the model's attention call that change what attention computes
_NOT_PLAIN = ("softcap", "s_aux", "sliding_window", "dropout", "output_attentions")


def plain_attention(kwargs: dict) -> bool:
    """Plain softmax attention (no softcap, sinks, window, dropout, weights requested)."""
    return not any(kwargs.get(k) for k in _NOT_PLAIN)


def plain_decode_row(query: torch.Tensor, attention_mask, kwargs: dict) -> bool:
    """One query row, nothing masked, plain softmax attention (no softcap, sinks, window,
    dropout, weights requested): what a fused decode kernel computes."""
    return query.shape[2] == 1 and attention_mask is None and plain_attention(kwargs)


def _grouped(mask: torch.Tensor, h_kv: int, groups: int) -> torch.Tensor:
    """A mask broadcastable to (B, H_q, q, T) as one broadcastable to (B, H_kv, g, q, T)."""
    if mask.dim() < 4 or mask.shape[1] == 1:
        return mask.unsqueeze(-3)
    return mask.unflatten(1, (h_kv, groups))


def group_mean(probs: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(B, H_q, q, T) -> (B, H_kv, q, T): mean over the g query heads sharing a KV head.

    GQA choice (H2O, oracle): a KV head's score is the mean probability its query heads give a
    token, so one kept set per KV head serves the whole group (no repeat_kv of the cache).
    """
    b, h, q, t = probs.shape
    return probs.view(b, num_kv_heads, h // num_kv_heads, q, t).mean(dim=2)


def group_column_sums(probs: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(B, H_q, q, T) -> (B, H_kv, T): attention each token receives, summed over the q query
    rows, of the group mean (H2O's accumulated score, SnapKV's window vote). One reduction over
    the group's g*q rows: a decode step runs this once per layer."""
    b, h, q, t = probs.shape
    return probs.view(b, num_kv_heads, -1, t).sum(dim=2).div_(h // num_kv_heads)


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Per-head gather along the token axis: x `(B, H, T, ...)`, index `(B, H, k)` -> `(B, H, k, ...)`."""
    if x.dim() == 3:
        return x.gather(2, index)
    return x.gather(2, index[..., None].expand(*index.shape, x.shape[-1]))


def few_rows_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a (..., m, k) @ b (..., k, n)`. A decode step's products have a few rows per head (the
    query heads of a group, one new key): there a broadcast multiply and a sum over k, which run
    as plain loops below the intra-op grain size, cost less than a batched matmul's parallel
    launch; larger products (a prompt's keys) take the matmul."""
    batch = math.prod(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    if batch * a.shape[-2] * a.shape[-1] * b.shape[-1] > SERIAL_ELEMENTS:
        return a @ b
    return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)


# Elementwise ops up to this many elements run serially on CPU (torch's intra-op grain size,
# at::internal::GRAIN_SIZE): few-row forms such as the one above stay under it.
SERIAL_ELEMENTS = 32768
