"""The layer of the head-wise methods (DuoAttention, RazorAttention), on the eviction template.

Per layer, every KV head is either a *retrieval* head (keeps the full cache) or a *streaming* head
(keeps `sink_tokens` + a recent window; RazorAttention adds one compensation token). Which heads are
which is decided offline, once per model (`prepare`, methods/_head_probe.py or a learned pattern),
and is the same for every request.

The layer is an `EvictionLayer` on its head-wise path (methods/eviction.py): one ragged store per
layer (K/V follow runner.kv_layout, contiguous or paged, positions beside them), each (sequence,
KV head) with its own length, attended each head over its own slots (the ragged kernels; the
model's attention with a per-head mask once a compensation slot's bias exists). What it writes:
  * the kept set: `score()` is recency (the text position), `protected()` the sinks, and per head
    class its count: a retrieval head every token it holds, a streaming head `stream_slots`
    (compensation slot included). Eviction is positional, so every streaming head of a layer holds
    the same positions; the steady state of decoding drops each streaming head's oldest non-sink
    token in place (`drop_one` on those heads only), larger cuts keep the top of the scores;
  * RazorAttention's compensation token (`method.compensate`): one slot of each streaming head
    holding the running mean of the tokens it dropped (post-RoPE keys, as cached; position entry
    COMP_POSITION, so no text position) and the count |D| it stands for, attended with +log|D|
    (eq. 5) through the template's `slot_bias`. The first fold writes it into a dropped slot.
Each head holds only its own tokens (as DuoAttention's official code, which stores its head
classes as separate tensors): `kv_bytes` counts each head's own rows; the contiguous layout's
padding to the longest head is storage waste (`kv_bytes_allocated`), the paged layout's per-head
block tables hold none. Keys stay post-RoPE at their text positions (no re-rotation), as in both
papers' code. `kept_positions()` lists each head's text positions first, -1 after
(`kept_lengths()` per head; `virtual_slots()` counts the compensation slot, which has none).

Budget and accounting. Tokens per layer are reported as the *mean over KV heads* of held slots
(rounded up), not the max: a retrieval head holds everything by design, so the max would always be
the full length. With `budget_ratio` r, the fraction of the full cache held over all KV heads of the
model is r: with f = the realised retrieval-head fraction, each streaming head may hold
floor((r - f) / (1 - f) * seen) slots (at least 1, 2 with a compensation token; the sinks are
capped at half the slots, at least the first token, so the ratio holds even when it leaves room
for fewer than `sink_tokens` and a recent window remains; sinks once dropped are not restored).
Each layer's budget is its own mean under that rule, and the engine compares held with it after
every forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcore.storage import Rows, gather_rows
from methods.base import KVMethod
from methods.budget import require_basis
from methods.model import ModelInfo
from methods.eviction import (PAD_POSITION, EvictionLayer, drop_one_token, keep_tokens,
                              per_head_index)

COMP_POSITION = -2  # the compensation slot's entry in the positions rows (no text position)


@dataclass(kw_only=True)
class HeadwiseMethod(KVMethod):
    """Knobs and prepared state shared by the head-wise methods (DuoAttention, RazorAttention)."""

    budget_ratio: float | None = None
    budget_tokens: int | None = None  # refused: the head-wise budget is a share of the whole cache
    # streaming heads are cut to their share when a dense prompt is compressed, not before
    prompt_end_knobs: ClassVar[tuple[str, ...]] = ("budget_ratio",)
    probe_period_tokens: int = 2500  # Huawei's tool: 2500 random tokens
    probe_repeats: int = 4  # ... repeated 4 times (capped to the model's positions)
    probe_seed: int = 0
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self._retrieval: torch.Tensor | None = None  # (L, H_kv) bool
        self._retrieval_fraction = 0.0


def check_headwise_knobs(method) -> list[str]:
    """Checks shared by the head-wise methods, each naming its key."""
    r = []
    if not isinstance(method.sink_tokens, int) or method.sink_tokens < 0:
        r.append(f"method.sink_tokens={method.sink_tokens!r} must be an integer >= 0")
    ratio = getattr(method, "retrieval_head_ratio", None)  # null: DuoAttention's GQA/MHA default
    if ratio is not None and (not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1):
        r.append(f"method.retrieval_head_ratio={ratio!r} must be in [0, 1]")
    if method.budget_tokens is not None:
        r.append("method.budget_tokens is not supported by head-wise methods (their budget is a "
                 "share of the whole cache): use method.budget_ratio")
    b = method.budget_ratio
    if b is not None:
        if not isinstance(b, (int, float)) or not 0 < b <= 1:
            r.append(f"method.budget_ratio={b!r} must be in (0, 1]")
        elif isinstance(ratio, (int, float)) and ratio >= b and b < 1:
            r.append(f"method.retrieval_head_ratio={ratio} must be below method.budget_ratio={b} "
                     "(retrieval heads alone already hold that share of the cache)")
    return r


class HeadwiseLayer(EvictionLayer):
    """Retrieval heads keep everything; streaming heads keep sinks + window (+ compensation), on
    the template's head-wise path (module docstring).

    `method` provides: sink_tokens, stream_slots(seen) (slots a streaming head may hold after
    `seen` tokens, compensation included) and compensate (bool).
    """

    state_fields = ("s_tokens", "s_sinks", "sinks", "comp_count")

    compress_at = "forward"  # after every prefill chunk and decode step
    # Per-head counts come from the head classes, not from a layer budget split over heads: the
    # shared contract holds each head to `head_allowed_tokens`; the kept sets are checked by the
    # methods' own tests.
    selects_top_scores = False

    def __init__(self, layer_idx: int, info: ModelInfo, method, retrieval: torch.Tensor):
        super().__init__(layer_idx, info, method)
        self.streaming = ~retrieval.bool()  # (H_kv,) the streaming heads of this layer
        self.retrieval_heads = torch.nonzero(retrieval).flatten()  # (H_r,)
        self.streaming_heads = torch.nonzero(self.streaming).flatten()  # (H_s,)
        self.ragged = True  # every head has its own length (equal ones until the first cut)
        # Host-side counts (every streaming head of every batch row holds the same positions:
        # eviction is positional), so no decision below reads the device.
        self.s_tokens = 0  # text tokens a streaming head holds
        self.s_sinks: int | None = None  # sinks kept at the last cut (None: no cut yet)
        self.sinks = 0  # the sinks the cut under way protects
        self.comp_count = 0  # |D|: tokens the compensation slot stands for (0: no such slot)

    # --- what the template asks -----------------------------------------------------------------
    def score(self) -> torch.Tensor:
        """Recency: the text position `(B, H_kv, T)`; the compensation slot is always kept."""
        return self.positions.float().masked_fill(self.positions < 0, float("inf"))

    def protected(self, budget: int) -> tuple[int, int]:
        return self.sinks, 0

    def budget(self) -> int:
        """The layer's mean slots per KV head under the rule now (retrieval heads: every token)."""
        seen = self.seen_tokens
        return self._mean_slots(seen, min(seen, self.method.stream_slots(self.basis_tokens())))

    def slot_bias(self) -> torch.Tensor | None:
        """+log|D| on the compensation slot (RazorAttention eq. 5: it stands for |D| tokens)."""
        if not self.comp_count:
            return None
        return (self.positions == COMP_POSITION).float() * math.log(self.comp_count)

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        return self.over_heads(base)(module, query, keys, values, attention_mask, **kwargs)

    def update(self, keys, values, position_ids):
        self.s_tokens += keys.shape[2]
        return super().update(keys, values, position_ids)

    # --- sizes ----------------------------------------------------------------------------------
    def _s_slots(self) -> int:
        return self.s_tokens + (1 if self.comp_count else 0)

    def _mean_slots(self, r: int, s: int) -> int:
        h_r, h_s = len(self.retrieval_heads), len(self.streaming_heads)
        return math.ceil((h_r * r + h_s * s) / (h_r + h_s))

    def _stream_mask(self, batch: int, device) -> torch.Tensor:
        return self.streaming.to(device).expand(batch, -1)  # (B, H_kv)

    # --- eviction -------------------------------------------------------------------------------
    def compress_to(self, budget: int) -> None:
        """Cut every streaming head back to its slots (folding the dropped tokens, if
        compensating); `budget` (the layer's mean) follows from those slots."""
        if not len(self.streaming_heads) or not self.s_tokens:
            return
        allowed = self.method.stream_slots(self.basis_tokens())
        if self._s_slots() <= allowed:
            return
        comp = 1 if self.method.compensate else 0
        # Slots fewer than sinks + window (a budget below the method's own shape): the sinks take
        # at most half (at least the first token), so a streaming head keeps a recent window
        # (all-sinks heads, e.g. DuoAttention's 64 sinks in 33 slots, lose the local context every
        # head relies on). Sinks dropped once never come back: after a cut, only the sinks it
        # kept are still text positions 0, 1, ... (never a window token frozen in place).
        real_sinks = self.s_tokens if self.s_sinks is None else self.s_sinks
        self.sinks = min(self.method.sink_tokens, max(1, (allowed - comp) // 2), real_sinks)
        window = max(0, allowed - self.sinks - comp)
        if self.s_tokens - self.sinks - window == 1 and (self.comp_count or not comp):
            self._drop_oldest()  # the steady state of decoding: no copy of the rows
        else:
            self._cut(self.sinks + window)
        self.s_sinks, self.s_tokens = self.sinks, self.sinks + window
        self.kept_count = self._mean_slots(self.seen_tokens, self._s_slots())
        self._views()

    def _drop_oldest(self) -> None:
        """Each streaming head drops its lowest-scoring slot, the oldest non-sink token (folded
        first, if compensating): its last token moves into that slot."""
        rows = self._token_rows()
        oldest = self.guarded_scores(0).argmin(-1)  # (B, H_kv); padding scores PAD_POSITION
        s = self.streaming_heads
        if self.method.compensate:
            comp_k, comp_v = self._fold(read_slots(rows["keys"], oldest)[:, s],
                                        read_slots(rows["values"], oldest)[:, s])
            slot = self._comp_slot()
            write_slots(rows["keys"], slot, comp_k, s)
            write_slots(rows["values"], slot, comp_v, s)
        heads = (None if not len(self.retrieval_heads)
                 else self._stream_mask(oldest.shape[0], oldest.device))
        drop_one_token(rows, oldest, self.appended, heads=heads)

    def _cut(self, kept: int) -> None:
        """Retrieval heads keep every slot, streaming heads the top `kept` scores (their sinks and
        most recent tokens) and, compensating, the compensation slot with the others folded in."""
        rows = self._token_rows()
        held = self.held_lengths().clone()
        slots = torch.arange(self.positions.shape[-1], device=held.device)
        scores = self.guarded_scores(0).masked_fill(slots >= held[..., None], float("-inf"))
        if self.method.compensate:
            self._fold_dropped(rows, scores, self.s_tokens - kept)
        stream = self._stream_mask(held.shape[0], held.device)
        counts = torch.where(stream, kept + (1 if self.comp_count else 0), held)
        keep_tokens(rows, per_head_index(scores, counts), valid=counts)

    def _fold_dropped(self, rows: dict[str, Rows], scores: torch.Tensor, dropped: int) -> None:
        """Fold each streaming head's `dropped` lowest-scoring slots into its compensation slot
        (made, at the first fold, in the first of them: then held and scored +inf)."""
        s, first = self.streaming_heads, not self.comp_count
        stream_scores = scores[:, s]
        index = stream_scores.masked_fill(stream_scores == float("-inf"), float("inf")).topk(
            dropped, dim=-1, largest=False).indices  # (B, H_s, m) the oldest non-sinks
        comp_k, comp_v = self._fold(gather_rows(rows["keys"].view()[:, s], index),
                                    gather_rows(rows["values"].view()[:, s], index))
        if first:  # the slot is made
            slot = torch.zeros(scores.shape[:2], dtype=torch.int64, device=scores.device)
            slot[:, s] = index[..., 0]
            stream = self._stream_mask(slot.shape[0], slot.device)
            made = (torch.arange(scores.shape[-1], device=slot.device) == slot[..., None]) & \
                stream[..., None]  # (B, H_kv, T)
            self.positions.masked_fill_(made, COMP_POSITION)
            scores.masked_fill_(made, float("inf"))
        else:
            slot = self._comp_slot()
        write_slots(rows["keys"], slot, comp_k, s)
        write_slots(rows["values"], slot, comp_v, s)

    def _comp_slot(self) -> torch.Tensor:
        """The compensation slot of every head `(B, H_kv)` (meaningful for streaming heads)."""
        return (self.positions == COMP_POSITION).to(torch.int8).argmax(-1)

    def _fold(self, keys, values) -> tuple[torch.Tensor, torch.Tensor]:
        """The compensation token `(B, H_s, 1, D)` with the dropped `keys`/`values` `(B, H_s, m,
        D)` (post-RoPE, as cached) folded in: the running mean, and the count |D|."""
        m = keys.shape[-2]
        k_sum, v_sum = keys.float().sum(-2, keepdim=True), values.float().sum(-2, keepdim=True)
        if self.comp_count:
            slot, s = self._comp_slot(), self.streaming_heads
            k_sum = k_sum + read_slots(self._kv["keys"], slot)[:, s].float() * self.comp_count
            v_sum = v_sum + read_slots(self._kv["values"], slot)[:, s].float() * self.comp_count
        self.comp_count += m
        return (k_sum / self.comp_count).to(keys.dtype), (v_sum / self.comp_count).to(values.dtype)

    # --- accounting -----------------------------------------------------------------------------
    def head_allowed_tokens(self) -> torch.Tensor | None:
        """Slots each KV head may hold now under the rule `(B, H_kv)` (retrieval heads: every
        token seen; streaming heads: `stream_slots`); None while a prompt is held in full."""
        if self.holding_prompt() or self.positions is None:
            return None
        seen = self.seen_tokens
        streaming = min(seen, self.method.stream_slots(self.basis_tokens()))
        stream = self._stream_mask(self.positions.shape[0], self.positions.device)
        return torch.where(stream, streaming, seen).to(torch.int64)

    def virtual_slots(self) -> torch.Tensor | None:
        """Slots each KV head holds that are no text position `(B, H_kv)`: the compensation
        token of a streaming head (RazorAttention's "virtual token"), else 0."""
        if self.positions is None:
            return None
        stream = self._stream_mask(self.positions.shape[0], self.positions.device)
        return (stream & bool(self.comp_count)).to(torch.int64)

    def kept_lengths(self) -> torch.Tensor | None:
        """Text positions each KV head holds `(B, H_kv)` (the held slots less
        `virtual_slots()`); None before the first token."""
        return None if self.positions is None else self.held_lengths() - self.virtual_slots()

    def kept_positions(self) -> torch.Tensor:
        """`(B, H_kv, T)` text positions per head, each head's first, -1 past `kept_lengths()`
        (the compensation slot has no position: not listed)."""
        if self.positions is None:
            return torch.full((1, self.info.num_kv_heads, 0), -1, dtype=torch.long)
        if not self.comp_count:
            return super().kept_positions()
        real = (self.positions >= 0) & (self.positions != PAD_POSITION)
        order = (~real).to(torch.int8).argsort(dim=-1, stable=True)  # real slots first, in order
        return self.positions.gather(-1, order).masked_fill(~real.gather(-1, order), -1)


def read_slots(rows: Rows, slot: torch.Tensor) -> torch.Tensor:
    """Head (b, h)'s row at slot `slot[b, h]`, read in place: `(B, H, 1, ...)` (a copy)."""
    blocks = rows.in_place()
    b, h = blocks.heads
    flat = slot.reshape(-1).to(blocks.table.device)
    block = blocks.table[torch.arange(b * h, device=flat.device), flat // blocks.block_tokens]
    out = blocks.data[block, flat % blocks.block_tokens]  # (B * H, ...)
    return out.view(b, h, 1, *out.shape[1:])


def write_slots(rows: Rows, slot: torch.Tensor, new: torch.Tensor, heads: torch.Tensor) -> None:
    """Overwrite head (b, heads[i])'s row at slot `slot[b, heads[i]]` with `new[b, i]`
    (`new (B, H_sel, 1, ...)`), every other row unchanged, through the `Rows` interface: the
    rows are appended to every head (the selected heads' values, the others' any), then each
    head drops one token with that last one moving into its slot, the others into their own
    (appended) slot: lengths unchanged, one row written per selected head."""
    b = new.shape[0]
    lengths = rows.lengths()  # (B, H): the slot the append writes
    full = new.new_zeros(b, lengths.shape[1], *new.shape[2:])
    full[:, heads] = new
    target = lengths.clone()
    target[:, heads] = slot[:, heads].to(target)
    rows.append(full)
    rows.drop_one(target, last=full)


def stream_budget_slots(seen: int, budget_ratio: float, retrieval_fraction: float,
                        minimum: int) -> int:
    """Slots a streaming head may hold so that the whole model holds `budget_ratio` of the full
    cache, given the realised retrieval-head fraction."""
    seen = require_basis(seen)
    if retrieval_fraction >= 1:  # no streaming heads at all
        return seen
    share = (budget_ratio - retrieval_fraction) / (1 - retrieval_fraction)
    return max(minimum, int(share * seen))
