"""The head probe of the head-wise methods: which KV heads retrieve, found without training.

RazorAttention's probe, as Huawei's public tool runs it (MindSpore Golden Stick,
`sequence_compress/razor_attention`: `DUMMY_INPUT_LENGTH = 2500`, `REPET_TIMES = 4`): `P` random
token ids (from [10000, 12500] where the vocabulary has them, else [3, vocab); seeded here, the
tool's are unseeded) repeated `repeats` times, the model's BOS first, go through the model once
(`ctx.capture`); `P` is capped so that the sequence fits the model's positions (SmolLM2: 8192 ->
P = 2047). For each query head, every query i of a repetition after the first attends to each
earlier occurrence j of its token (echo) and to the token after it, j + 1 (induction); a head's
score is the sum of those attention weights over all such (i, j) divided by S^2 (the tool's mean
over the S x S attention map). KV head score = max over its query group (the tool's
`_max_every_group`). The attention map is computed in row blocks (never S x S at once); the
model's own output comes from its attention function. The scores are cached on disk per model
fingerprint and probe. Not reproduced: the tool's index quirk that also counts the BOS as an
earlier occurrence for the rows whose position is a multiple of P.

Used by RazorAttention (its identification), DuoAttention (proxy heads where no learned pattern is
given) and HeadKV (proxy head scores); the selection rules over the scores are here too.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from methods import _artefacts as artefacts
from methods.base import KVMethod
from methods.layer import KVLayer
from methods.model import ModelInfo

log = logging.getLogger(__name__)
PROBE_FORMAT_VERSION = 2  # 2: P tokens x repeats + BOS, every earlier occurrence, / S^2

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


def check_probe_knobs(method) -> list[str]:
    """The head probe's knobs (shared by the head-wise methods)."""
    r = []
    if not isinstance(method.probe_period_tokens, int) or method.probe_period_tokens < 2:
        r.append(f"method.probe_period_tokens={method.probe_period_tokens!r} must be >= 2")
    if not isinstance(method.probe_repeats, int) or method.probe_repeats < 2:
        r.append(f"method.probe_repeats={method.probe_repeats!r} must be >= 2 (the probe needs a "
                 "repetition)")
    return r


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
    path = artefacts.cache_root("headwise_probe", cache_dir, ctx.cache_dir) / f"{key}.pt"
    scores = _load_scores(path, info)
    loaded = scores is not None
    if not loaded:
        ids = probe_tokens(period, repeats, ctx.vocab_size, seed, bos)
        layers = ctx.capture(_ProbeMethod(period_tokens=period, offset_tokens=offset), ids)
        g = info.group_size
        echo = torch.stack([lay.echo.view(info.num_kv_heads, g).amax(-1) for lay in layers])
        ind = torch.stack([lay.induction.view(info.num_kv_heads, g).amax(-1) for lay in layers])
        scores = (echo.float(), ind.float())
        _save_scores(path, *scores)
    facts = {"probe_scores": artefacts.provenance("head probe scores", key, path, scores, loaded), "probe_period_tokens": period,
             "probe_repeats": repeats, "probe_bos": bos, "probe_seed": seed,
             "probe_group_reduce": "max"}
    return scores[0], scores[1], facts


def _save_scores(path: Path, echo: torch.Tensor, induction: torch.Tensor) -> None:
    payload = {"version": PROBE_FORMAT_VERSION, "echo": echo, "induction": induction}
    artefacts.save(path, lambda tmp: torch.save(payload, tmp), "head probe scores")


def _load_scores(path: Path, info: ModelInfo):
    try:
        payload = artefacts.load(path)
        if payload is None:
            return None
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
