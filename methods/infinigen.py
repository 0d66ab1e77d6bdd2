"""InfiniGen: speculate which KV rows layer i needs from layer i-1's input, fetch only those.

Lee et al., "InfiniGen: Efficient Generative Inference of Large Language Models with Dynamic KV
Cache Management", OSDI 2024, https://arxiv.org/abs/2406.19707; official code
https://github.com/snu-comparch/InfiniGen (`accuracy/src/modeling_llama_ours.py`, the mask
simulation; `speedup/`, the OPT system).

Official behaviour, reproduced (benchmarks/infinigen_official.py re-implements the simulation
and matches it): offline, per head the SVD of the calibration queries gives an orthogonal skew A
(methods/_infinigen_prep.py), so (qA)(kA)^T = qk^T with q's energy in few columns; the partial
columns are the union of the top int(d * partial_ratio) by |QA| and by |KA| over the official
six-sentence setup prompt. At layer i-1 the query of layer i (W_q[i] x_{i-1}, RoPE at the current
position, times A[:, cols]) is scored against layer i's partial keys (K A[:, cols], kept on the
device). Every head counts the tokens above head 0's max - alpha; one count n' = floor(mean over
heads), capped at budget_ratio x the final length (dense until that many are stored), is shared
by all heads; the current token competes within n', and a count of 0 leaves the row unmasked
(every token attended). GQA is the official code's expansion: one A and one set per query head,
each KV head moving the union of its group's sets; layers 0 and 1 stay dense (SmolLM2-135M,
9/3 heads, WikiText-2's first 1024 tokens: perplexity 18.10; 24.49 with both `*_per=kv_head`).

Named variants (ours; each measured against the official rule by the benchmark): per-KV-head
skewing or selection (`skew_per`, `select_per`, `group_reduce`: g times fewer rows moved), each
head's own threshold (`head0_threshold=false`), the current token attended on top of n'
(`current_token=added`), at least one token (`zero_count=one`), per-head counts
(`shared_count=false`), columns from the calibration text or the prompt (`partial_index`), |QA|
only or |QA| + |KA| (`column_score`: the OPT system, the paper's Sec. 4.3), speculation from the
layer's own input (`speculation_input=own`, an ablation), and a bounded host pool
(`pool_capacity` < 1, evicting by `counter` (the paper's), `lru` or `fifo`; the official code only
simulates it).

Deviations: the count is strict `>` (the official system; its simulation counts `>=`). RoPE sits
between the projection and the dot product, so A is applied at run time to the rotated q and k
rather than folded into W_q. The step queues no host sync: system mode reads the count only when
layer i-1's attention is queued, then gathers the rows on the host and copies them on a side
stream (overlapping layer i-1's FFN). On CPU our variants' speculation is one C call per layer
(methods/kernels/speculation_cpu.c); on CUDA the sparse attention kernel gathers the rows.
`mode=simulate` keeps the K/V on the device and masks attention to the same sets (as the paper
measured accuracy); both modes give the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

import torch

from kvcore.storage import KV_LAYOUTS
from methods._infinigen_prep import (ColumnScore, PartialIndex, SkewingArtefacts,
                                     cache_dir_reason, calibration_reasons, prepare_skewing)
from methods._infinigen_speculation import (PartialKeys, group_scores, rank_current,
                                            select_tokens)
from methods._selection_host import HostTierLayer
from methods._selection_pool import Eviction, PooledLayer
from methods.base import KVMethod
from methods.budget import budget_for
from methods.capabilities import Capabilities, ServingNeeds
from methods.kernels import sparse_attention, speculation_cpu
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.rope import rotate
from methods.scoring import additive_mask, expand_kv, few_rows_matmul, gather_tokens
from methods.selection import Selection, SelectionLayer, kv_union, serving_rows

GroupReduce = Literal["max", "mean", "prob_mean"]
# skew_per / select_per: the official MHA form, or ours
HeadForm = Literal["query_head", "kv_head"]


def _use_kernel(query: torch.Tensor) -> bool:
    """The Triton sparse-attention kernel serves decode on CUDA (on CPU its interpreter is exact
    but ~100 ms a call: the torch path; one InfiniGen test forces it through the interpreter)."""
    return query.is_cuda and sparse_attention.use_triton(query)


@dataclass(kw_only=True)
class InfiniGen(KVMethod):
    name: ClassVar[str] = "infinigen"
    provenance: ClassVar[str] = "official code"
    family: ClassVar[str] = "selection"
    summary: ClassVar[str] = (
        "speculate layer i's important rows from layer i-1's input; fetch only those from the host")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2406.19707"
    code_url: ClassVar[str | None] = "https://github.com/snu-comparch/InfiniGen"
    operating_point: ClassVar[str] = (
        "snu-comparch/InfiniGen: OPT-6.7B..30B, Llama-2-7B/13B; alpha 4..5, partial 0.3, "
        "20 % budget; lm-eval, WikiText-2 perplexity"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        modes=("system", "simulate"), offloads_kv=True, lookahead=True,
        needs_rope=True, selects_tokens=True, kv_layouts=KV_LAYOUTS)
    serving_needs: ClassVar[ServingNeeds] = ServingNeeds(
        evicts_during_decode=False, needs_host_tier=True, needs_calibration=True)
    axis_keys: ClassVar[tuple[str, ...]] = ("alpha", "budget_ratio")
    # the fetch budget is read at decode steps only: a dense prompt is held whole until its end
    prompt_end_knobs: ClassVar[tuple[str, ...]] = ("budget_ratio",)
    variant_keys: ClassVar[tuple[str, ...]] = (
        "partial_ratio", "dense_layers", "pool_capacity", "mode", "skewing", "column_score",
        "group_reduce", "shared_count", "speculation_input", "skew_per", "select_per",
        "partial_index", "head0_threshold", "current_token", "zero_count")
    # what the C speculation kernel serves (speculation_cpu.applies), unlike the defaults
    path_variants: ClassVar = ({"current_token": "added", "head0_threshold": False},)
    alpha: float = 5.0
    partial_ratio: float = 0.2
    budget_ratio: float = 0.2
    dense_layers: list[int] = field(default_factory=lambda: [0, 1])
    pool_capacity: float = 1.0
    eviction: Eviction = "counter"
    mode: Literal["system", "simulate"] = "system"
    skewing: bool = True
    partial_index: PartialIndex = "setup_prompt"
    column_score: ColumnScore = "qk_union"
    group_reduce: GroupReduce = "max"
    shared_count: bool = True
    speculation_input: Literal["previous", "own"] = "previous"
    skew_per: HeadForm = "query_head"
    select_per: HeadForm = "query_head"
    head0_threshold: bool = True
    current_token: Literal["ranked", "added"] = "ranked"
    zero_count: Literal["all", "one"] = "all"
    calibration_path: str | None = None
    calibration_tokens: int = 2048
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.dense_layers = list(self.dense_layers)
        self._art: SkewingArtefacts | None = None

    def check_hyperparameters(self) -> list[str]:
        r = []
        number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
        if not number(self.alpha) or self.alpha <= 0:
            r.append(f"method.alpha={self.alpha!r} must be > 0 (a logit margin)")
        for key in ("partial_ratio", "budget_ratio", "pool_capacity"):
            value = getattr(self, key)
            if not number(value) or not 0 < value <= 1:
                r.append(f"method.{key}={value!r} must be in (0, 1]")
        if self.eviction != "counter" and number(self.pool_capacity) and self.pool_capacity >= 1:
            r.append(f"method.eviction={self.eviction} acts only when the host pool is smaller "
                     "than the context: set method.pool_capacity below 1 (it is "
                     f"{self.pool_capacity}, so nothing is ever evicted)")
        if self.group_reduce != "max" and self.select_per == "query_head":
            r.append(f"method.group_reduce={self.group_reduce} acts only when a KV head selects "
                     "for its group: set method.select_per=kv_head (each query head selects on "
                     "its own scores)")
        index = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
        layers = self.dense_layers
        if not isinstance(layers, (list, tuple)) or not all(index(i) and i >= 0 for i in layers):
            r.append(f"method.dense_layers={layers!r} must be a list of layer indices >= 0")
        if not index(self.calibration_tokens) or self.calibration_tokens < 16:
            r.append(f"method.calibration_tokens={self.calibration_tokens!r} must be an integer "
                     ">= 16")
        return r

    def validate(self, info: ModelInfo, runner) -> list[str]:
        reasons = super().validate(info, runner)
        reasons += calibration_reasons(self, info)
        if any(i >= info.num_layers for i in self.dense_layers):
            reasons.append(f"method.dense_layers={self.dense_layers} names a layer >= the model's "
                           f"{info.num_layers} layers")
        return reasons + list(filter(None, [cache_dir_reason(self)]))

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict:
        return {"alpha": 1e9, "budget_ratio": 1.0, "mode": "simulate"}

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict:
        # a cap above most counts, so that alpha's threshold decides how many tokens are fetched
        return {"budget_ratio": 0.5}

    artefact_names = ("_art",)  # what `prepare` sets

    def prepare(self, ctx) -> dict:
        self._art, facts = prepare_skewing(self, ctx)
        # which implementation speculates (its speed depends on it; configurations the C kernel
        # does not cover take the torch path whatever this says: see speculation_cpu.applies)
        return {**facts, "speculation": speculation_cpu.kernel_name(ctx.device)}

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        if self._art is None:
            raise RuntimeError("infinigen: call prepare(model, tokenizer, ...) first")
        return InfiniGenLayer(layer_idx, info, self)

    def own_dense_layers(self, info: ModelInfo) -> tuple[int, ...]:
        # Layer 0 has no previous layer to speculate from; the rest are the paper's choice.
        return tuple(sorted({0, *self.dense_layers}))

    def make_dense_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        # Dense layers still keep their K/V on the host tier and prefetch it whole (system mode).
        layer = self.make_layer(layer_idx, info)
        layer.dense = True
        return layer


class InfiniGenLayer(HostTierLayer, PooledLayer, SelectionLayer):
    unforkable = "its K/V are on the host tier (a host store, transfers in flight)"

    eviction_policy = property(lambda self: self.m.eviction)

    def __init__(self, layer_idx: int, info: ModelInfo, method: InfiniGen):
        super().__init__(layer_idx, info, method)
        self.m = method
        self.art = method._art
        self.dense = layer_idx in method.dense_layers or layer_idx == 0
        self.init_host(method.mode == "system")  # system: K/V on the host tier
        self._pk = PartialKeys()  # (B, H_s, k_u, capacity) on the device, channel-major
        self.init_pool()  # per stored token: position, selections (methods/_selection_pool.py)
        # H_sel: the heads that select (select_per): H_q (official) or H_kv (ours)
        self.selected: torch.Tensor | None = None  # (B, H_sel, cap) slots, first `counts` used
        self.counts: torch.Tensor | None = None  # (B, H_sel) how many of them are used (device)
        self._scores = None  # () -> (B, H_sel, T): the speculated logits (the C kernel's if read)
        self._map: torch.Tensor | None = None  # (H_s, d, k_u) A[:, cols] of this request
        # the model's q.k multiplier (its attention's `scaling`): alpha is a margin in its logits
        self._scaling: float | None = None
        self._qmap: torch.Tensor | None = None  # (H_s, d, k_u) A[:, cols] * scaling
        self._last_counts: torch.Tensor | None = None  # (B, H_sel) counts of the last sparse step
        # current_token=ranked: (q_partial, stored logits (B, H_sel, T), cap) until the new key
        # is stored; then whether each head attends it and whether its count 0 attends all
        self._ranked: tuple | None = None
        self._current_keep = self._unmasked = None  # (B, H_sel) bool each

    # --- speculation (run one layer ahead) ---------------------------------------------------
    def prefetch(self, hidden_states, position_ids, ahead: bool) -> None:
        if hidden_states.shape[1] != 1 or self.stored() == 0 or self.pending is not None:
            return
        if self.dense:
            if ahead or self.layer_idx == 0:
                self.fetch_all()
            return
        if self.holding_prompt():  # prompt rows attend densely, one-token chunks too
            return
        if ahead != (self.m.speculation_input == "previous"):
            if not ahead:  # x_{i-1} never reached this layer (e.g. a hook-less caller)
                self.launch_fetch()
            return
        self.selected, self.counts = self.speculate(hidden_states, position_ids)
        if self._ranked is None:  # ranked: the pool statistics wait for the final sets
            self.touch(self.selected, self.counts)
        if not ahead:  # own input: nothing is left to overlap with
            self.launch_fetch()

    def rows_to_fetch(self) -> torch.Tensor | None:
        """The speculated rows: per query head, per KV head the union of its query heads' sets
        (the ledger counts those rows); reads the count, the only host sync of the step."""
        if self.selected is None or self.dense:
            return None
        return (self.union_rows()[0] if self.per_query_head()
                else self.selected[..., : int(self.counts.max())])

    def per_query_head(self) -> bool:
        """Whether each query head has its own selection (the official code's GQA expansion)."""
        return self.m.select_per == "query_head" and self.info.group_size > 1

    def query_sets(self, tokens: int) -> torch.Tensor:
        """(B, H_sel, tokens) bool: the slots each selecting head uses this step."""
        b, h, _ = self.selected.shape
        used = torch.zeros(b, h, tokens, dtype=torch.bool, device=self.selected.device)
        return used.scatter_(2, self.selected, self.valid())

    def union_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query head: the rows each KV head provides `(B, H_kv, n_max)` (its query heads'
        union in slot order, padded to the widest union with other slots, moved but attended by
        none) and which of them each query head attends `(B, H_q, n_max)` (a host sync)."""
        return serving_rows(self.query_sets(self.stored()), self.info.num_kv_heads)

    def speculate(self, x: torch.Tensor, position_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots `(B, H_kv, cap)` of stored tokens and how many of them layer i needs `(B, H_kv)`,
        from an attention input `(B, 1, hidden)`: per head the first `count` slots are its
        `count` best-scored tokens (torch: best first; CPU kernel: in slot order), the rest
        other distinct slots. No host sync: both stay on the device."""
        art, info, m = self.art, self.info, self.m
        b, h_kv, g = x.shape[0], info.num_kv_heads, info.group_size
        h_s = self.query_map().shape[0]  # skewing heads: H_q (skew_per=query_head), or H_kv
        q = art.project_query(self.layer_idx, x)  # (B, H_q, 1, D) pre-RoPE
        pos = (position_ids if position_ids is not None
               else torch.full((b, 1), self.seen_tokens, device=q.device))
        q = rotate(q, pos.to(q.device).view(b, 1, 1), art.inv_freq)  # RoPE at the current position
        q_partial = few_rows_matmul(q.float().view(b, h_s, -1, q.shape[-1]),
                                     self.query_map())  # (B, H_s, H_q / H_s, k_u)
        t = self._pk.length
        cap = self.fetch_cap(t)
        self._allowed, self._scores = (t if cap is None else cap) + 1, None
        if cap is None:  # a dense step: every stored token, for every head
            slots = torch.arange(t, device=q_partial.device)
            h_sel = info.num_heads if self.per_query_head() else h_kv
            self._last_counts = torch.full((b, h_sel), t, device=q_partial.device)
            return slots.expand(b, h_sel, t), self._last_counts
        per_query = self.per_query_head()
        sel_heads = info.num_heads if per_query else h_kv
        if m.current_token == "added" and speculation_cpu.applies(
                q_partial, self.partial_keys(), sel_heads, m.group_reduce, m.head0_threshold):
            selected, self._last_counts = speculation_cpu.select(
                q_partial, self.partial_keys(), cap, m.alpha, m.shared_count)
            self._scores = lambda: self.selecting_scores(q_partial @ self.partial_keys()[..., :t])
            return selected, self._last_counts
        scores = self.selecting_scores(q_partial @ self.partial_keys())  # (B, H_sel, T)
        self._scores = lambda: scores
        selected, self._last_counts = select_tokens(scores, cap, m.alpha, m.shared_count,
                                                    m.head0_threshold)
        if m.current_token == "ranked":
            # the final sets need the new token's score (its key comes at layer i): fetch the
            # best n' + 1 now; the n' of T + 1 tokens keeps at most that many stored ones (a
            # head's count grows by at most one, or the threshold rises)
            self._ranked = (q_partial, scores, cap)
            return selected, (self._last_counts + 1).clamp(max=min(cap, t))
        return selected, self._last_counts

    def selecting_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """(B, H_s, H_q / H_s, T) speculated logits -> (B, H_sel, T), one row per selecting
        head: per query head, query head h_s * (H_q / H_s) + j is row j of skew head h_s; per
        KV head, the group's rows reduced by `group_reduce`."""
        b, info = scores.shape[0], self.info
        if self.per_query_head() or info.group_size == 1:
            return scores.reshape(b, info.num_heads if self.per_query_head() else
                                  info.num_kv_heads, -1)
        return group_scores(scores.view(b, info.num_kv_heads, info.group_size, -1),
                            self.m.group_reduce)

    def rank_current(self) -> torch.Tensor:
        """current_token=ranked, once the new token's partial key is stored: the official sets
        (n' of the T + 1 tokens, the current one included) -> `counts` (stored tokens each
        head attends, its best first) and `_current_keep`; returns the current token's
        speculated logit `(B, H_sel)`."""
        q_partial, stored, cap = self._ranked
        self._ranked = None
        new_key = self.partial_keys()[..., -1:]  # (B, H_s, k_u, 1)
        current = self.selecting_scores(q_partial @ new_key)[..., 0]  # (B, H_sel)
        m = self.m
        least = 0 if m.zero_count == "all" else 1
        self.counts, self._current_keep = rank_current(stored, current, cap, m.alpha,
                                                       m.shared_count, m.head0_threshold, least)
        self._unmasked = (self.counts == 0) & ~self._current_keep
        self._last_counts = self.counts + self._current_keep.long() - 1  # the official n' - 1
        self.touch(self.selected, self.counts)
        return current

    def fetch_cap(self, stored_tokens: int) -> int | None:
        """Most stored tokens a head may fetch this step: `budget_ratio` of the protocol's budget
        basis (at least 1), or None: a dense step, every stored token (the final-length basis
        until that many are stored: the official simulation's first budget * length rows)."""
        budget = budget_for(self.basis_tokens(stored_tokens), self.m.budget_ratio, None)
        if self.protocol.budget_basis == "final" and stored_tokens < budget:
            return None
        return max(1, min(stored_tokens, budget))

    def partial_map(self) -> torch.Tensor:
        """(H_s, d, k_u) A[:, cols]: the calibration's, unless the prompt chose (prefill)."""
        if self._map is None:
            self._map = self.art.partial_map(self.layer_idx)
        return self._map

    def query_map(self) -> torch.Tensor:
        """The partial map times the model's scaling, so q_rot @ it @ partial keys are logits."""
        if self._qmap is None:
            if self._scaling is None:
                raise RuntimeError(f"infinigen layer {self.layer_idx}: speculation before the "
                                   "layer's first attention (its scaling is unknown)")
            self._qmap = self.partial_map() * self._scaling
        return self._qmap

    def partial_keys(self) -> torch.Tensor:
        """(B, H_s, k_u, T): the partial keys, channel-major."""
        return self._pk.view()

    def valid(self) -> torch.Tensor:
        """(B, H_sel, cap) bool: which of `selected` are used this step."""
        ranks = torch.arange(self.selected.shape[-1], device=self.selected.device)
        return ranks < self.counts[..., None]

    def touch(self, index: torch.Tensor, counts: torch.Tensor) -> None:
        """Pool statistics per KV head: a token counts as selected when any head reading it did."""
        self.touch_pool(kv_union(self.query_sets(self.stored()), self.info.num_kv_heads))

    # --- cache seam --------------------------------------------------------------------------
    def hold_extra(self, keys: torch.Tensor) -> None:
        self.pool_append(keys, self.seen_tokens)
        if not self.dense:
            self._append_partial(keys)

    def _append_partial(self, keys):
        if self.m.partial_index == "prefill" and self._map is None and keys.shape[2] > 1:
            return  # the prompt's columns are chosen in attend(); keys are added there
        cols = self.partial_map()  # (H_s, d, k_u)
        keys = expand_kv(keys.float(), cols.shape[0] // keys.shape[1])  # (B, H_s, t, d)
        self._pk.append(few_rows_matmul(keys, cols))  # (B, H_s, t, k_u)

    # --- attention seam ----------------------------------------------------------------------
    def _attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        q_len = query.shape[2]
        if self._scaling is None:
            self._scaling = float(kwargs.get("scaling") or module.scaling)
        if q_len > 1:
            if not self.dense and self.m.partial_index == "prefill" and self._map is None:
                q_e, k_e = self.art.energies_from(query, keys, self.layer_idx)
                self._map = self.art.partial_map(self.layer_idx, q_e, k_e)
                self._append_partial(keys)
            if attention_mask is not None and attention_mask.shape[-1] != keys.shape[2]:
                # The model builds one mask from layer 0's sizes; a layer whose pool evicted
                # holds fewer past tokens (dense layers never evict): its own causal mask.
                attention_mask = additive_mask(None, q_len, keys.shape[2], query.device
                                               ).to(query.dtype)[None, None]
            return base(module, query, keys, values, attention_mask, **kwargs)
        if self.dense or self.selected is None:
            self._attended, self.selection = keys.shape[2], None
            return base(module, query, keys, values, None, **kwargs)
        ranked = self._ranked is not None
        if ranked:  # the new key is stored now: the official sets over the T + 1 tokens
            current = self.rank_current()
            unmasked = self._unmasked[..., None]  # (B, H_sel, 1)
            new = self._current_keep[..., None] | unmasked
        else:
            new, unmasked = torch.ones_like(self.counts[..., None], dtype=torch.bool), False
        sets = torch.cat([self.query_sets(self.stored() - 1) | unmasked, new], 2)  # (B, H_sel, T)
        self._attended = sets.sum(-1).float().mean()  # device; read after the step
        self.publish(sets, current if ranked else None)
        if self.system and ranked and self.m.zero_count == "all" and bool(unmasked.any()):
            # a count of 0 (zero_count=all): the official row attends every token; the rows
            # come from the host now, synchronously (the speculation could not know)
            keys, values = (t.wait() for t in self.host.fetch())
        elif self.system:  # what each head attends of the fetched rows, the new token last
            rows = self.fetched.repeat_interleave(sets.shape[1] // self.fetched.shape[1], 1)
            sets = torch.cat([sets.gather(2, rows), new], 2)
            if self.selection is not None:  # the rows attend gets, at their text positions
                slots = torch.cat([self.fetched, self.fetched[..., :1] * 0 + self.stored() - 1], 2)
                rows = self.positions.long().gather(2, slots)
                self.selection = replace(self.selection, kv_rows=rows)
            return self.attend_rows(module, query, keys, values, sets, base, kwargs["scaling"],
                                    kwargs)
        return self.fetch_and_attend(module, query, keys, values, sets, base, kwargs["scaling"],
                                     kwargs)

    def sparse_kernel(self, query: torch.Tensor) -> bool:
        return _use_kernel(query)

    def publish(self, sets: torch.Tensor, current: torch.Tensor | None) -> None:
        """The step's `selection` at text positions, for the shared contract: the speculated
        logits (computed when read) of the stored tokens and of the current one (ranked; added:
        -inf, it is protected), the sets `(B, H_sel, T)` and each head's count n' (T: all)."""
        if (stored := self._scores) is None:
            self.selection = None
            return

        def scores():  # (B, H_sel, 1, seen)
            rows = torch.nn.functional.pad(stored(), (0, 1), value=float("-inf"))
            if current is not None:
                rows[..., -1] = current
            return self.at_positions(rows, float("-inf"))[:, :, None]
        size = self.counts if current is None else torch.where(
            self._unmasked, sets.shape[-1], self.counts + self._current_keep.long())
        self.selection = Selection(scores, self.at_positions(sets, False)[:, :, None], size,
                                   (0, 0 if current is not None else 1))

    def after_forward(self) -> None:
        if not self.holding_prompt():  # a prompt is fitted to the pool once, at its end
            self._fit_pool()
        self.selected = self.counts = self.fetched = self._scores = None
        self._ranked = self._current_keep = self._unmasked = None

    def on_prefill_end(self) -> None:
        self._fit_pool()

    def _fit_pool(self) -> None:
        # dense layers never evict (the official simulation masks only speculating layers), and
        # their counters stay zero, so counter/lru eviction there would be arbitrary
        if not self.dense:
            self.fit_pool(self.m.pool_capacity)

    def keep_rows(self, index: torch.Tensor) -> None:
        if self._pk is not None:
            self._pk.keep(index)
        self.keep_held(index)

    # --- accounting --------------------------------------------------------------------------
    def kept_positions(self) -> torch.Tensor:
        """Positions each selecting head attended `(B, H_sel, n)`: per query head (H_q rows,
        the default) or per KV head."""
        if self.selected is None:
            return self.positions if self.positions is not None else super().kept_positions()
        # Heads with fewer tokens than the widest (shared_count=false) repeat their best slot, so
        # a mass-recall over these positions counts that token twice for them.
        n_max = int(self.counts.max())
        slots = torch.where(self.valid(), self.selected, self.selected[..., :1])[..., :n_max]
        positions = self.positions.repeat_interleave(slots.shape[1] // self.positions.shape[1], 1)
        chosen = gather_tokens(positions, slots)
        current = positions[:, :, -1:]
        # current_token=ranked: a head that left the current token out repeats its best slot
        if self._current_keep is not None and chosen.shape[-1]:
            current = torch.where(self._current_keep[..., None], current, chosen[..., :1])
        return torch.cat([chosen, current], dim=2)

    def stats(self) -> dict[str, int]:
        held, on_device = self.held_bytes()
        partial = self._pk.nbytes()
        out = {"kv_tokens": self.stored(), "kv_bytes": held + partial,
               "kv_bytes_device": partial + on_device, **self.storage_stats()}
        if not self.dense and self._last_counts is not None:
            out["selected_tokens"] = int(self._last_counts.max()) + 1
        return out
