"""HeadKV (Fu, Cai, Asi, Xiong, Dong, Xiao, arXiv 2410.19258, ICLR 2025): SnapKV's selection with
one global budget pool shared by every KV head of every layer, split by static head-importance
scores (the paper's retrieval-reasoning scores).

Allocation (official FYYFU/HeadKV, headkv/snapkv_utils.py `ReasonSnapKVCluster.__init__`), with
B the uniform budget per head (window w included), base = B - w and s the scores normalized over
all L x H heads (s / sum s, then s ** temp, normalized again):

    capacity[l, h] = w + (base - base // beta) + s[l, h] x (base // beta) x L x H

(`base // beta` with a float beta, as the official code: beta 1.005 leaves a floor of 1 token at
base 96 and pools the rest). The capacities sum to L x H x B: the model holds the uniform method's
tokens, a high-score head far more, a zero-score head the window plus the floor. Each head then
keeps the window plus its own top SnapKV votes (methods/snapkv.py: window queries, kernel pooling;
decode appends). Heads stored ragged (methods/eviction.py).

Scores: `head_scores_path`, the official JSON (`Important_Head/head_score/*_heads.json`: one line,
{"layer-head": [per-test scores]}, a query head each, its score the mean of its list; provenance
"official code"); else a proxy: the induction score per KV head of the RazorAttention probe already
in the repo (methods/_head_probe.py: seeded random tokens repeated, attention from each repeat to the
token after its earlier occurrence, i.e. the copy-paste behaviour HeadKV's retrieval score counts;
max over the query group). Provenance then "reconstruction (proxy head scores)".

Deviations, each to keep the one budget rule exact per layer (the template checks every layer):
(1) the global pool is realised as per-layer budgets (`layer_budget`: a layer's share of L x H x B,
rounded to a whole token per head by largest remainder over layers, so the total over every layer
and head is exactly L x H x B) and within a layer the heads' prefix tokens are split in
proportion to their official capacities (largest remainder) instead of per-head `round` (whose
total drifts); each head is within 2 tokens of the official capacity. (2) A capacity above the
tokens a head holds: the official code keeps what there is (the layer holds less); here the excess
goes to the layer's other heads in proportion to their room; likewise a layer's share above the
budget basis (the whole sequence) goes to the other layers (peaked scores would else waste it). (3) One allocation per KV head (GQA):
with an official file, a KV head's share is the sum of its query heads' (its capacity the mean of
theirs). Defaults: the official scripts (`head_start_*.sh`: beta 1.005, temp 1; `run_longbench.py`:
window 8, kernel 7, max pooling).
"""

from __future__ import annotations

import math
from pathlib import Path
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcore.errors import ConfigError
from methods import _sidefiles as sidefiles
from methods._head_probe import check_probe_knobs, probe_scores
from methods.adakv import AdaKVLayer
from methods.capabilities import ServingNeeds
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.snapkv import SnapKV


@dataclass(kw_only=True)
class HeadKV(SnapKV):
    name: ClassVar[str] = "headkv"
    provenance: ClassVar[str] = "official code"
    family: ClassVar[str] = "prompt compression"
    summary: ClassVar[str] = (
        "SnapKV's votes with one budget pool over all KV heads, shared by head-importance scores")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2410.19258"
    code_url: ClassVar[str | None] = "https://github.com/FYYFU/HeadKV"
    operating_point: ClassVar[str] = (
        "FYYFU/HeadKV: Llama-3-8B-Instruct, Mistral-7B-Instruct-v0.2; retrieval-reasoning head "
        "scores, 64..1024 tokens per head on average, window 8, kernel 7 max-pool, beta 1.005, "
        "temp 1; LongBench, needle-in-a-haystack, BABILong (official scripts)")
    serving_needs: ClassVar[ServingNeeds] = ServingNeeds(ragged_heads=True,
                                                         needs_calibration=True)
    variant_keys: ClassVar[tuple[str, ...]] = ("window_tokens", "kernel_tokens", "pooling",
                                               "beta", "temp")
    window_tokens: int = 8
    beta: float = 1.005
    temp: float = 1.0
    head_scores_path: str | None = None
    probe_period_tokens: int = 2500
    probe_repeats: int = 4
    probe_seed: int = 0
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self._shares: torch.Tensor | None = None  # (L, H_kv) float64, summing to 1
        self._uniform: dict[tuple[int, int], int] = {}  # (layer, its budget) -> the uniform B

    def check_hyperparameters(self) -> list[str]:
        r = super().check_hyperparameters() + check_probe_knobs(self)
        for key, low in (("beta", 1), ("temp", 0)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= low:
                r.append(f"method.{key}={v!r} must be a number >= {low}")
        return r

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict:
        return {"budget_tokens": seq_tokens, "beta": 1e9}  # base // beta = 0: no pool, uniform

    def provenance_label(self) -> str:
        if self.head_scores_path:
            return self.provenance
        return "reconstruction (proxy head scores: the echo/induction probe's induction score)"

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return AdaKVLayer(layer_idx, info, self)  # SnapKV's, each head over its own tokens

    def validate(self, info: ModelInfo, runner: dict) -> list[str]:
        reasons = super().validate(info, runner)
        if self.head_scores_path:
            try:
                load_head_scores(self.head_scores_path, info)
            except ConfigError as exc:
                reasons.append(str(exc))
        return reasons

    artefact_names = ("_shares",)  # what `prepare` sets

    def prepare(self, ctx) -> dict:
        if self.head_scores_path:
            scores, facts = load_head_scores(self.head_scores_path, ctx.info), {
                "head_scores": "official file", "head_scores_path": str(self.head_scores_path)}
        else:
            _, scores, facts = probe_scores(ctx, self.probe_period_tokens, self.probe_repeats,
                                            self.probe_seed, self.cache_dir)
            facts = {"head_scores": "proxy: induction score (RazorAttention probe)", **facts}
        self._shares = head_shares(scores, self.temp, ctx.info.num_kv_heads)
        return {**facts, "head_share_max": round(float(self._shares.max()), 6)}

    def capacities(self, budget: int) -> torch.Tensor:
        """The official prefix capacities (L, H_kv) float64 (window not included)."""
        if self._shares is None:
            raise RuntimeError(f"{self.name}: call prepare(ctx) first (it loads the head scores)")
        base = budget - min(self.window_tokens, budget)
        pooled = base // self.beta
        return (base - pooled) + self._shares * pooled * self._shares.numel()

    def layer_budget(self, layer_idx: int, num_layers: int, basis: int) -> int:
        budget = self.total_tokens(basis)
        caps = self.capacities(budget)
        base = budget - min(self.window_tokens, budget)
        room = torch.full((1, num_layers), max(basis - (budget - base), 0))  # all there will be
        per_layer = split_tokens(caps.sum(-1)[None] / caps.shape[1],
                                 torch.tensor([num_layers * base]), room)[0]
        layer = budget - base + int(per_layer[layer_idx])
        self._uniform[layer_idx, layer] = budget  # the pool it came from, for head_budgets
        return layer

    def head_budgets(self, scores: torch.Tensor, budget: int, layer_idx: int) -> torch.Tensor:
        protected = torch.isposinf(scores).sum(-1)  # (B, H): the window
        room = (scores > float("-inf")).sum(-1) - protected  # prefix tokens each head holds
        total = scores.shape[1] * budget - protected.sum(-1)
        if (layer_idx, budget) not in self._uniform:
            raise RuntimeError(f"{self.name}: layer {layer_idx}'s budget {budget} did not come "
                               "from layer_budget (the pool it splits is unknown)")
        caps = self.capacities(self._uniform[layer_idx, budget])[layer_idx]
        return protected + split_tokens(caps.expand(room.shape).to(scores.device), total, room)


def split_tokens(weights: torch.Tensor, total: torch.Tensor, room: torch.Tensor | None
                 ) -> torch.Tensor:
    """Integers `(B, H)` in proportion to `weights (B, H)`, summing to `total (B,)` (at most what
    `room` holds), none above its `room` (the excess of a capped one spread over the others in
    proportion to their room; one pass suffices), rounded by largest remainder."""
    weights = weights.double()
    if room is not None:
        total = torch.minimum(total, room.sum(-1))
    share = total[:, None] * weights / weights.sum(-1, keepdim=True).clamp(min=1e-300)
    if room is not None:
        over = share > room
        share = torch.where(over, room.double(), share)
        free = torch.where(over, 0, room - share)
        spill = (total - share.sum(-1)).clamp(min=0)
        share = share + spill[:, None] * free / free.sum(-1, keepdim=True).clamp(min=1e-300)
    counts = share.floor()
    short = (total - counts.sum(-1)).round()[:, None]
    rank = (counts - share).argsort(dim=-1, stable=True).argsort(dim=-1)  # largest first
    return (counts + (rank < short)).to(torch.int64)


def head_shares(scores: torch.Tensor, temp: float, kv_heads: int) -> torch.Tensor:
    """Official normalization of per-head scores `(L, H)` (s / sum, ** temp, / sum) as KV-head
    shares `(L, H_kv)`: query-head scores (H = group x H_kv) summed over their group."""
    s = scores.double().clamp(min=0)
    s = s / s.sum() if s.sum() > 0 else torch.ones_like(s)  # all zero: uniform
    s = s.pow(temp)
    s = s / s.sum()
    return s.view(s.shape[0], kv_heads, -1).sum(-1)  # a query group is contiguous (repeat_kv)


def load_head_scores(path, info: ModelInfo) -> torch.Tensor:
    """The official score file: one line of JSON {"layer-head": [scores]} over every query head
    (L x H_q, or L x H_kv); a head's score is the mean of its list. `(L, H)` float64."""
    key, where = "method.head_scores_path", f"method.head_scores_path={path}"
    first = (sidefiles.read_text(key, Path(path)).splitlines() or [""])[0]
    table = sidefiles.parse_json(key, path, first, dict, 'one JSON line {"layer-head": [scores]}')
    try:
        heads = {tuple(int(i) for i in k.split("-")): v for k, v in table.items()}
        for head, v in heads.items():
            sidefiles.check_numbers(key, path, v, lambda i: f"score {i} of head {head}",
                                    allowed="finite numbers")
        means = {k: sum(v) / len(v) for k, v in heads.items()}
    except ConfigError:
        raise
    except (ValueError, TypeError, ZeroDivisionError, AttributeError) as exc:
        raise ConfigError(f"{where}: not an official HeadKV score file (one JSON line "
                          f'{{"layer-head": [scores]}}): {exc}') from None
    if not all(math.isfinite(m) for m in means.values()):
        raise ConfigError(f"{where}: a head's mean score overflows; allowed: finite scores")
    if means and max(means.values()) <= 0:
        raise ConfigError(f"{where}: every head's score is <= 0, so no head would get a share "
                          "(the allocation would silently be uniform); allowed: scores >= 0, "
                          "some > 0")
    layers = info.num_layers
    for h in (info.num_heads, info.num_kv_heads):
        if set(means) == {(l, i) for l in range(layers) for i in range(h)}:
            return torch.tensor([[means[l, i] for i in range(h)] for l in range(layers)],
                                dtype=torch.float64)
    raise ConfigError(f"{where}: heads {len(means)} do not cover this model's {layers} layers x "
                      f"{info.num_heads} query heads (keys 'layer-head', from 0)")
