"""FastGen (Ge et al., "Model Tells You What to Discard", ICLR 2024, arXiv 2310.01801): one eviction
policy per KV head, profiled at the prompt's end; the compression is an outcome, not a budget.

Paper (§3.3-3.4, eq. 1-2): for each head, among the feasible policies in order of memory cost,
the cheapest whose compressed cache recovers the head's attention map A to a ratio T,
|A - softmax(Q K_C^T)| <= 1 - T; then, during generation, each head keeps what its policy keeps
(Algorithm 2: the new token too, if the policy keeps it). Policies: special tokens (C_special),
punctuation (C_punct), locality (C_local: the last r_l x prompt-length tokens, sliding), frequency
(C_frequent: the r_f x current-length tokens with the most accumulated attention, H2O's score,
updated every step), their greedy unions in the order special -> special+punct ->
special+punct+frequent -> special+punct+frequent+local, and the full cache (`POLICIES`). Paper
defaults: r_l = r_f = 0.3 (§5.1, A.2); T = 0.95 in the profiling study (§4.1, and the middle of
Table 1's 0.91..0.98, ~40 % pruned on Llama-1-65B). The paper names github.com/machilusZ/FastGen
for code; that repository holds a README and a licence only: provenance "paper".

Token identity reaches the layers through the token-id seam (`Capabilities.needs_token_ids`: the
engine hands each forward's ids to `observe_token_ids` before it runs); every token carries its
kind (special, punctuation bits) as per-token state, moved with its K/V. The sets come from the
tokenizer in `prepare` (metrics.json `method.prepare` records their sizes and the rules):
  * special: the tokenizer's special ids (`all_special_ids`: BOS, EOS, pad, unk, chat markers)
    present in the sequence; where a prompt holds none (tokenizers adding no BOS: SmolLM2), its
    first token instead (the attention sink), and `kv.method_facts.special_fallback_heads`
    counts the heads concerned;
  * punctuation: every non-special id whose decoded text, whitespace stripped, is non-empty and
    all punctuation: Unicode categories P* or ASCII punctuation (Python's string.punctuation,
    which adds $ + < = > ^ ` | ~); so " ." and "?!" are punctuation, "\n", "a." and byte pieces
    of a character are not.

Our reading where the paper is not explicit:
  * recovery: the attention mass the policy's kept set holds, from the prompt's last
    `window_tokens` query rows (the rows nearest the decode steps that will attend to the kept
    set; the paper's A is the whole prompt's map): a head takes the first policy whose dropped
    mass is <= 1 - T (the paper's inequality; renormalised, the L1 gap is twice the dropped mass).
    T = 1 drops nothing with any mass: the full cache;
  * GQA (the paper is MHA only): one policy per KV head, from the group's mean attention;
  * unions are of the separately chosen sets, so a head keeps at most their sizes' sum.

The compression chosen is reported: `kv.method_facts.heads_<policy>` (mean per request of the
(layer, KV head) pairs that took each policy; dense protocol layers take none) next to
`kv.held_ratio`.

Cost: every forward computes attention probabilities (the frequencies are updated at every step),
so decode takes the eager path, not SDPA or the ragged kernels.

No budget knob (budget_ratio / budget_tokens are refused, as kvmerger's); move along the size axis
with `recovery_ratio`. What a layer holds is its heads' policies' outcome (`kv.tokens_per_layer`,
`kv.held_ratio` report it); heads are stored ragged (methods/eviction.py).
"""

from __future__ import annotations

import string
import unicodedata
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvcore.storage import KV_LAYOUTS
from methods.base import KVMethod
from methods.capabilities import Capabilities, ServingNeeds
from methods.eviction import EvictionLayer, keep_tokens, per_head_index
from methods.layer import KVLayer
from methods.model import ModelInfo, PrepareContext
from methods.scoring import attention_with_probs, group_column_sums
from methods.snapkv import window_votes

POLICIES = ("special", "special+punct", "special+punct+frequent", "special+punct+frequent+local",
            "full")  # by memory cost (the paper's greedy order)
SPECIAL, PUNCT = 1, 2  # bits of a token's kind (FastGen.token_kinds)


@dataclass(kw_only=True)
class FastGen(KVMethod):
    name: ClassVar[str] = "fastgen"
    provenance: ClassVar[str] = "paper"
    family: ClassVar[str] = "head-wise"
    summary: ClassVar[str] = (
        "per KV head, the cheapest of the paper's policies that recovers the prompt's attention")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2310.01801"
    code_url: ClassVar[str | None] = None
    operating_point: ClassVar[str] = (
        "paper only (arXiv 2310.01801; the named repo has no code): Llama-1 7B..65B (MHA); "
        "r_l = r_f = 0.3, T 0.91..0.98 (0.95 in its profiling study); AlpacaEval, GSM8k, "
        "HumanEval, NQ, TQA at 512-token sequences")
    capabilities: ClassVar[Capabilities] = Capabilities(
        needs_attn_scores=True, eager_prompt_attention=True, prefill_modes=("dense",),
        selects_tokens=True, kv_layouts=KV_LAYOUTS, needs_token_ids=True)
    serving_needs: ClassVar[ServingNeeds] = ServingNeeds(granularity="head", ragged_heads=True)
    axis_keys: ClassVar[tuple[str, ...]] = ("recovery_ratio",)
    variant_keys: ClassVar[tuple[str, ...]] = ("local_ratio", "frequent_ratio", "window_tokens")
    recovery_ratio: float = 0.95
    local_ratio: float = 0.3
    frequent_ratio: float = 0.3
    window_tokens: int = 32

    def check_hyperparameters(self) -> list[str]:
        reasons = [f"method.{key}={getattr(self, key)!r} must be a number in [0, 1]"
                   for key in ("recovery_ratio", "local_ratio", "frequent_ratio")
                   if isinstance(getattr(self, key), bool)
                   or not isinstance(getattr(self, key), (int, float))
                   or not 0 <= getattr(self, key) <= 1]
        if isinstance(self.window_tokens, bool) or not isinstance(self.window_tokens, int) \
                or self.window_tokens <= 0:
            reasons.append(f"method.window_tokens={self.window_tokens!r} must be a positive integer")
        return reasons

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict:
        return {"recovery_ratio": 1.0}  # no mass may be dropped: every head full

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict:
        # a random tiny model attends diffusely: a low threshold so that heads compress
        return {"recovery_ratio": 0.5, "window_tokens": 8}

    artefact_names = ("token_kinds",)  # what `prepare` sets

    def prepare(self, ctx: PrepareContext) -> dict[str, Any]:
        """The kind of every id (module docstring): `token_kinds` `(V,)` uint8, SPECIAL | PUNCT."""
        tok = ctx.tokenizer
        special = [] if tok is None else sorted(set(getattr(tok, "all_special_ids", None) or []))
        punct = punctuation_ids(tok, set(special)) if tok is not None else []
        kinds = torch.zeros(len(tok) if tok is not None else ctx.vocab_size, dtype=torch.uint8)
        kinds[torch.as_tensor(special, dtype=torch.long)] |= SPECIAL
        kinds[torch.as_tensor(punct, dtype=torch.long)] |= PUNCT
        self.token_kinds = kinds.to(ctx.device)
        return {"special_ids": len(special), "punctuation_ids": len(punct),
                "punctuation_examples": [tok.decode([i]) for i in punct[:12]] if punct else [],
                "special_rule": "the tokenizer's special ids in the sequence; none in a prompt: "
                                "its first token",
                "punctuation_rule": "decoded text, whitespace stripped, non-empty and all "
                                    "Unicode P* or ASCII punctuation; special ids excluded",
                "no_tokenizer": tok is None}

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return FastGenLayer(layer_idx, info, self)


def punctuation_ids(tokenizer, special: set[int]) -> list[int]:
    """Ids whose decoded text is punctuation only (module docstring)."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return [i for i, text in enumerate(texts) if i not in special and is_punctuation(text)]


def is_punctuation(text: str) -> bool:
    text = text.strip()
    return bool(text) and all(c in string.punctuation or unicodedata.category(c).startswith("P")
                              for c in text)


class FastGenLayer(EvictionLayer):
    """The template's storage (ragged heads) and accounting; the policies instead of a budget."""

    state_fields = ("window_queries", "scaling", "policy", "local_tokens", "next_kinds",
                    "fallback_rows")

    selects_top_scores: ClassVar[bool] = False  # policy sets, not a top-k (tests/methods/test_fastgen.py)

    def __init__(self, layer_idx: int, info: ModelInfo, method: FastGen):
        super().__init__(layer_idx, info, method)
        self.window_queries: torch.Tensor | None = None  # (B, H_q, <=w, D) the last queries
        self.scaling = 1.0
        self.policy: torch.Tensor | None = None  # (B, H_kv) index into POLICIES
        self.local_tokens = 0  # int(r_l x the prompt's length), fixed at profiling
        self.next_kinds: torch.Tensor | None = None  # (B, q) the kinds of the next update's tokens
        self.fallback_rows: torch.Tensor | None = None  # (B,) no special id in the prompt

    def observe_token_ids(self, ids: torch.Tensor) -> None:
        kinds = getattr(self.method, "token_kinds", None)
        if kinds is None:
            raise RuntimeError("method=fastgen needs prepare(ctx) (its token kinds) first")
        known = ids < kinds.numel()  # ids past the tokenizer (embedding padding rows): no kind
        self.next_kinds = kinds[ids.clamp(max=kinds.numel() - 1)] * known

    def new_state(self, b, h, q, device):
        kinds, self.next_kinds = self.next_kinds, None
        if kinds is None or kinds.shape != (b, q):
            raise RuntimeError(f"fastgen layer {self.layer_idx}: {q} new tokens but the ids of "
                               f"{None if kinds is None else tuple(kinds.shape)} observed; the "
                               "engine hands them before every forward (needs_token_ids)")
        return {"scores": torch.zeros(b, h, q, device=device),  # accumulated attention, fp32
                "kinds": kinds[:, None].expand(b, h, q).to(device)}  # SPECIAL | PUNCT bits

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        self.scaling = kwargs["scaling"]
        if self.holding_prompt():
            past = self.window_queries
            recent = query if past is None else torch.cat([past, query], dim=2)
            self.window_queries = recent[:, :, -self.method.window_tokens:]
        keep = None
        if self.ragged:  # each head over its own tokens, its chunk last (the template's over_heads)
            q, t = query.shape[2], keys.shape[2]
            seen = (self.kept_lengths() - q)[..., None] + 1 + torch.arange(q, device=keys.device)
            keep = torch.arange(t, device=keys.device) < seen[..., None]  # (B, H_kv, q, T)
            held = keep[:, :, -1:].transpose(2, 3)  # (B, H_kv, T, 1); padding zeroed, never read
            keys, values, attention_mask = keys.masked_fill(~held, 0), values.masked_fill(~held, 0), None
            keep = keep.repeat_interleave(query.shape[1] // keys.shape[1], dim=1)
        out, probs = attention_with_probs(query, keys, values, attention_mask, self.scaling, keep)
        self.state("scores").add_(group_column_sums(probs, keys.shape[1]))
        return out, None

    def score(self) -> torch.Tensor:
        return self.state("scores")  # the frequency policy's ranking (diagnostics read it too)

    def held(self) -> torch.Tensor:
        """Slots holding a token `(B, H_kv, T)` bool (ragged rows: not the padding)."""
        lengths = self.kept_lengths()
        if lengths is None:
            return torch.ones_like(self.positions, dtype=torch.bool)
        return torch.arange(self.positions.shape[-1], device=lengths.device) < lengths[..., None]

    def policy_sets(self) -> torch.Tensor:
        """What each policy keeps now, `(P, B, H_kv, T)` bool over the slots (POLICIES' order)."""
        held, n, kinds = self.held(), self.seen_tokens, self.state("kinds")
        special = held & (kinds & SPECIAL).bool()
        punct = held & (kinds & PUNCT).bool()
        frequent = torch.zeros_like(held)
        top = min(int(self.method.frequent_ratio * n), self.positions.shape[-1])
        if top:
            scores = self.state("scores").masked_fill(~held, float("-inf"))
            frequent.scatter_(-1, scores.topk(top, dim=-1).indices, True)
            frequent &= held
        local = held & (self.positions >= n - self.local_tokens)
        cheap = special | punct
        return torch.stack([special, cheap, cheap | frequent, cheap | frequent | local, held])

    def on_prefill_end(self) -> None:
        """Profile every head (module docstring), then keep what its policy keeps."""
        w = self.window_queries.shape[2]
        self.mark_fallback_special()
        self.local_tokens = int(self.method.local_ratio * self.seen_tokens)
        mass = window_votes(self.window_queries, self.keys, self.positions, self.seen_tokens - w,
                            self.scaling).double() / w  # (B, H_kv, T): each row's mass, averaged
        sets = self.policy_sets()
        dropped = (mass * (self.held() & ~sets)).sum(-1)  # (P, B, H_kv)
        fits = dropped <= 1 - self.method.recovery_ratio
        fits[-1] = True  # the full cache always recovers A
        self.policy = fits.to(torch.int8).argmax(dim=0)  # the first (cheapest) that fits
        self.window_queries = None
        self.apply_policies()

    def mark_fallback_special(self) -> None:
        """A sequence row whose prompt holds no special id: its first token is special instead."""
        kinds = self.state("kinds")  # (B, H_kv, T) a view: marked in place
        none = ~((kinds & SPECIAL).bool() & self.held()).flatten(1).any(-1)  # (B,)
        first = (self.positions == 0) & none[:, None, None]
        # a later prompt of the request finds the marked first token: still the fallback
        self.fallback_rows = none if self.fallback_rows is None else self.fallback_rows | none
        kinds |= first.to(kinds.dtype) * SPECIAL

    def facts(self) -> dict[str, float]:
        """The (KV head) count per policy this request chose here; the heads whose special set
        is the first token (module docstring)."""
        if self.policy is None:
            return {}
        counts = torch.bincount(self.policy.flatten().long(), minlength=len(POLICIES)).tolist()
        facts = {f"heads_{name.replace('+', '_')}": c for name, c in zip(POLICIES, counts)}
        facts["special_fallback_heads"] = int(self.policy[self.fallback_rows].numel())
        return facts

    def after_forward(self) -> None:
        if self.policy is not None and not self.holding_prompt():
            self.apply_policies()  # each decode step: the window slides, frequencies update
        self.appended = self.picked = None

    def apply_policies(self) -> None:
        keep = self.policy_sets().gather(0, self.policy[None, ..., None].expand(
            1, *self.positions.shape).to(torch.int64))[0]  # (B, H_kv, T)
        counts = keep.sum(-1)
        if torch.equal(counts, self.held().sum(-1)):
            return  # every head keeps all it holds
        index = per_head_index(keep.float().masked_fill(~self.held(), float("-inf")), counts)
        keep_tokens(self._token_rows(), index, valid=counts)
        self.ragged = self.token_state["positions"].ragged
        self.kept_count = -(-int(counts.sum()) // counts.numel())  # the mean, rounded up
        self._views()

    def budget(self) -> int:
        """Not a budget: what the heads' policies keep now (the outcome, as kvmerger's)."""
        return self.kept_tokens()
