"""The scored-eviction template: what every evicting method shares, so a method writes only its score.

A method on this template (H2O, StreamingLLM, TOVA, SnapKV, PyramidKV) provides:
  * `score()` on its layer: the importance of every kept token per KV head, `(B, H_kv, T)` fp32,
    higher = keep (attention-based methods gather what they need in `attend`, usually into a
    per-token state declared by `new_state`, which the template moves along with the K/V);
  * `protected(budget)`: how many sink tokens (the first positions) and recent tokens (the last
    positions) are kept whatever their score;
  * when it acts: every method compresses a prompt once, at its end (`on_prefill_end`, whatever
    the chunking) under the default protocol (`runner.prefill=dense`); then either after every
    decode step (`compress_at = "forward"`; also after every prefill chunk under
    `runner.prefill=chunked|sparse`) or never again (`compress_at = "prefill_end"`: SnapKV-like
    compressors, read from their `Capabilities.acts_during_decode=False`; decode then appends,
    unless `runner.decode_interval_tokens` is set: then every that many tokens after the prompt the cache is compressed back to the budget by the same
    `score()`, `on_decode_compression` telling the layer its window starts again);
  * optionally a per-layer budget: `BudgetedMethod.layer_budget` (PyramidKV, SqueezeAttention),
    and a per-head split of it: `BudgetedMethod.head_budgets` (AdaKV). By default every KV head
    keeps the layer's budget (rectangular rows, the path every uniform method takes unchanged).

Head-wise budgets (a method overriding `head_budgets`). At each compression the method splits
the layer's budget B over its KV heads, `(B_rows, H_kv)` counts; each head keeps the top of its
own guarded scores (protected tokens first, they score +inf), as many as its count (clamped to
the tokens it holds), and the rows become ragged (kvcore.storage: per-head lengths, no padding
held: `kv_bytes` counts each head's own tokens). Decoding appends one token to every head.
  * the token figure (`kept_tokens()`, hence `kv_tokens`, the budget check and the attended
    fraction): the mean over (batch row, KV head) of the tokens each head holds, rounded up;
    equal to the layer's budget right after a compression when the counts sum to H_kv x B;
  * `kept_positions()`: `(B, H_kv, T)` padded to the longest head, the slots past a head's own
    length set to -1 (`kept_lengths()` gives the per-head counts);
  * attention (`over_heads(base)`): each head over its own tokens (methods.kernels.
    ragged_attention for plain calls, else the model's attention with a per-head mask, which
    also carries `slot_bias()`, an additive logit per slot: RazorAttention's +log|D|);
  * a later compression scores the padded rows: padded slots carry position PAD_POSITION (past
    every real one, so causal-by-position scorers ignore them; re-marked as the rows grow) and
    score -inf.
The head-wise methods with fixed head classes (DuoAttention, RazorAttention: methods/_headwise.py)
take this path too, with counts per head class instead of `head_budgets` and a slot of their own
(a compensation token) that holds no text position (`held_lengths()` counts it, `kept_lengths()`
does not).

The template does the rest: text positions `(B, H_kv, T)`, the protection, top-k per KV head,
compaction of K, V, positions and state, the budget that the engine checks after every forward
(`allowed_tokens`), the optional host tier (`runner.kv_offload=cpu`), and the accounting.

Budget rule (the one rule of every method, methods/budget.py): `budget_tokens`, when set, takes
precedence over `budget_ratio` (a fraction of the protocol's budget basis: the final length by
default). What a layer may hold (`allowed_tokens`) always comes from that rule at that moment,
never from what the method kept: after a prompt compressor's compression it is the rule's budget
then, plus the tokens appended since.

Storage: K and V are the layer's own (`KVLayer.kv_rows`, so they follow runner.kv_layout:
contiguous or paged), positions and per-token state are small contiguous `Rows` of the template
(`token_state`); all grow together (`append_tokens`), so a decode step costs no copy of the cache:
the new token is written at the end, and when exactly one token must go (the steady state of a
per-step method) the last slot moves into the evicted slot, per KV head (paged: a block freed
when it empties). The cache is therefore *not* in text order; nothing depends on it: attention
over old tokens is order-free (a chunk's own tokens are always the last ones, in order, so causal
masks hold) and positions travel with the tokens. Larger evictions gather the kept tokens in slot
order (paged: rewritten into the first blocks, the rest freed).
"""

from __future__ import annotations

import functools
from typing import Callable, ClassVar

import torch

from kvcore.storage import ContiguousRows, Rows, doubled_capacity
from methods.budget import BudgetedMethod
from methods.layer import KVLayer, exact_attention
from methods.model import ModelInfo
from methods.scoring import plain_attention

PAD_POSITION = 2 ** 62  # the position of a ragged head's padded slots (never a real one)


# Aligned per-token rows `(B, H_kv, T, ...)` (K, V, positions and a method's state), one `Rows`
# each (kvcore.storage), every one holding the same tokens in the same slots.
def append_tokens(rows_for: Callable[[str], Rows], new: dict[str, torch.Tensor]) -> int:
    """Write each `(B, H_kv, q, ...)` tensor after the tokens held (amortised growth); returns
    the new length."""
    lengths = set()
    for name, x in new.items():
        rows = rows_for(name)
        rows.append(x)
        lengths.add(rows.length)
    (length,) = lengths
    return length


def keep_tokens(rows: dict[str, Rows], index: torch.Tensor,
                valid: torch.Tensor | None = None) -> int:
    """Keep the tokens at `index (B, H_kv, k)` per head, in that order (contiguous: fresh fitted
    buffers with one slot of decode headroom, so a long prompt compressed to its budget frees its
    memory; paged: the surplus blocks go back to the pool). `valid (B, H_kv)`: head-wise counts
    (Rows.keep). Returns the rows' extent (the longest head's count)."""
    for r in rows.values():
        r.keep(index, headroom=1, valid=valid)
    return next(iter(rows.values())).length


def per_head_index(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Slots `(B, H, max(counts))` keeping head (b, h)'s top `counts[b, h]` scores, in slot
    order; the entries past a head's count are the last slot (ignored by Rows.keep)."""
    t = scores.shape[-1]
    index = scores.topk(int(counts.max()), dim=-1).indices  # (B, H, k) best first
    inside = torch.arange(index.shape[-1], device=index.device) < counts[..., None]
    return torch.where(inside, index, t).sort(dim=-1).values.clamp_(max=t - 1)


def drop_one_token(rows: dict[str, Rows], slot: torch.Tensor,
                   last: dict[str, torch.Tensor] | None = None,
                   heads: torch.Tensor | None = None) -> int:
    """Evict one token per head, `slot (B, H_kv)`: the last token moves into its place. `last`:
    some rows' last token `(B, H_kv, 1, ...)` as the caller still holds it (moved from there).
    `heads (B, H_kv)` bool: only those heads drop one (Rows.drop_one)."""
    last = last or {}
    for name, r in rows.items():
        r.drop_one(slot, last.get(name), heads=heads)
    return next(iter(rows.values())).length


@functools.lru_cache(maxsize=4)
def _text_positions(start: int, count: int, device: torch.device) -> torch.Tensor:
    """Positions start..start+count-1 `(count,)` (read-only): every layer of a forward asks for
    the same ones, so they are made once per step, not once per layer."""
    return torch.arange(start, start + count, device=device)


class TokenRows:
    """The rows a layer keeps in step with its K/V (a KVLayer mixin): K/V in the layer's storage
    (runner.kv_layout), per-token state (`token_state`: positions, scores, ...) contiguous beside
    them, so one `keep`/`drop_one` moves a token's K, V and state together."""

    token_state: dict[str, Rows]

    def _rows_for(self, name: str) -> Rows:
        if name in ("keys", "values"):  # the layer's K/V storage (runner.kv_layout)
            return self.kv_rows(name, growth=doubled_capacity)
        if name not in self.token_state:  # small; contiguous in both layouts
            self.token_state[name] = ContiguousRows(doubled_capacity)
        return self.token_state[name]

    def _token_rows(self) -> dict[str, Rows]:
        """Every per-token `Rows` of the kept tokens (K/V on the device tier, positions, state)."""
        return {**self._kv, **self.token_state}


class EvictionLayer(TokenRows, KVLayer):
    """Per-request, per-layer state of a scored-eviction method (see the module docstring)."""

    state_fields = ("token_state", "kept_count", "positions", "granted",
                    "appended", "picked", "ragged")

    # keeps the protected tokens and the top of score() (the shared contract recomputes that
    # set at every compression); False for a method keeping something else (KVMerger merges)
    selects_top_scores: ClassVar[bool] = True
    # score() is the attention each kept token has received, summed over every query row since
    # it entered the cache, per KV head the mean over its query heads (H2O's heavy hitters): the
    # shared contract then recomputes those sums from the attention it observes itself
    accumulates_attention: ClassVar[bool] = False

    def __init__(self, layer_idx: int, info: ModelInfo, method: BudgetedMethod):
        super().__init__(layer_idx, info)
        self.method = method
        self.token_state: dict[str, Rows] = {}  # positions + new_state(), see append_tokens
        self.kept_count = 0  # tokens kept
        self.positions: torch.Tensor | None = None  # (B, H_kv, T) text positions of kept tokens
        # prefill_end: (the rule's budget, tokens seen) when the prompt was compressed
        self.granted: tuple[int, int] | None = None
        # the one token this forward appended, as given (K, V, positions; rows nothing rewrites
        # before the eviction), so the steady-state eviction moves it without copying it first
        self.appended: dict[str, torch.Tensor] | None = None
        # (tokens seen, budget, slot (B, H_kv)): the token to evict, chosen while attending by a
        # fused kernel that had the updated scores at hand (`one_token_eviction`); used only by
        # the compression of that same forward (same tokens seen, same budget)
        self.picked: tuple[int, int, torch.Tensor] | None = None
        self.ragged = False  # heads hold different counts (head-wise budgets); see the docstring

    @property
    def compress_at(self) -> str:
        """"forward" (after every forward) or "prefill_end" (once per prompt, at its end), as
        the method declares (`acts_during_decode`). A layer compressing at the prompt's end and
        then by a decode rule of its own (R-KV's buffer) sets it as a class attribute."""
        return "forward" if self.method.capabilities.acts_during_decode else "prefill_end"

    # --- what a method writes ---------------------------------------------------------------

    def score(self) -> torch.Tensor:
        """Importance of every kept token, `(B, H_kv, T)` (higher = keep)."""
        raise NotImplementedError

    def protected(self, budget: int) -> tuple[int, int]:
        """(sink tokens, recent tokens) kept whatever their score."""
        return 0, 0

    def new_state(self, b: int, h: int, q: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Per-token state of `q` new tokens, `(B, H_kv, q, ...)`; moved along with the K/V."""
        return {}

    def state(self, name: str) -> torch.Tensor:
        """A per-token state of the kept tokens, `(B, H_kv, T, ...)` (a view: add to it in place)."""
        return self.token_state[name].view()

    # --- cache seam -------------------------------------------------------------------------
    def offloaded(self) -> bool:
        return self.tier is not None and self.tier.offload

    def prefetch(self, hidden_states, position_ids, ahead: bool) -> None:
        # runner.kv_offload=cpu: the kept K/V live in the layer's host store (`host_kv`)
        if self.offloaded() and hidden_states.shape[1] == 1 and self.host is not None:
            self.host.prefetch()  # the kept set, one layer ahead

    def update(self, keys, values, position_ids):
        b, h, q, _ = keys.shape
        text_pos = _text_positions(self.seen_tokens, q, keys.device)
        new = {"positions": text_pos.expand(b, h, q), **self.new_state(b, h, q, keys.device)}
        self.seen_tokens += q
        if self.offloaded():
            self.kept_count = append_tokens(self._rows_for, new)
            self._views()
            return self.host_kv().past_and_new(keys, values)
        extent = append_tokens(self._rows_for, {"keys": keys, "values": values, **new})
        self.kept_count = self.kept_count + q if self.ragged else extent  # every head grew by q
        self.appended = ({"keys": keys, "values": values, "positions": new["positions"]}
                         if q == 1 else None)
        self._views()
        return self.keys, self.values

    def _views(self) -> None:
        self.positions = self.state("positions")
        if self.ragged:  # the padding past each head's tokens: PAD_POSITION (module docstring)
            slots = torch.arange(self.positions.shape[-1], device=self.positions.device)
            self.positions.masked_fill_(slots >= self.held_lengths()[..., None], PAD_POSITION)

    def adopt(self, state, consume: bool = False) -> None:
        super().adopt(state, consume)
        # `positions` views the positions rows; adopted, it is a copy of the donor's view, and an
        # in-place write to it (RazorAttention's compensation slot) would miss the rows it views
        if "positions" in self.token_state:
            self._views()

    def kept_tokens(self) -> int:
        return self.kept_count

    def kept_positions(self) -> torch.Tensor:
        if self.positions is None:
            return super().kept_positions()
        if not self.ragged:
            return self.positions
        lengths = self.kept_lengths()  # ragged: the padding is -1 (module docstring)
        slots = torch.arange(self.positions.shape[-1], device=lengths.device)
        return self.positions.masked_fill(slots >= lengths[..., None], -1)

    def kept_lengths(self) -> torch.Tensor | None:
        """Tokens each KV head holds `(B, H_kv)` (the storage's own tensor: it grows with the
        rows, clone it to keep it); None while every head holds `kept_tokens()`."""
        return self.held_lengths() if self.ragged else None

    def _heads_alike(self) -> bool:
        """Every head of a ragged store holds the same count (a prompt before its first cut)."""
        lengths = self.held_lengths()
        return bool((lengths == lengths.flatten()[0]).all())

    def held_lengths(self) -> torch.Tensor:
        """Slots each KV head holds `(B, H_kv)`: its text tokens, plus a slot standing for
        evicted ones where a layer keeps one (RazorAttention's compensation token)."""
        return self.token_state["positions"].lengths()

    def slot_bias(self) -> torch.Tensor | None:
        """An additive logit per held slot `(B, H_kv, T)` fp32 for ragged attention (None: none;
        RazorAttention's +log|D| on its compensation slot); attention then takes the masked path."""
        return None

    def mask_sizes(self, q_len: int) -> tuple[int, int]:
        # the rows' padded extent (the longest head's), what update returns
        ragged = self.ragged and self.positions is not None
        extent = self.token_state["positions"].length if ragged else self.kept_tokens()
        return extent + q_len, self.seen_tokens - extent

    def over_heads(self, base):
        """`base` (the model's attention) when every head holds the same count (a ragged store:
        for a chunk of several tokens); ragged rows: attention of each head over its own tokens
        (the chunk's new ones are each head's last):
        the ragged kernels for plain calls, else `base` with a per-head mask over the padded
        rows (their padding zeroed, never read)."""
        if not self.ragged:
            return base

        def attend(module, query, keys, values, attention_mask, **kwargs):
            bias = self.slot_bias()
            if bias is None and query.shape[2] > 1 and self._heads_alike():
                # a chunk while every head holds the same tokens (a prompt before the first
                # cut): the padded rows are the dense ones, attended as the full cache does
                return base(module, query, keys, values, attention_mask, **kwargs)
            if bias is None and plain_attention(kwargs):
                blocks = self._kv["keys"].in_place(), self._kv["values"].in_place()
                return exact_attention(module, query, *blocks, None, base, **kwargs)
            lengths, q, t = self.held_lengths(), query.shape[2], keys.shape[2]
            seen = (lengths - q)[..., None] + 1 + torch.arange(q, device=keys.device)
            visible = torch.arange(t, device=keys.device) < seen[..., None]  # (B, H_kv, q, T)
            held = visible[:, :, -1:].transpose(2, 3)  # (B, H_kv, T, 1) a head's own slots
            keys, values = keys.masked_fill(~held, 0), values.masked_fill(~held, 0)
            mask = torch.zeros(visible.shape, dtype=query.dtype, device=query.device)
            mask = mask.masked_fill(~visible, torch.finfo(query.dtype).min)
            if bias is not None:
                mask = mask + bias[:, :, None].to(mask.dtype)
            mask = mask.repeat_interleave(query.shape[1] // keys.shape[1], dim=1)
            return base(module, query, keys, values, mask, **kwargs)
        return attend

    # --- eviction ---------------------------------------------------------------------------
    def budget(self) -> int:
        return self.method.layer_budget(self.layer_idx, self.info.num_layers, self.basis_tokens())

    def allowed_tokens(self) -> int | None:
        if self.holding_prompt():  # the prompt is held in full until it is over
            return None
        if self.compress_at == "forward":
            return self.budget()
        if self.granted is None:  # no prompt compressed yet
            return None
        budget, seen = self.granted
        return budget + self.seen_tokens - seen  # decode appends without eviction

    def after_forward(self) -> None:
        if self.compress_at == "forward" and not self.holding_prompt():
            self.compress_to(self.budget())
        elif self.decode_compression_due():
            budget = self.budget()
            self.compress_to(budget)
            self.granted = (budget, self.seen_tokens)
            self.on_decode_compression()
        self.appended = self.picked = None  # valid for this forward only

    def decode_interval(self) -> int | None:
        """Tokens after which a once-per-prompt compressor compresses again while decoding:
        the run's `Protocol.decode_interval_tokens` (a method with an interval of its own, R-KV's
        buffer, returns that instead)."""
        return self.protocol.decode_interval_tokens

    def decode_compression_due(self) -> bool:
        """`decode_interval()` tokens were fed since the last compression."""
        interval = self.decode_interval()
        return (interval is not None and self.compress_at == "prefill_end"
                and self.granted is not None and self.seen_tokens - self.granted[1] >= interval)

    def on_decode_compression(self) -> None:
        """The cache was brought back to its budget during decoding (decode_interval_tokens):
        a layer scoring from what it recorded since the last compression starts again."""

    def on_prefill_end(self) -> None:
        budget = self.budget()
        self.compress_to(budget)
        if self.compress_at == "prefill_end":
            self.granted = (budget, self.seen_tokens)

    def compress_to(self, budget: int) -> None:
        """Keep `budget` tokens per KV head: the protected ones, then the top scores (head-wise
        budgets: `head_budgets`' count per head, see the module docstring)."""
        kept = self.kept_tokens()
        if kept <= budget:
            return
        if self.method.allocates_per_head():
            self.keep_per_head(budget)
        elif kept - budget == 1 and not self.offloaded():  # steady state: no copy of the cache
            self.kept_count = drop_one_token(self._token_rows(), self.lowest_slot(budget),
                                             self.appended)
        else:
            index = self.guarded_scores(budget).topk(budget, dim=-1).indices.sort(dim=-1).values
            if self.offloaded():
                self.host.keep(index)
            self.kept_count = keep_tokens(self._token_rows(), index)
        self._views()

    def keep_per_head(self, budget: int) -> None:
        """Keep `head_budgets(scores, budget)` tokens per KV head (clamped to what it holds),
        each its top guarded scores; the rows become ragged unless the counts are equal."""
        if self.offloaded():
            raise ValueError("head-wise budgets keep ragged rows; the host tier holds rectangular "
                             "ones (runner.kv_offload=cpu is for uniform methods)")
        scores = self.guarded_scores(budget)
        held = self.held_lengths() if self.ragged else None
        if held is not None:  # padded slots are no candidates
            slots = torch.arange(scores.shape[-1], device=scores.device)
            scores = scores.masked_fill(slots >= held[..., None], float("-inf"))
        else:
            held = torch.full(scores.shape[:2], scores.shape[-1], device=scores.device)
        counts = torch.minimum(self.method.head_budgets(scores, budget, self.layer_idx).to(held), held)
        keep_tokens(self._token_rows(), per_head_index(scores, counts), valid=counts)
        self.ragged = self.token_state["positions"].ragged
        self.kept_count = -(-int(counts.sum()) // counts.numel())  # the mean, rounded up

    def one_token_eviction(self) -> tuple[int, int, int] | None:
        """`(budget, lo, hi)` when this forward's compression will evict exactly one token per
        head (the steady state of decoding), the unprotected tokens being those with text
        positions lo <= p < hi; else None. For a method scoring while it attends: it may pick
        the slot then (`picked`), as `lowest_slot` would from the same scores."""
        if self.compress_at != "forward" or self.offloaded() or self.method.allocates_per_head():
            return None
        budget = self.allowed_tokens()  # what after_forward compresses to (None: it will not)
        if budget is None or self.kept_tokens() - budget != 1:
            return None
        sinks, recent = self.protected(budget)
        return budget, sinks, self.seen_tokens - recent

    def guarded_scores(self, budget: int) -> torch.Tensor:
        """Scores `(B, H_kv, T)` fp32 with the protected tokens at +inf."""
        sinks, recent = self.protected(budget)
        guard = None  # as few kernels as the protection needs: this runs every decode step
        if sinks:
            guard = self.positions < sinks
        if recent:
            newest = self.positions >= self.seen_tokens - recent
            guard = newest if guard is None else guard | newest
        scores = self.score().float()
        return scores if guard is None else scores.masked_fill(guard, float("inf"))

    def lowest_slot(self, budget: int) -> torch.Tensor:
        """The slot to evict when exactly one token must go, `(B, H_kv)`."""
        picked, self.picked = self.picked, None
        if picked is not None and picked[:2] == (self.seen_tokens, budget):
            return picked[2]
        return self.guarded_scores(budget).argmin(dim=-1)

    # --- accounting -------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        if self.offloaded():
            held = 0 if self.host is None else self.host.nbytes()
            return {"kv_tokens": self.kept_tokens(), "kv_bytes": held, "kv_bytes_device": 0}
        storage = self.storage_stats()
        return {"kv_tokens": self.kept_tokens(), "kv_bytes": storage.get("kv_bytes_used", 0),
                **storage}
