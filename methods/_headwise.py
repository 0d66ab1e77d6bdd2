"""Shared machinery of the head-wise methods (DuoAttention, RazorAttention).

Per layer, every KV head is either a *retrieval* head (keeps the full cache) or a *streaming* head
(keeps `sink_tokens` + a recent window; RazorAttention adds one compensation token). Which heads are
which is decided offline, once per model (`prepare`), and is the same for every request.

Layout (methods-2.md §14.8: "store the head classes as separate tensors"):
  * retrieval store `(B, H_r, T, D)`: every token seen, heads `retrieval_heads` of the layer;
  * streaming store `(B, H_s, T_s, D)`: sinks + window, heads `streaming_heads`, with one `(T_s,)`
    vector of text positions (eviction is positional, so all streaming heads of a layer keep the
    same positions); optional compensation token `(B, H_s, 1, D)` + the count |D| it stands for.
Only these are held (and counted by `stats()`). For attention, `update` assembles a transient
`(B, H_kv, S, D)` view with S = max over heads of the held slots + the new tokens: a streaming
head's rows are `[sinks, (compensation), window, padding..., new tokens]`; the padding is hidden
by a per-head additive mask, and the compensation slot gets +log|D| (RazorAttention eq. 5). Keys
stay post-RoPE at their text positions (no re-rotation), as in both papers' code.

Head identification without learned gates: RazorAttention's probe. A sequence of `P` seeded random
tokens repeated twice goes through the model once (`ctx.capture`); for each query head and each
query i in the repeat, the echo score is the attention on i - P (the token's earlier occurrence)
and the induction score the attention on i - P + 1 (the token that followed it), averaged over the
repeat. KV head score = max over its query group (conservative, methods-2.md §8 GQA). The scores
are cached on disk per model fingerprint and probe.

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
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcore.errors import ConfigError
from methods.base import KVLayer, KVMethod, ModelInfo, require_basis
from methods.scoring import additive_mask, attention_with_probs

log = logging.getLogger(__name__)
PROBE_FORMAT_VERSION = 1


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


def load_duo_pattern(path: str | Path, info: ModelInfo) -> tuple[torch.Tensor, dict]:
    """The official DuoAttention pattern: a folder holding `full_attention_heads.tsv` (one row per
    layer, one tab-separated gate alpha in [0, 1] per KV head) and `config.json` (`sink_size`,
    `recent_size` used in training), or the .tsv file itself. Returns (gates (L, H_kv) fp64, config)."""
    path = Path(path)
    tsv = path / "full_attention_heads.tsv" if path.is_dir() else path
    if not tsv.is_file():
        raise ConfigError(f"method.pattern_path={path}: no full_attention_heads.tsv there (the "
                          "official DuoAttention pattern folder or its .tsv file)")
    try:
        rows = [[float(v) for v in line.split("\t")]
                for line in tsv.read_text().splitlines() if line.strip()]
        gates = torch.tensor(rows, dtype=torch.float64)
    except ValueError as exc:
        raise ConfigError(f"method.pattern_path={tsv}: not a tab-separated matrix of gate values "
                          f"({exc})") from exc
    if tuple(gates.shape) != (info.num_layers, info.num_kv_heads):
        raise ConfigError(f"method.pattern_path={tsv}: gates of shape {tuple(gates.shape)}, but "
                          f"this model has {info.num_layers} layers x {info.num_kv_heads} KV heads")
    config = {}
    cfg = (path if path.is_dir() else path.parent) / "config.json"
    if cfg.is_file():
        raw = json.loads(cfg.read_text())
        config = {k: raw[k] for k in ("sink_size", "recent_size") if k in raw}
    return gates.clamp(0, 1), config


# --------------------------------------------------------------------------------------------
# the probe (training-free identification)
class _ProbeLayer(KVLayer):
    def __init__(self, layer_idx: int, info: ModelInfo, period: int):
        super().__init__(layer_idx, info)
        self.period = period
        self.echo = self.induction = None  # (H_q,)

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        scaling = kwargs.get("scaling") or module.scaling
        out, probs = attention_with_probs(query, keys, values, attention_mask, scaling)
        p = self.period
        rows = torch.arange(p, 2 * p, device=probs.device)  # queries in the repeat
        a = probs[0]  # (H_q, 2P, 2P)
        self.echo = a[:, rows, rows - p].mean(-1).cpu()
        self.induction = a[:, rows, rows - p + 1].mean(-1).cpu()
        return out, None


@dataclass(kw_only=True)
class _ProbeMethod(KVMethod):
    name = "headwise_probe"
    period_tokens: int = 256

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return _ProbeLayer(layer_idx, info, self.period_tokens)


def probe_tokens(period: int, vocab: int, seed: int) -> torch.Tensor:
    """`period` seeded random ids (avoiding the lowest ids, where special tokens live), twice."""
    low = min(3, vocab - 1)
    g = torch.Generator().manual_seed(seed)
    block = torch.randint(low, vocab, (period,), generator=g)
    return torch.cat([block, block])


def probe_scores(ctx, period: int, seed: int, cache_dir: str | None
                 ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Echo and induction scores per (layer, KV head) (max over the query group), cached on disk."""
    info = ctx.info
    period = min(period, max(2, (info.max_positions or 2 * period) // 2))
    key = hashlib.sha256(json.dumps({"v": PROBE_FORMAT_VERSION, "model": ctx.fingerprint,
                                     "period": period, "seed": seed}).encode()).hexdigest()[:24]
    root = Path(cache_dir or ctx.cache_dir or os.environ.get("KVH_CACHE_DIR")
                or Path.home() / ".cache" / "kv-harness") / "headwise_probe"
    path = root / f"{key}.pt"
    loaded = _load_scores(path, info)
    status = "loaded"
    if loaded is None:
        ids = probe_tokens(period, ctx.vocab_size, seed)
        layers = ctx.capture(_ProbeMethod(period_tokens=period), ids)
        g = info.group_size
        echo = torch.stack([lay.echo.view(info.num_kv_heads, g).amax(-1) for lay in layers])
        ind = torch.stack([lay.induction.view(info.num_kv_heads, g).amax(-1) for lay in layers])
        loaded = (echo.float(), ind.float())
        _save_scores(path, *loaded)
        status = "computed"
    facts = {"probe_scores": status, "probe_path": str(path), "probe_period_tokens": period,
             "probe_seed": seed, "probe_group_reduce": "max"}
    return loaded[0], loaded[1], facts


def _save_scores(path: Path, echo: torch.Tensor, induction: torch.Tensor) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        torch.save({"version": PROBE_FORMAT_VERSION, "echo": echo, "induction": induction}, tmp)
        os.replace(tmp, path)  # atomic: a reader never sees half a file
    finally:
        Path(tmp).unlink(missing_ok=True)


def _load_scores(path: Path, info: ModelInfo):
    if not path.is_file():
        return None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
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
    probe_period_tokens: int = 256
    probe_seed: int = 0
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self._retrieval: torch.Tensor | None = None  # (L, H_kv) bool
        self._retrieval_fraction = 0.0


class HeadwiseLayer(KVLayer):
    """Retrieval heads keep everything; streaming heads keep sinks + window (+ compensation).

    `method` provides: sink_tokens, stream_slots(seen) (slots a streaming head may hold after
    `seen` tokens, compensation included) and compensate (bool).
    """

    def __init__(self, layer_idx: int, info: ModelInfo, method, retrieval: torch.Tensor):
        super().__init__(layer_idx, info)
        self.method = method
        self.retrieval_heads = torch.nonzero(retrieval).flatten()  # (H_r,)
        self.streaming_heads = torch.nonzero(~retrieval).flatten()  # (H_s,)
        self.r_keys = self.r_values = None  # (B, H_r, T, D)
        self.s_keys = self.s_values = None  # (B, H_s, T_s, D)
        self.s_positions = torch.empty(0, dtype=torch.long)  # (T_s,)
        self.comp_keys = self.comp_values = None  # (B, H_s, 1, D) mean of the dropped tokens
        self.comp_count = 0  # |D|: tokens the compensation token stands for
        self.s_sinks = 0  # sinks kept at the last eviction (fewer than sink_tokens if slots are few)
        self._extra_mask = None  # (H_kv, S) additive mask for this step's attention
        self._attended_slots = 0

    # --- sizes ---------------------------------------------------------------------------------
    def _r_len(self) -> int:
        return 0 if self.r_keys is None else self.r_keys.shape[-2]

    def _s_slots(self) -> int:
        held = 0 if self.s_keys is None else self.s_keys.shape[-2]
        return held + (1 if self.comp_count else 0)

    def kept_tokens(self) -> int:
        """Slots before the new tokens in what `update` returns (max over heads)."""
        r = self._r_len() if len(self.retrieval_heads) else 0
        s = self._s_slots() if len(self.streaming_heads) else 0
        return max(r, s)

    def _mean_slots(self, r: int, s: int) -> int:
        h_r, h_s = len(self.retrieval_heads), len(self.streaming_heads)
        return math.ceil((h_r * r + h_s * s) / (h_r + h_s))

    # --- cache seam ----------------------------------------------------------------------------
    def update(self, keys, values, position_ids):
        q_len = keys.shape[-2]
        text_pos = torch.arange(self.seen_tokens, self.seen_tokens + q_len)
        self.seen_tokens += q_len
        before = self.kept_tokens()
        r_len, s_slots = self._r_len(), self._s_slots()
        b, h_kv, _, d = keys.shape
        out_k = keys.new_zeros(b, h_kv, before + q_len, d)
        out_v = values.new_zeros(b, h_kv, before + q_len, d)
        hidden = torch.zeros(h_kv, before + q_len, dtype=torch.bool)
        bias = torch.zeros(h_kv, before + q_len)
        r, s = self.retrieval_heads, self.streaming_heads
        if len(r):
            if r_len:
                out_k[:, r, :r_len], out_v[:, r, :r_len] = self.r_keys, self.r_values
            hidden[r, r_len:before] = True
            self.r_keys = self._append(self.r_keys, keys[:, r])
            self.r_values = self._append(self.r_values, values[:, r])
        if len(s):
            if s_slots:
                old_k, old_v = self._streaming_slots()
                out_k[:, s, :s_slots], out_v[:, s, :s_slots] = old_k, old_v
            hidden[s, s_slots:before] = True
            if self.comp_count:
                bias[s, self.s_sinks] = math.log(self.comp_count)
            self.s_keys = self._append(self.s_keys, keys[:, s])
            self.s_values = self._append(self.s_values, values[:, s])
            self.s_positions = torch.cat([self.s_positions, text_pos])
        out_k[:, :, before:], out_v[:, :, before:] = keys, values
        extra = bias.masked_fill(hidden, float("-inf"))
        self._extra_mask = extra.to(keys.device) if (hidden.any() or self.comp_count) else None
        self._attended_slots = self._mean_slots(r_len + q_len, s_slots + q_len)
        return out_k, out_v

    @staticmethod
    def _append(held, new):
        return new if held is None else torch.cat([held, new], dim=-2)

    def _streaming_slots(self):
        """(B, H_s, slots, D): sinks, then the compensation token (if any), then the window."""
        if not self.comp_count:
            return self.s_keys, self.s_values
        n = self.s_sinks
        k = torch.cat([self.s_keys[:, :, :n], self.comp_keys, self.s_keys[:, :, n:]], dim=-2)
        v = torch.cat([self.s_values[:, :, :n], self.comp_values, self.s_values[:, :, n:]], dim=-2)
        return k, v

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        """The model's attention with causality rebuilt for this layer's own length: transformers
        builds one mask per forward from layer 0's sizes, but kept lengths differ per layer here
        (batch size 1, so the mask carries nothing but causality)."""
        q_len, kv_len = query.shape[2], keys.shape[2]
        if self._extra_mask is None and q_len == 1:
            return base(module, query, keys, values, None, **kwargs)
        mask = additive_mask(None, q_len, kv_len, query.device)[None, None]  # (1, 1, q, S)
        if self._extra_mask is not None:
            groups = query.shape[1] // keys.shape[1]
            mask = mask + self._extra_mask.repeat_interleave(groups, dim=0)[None, :, None, :]
        return base(module, query, keys, values, mask.to(query.dtype), **kwargs)

    def after_forward(self) -> None:
        """Cut every streaming head back to its slots (folding the dropped tokens, if
        compensating); a prompt held in full under runner.prefill=dense is cut at its end."""
        if not self.holding_prompt():
            self.cut_streaming_heads()

    def on_prefill_end(self) -> None:
        self.cut_streaming_heads()

    def cut_streaming_heads(self) -> None:
        if not len(self.streaming_heads) or self.s_keys is None:
            return
        allowed = self.method.stream_slots(self.basis_tokens())
        if self._s_slots() <= allowed:
            return
        comp = 1 if self.method.compensate else 0
        # Slots fewer than sinks + window (a budget below the method's own shape): the sinks take
        # at most half (at least the first token), so a streaming head keeps a recent window
        # (all-sinks heads, e.g. DuoAttention's 64 sinks in 33 slots, lose the local context every
        # head relies on). Sinks dropped once never come back: only the leading rows that still
        # are text positions 0, 1, ... count as sinks (never a window token frozen in place).
        sinks = min(self.method.sink_tokens, max(1, (allowed - comp) // 2), self._real_sinks())
        self.s_sinks = sinks
        window = max(0, allowed - sinks - comp)
        held = self.s_keys.shape[-2]
        drop = slice(sinks, held - window)
        if self.method.compensate:
            self._fold(self.s_keys[:, :, drop], self.s_values[:, :, drop])
        keep = torch.cat([torch.arange(sinks), torch.arange(held - window, held)])
        self.s_keys = self.s_keys[:, :, keep].contiguous()
        self.s_values = self.s_values[:, :, keep].contiguous()
        self.s_positions = self.s_positions[keep]

    def _real_sinks(self) -> int:
        """Leading streaming rows that hold text positions 0, 1, ... (the sinks still held)."""
        n = len(self.s_positions)
        return int((self.s_positions == torch.arange(n)).long().cumprod(0).sum())

    def _fold(self, keys, values) -> None:
        """Running mean of the dropped keys/values (post-RoPE, as cached) and their count |D|."""
        m = keys.shape[-2]
        if m == 0:
            return
        k_sum, v_sum = keys.float().sum(-2, keepdim=True), values.float().sum(-2, keepdim=True)
        if self.comp_count:
            k_sum = k_sum + self.comp_keys.float() * self.comp_count
            v_sum = v_sum + self.comp_values.float() * self.comp_count
        self.comp_count += m
        self.comp_keys = (k_sum / self.comp_count).to(keys.dtype)
        self.comp_values = (v_sum / self.comp_count).to(values.dtype)

    # --- accounting ----------------------------------------------------------------------------
    def allowed_tokens(self) -> int | None:
        if self.holding_prompt():
            return None
        seen = self.seen_tokens
        return self._mean_slots(seen, min(seen, self.method.stream_slots(self.basis_tokens())))

    def attended_tokens(self) -> int:
        return self._attended_slots

    def stats(self) -> dict[str, int]:
        parts = (self.r_keys, self.r_values, self.s_keys, self.s_values, self.comp_keys,
                 self.comp_values)
        held = sum(p.nbytes for p in parts if p is not None)
        tokens = self._mean_slots(self._r_len(), self._s_slots()) if self.seen_tokens else 0
        return {"kv_tokens": tokens, "kv_bytes": int(held)}

    def kept_positions(self) -> torch.Tensor:
        """(1, H_kv, S) text positions per head; a streaming head's row is padded with its last
        kept position (duplicates: a recall figure over it double counts that one token), and
        the compensation token has no position, so it is not listed."""
        h_kv = len(self.retrieval_heads) + len(self.streaming_heads)
        width = max(self._r_len(), len(self.s_positions), 1)
        out = torch.zeros(1, h_kv, width, dtype=torch.long)
        out[0, self.retrieval_heads, :self._r_len()] = torch.arange(self._r_len())
        if len(self.streaming_heads) and len(self.s_positions):
            row = torch.full((width,), int(self.s_positions[-1]), dtype=torch.long)
            row[:len(self.s_positions)] = self.s_positions
            out[0, self.streaming_heads] = row
        return out


def stream_budget_slots(seen: int, budget_ratio: float, retrieval_fraction: float,
                        minimum: int) -> int:
    """Slots a streaming head may hold so that the whole model holds `budget_ratio` of the full
    cache, given the realised retrieval-head fraction."""
    seen = require_basis(seen)
    if retrieval_fraction >= 1:  # no streaming heads at all
        return seen
    share = (budget_ratio - retrieval_fraction) / (1 - retrieval_fraction)
    return max(minimum, int(share * seen))
