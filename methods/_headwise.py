"""Shared machinery of the head-wise methods (DuoAttention, RazorAttention).

Per layer, every KV head is either a *retrieval* head (keeps the full cache) or a *streaming* head
(keeps `sink_tokens` + a recent window; RazorAttention adds one compensation token). Which heads are
which is decided offline, once per model (`prepare`), and is the same for every request.

Layout: one ragged store per layer, the harness's shared storage (kvcore.storage: K and V are the
layer's `kv_rows`, so they follow runner.kv_layout, contiguous or paged; a small contiguous
`(B, H_kv, T)` positions row travels with them). Every (sequence, KV head) has its own length: a
retrieval head holds every token seen; a streaming head its sinks + window and, compensating, one
compensation slot (the running mean of the tokens it dropped, post-RoPE keys as cached; position
entry COMP_POSITION) + the count |D| it stands for. Each head holds only its own tokens (as
DuoAttention's official code, which stores its head classes as separate tensors): `kv_bytes` counts
each head's own rows; the contiguous layout's padding to the longest head is storage waste
(`kv_bytes_allocated`), the paged layout's per-head block tables hold none.
Eviction is positional, so every streaming head of a layer holds the same positions; a decode step
appends the new token to every head and each streaming head then drops its oldest non-sink token
(its last row moves into that slot: the rows are not in text order, attention is order-free);
cuts of more than one token (a prompt's end, a prefill chunk) rewrite the rows in text order.
Attention: each head over its own slots, the chunk's new tokens last. Without a compensation
slot (DuoAttention; RazorAttention before its first fold) through methods.kernels.
ragged_attention over the rows in place (no mask: the C kernel or Triton for decode rows, heads of
equal length packed into SDPA for prefill chunks); with one, the model's attention over the padded
rows with a per-head additive mask (causal per head, padding hidden) and +log|D| on that slot
(RazorAttention eq. 5). Keys stay post-RoPE at their text positions (no re-rotation), as in both
papers' code. `kept_positions()` lists each head's text positions first, -1 after
(`kept_lengths()` per head; `virtual_slots()` counts the compensation slot, which has none).

Head identification without learned gates: RazorAttention's probe, as Huawei's public tool runs it
(MindSpore Golden Stick, `sequence_compress/razor_attention`: `DUMMY_INPUT_LENGTH = 2500`,
`REPET_TIMES = 4`): `P` random token ids (from [10000, 12500] where the vocabulary has them, else
[3, vocab); seeded here, the tool's are unseeded) repeated `repeats` times, the model's BOS first,
go through the model once (`ctx.capture`); `P` is capped so that the sequence fits the model's
positions (SmolLM2: 8192 -> P = 2047). For each query head, every query i of a repetition after
the first attends to each earlier occurrence j of its token (echo) and to the token after it,
j + 1 (induction); a head's score is the sum of those attention weights over all such (i, j)
divided by S^2 (the tool's mean over the S x S attention map). KV head score = max over its
query group (the tool's `_max_every_group`). The attention map is computed in row blocks (never
S x S at once); the model's own output comes from its attention function. The scores are cached
on disk per model fingerprint and probe. Not reproduced: the tool's index quirk that also counts
the BOS as an earlier occurrence for the rows whose position is a multiple of P.

Budget and accounting. Tokens per layer are reported as the *mean over KV heads* of held slots
(rounded up), not the max: a retrieval head holds everything by design, so the max would always be
the full length. With `budget_ratio` r, the fraction of the full cache held over all KV heads of the
model is r: with f = the realised retrieval-head fraction, each streaming head may hold
floor((r - f) / (1 - f) * seen) slots (at least 1, 2 with a compensation token; the sinks are
capped at half the slots, at least the first token, so the ratio holds even when it leaves room
for fewer than `sink_tokens` and a recent window remains; sinks once dropped are not restored). Each layer's budget is its own mean
under that rule, and `check_step` compares held with it after every forward.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcore.errors import ConfigError
from kvcore.storage import Rows, gather_rows
from methods import _sidefiles as sidefiles
from methods.base import KVLayer, KVMethod, ModelInfo, exact_attention, require_basis
from methods.eviction import PAD_POSITION, TokenRows, append_tokens
from methods.scoring import plain_attention

log = logging.getLogger(__name__)
PROBE_FORMAT_VERSION = 2  # 2: P tokens x repeats + BOS, every earlier occurrence, / S^2
COMP_POSITION = -2  # the compensation slot's entry in the positions rows (no text position)


# --------------------------------------------------------------------------------------------
# retrieval-head selection
def select_retrieval(echo: torch.Tensor, induction: torch.Tensor, retrieval_heads: int,
                     echo_heads: int) -> torch.Tensor:
    """RazorAttention's union rule over all (layer, KV head) of the model.

    echo, induction: (L, H_kv) scores. The `echo_heads` best echo heads, then the best induction
    heads until `retrieval_heads` are chosen. Ties go to the lower (layer, head) index.
    Returns a bool (L, H_kv) mask of retrieval heads.
    """
    flat_e, flat_i = echo.flatten().double(), induction.flatten().double()
    n = flat_e.numel()
    retrieval_heads, echo_heads = max(0, min(retrieval_heads, n)), max(0, min(echo_heads, n))
    chosen = torch.zeros(n, dtype=torch.bool)
    order_e = torch.sort(-flat_e, stable=True).indices
    chosen[order_e[:min(echo_heads, retrieval_heads)]] = True
    for idx in torch.sort(-flat_i, stable=True).indices.tolist():
        if int(chosen.sum()) >= retrieval_heads:
            break
        chosen[idx] = True
    return chosen.view(echo.shape)


def select_union(echo: torch.Tensor, induction: torch.Tensor, echo_heads: int,
                 induction_heads: int) -> torch.Tensor:
    """Huawei's RazorAttention selection (`_finalize_compress_head`): the `echo_heads` best echo
    heads and the `induction_heads` best induction heads of all (layer, KV head), united (an
    overlap leaves fewer than their sum). Ties go to the lower (layer, head) index. Returns a bool
    (L, H_kv) mask of retrieval heads."""
    chosen = torch.zeros(echo.numel(), dtype=torch.bool)
    for scores, count in ((echo, echo_heads), (induction, induction_heads)):
        order = torch.sort(-scores.flatten().double(), stable=True).indices
        chosen[order[:max(0, min(count, echo.numel()))]] = True
    return chosen.view(echo.shape)


def sparsify_gates(gates: torch.Tensor, sparsity: float, seed: int = 42) -> torch.Tensor:
    """DuoAttention's deployment rule (`sparsify_attention_heads` with `sparsity`): add U(0, 1e-6)
    tie-break noise (seeded, as `pred.py` seeds 42), threshold at the `sparsity` quantile; heads
    with gate >= threshold are retrieval heads. sparsity >= 1: none; <= 0: all."""
    if sparsity >= 1:
        return torch.zeros(gates.shape, dtype=torch.bool)
    if sparsity <= 0:
        return torch.ones(gates.shape, dtype=torch.bool)
    noise = torch.rand(gates.shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64) * 1e-6
    noisy = gates.double() + noise
    threshold = torch.quantile(noisy.flatten(), sparsity)
    return noisy >= threshold


# The official pattern files hold slightly negative gates, which its loader clips to [0, 1]; a
# gate further out is no gate of a trained pattern.
GATE_SLACK = 0.1


def load_duo_pattern(path: str | Path, info: ModelInfo) -> tuple[torch.Tensor, dict]:
    """The official DuoAttention pattern: a folder holding `full_attention_heads.tsv` (one row per
    layer, one tab-separated gate alpha in [0, 1] per KV head) and `config.json` (`sink_size`,
    `recent_size` used in training), or the .tsv file itself. Returns (gates (L, H_kv) fp64, config)."""
    key, path = "method.pattern_path", Path(path)
    tsv = path / "full_attention_heads.tsv" if path.is_dir() else path
    if not tsv.is_file():
        raise ConfigError(f"{key}={path}: no full_attention_heads.tsv there (the "
                          "official DuoAttention pattern folder or its .tsv file)")
    text = sidefiles.read_text(key, tsv)
    try:
        rows = [[float(v) for v in line.split("\t")] for line in text.splitlines() if line.strip()]
        gates = torch.tensor(rows, dtype=torch.float64)
    except ValueError as exc:
        raise ConfigError(f"{key}={tsv}: not a tab-separated matrix of gate values "
                          f"({exc})") from exc
    if tuple(gates.shape) != (info.num_layers, info.num_kv_heads):
        raise ConfigError(f"{key}={tsv}: gates of shape {tuple(gates.shape)}, but "
                          f"this model has {info.num_layers} layers x {info.num_kv_heads} KV heads")
    heads = info.num_kv_heads
    sidefiles.check_numbers(key, tsv, gates.flatten().tolist(),
                            lambda i: f"the gate of layer {i // heads} KV head {i % heads}",
                            -GATE_SLACK, 1 + GATE_SLACK,
                            f"finite gates in [0, 1] (within {GATE_SLACK:g}, which the official "
                            "loader clips)")
    config = {}
    cfg = (path if path.is_dir() else path.parent) / "config.json"
    if cfg.is_file():
        raw = sidefiles.parse_json(key, cfg, sidefiles.read_text(key, cfg), dict,
                                   'an object such as {"sink_size": 64, "recent_size": 256}')
        config = {k: raw[k] for k in ("sink_size", "recent_size") if k in raw}
        for k, v in config.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"{key}={cfg}: {k}={v!r}; allowed: an integer >= 0 (tokens)")
    return gates.clamp(0, 1), config


# --------------------------------------------------------------------------------------------
# the probe (training-free identification)
class _ProbeLayer(KVLayer):
    def __init__(self, layer_idx: int, info: ModelInfo, period: int, offset: int = 0,
                 block_rows: int = 512):
        super().__init__(layer_idx, info)
        self.period, self.offset, self.block_rows = period, offset, block_rows
        self.echo = self.induction = None  # (H_q,)

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        scaling = kwargs.get("scaling") or module.scaling
        self.echo, self.induction = echo_induction_scores(
            query[0], keys[0], scaling, self.period, self.offset, self.block_rows)
        return base(module, query, keys, values, attention_mask, **kwargs)


def echo_induction_scores(query: torch.Tensor, keys: torch.Tensor, scaling: float, period: int,
                          offset: int = 0, block_rows: int = 512
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query head `(H_q,)`: the causal attention of every query on each earlier occurrence of
    its token (echo) and on the token after it (induction), summed and divided by S^2. query
    `(H_q, S, D)`, keys `(H_kv, S, D)`: a sequence of `offset` leading tokens (the BOS), then a
    block of `period` tokens repeated; computed in blocks of `block_rows` query rows."""
    h_q, s, _ = query.shape
    groups = h_q // keys.shape[0]
    k = keys.float().repeat_interleave(groups, 0)  # (H_q, S, D)
    reps = (s - offset) // period
    echo = torch.zeros(h_q, dtype=torch.float64)
    induction = torch.zeros(h_q, dtype=torch.float64)
    for r0 in range(0, s, block_rows):
        rows = torch.arange(r0, min(s, r0 + block_rows))
        logits = (query[:, rows].float() * scaling) @ k.transpose(1, 2)  # (H_q, rows, S)
        future = torch.arange(s)[None, :] > rows[:, None]
        probs = torch.softmax(logits.masked_fill(future, float("-inf")), -1)
        text = rows - offset  # position in the repeated text
        back = torch.arange(1, max(reps, 1))  # occurrences 1..reps-1 repetitions back
        earlier = text[:, None] - back[None, :] * period  # (rows, reps - 1) in text positions
        valid = (text[:, None] >= 0) & (earlier >= 0)
        j = (earlier + offset).clamp(min=0)  # (rows, reps - 1) sequence positions
        for shift, total in ((0, echo), (1, induction)):
            got = probs.gather(-1, (j + shift).clamp(max=s - 1).expand(h_q, -1, -1))
            total += (got * valid).sum((1, 2)).double()
    return (echo / s ** 2).float(), (induction / s ** 2).float()


@dataclass(kw_only=True)
class _ProbeMethod(KVMethod):
    name = "headwise_probe"
    period_tokens: int = 2500
    offset_tokens: int = 0

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return _ProbeLayer(layer_idx, info, self.period_tokens, self.offset_tokens)


def probe_tokens(period: int, repeats: int, vocab: int, seed: int,
                 bos: int | None = None) -> torch.Tensor:
    """`period` seeded random ids repeated `repeats` times, `bos` first if given: ids from
    [10000, 12500] (Huawei's tool) where the vocabulary holds them, else from [3, vocab) (small
    vocabularies; the lowest ids, where special tokens live, avoided)."""
    low, high = (10000, 12501) if vocab > 12500 else (min(3, vocab - 1), vocab)
    g = torch.Generator().manual_seed(seed)
    block = torch.randint(low, high, (period,), generator=g)
    ids = block.repeat(repeats)
    return ids if bos is None else torch.cat([torch.tensor([bos]), ids])


def probe_period(period: int, repeats: int, max_positions: int | None, offset: int) -> int:
    """The period actually probed: capped so that offset + period * repeats fits the positions."""
    if not max_positions:
        return period
    return max(2, min(period, (max_positions - offset) // repeats))


def probe_scores(ctx, period: int, repeats: int, seed: int, cache_dir: str | None
                 ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Echo and induction scores per (layer, KV head) (max over the query group), cached on disk."""
    info = ctx.info
    tokenizer = ctx.tokenizer
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    offset = 0 if bos is None else 1
    period = probe_period(period, repeats, info.max_positions, offset)
    key = hashlib.sha256(json.dumps({"v": PROBE_FORMAT_VERSION, "model": ctx.fingerprint,
                                     "period": period, "repeats": repeats, "bos": bos,
                                     "seed": seed}).encode()).hexdigest()[:24]
    root = Path(cache_dir or ctx.cache_dir or os.environ.get("KVH_CACHE_DIR")
                or Path.home() / ".cache" / "kv-harness") / "headwise_probe"
    path = root / f"{key}.pt"
    loaded = _load_scores(path, info)
    status = "loaded"
    if loaded is None:
        ids = probe_tokens(period, repeats, ctx.vocab_size, seed, bos)
        layers = ctx.capture(_ProbeMethod(period_tokens=period, offset_tokens=offset), ids)
        g = info.group_size
        echo = torch.stack([lay.echo.view(info.num_kv_heads, g).amax(-1) for lay in layers])
        ind = torch.stack([lay.induction.view(info.num_kv_heads, g).amax(-1) for lay in layers])
        loaded = (echo.float(), ind.float())
        _save_scores(path, *loaded)
        status = "computed"
    facts = {"probe_scores": status, "probe_path": str(path), "probe_period_tokens": period,
             "probe_repeats": repeats, "probe_bos": bos, "probe_seed": seed,
             "probe_group_reduce": "max"}
    return loaded[0], loaded[1], facts


def _save_scores(path: Path, echo: torch.Tensor, induction: torch.Tensor) -> None:
    payload = {"version": PROBE_FORMAT_VERSION, "echo": echo, "induction": induction}
    sidefiles.save_cache(path, lambda tmp: torch.save(payload, tmp), "head probe scores")


def _load_scores(path: Path, info: ModelInfo):
    if not path.is_file():
        return None
    try:
        payload = sidefiles.load_cache("method.cache_dir", path, lambda p: torch.load(
            p, map_location="cpu", weights_only=True))
        echo, ind = payload["echo"], payload["induction"]
    except Exception as exc:  # unreadable: rebuild
        log.warning("head probe scores %s unreadable (%s): recomputing", path, exc)
        return None
    shape = (info.num_layers, info.num_kv_heads)
    if tuple(echo.shape) != shape or tuple(ind.shape) != shape or not (
            torch.isfinite(echo).all() and torch.isfinite(ind).all()):
        log.warning("head probe scores %s do not fit this model: recomputing", path)
        return None
    return echo, ind


# --------------------------------------------------------------------------------------------
# the per-layer cache
@dataclass(kw_only=True)
class HeadwiseMethod(KVMethod):
    """Knobs and prepared state shared by the head-wise methods (DuoAttention, RazorAttention)."""

    budget_ratio: float | None = None
    budget_tokens: int | None = None  # refused: the head-wise budget is a share of the whole cache
    probe_period_tokens: int = 2500  # Huawei's tool: 2500 random tokens
    probe_repeats: int = 4  # ... repeated 4 times (capped to the model's positions)
    probe_seed: int = 0
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self._retrieval: torch.Tensor | None = None  # (L, H_kv) bool
        self._retrieval_fraction = 0.0


class HeadwiseLayer(TokenRows, KVLayer):
    """Retrieval heads keep everything; streaming heads keep sinks + window (+ compensation),
    all in one ragged store per layer (module docstring, "Layout").

    `method` provides: sink_tokens, stream_slots(seen) (slots a streaming head may hold after
    `seen` tokens, compensation included) and compensate (bool).
    """

    def __init__(self, layer_idx: int, info: ModelInfo, method, retrieval: torch.Tensor):
        super().__init__(layer_idx, info)
        self.method = method
        self.streaming = ~retrieval.bool()  # (H_kv,) the streaming heads of this layer
        self.retrieval_heads = torch.nonzero(retrieval).flatten()  # (H_r,)
        self.streaming_heads = torch.nonzero(self.streaming).flatten()  # (H_s,)
        self.token_state: dict[str, Rows] = {}  # "positions" (B, H_kv, T), aligned with K/V
        # Host-side counts (every streaming head of every batch row holds the same positions:
        # eviction is positional), so no decision below reads the device.
        self.s_tokens = 0  # text tokens a streaming head holds
        self.s_sinks: int | None = None  # sinks kept at the last cut (None: no cut yet)
        self.comp_count = 0  # |D|: tokens the compensation slot stands for (0: no such slot)
        self._attended_slots = 0

    # --- sizes ---------------------------------------------------------------------------------
    def _s_slots(self) -> int:
        return self.s_tokens + (1 if self.comp_count else 0)

    def _mean_slots(self, r: int, s: int) -> int:
        h_r, h_s = len(self.retrieval_heads), len(self.streaming_heads)
        return math.ceil((h_r * r + h_s * s) / (h_r + h_s))

    def _stream_mask(self, batch: int, device) -> torch.Tensor:
        return self.streaming.to(device).expand(batch, -1)  # (B, H_kv)

    # --- cache seam ----------------------------------------------------------------------------
    def update(self, keys, values, position_ids):
        b, h, q, _ = keys.shape
        positions = torch.arange(self.seen_tokens, self.seen_tokens + q, device=keys.device)
        self.seen_tokens += q
        append_tokens(self._rows_for, {"keys": keys, "values": values,
                                       "positions": positions.expand(b, h, q)})
        self.s_tokens += q
        self._attended_slots = self._mean_slots(self.seen_tokens, self._s_slots())
        return self.keys, self.values

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        """Each head over its own slots (the chunk's new tokens are each head's last; causality
        rebuilt per head: the caches are per sequence, so the model's mask carries nothing
        else). No compensation slot: the ragged kernels over the rows in place (no mask);
        with one: the model's attention with a per-head additive mask (+log|D| on that slot)."""
        if not self.comp_count and plain_attention(kwargs):
            blocks = self._kv["keys"].in_place(), self._kv["values"].in_place()
            return exact_attention(module, query, *blocks, None, base, **kwargs)
        keys, values, mask = self._masked(query, keys, values)
        return base(module, query, keys, values, mask, **kwargs)

    def _masked(self, query, keys, values):
        """The padded rows with what a head does not hold zeroed, and the additive mask
        `(B, H_q, q, T)`: causal per head over its own length, the compensation slot +log|D|."""
        lengths, q, t = self._kv["keys"].lengths(), query.shape[2], keys.shape[2]
        slots = torch.arange(t, device=keys.device)
        seen = (lengths - q)[..., None] + 1 + torch.arange(q, device=keys.device)
        visible = slots < seen[..., None]  # (B, H_kv, q, T)
        held = visible[:, :, -1:].transpose(2, 3)  # (B, H_kv, T, 1) a head's own slots
        keys, values = keys.masked_fill(~held, 0), values.masked_fill(~held, 0)
        mask = torch.zeros(visible.shape, device=keys.device)
        mask = mask.masked_fill(~visible, float("-inf"))
        if self.comp_count:  # RazorAttention eq. 5: the slot stands for |D| tokens
            comp = (slots == self._comp_slot()[..., None]) & self._stream_mask(
                keys.shape[0], keys.device)[..., None]  # (B, H_kv, T)
            mask = mask + comp[:, :, None].float() * math.log(self.comp_count)
        mask = mask.repeat_interleave(query.shape[1] // keys.shape[1], dim=1)
        return keys, values, mask.to(query.dtype)

    def after_forward(self) -> None:
        """Cut every streaming head back to its slots (folding the dropped tokens, if
        compensating); a prompt held in full under runner.prefill=dense is cut at its end."""
        if not self.holding_prompt():
            self.cut_streaming_heads()

    def on_prefill_end(self) -> None:
        self.cut_streaming_heads()

    def cut_streaming_heads(self) -> None:
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
        sinks = min(self.method.sink_tokens, max(1, (allowed - comp) // 2), real_sinks)
        window = max(0, allowed - sinks - comp)
        if self.s_tokens - sinks - window == 1 and (self.comp_count or not comp):
            self._drop_oldest(sinks)  # the steady state of decoding: no copy of the rows
        else:
            self._cut(sinks, window)
        self.s_sinks, self.s_tokens = sinks, sinks + window

    def _drop_oldest(self, sinks: int) -> None:
        """Each streaming head drops its oldest non-sink token (folded first, if compensating):
        its last token moves into that slot (the rows are not in text order; nothing needs it)."""
        rows = self._token_rows()
        positions, lengths = rows["positions"].view(), rows["positions"].lengths()
        b = positions.shape[0]
        slots = torch.arange(positions.shape[-1], device=positions.device)
        candidate = (slots < lengths[..., None]) & (positions >= sinks)  # no sink, no comp slot
        oldest = positions.masked_fill(~candidate, PAD_POSITION).argmin(-1)  # (B, H_kv)
        s = self.streaming_heads
        if self.method.compensate:
            comp_k, comp_v = self._fold(read_slots(rows["keys"], oldest)[:, s],
                                        read_slots(rows["values"], oldest)[:, s])
            slot = self._comp_slot()
            write_slots(rows["keys"], slot, comp_k, s)
            write_slots(rows["values"], slot, comp_v, s)
        heads = None if not len(self.retrieval_heads) else self._stream_mask(b, oldest.device)
        for r in rows.values():
            r.drop_one(oldest, heads=heads)

    def _cut(self, sinks: int, window: int) -> None:
        """Rewrite the rows: retrieval heads keep everything, streaming heads their `sinks`
        first and `window` last text positions, then (compensating) the compensation slot, all
        in text order; the tokens between are folded into it."""
        rows = self._token_rows()
        positions, lengths = rows["positions"].view(), rows["positions"].lengths()
        b, h, t = positions.shape
        slots = torch.arange(t, device=positions.device)
        real = (slots < lengths[..., None]) & (positions >= 0)
        order = positions.masked_fill(~real, PAD_POSITION).argsort(-1)  # (B, H_kv, T) by position
        held, kept = self.s_tokens, sinks + window
        comp = 1 if self.method.compensate else 0
        stream = self._stream_mask(b, positions.device)
        width = max(int(lengths.max()), kept + comp)  # retrieval heads keep all they hold
        j = torch.arange(width, device=positions.device)
        rank = torch.where(stream[..., None] & (j >= sinks), j - sinks + held - window, j)
        index = order.gather(-1, rank.clamp(max=t - 1))  # (B, H_kv, width) slots to keep
        new_lengths = torch.where(stream, kept + comp, lengths)
        s = self.streaming_heads
        comp_k = comp_v = None
        if comp:  # the dropped ranks sinks .. held - window - 1, in text order
            dropped = order[:, s, sinks:held - window]  # (B, H_s, m)
            comp_k, comp_v = self._fold(gather_rows(rows["keys"].view()[:, s], dropped),
                                        gather_rows(rows["values"].view()[:, s], dropped))
        fill = {"keys": comp_k, "values": comp_v}
        for name, r in rows.items():
            x = gather_rows(r.view(), index)  # a fresh tensor (B, H_kv, width, ...)
            if comp:  # the compensation slot, after the streaming heads' kept tokens
                x[:, s, kept] = COMP_POSITION if name == "positions" else fill[name][:, :, 0]
            r.assign(x, lengths=new_lengths)

    def _comp_slot(self) -> torch.Tensor:
        """The compensation slot of every head `(B, H_kv)` (meaningful for streaming heads)."""
        rows = self.token_state["positions"]
        positions, lengths = rows.view(), rows.lengths()
        slots = torch.arange(positions.shape[-1], device=positions.device)
        return ((positions == COMP_POSITION) & (slots < lengths[..., None])).to(
            torch.int8).argmax(-1)

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

    # --- accounting ----------------------------------------------------------------------------
    def allowed_tokens(self) -> int | None:
        if self.holding_prompt():
            return None
        seen = self.seen_tokens
        return self._mean_slots(seen, min(seen, self.method.stream_slots(self.basis_tokens())))

    def head_allowed_tokens(self) -> torch.Tensor | None:
        """Slots each KV head may hold now under the rule `(B, H_kv)` (retrieval heads: every
        token seen; streaming heads: `stream_slots`); None while a prompt is held in full."""
        rows = self.token_state.get("positions")
        if self.holding_prompt() or rows is None:
            return None
        seen = self.seen_tokens
        streaming = min(seen, self.method.stream_slots(self.basis_tokens()))
        stream = self._stream_mask(rows.view().shape[0], rows.view().device)
        return torch.where(stream, streaming, seen).to(torch.int64)

    def attended_tokens(self) -> int:
        return self._attended_slots

    def stats(self) -> dict[str, int]:
        storage = self.storage_stats()
        tokens = self._mean_slots(self.seen_tokens, self._s_slots()) if self.seen_tokens else 0
        return {"kv_tokens": tokens, "kv_bytes": storage.get("kv_bytes_used", 0), **storage}

    def virtual_slots(self) -> torch.Tensor | None:
        """Slots each KV head holds that are no text position `(B, H_kv)`: the compensation
        token of a streaming head (RazorAttention's "virtual token"), else 0."""
        rows = self.token_state.get("positions")
        if rows is None:
            return None
        stream = self._stream_mask(rows.view().shape[0], rows.view().device)
        return (stream & bool(self.comp_count)).to(torch.int64)

    def kept_lengths(self) -> torch.Tensor | None:
        """Text positions each KV head holds `(B, H_kv)` (the store's lengths less
        `virtual_slots()`); None before the first token."""
        rows = self.token_state.get("positions")
        return None if rows is None else rows.lengths() - self.virtual_slots()

    def kept_positions(self) -> torch.Tensor:
        """`(B, H_kv, T)` text positions per head, each head's first, -1 past `kept_lengths()`
        (the compensation slot has no position: not listed)."""
        rows = self.token_state.get("positions")
        if rows is None:
            return torch.full((1, self.info.num_kv_heads, 0), -1, dtype=torch.long)
        positions, lengths = rows.view(), rows.lengths()
        slots = torch.arange(positions.shape[-1], device=positions.device)
        real = (slots < lengths[..., None]) & (positions >= 0)
        order = (~real).to(torch.int8).argsort(dim=-1, stable=True)  # real slots first, in order
        return positions.gather(-1, order).masked_fill(~real.gather(-1, order), -1)


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
