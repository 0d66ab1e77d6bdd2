"""SqueezeAttention (Wang, Cui, Gan; ICLR 2025, arXiv 2404.04793): layer-wise budgets from how much
each layer's attention changes the hidden state, on top of a sequence-wise scorer.

A budget allocator, not a scorer. During every prompt, each layer measures the mean cosine
similarity c_l between the residual stream entering it (x_in) and that stream after its attention
block (x_in + attention output): a layer whose attention barely turns the stream (high c_l) is
"unimportant". When the prompt is over, the compressed layers' c_l are clustered into three groups
(1-D k-means); the group with the highest centre (G3) keeps `low_group_ratio` of the uniform
budget and the freed budget is shared evenly by the other layers (G12), so the total stays L x the
uniform budget:
    factor(G3) = low_group_ratio,  factor(G12) = (L - |G3| * low_group_ratio) / |G12|,
    layer budget = int(factor * budget_ratio * seen)   (or int(factor * budget_tokens)).
A budget above the tokens seen keeps them all (as the official code: "capped at n in effect"),
so when the squeezed group is large the layers hold less than L x the uniform budget in total.
The `scorer` then runs in each layer with that budget (H2O by default, as in the paper): the
prompt is held in full (dense prefill, as the official code), compressed at its end, and decoding
continues under the scorer's own policy. Paper: 30-70 % memory reduction and up to 2.2x
throughput over a wide range of LLMs and benchmarks (abstract).

Official-code facts (github.com/hetailang/SqueezeAttention, `utils_hh/modify_llama_drop.py`):
KMeans(n_clusters=3) on the L scalars, the highest-centre cluster squeezed, ratio(G12) = (L*ini -
|G3|*p) / |G12|, budgets int(ratio * prompt length). Deliberate differences: the clustering is an
exact 1-D k-means (dynamic programming, deterministic; sklearn's KMeans there has no seed); with
fewer than three compressed layers, as many clusters as layers; identical c_l everywhere (one
centre) leave the allocation uniform; the similarity is over the tokens fed since the last prompt
ended (the prompt itself for the first one); layers left dense by the protocol are outside the
allocation. The released code's inner policies are StreamingLLM (Llama: 4 sinks + recent, keys
re-rotated at in-cache positions; `scorer=streaming_llm`) and a sliding window (Mistral); here any
method on the scored-eviction template (`Scorer`), H2O by default as in the paper.

Hyperparameters:
    budget_ratio / budget_tokens: the uniform budget `ini` (one budget rule, methods/budget.py).
    low_group_ratio: G3's budget as a fraction of the uniform one (README runs: p/ini = 0.25/0.4
        and 0.08/0.21; default 0.5, ours: halfway between them, as no single default is published).
    scorer: the sequence-wise method inside each layer (`Scorer`).
    scorer_options: that method's own hyperparameters (its defaults otherwise).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F

from kvcore.errors import ConfigError
from kvcore.storage import KV_LAYOUTS
from methods.budget import BudgetedMethod, require_basis
from methods.capabilities import Capabilities
from methods.eviction import EvictionLayer
from methods.layer import KVLayer
from methods.model import ModelInfo

# (not kvmerger: its threshold, not a budget, decides what a layer keeps)
Scorer = Literal["h2o", "streaming_llm", "tova", "scissorhands", "keydiff", "snapkv"]


@dataclass(kw_only=True)
class SqueezeAttention(BudgetedMethod):
    name: ClassVar[str] = "squeezeattention"
    provenance: ClassVar[str] = "official code"
    family: ClassVar[str] = "eviction"
    summary: ClassVar[str] = (
        "per-layer budgets from how much each layer's attention changes the hidden state")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2404.04793"
    code_url: ClassVar[str | None] = "https://github.com/hetailang/SqueezeAttention"
    operating_point: ClassVar[str] = (
        "hetailang/SqueezeAttention: Llama-2-7B, Mistral-7B; 20..40 % of the sequence per "
        "layer on average"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(  # per instance: the scorer's, adjusted
        needs_attn_scores=True, prefill_modes=("dense",), selects_tokens=True,
        observes_attention_block=True, kv_layouts=KV_LAYOUTS)
    variant_keys: ClassVar[tuple[str, ...]] = ("scorer", "low_group_ratio")
    low_group_ratio: float = 0.5
    scorer: Scorer = "h2o"
    scorer_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        from methods import build_method  # the package, not the harness

        try:
            self.inner = build_method(self.scorer, budget_ratio=self.budget_ratio,
                                      budget_tokens=self.budget_tokens, **self.scorer_options)
        except ConfigError as error:
            raise ConfigError(str(error).replace("method.", "method.scorer_options.", 1)) from None
        self.capabilities = dataclasses.replace(
            self.inner.capabilities, prefill_modes=("dense",),
            offloads_kv=False, observes_attention_block=True)

    def check_hyperparameters(self) -> list[str]:
        reasons = super().check_hyperparameters()
        if not isinstance(self.low_group_ratio, (int, float)) or not 0 < self.low_group_ratio <= 1:
            reasons.append(f"method.low_group_ratio={self.low_group_ratio!r} must be in (0, 1]")
        if {"budget_ratio", "budget_tokens"} & set(self.scorer_options or {}):
            reasons.append("method.scorer_options sets a budget; set method.budget_ratio or "
                           "method.budget_tokens instead (the uniform budget)")
        return reasons

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict:
        return {"budget_tokens": seq_tokens, "low_group_ratio": 1.0}

    # The scorer's own needs (StreamingLLM re-rotates its sinks with the model's RoPE).
    def needs_prepare(self) -> bool:
        return self.inner.needs_prepare()

    def prepare(self, ctx) -> dict:
        return self.inner.prepare(ctx)

    def artefacts(self) -> dict:
        return self.inner.artefacts()  # its scorer's, made by the scorer's prepare

    def adopt_artefacts(self, artefacts: dict) -> None:
        self.inner.adopt_artefacts(artefacts)

    def needs_rope(self) -> bool:
        return self.inner.needs_rope()

    def bounds_positions(self) -> bool:
        return self.inner.bounds_positions()

    def layer_tokens(self, factor: float, basis: int) -> int:
        """Tokens a layer with budget `factor` (x the uniform budget) keeps when the budget basis
        is `basis` tokens."""
        uniform = (self.budget_tokens if self.budget_tokens is not None
                   else self.budget_ratio * require_basis(basis))
        return max(self.inner.min_budget_tokens, int(factor * uniform))

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        layer = self.inner.make_layer(layer_idx, info)
        return squeezed(type(layer))(layer_idx, info, self.inner, self)


class SqueezedLayer(EvictionLayer):
    """Mixed in before a scorer's layer class: the allocation, the similarity, the timing."""

    state_fields = ("similarity_sum", "similarity_tokens", "budget_factor")

    def __init__(self, layer_idx: int, info: ModelInfo, method: BudgetedMethod,
                 squeeze: SqueezeAttention):
        super().__init__(layer_idx, info, method)
        self.squeeze = squeeze
        self.similarity_sum: torch.Tensor | float = 0.0  # sum over tokens of cos(x_in, x_mid)
        self.similarity_tokens = 0
        self.budget_factor: float | None = None  # set at the end of each prompt

    def prompt_state_key(self) -> tuple | None:
        # its scorer's part of the layer is built by an inner method of its own (holding the
        # squeeze's budget), which the sweep's prefill key does not read: never shared
        return None

    def observe_attention_block(self, residual, attention_output) -> None:
        mid = residual.float() + attention_output.float()
        cos = F.cosine_similarity(residual.float(), mid, dim=-1)  # (B, q)
        self.similarity_sum = self.similarity_sum + cos.sum()
        self.similarity_tokens += cos.numel()

    def budget(self) -> int:
        return self.squeeze.layer_tokens(self.budget_factor, self.basis_tokens())

    def allowed_tokens(self) -> int | None:
        return None if self.budget_factor is None else super().allowed_tokens()

    def after_forward(self) -> None:
        if self.budget_factor is not None:
            super().after_forward()

    def on_prefill_end(self) -> None:
        dense = self.squeeze.effective_dense_layers(self.info, self.protocol)
        if self.layer_idx == min(set(range(self.info.num_layers)) - set(dense)):
            self.allocate()  # the engine ends prompts in layer order: the first one sees them all
        if self.compress_at == "forward":
            self.compress_to(self.budget())
        super().on_prefill_end()
        self.similarity_sum, self.similarity_tokens = 0.0, 0

    def allocate(self) -> None:
        layers, layer = [], self
        while layer is not None:
            if isinstance(layer, SqueezedLayer):
                layers.append(layer)
            layer = layer.next_layer
        similarity = [float(x.similarity_sum) / max(1, x.similarity_tokens) for x in layers]
        for x, factor in zip(layers, budget_factors(similarity, self.squeeze.low_group_ratio)):
            x.budget_factor = factor


@functools.cache
def squeezed(scorer_layer: type) -> type:
    return type(f"Squeezed{scorer_layer.__name__}", (SqueezedLayer, scorer_layer), {})


def budget_factors(similarity: list[float], low_ratio: float) -> list[float]:
    """Each layer's budget as a multiple of the uniform one (mean 1): the cluster(s) with the
    highest centre get `low_ratio`, the others share the rest evenly."""
    centres = kmeans_1d(similarity, min(3, len(similarity)))
    top = max(centres)
    squeezed_group = [centres[i] == top for i in range(len(similarity))]
    rest = len(similarity) - sum(squeezed_group)
    if rest == 0:
        return [1.0] * len(similarity)
    high = (len(similarity) - sum(squeezed_group) * low_ratio) / rest
    return [low_ratio if s else high for s in squeezed_group]


def kmeans_1d(values: list[float], k: int) -> list[float]:
    """Exact 1-D k-means (least squares, by dynamic programming over the sorted values): the centre
    of each value's cluster, in the input order. Ties keep the earliest split (deterministic)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    x = [values[i] for i in order]
    n = len(x)

    def sse(i: int, j: int) -> float:  # cost of one cluster x[i:j]
        part = x[i:j]
        mean = sum(part) / len(part)
        return sum((v - mean) ** 2 for v in part)

    cost = [[float("inf")] * (n + 1) for _ in range(k + 1)]
    split = [[0] * (n + 1) for _ in range(k + 1)]
    cost[0][0] = 0.0
    for c in range(1, k + 1):
        for j in range(c, n + 1):
            for i in range(c - 1, j):
                value = cost[c - 1][i] + sse(i, j)
                if value < cost[c][j] - 1e-15:
                    cost[c][j], split[c][j] = value, i
    centres, j = [0.0] * n, n
    for c in range(k, 0, -1):
        i = split[c][j]
        mean = sum(x[i:j]) / (j - i)
        for pos in range(i, j):
            centres[order[pos]] = mean
        j = i
    return centres
