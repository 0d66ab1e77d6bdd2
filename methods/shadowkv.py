"""ShadowKV: low-rank pre-RoPE keys on the device, values on the host, chunk-sparse decode.

Sun et al., "ShadowKV: KV Cache in Shadows for High-Throughput Long-Context LLM Inference",
ICML 2025, arXiv 2410.21465; official code ByteDance-Seed/ShadowKV@e51904cdeab7
(`models/kv_cache.py`: `ShadowKVCache`, `ShadowKVCache_CPU`).

At the end of a prompt (`on_prefill_end`; the prompt itself is prefilled densely):
1. Pre-RoPE keys: the layer sees post-RoPE keys, so they are un-rotated exactly with the model's
   own frequencies (`PrepareContext.rope_inv_freq`, methods/rope.py, rotation by -position in
   fp32). K_pre `(n, H_kv*D)` (all KV heads concatenated, as the official code) is decomposed by
   SVD in fp32; U_r `(n_ctx, r)` (shared by the heads) and SV_r = diag(s_r) V_r^T split per head
   `(H_kv, r, D)` stay on the device in the model dtype. Rank r = `rank`, else
   round(`rank_ratio` * H_kv*D): the paper's 160 at H_kv*D = 1024 (Llama-3-8B) is ratio 0.15625;
   a fixed 160 would be no compression on small models (SmolLM2: H_kv*D = 192 -> r = 30).
2. The prompt is cut into `chunk_size`-token chunks (default 8); the last `local_chunks` (4) chunks
   plus the remainder stay exact on the device (the local window), the rest form n_ctx tokens.
3. Per KV head and chunk: landmark = mean of the chunk's post-RoPE keys; a chunk's badness is the
   minimum cosine similarity between its landmark and its keys. The O chunks with the lowest
   minimum are outliers: their exact K and V stay on the device and they are always attended.
4. Every value of the n_ctx chunked tokens goes to the host tier (the layer's host store, values
   only: kvcore.offload.HostKVStore, pinned memory on CUDA); only landmarks of the non-outlier
   chunks stay on the device.

Each decode step (per layer): the new token's exact K/V join the local window (generated tokens are
never compressed, as in the paper and the official code; the window is attended whole). Per query head p = softmax_j(s q . m_j) over the
non-outlier landmarks; one chunk set per KV head from the max of p over the group's query heads
(the official GQA rule); the top-k chunks' values are gathered on the host and copied to the device
(side stream on CUDA; the bytes go to the transfer ledger), while their keys are rebuilt on the
device as RoPE(U_r[rows] @ SV_r[head]) at their original positions. Attention is exact softmax
over outliers + selected chunks + the local window.

Budget, as the official code counts it (`models/kv_cache.py`): the *sparse budget* S is the
number of tokens of the selected chunks per KV head and decode step, k = S // chunk_size chunks
(all of them when fewer remain). S = `budget_tokens`, else int(`budget_ratio` * the budget basis)
(`KVLayer.basis_tokens()`: the final length by default), else, when both are null,
`sparse_budget_tokens` (official default 2048). Everything else comes on top and is always
attended exactly: the O outlier chunks, O = floor(`outlier_ratio` * S) // chunk_size (default
0.1875: the accuracy class's 48 chunks at S = 2048, and the CPU class's (S // 1024) * 24 chunks),
the local window (the last `local_chunks` prompt chunks + the remainder) and every generated
token (the local window grows by one per decode step). What a layer may attend at a step is thus
k * chunk_size + O * chunk_size + (tokens seen - chunked tokens), all from the rule
(`allowed_tokens`).

When a prompt is compressed: the official prefill path runs only for a forward of more than 4096
tokens (`models/llama.py`: `q_len > 4*1024`; shorter prompts are not served). Here
`compress_above_tokens` (default 4096, the official threshold) decides: a prompt of more tokens is
compressed at its end; a shorter one stays dense (full cache, exact), which the harness then
reports as an inactive run. Set `method.compress_above_tokens=0` to compress shorter prompts (the
harness's 1K-4K needle contexts and the tests do): a deviation from the official code, recorded in
the run's config.

Other deliberate deviations:
* The official code asserts budget < prompt; here a sparse budget covering every chunk selects all
  of them (the method is then lossless up to the rank).
* Landmark scores use the model's own scaling s (1/sqrt(D) for most), not a hard-coded 1/sqrt(128)
  (which is the model's own only at head_dim 128, the official models').
* The official accuracy class keeps the "CPU" values on the GPU; here they are really on the host
  tier and the fetch is real. The CPU class's cache of chunks fetched at earlier steps (only misses
  transferred) is not implemented: every step fetches its selected chunks (an upper bound on the
  bytes moved).
* Only the first prompt of a request is compressed; later prompts join the exact local window
  (the official code handles one prefill).

Hyperparameters:
    budget_ratio / budget_tokens: the sparse budget S (selected chunks' tokens, see above).
    sparse_budget_tokens: S when both shared knobs are null (official 2048).
    compress_above_tokens: prompts longer than this are compressed (official 4096).
    chunk_size: tokens per chunk (paper 8).
    rank / rank_ratio: SVD rank, or its share of H_kv * D (default 0.15625 = 160 / 1024).
    local_chunks: exact trailing prompt chunks (official 4).
    outlier_ratio: outlier tokens as a share of S (default 0.1875, see above).

Paper's number: up to 6x larger batches and 3.04x throughput on an A100 without accuracy loss
(abstract), sparse budget 1.56 % at 128K, rank 160, chunk 8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcore.errors import ConfigError
from kvcore.offload import fitted_capacity
from methods.base import KVMethod
from methods.budget import budget_for, check_budget
from methods.capabilities import Capabilities, ServingNeeds
from methods.layer import KVLayer
from methods.model import ModelInfo
from methods.rope import rotate
from methods.scoring import gather_tokens
from methods.selection import SelectionLayer


OFFICIAL_MIN_PROMPT_TOKENS = 4096  # models/llama.py: the prefill path runs for q_len > 4096


@dataclass(kw_only=True)
class ShadowKV(KVMethod):
    name: ClassVar[str] = "shadowkv"
    provenance: ClassVar[str] = "official code"
    family: ClassVar[str] = "selection"
    summary: ClassVar[str] = (
        "low-rank keys on the device, values on the host, chunk-sparse fetch per step")
    paper_url: ClassVar[str | None] = "https://arxiv.org/abs/2410.21465"
    code_url: ClassVar[str | None] = "https://github.com/ByteDance-Seed/ShadowKV"
    operating_point: ClassVar[str] = (
        "ByteDance-Seed/ShadowKV: Llama-3-8B-1M, GLM-4-9B-1M; 128K context, sparse budget "
        "2048 (1.56 %) + 48 outlier chunks + local window, chunk 8, rank 160, prompts > 4096 "
        "tokens; RULER"
    )
    capabilities: ClassVar[Capabilities] = Capabilities(
        offloads_kv=True, needs_rope=True, prefill_modes=("dense",), selects_tokens=True)
    serving_needs: ClassVar[ServingNeeds] = ServingNeeds(
        evicts_during_decode=False, granularity="page", needs_host_tier=True)
    variant_keys: ClassVar[tuple[str, ...]] = ("rank", "rank_ratio", "chunk_size")
    inert_knobs: ClassVar[dict[str, str]] = {
        "sparse_budget_tokens": "applies only when budget_ratio and budget_tokens are both null "
                                "(the shared budget takes precedence; the compressing case sets "
                                "one)"}
    # the sparse budget is read at decode steps only: a dense prompt is compressed whole
    prompt_end_knobs: ClassVar[tuple[str, ...]] = ("budget_ratio", "budget_tokens",
                                                   "sparse_budget_tokens")
    budget_ratio: float | None = None
    budget_tokens: int | None = None
    sparse_budget_tokens: int = 2048
    compress_above_tokens: int = 4096
    chunk_size: int = 8
    rank: int | None = None
    rank_ratio: float = 0.15625
    local_chunks: int = 4
    outlier_ratio: float = 0.1875

    def __post_init__(self) -> None:
        super().__post_init__()
        self._inv_freq: torch.Tensor | None = None

    def check_hyperparameters(self) -> list[str]:
        reasons = []
        if self.budget_ratio is not None or self.budget_tokens is not None:
            reasons += check_budget(self.budget_ratio, self.budget_tokens)
        for key in ("chunk_size", "local_chunks", "sparse_budget_tokens", "compress_above_tokens"):
            value = getattr(self, key)
            minimum = 1 if key in ("chunk_size", "sparse_budget_tokens") else 0
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                reasons.append(f"method.{key}={value!r} must be an integer >= {minimum}")
        if self.rank is not None and (not isinstance(self.rank, int) or isinstance(self.rank, bool)
                                      or self.rank < 1):
            reasons.append(f"method.rank={self.rank!r} must be a positive integer or null")
        if not isinstance(self.rank_ratio, (int, float)) or not 0 < self.rank_ratio <= 1:
            reasons.append(f"method.rank_ratio={self.rank_ratio!r} must be in (0, 1]")
        if not isinstance(self.outlier_ratio, (int, float)) or not 0 <= self.outlier_ratio < 1:
            reasons.append(f"method.outlier_ratio={self.outlier_ratio!r} must be in [0, 1)")
        default_ratio = type(self).__dataclass_fields__["rank_ratio"].default
        if self.rank is not None and self.rank_ratio != default_ratio:
            reasons.append(f"method.rank={self.rank} and method.rank_ratio={self.rank_ratio}: the "
                           "rank would win and the ratio be ignored; set one (method.rank=null, "
                           f"or method.rank_ratio={default_ratio})")
        return reasons

    def provenance_label(self) -> str:
        if self.compress_above_tokens < OFFICIAL_MIN_PROMPT_TOKENS:
            return (f"{self.provenance} (compress_above_tokens={self.compress_above_tokens}: "
                    f"prompts of {OFFICIAL_MIN_PROMPT_TOKENS} tokens or fewer compressed too, "
                    "which the official code does not serve)")
        return self.provenance

    def validate(self, info: ModelInfo, runner) -> list[str]:
        reasons = super().validate(info, runner)
        if info.rope_theta is None:
            reasons.append(f"method=shadowkv needs a RoPE model (it un-rotates keys to pre-RoPE); "
                           f"{info.model_type} has no rope_theta")
        width = info.num_kv_heads * info.head_dim
        if self.rank is not None and self.rank > width:
            reasons.append(f"method.rank={self.rank} is larger than the keys' width on this model "
                           f"(H_kv x head_dim = {width}): the factors would hold more than the keys;"
                           f" allowed: 1..{width}")
        if info.max_positions and self.compress_above_tokens >= info.max_positions:
            reasons.append(f"method.compress_above_tokens={self.compress_above_tokens}: ShadowKV "
                           "compresses only prompts longer than that, but this model has "
                           f"{info.max_positions} max positions, so it would never act; allowed: "
                           f"0..{info.max_positions - 1}")
        return reasons

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict:
        return {"budget_tokens": seq_tokens, "rank_ratio": 1.0, "compress_above_tokens": 0}

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict:
        # short prompts compressed (official: > 4096 tokens only), chunks small enough that the
        # outlier share of the sparse budget is a chunk and the selection leaves chunks out
        return {"budget_tokens": max(8, seq_tokens // 6), "chunk_size": 4,
                "outlier_ratio": 0.5, "compress_above_tokens": seq_tokens // 2}

    def sparse_budget(self, basis_tokens: int | None) -> int:
        """S: tokens of the selected chunks per KV head and decode step (the official budget)."""
        if self.budget_ratio is None and self.budget_tokens is None:
            return self.sparse_budget_tokens
        return budget_for(basis_tokens, self.budget_ratio, self.budget_tokens)

    artefact_names = ("_inv_freq",)  # what `prepare` sets

    def prepare(self, ctx) -> dict:
        if ctx.rope_inv_freq is None:
            raise ConfigError("method=shadowkv: the model's RoPE is scaled in a way that cannot be "
                              "inverted exactly (or absent); pre-RoPE keys are unavailable")
        self._inv_freq = ctx.rope_inv_freq.float()
        return {"shadowkv_rank": self.rank_of(ctx.info)}

    def rank_of(self, info: ModelInfo) -> int:
        width = info.num_kv_heads * info.head_dim
        return min(width, self.rank if self.rank is not None else max(1, round(self.rank_ratio * width)))

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        if self._inv_freq is None:
            raise RuntimeError("shadowkv: call prepare(ctx) first (it needs the model's RoPE)")
        return ShadowKVLayer(layer_idx, info, self)


class ShadowKVLayer(SelectionLayer):
    """Exact until its prompt is compressed; then per decode step (methods/selection.py) one set
    of chunks per KV head: the outlier chunks (scored +inf), the top landmark chunks, and the
    local window (protected), rebuilt and fetched by `fetch`."""

    unforkable = "its values are on the host tier (a host store, transfers in flight)"

    def __init__(self, layer_idx: int, info: ModelInfo, method: ShadowKV):
        super().__init__(layer_idx, info, method)
        self.unit_tokens = method.chunk_size  # the template chooses chunks
        self.positions: torch.Tensor | None = None  # (T,) text positions of self.keys (exact rows)
        self.compressed = False
        # after compression (B = batch, H = H_kv):
        self.u: torch.Tensor | None = None  # (B, n_ctx, r) left factor, shared by the heads
        self.sv: torch.Tensor | None = None  # (B, H, r, D) diag(s) V^T per head
        self.ctx_positions: torch.Tensor | None = None  # (n_ctx,) positions of the chunked tokens
        self.landmarks: torch.Tensor | None = None  # (B, H, C, D) non-outlier chunk means
        self.landmark_chunks: torch.Tensor | None = None  # (B, H, C) their chunk ids
        self.outlier_rows: torch.Tensor | None = None  # (B, H, O*c) chunked-token rows of outliers
        self.outlier_keys: torch.Tensor | None = None  # (B, H, O*c, D) exact post-RoPE
        self.outlier_values: torch.Tensor | None = None  # (B, H, O*c, D)
        # the chunked tokens' values live in the layer's host store (`host_kv`, values only)
        # self.keys / self.values / self.positions then hold the exact local window
        self.grant_chunks = (0, 0)  # (selected, outlier) chunks per KV head, from the rule

    # --- cache seam ----------------------------------------------------------------------------
    def update(self, keys, values, position_ids):
        q_len = keys.shape[2]
        pos = (position_ids[0].to(keys.device) if position_ids is not None else
               torch.arange(self.seen_tokens, self.seen_tokens + q_len, device=keys.device))
        self.positions = pos if self.positions is None else torch.cat([self.positions, pos])
        local = super().update(keys, values, position_ids)
        if not self.compressed or q_len == 1:
            return local  # decode after compression: attend() builds the real set
        k_ctx, v_ctx = self._reconstruct(None)  # a later prompt chunk: dense over everything
        return torch.cat([k_ctx, local[0]], 2), torch.cat([v_ctx, local[1]], 2)

    def kept_tokens(self) -> int:
        ctx = 0 if self.ctx_positions is None else self.ctx_positions.numel()
        return ctx + super().kept_tokens()

    def mask_sizes(self, q_len: int) -> tuple[int, int]:
        """A decode step after compression: update returns the local window + the new token
        (attend then adds the outliers and the selected chunks itself, unmasked)."""
        if self.compressed and q_len == 1:
            local = super().kept_tokens()
            return local + q_len, self.seen_tokens - local
        return super().mask_sizes(q_len)

    def on_prefill_end(self) -> None:
        c = self.method.chunk_size
        if self.compressed or self.keys is None:
            return
        prompt = self.keys.shape[2]
        chunks = prompt // c - self.method.local_chunks
        if prompt <= self.method.compress_above_tokens or chunks < 1:
            return  # short prompts stay dense (official: compressed above 4096 tokens only)
        self._compress(chunks)

    def _compress(self, chunks: int) -> None:
        c, keys, values = self.method.chunk_size, self.keys, self.values
        b, h, n, d = keys.shape
        n_ctx = chunks * c
        inv_freq = self.method._inv_freq.to(keys.device)
        # pre-RoPE keys, exact inverse rotation in fp32; SVD over all heads jointly (official)
        pre = rotate(keys.float(), -self.positions.float(), inv_freq)  # (B, H, n, D)
        flat = pre.transpose(1, 2).reshape(b, n, h * d)
        u, s, vh = torch.linalg.svd(flat, full_matrices=False)
        r = min(self.method.rank_of(self.info), s.shape[-1])
        self.u = u[:, :n_ctx, :r].to(keys.dtype).contiguous()
        self.sv = (s[:, :r, None] * vh[:, :r]).view(b, r, h, d).transpose(1, 2).to(keys.dtype)
        self.ctx_positions = self.positions[:n_ctx]
        # landmarks and outliers from the post-RoPE keys of the chunked region
        ctx_k = keys[:, :, :n_ctx].float().view(b, h, chunks, c, d)
        means = ctx_k.mean(3)  # (B, H, chunks, D)
        badness = torch.nn.functional.cosine_similarity(means[:, :, :, None], ctx_k, dim=-1).amin(-1)
        sparse = self.method.sparse_budget(self.basis_tokens(n))
        outliers = min(chunks, int(self.method.outlier_ratio * sparse) // c)
        # the grant, from the rule: selected chunks and outlier chunks per KV head (the local
        # window and generated tokens come on top)
        self.grant_chunks = (min(chunks - outliers, sparse // c), outliers)
        order = badness.argsort(dim=-1, stable=True)  # lowest min-cos first
        out_chunks = order[..., :outliers].sort(-1).values
        rest = order[..., outliers:].sort(-1).values  # (B, H, C)
        self.landmark_chunks = rest
        self.landmarks = gather_tokens(means, rest).to(keys.dtype)
        self.outlier_rows = chunk_rows(out_chunks, c)
        self.outlier_keys = gather_tokens(keys, self.outlier_rows)
        self.outlier_values = gather_tokens(values, self.outlier_rows)
        if self.tier is None:
            raise RuntimeError("shadowkv: the layer has no tier (build it through the engine)")
        # written once, never grown: a buffer of exactly the chunked tokens
        self.host_kv(("values",), fitted_capacity).append(values[:, :, :n_ctx])
        self.keys, self.values = keys[:, :, n_ctx:].clone(), values[:, :, n_ctx:].clone()
        self.positions = self.positions[n_ctx:]
        self.compressed = True

    def _reconstruct(self, rows: torch.Tensor | None):
        """Keys rebuilt from the factors and rotated at their positions, and values fetched from
        the host: of `rows (B, H, n)` of the chunked region, or of all of it (outliers exact)."""
        (pending,) = self.host.fetch(rows)  # start the value copy first, rebuild keys meanwhile
        b, h = self.sv.shape[:2]
        if rows is None:
            u = self.u[:, None].expand(b, h, *self.u.shape[1:])  # (B, H, n_ctx, r)
            pos = self.ctx_positions
        else:
            u = gather_tokens(self.u[:, None].expand(b, h, *self.u.shape[1:]), rows)
            pos = self.ctx_positions[rows]
        keys = rotate(torch.matmul(u, self.sv), pos.float(), self.method._inv_freq)  # (B, H, n, D)
        values = pending.wait()
        if rows is None and self.outlier_rows.shape[2]:
            index = self.outlier_rows[..., None].expand_as(self.outlier_keys)
            keys = keys.scatter(2, index, self.outlier_keys)
        return keys, values

    # --- selection (methods/selection.py) ----------------------------------------------------
    def attends_densely(self, query: torch.Tensor) -> bool:
        return not self.compressed or query.shape[2] > 1

    def step_budget(self) -> int:
        """The grant (selected and outlier chunks, from the rule at the prompt's end) plus the
        local window, generated tokens included."""
        k, outliers = self.grant_chunks
        return (k + outliers) * self.unit_tokens + self.seen_tokens - self.ctx_positions.numel()

    def protected(self, budget: int, t: int) -> tuple[int, int]:
        return 0, t - self.ctx_positions.numel()  # the local window

    def selection_size(self, budget: int, t: int) -> int:
        return sum(self.grant_chunks)  # the outliers (+inf) and the k best landmark chunks

    def outlier_chunk_ids(self) -> torch.Tensor:
        return self.outlier_rows[..., ::self.unit_tokens] // self.unit_tokens  # (B, H, O)

    def selection_scores(self, query, keys, attention_mask, scaling) -> torch.Tensor:
        """`(B, H_kv, 1, U)` per chunk: softmax_j(scaling q . m_j) over the non-outlier landmarks
        per query head, max over the group's heads (the official GQA rule); outlier chunks +inf
        (always attended), the local window's -inf (protected)."""
        b, h_q, _, d = query.shape
        h = self.landmarks.shape[1]
        q = query[:, :, 0].float().view(b, h, h_q // h, d)
        probs = torch.softmax(q @ self.landmarks.float().transpose(2, 3) * scaling, -1).amax(2)
        units = -(-self.seen_tokens // self.unit_tokens)
        scores = torch.full((b, h, units), float("-inf"), device=query.device)
        scores.scatter_(2, self.landmark_chunks, probs)
        scores.scatter_(2, self.outlier_chunk_ids(), float("inf"))
        return scores[:, :, None]

    def fetch(self, keys, values, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of `slots`: the outliers' exact K/V (device), the selected chunks' keys
        rebuilt and values fetched from the host, then the local window (`keys`/`values`, as
        `update` returned it)."""
        b, h = slots.shape[:2]
        ctx = slots[..., : slots.shape[-1] - keys.shape[2]]  # (B, H, (k + O) c), ascending
        chunk_ids = self.outlier_chunk_ids()
        outlier = torch.zeros(b, h, self.landmark_chunks.shape[2] + chunk_ids.shape[2],
                              dtype=torch.bool, device=slots.device)
        outlier = outlier.scatter_(2, chunk_ids, True).gather(2, ctx // self.unit_tokens)
        rows = ctx[~outlier].view(b, h, -1)  # the selected chunks' rows
        parts_k, parts_v, held = [self.outlier_keys], [self.outlier_values], [self.outlier_rows]
        if rows.shape[-1]:
            sel_k, sel_v = self._reconstruct(rows)
            parts_k, parts_v, held = parts_k + [sel_k], parts_v + [sel_v], held + [rows]
        order = torch.cat(held, 2).argsort(dim=-1)  # into slots' (text) order
        ctx_k = gather_tokens(torch.cat(parts_k, 2), order)
        ctx_v = gather_tokens(torch.cat(parts_v, 2), order)
        return torch.cat([ctx_k, keys], 2), torch.cat([ctx_v, values], 2)

    def stats(self) -> dict[str, int]:
        if not self.compressed:
            return super().stats()
        device = [self.keys, self.values, self.u, self.sv, self.landmarks, self.landmark_chunks,
                  self.outlier_keys, self.outlier_values, self.outlier_rows]
        device_bytes = int(sum(t.nbytes for t in device))
        return {"kv_tokens": self.kept_tokens(), "kv_bytes": device_bytes + self.host.nbytes(),
                "kv_bytes_device": device_bytes, **self.selection_stats()}


def chunk_rows(chunks: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Token rows `(B, H, k * chunk_size)` of chunk ids `(B, H, k)`."""
    rows = chunks[..., None] * chunk_size + torch.arange(chunk_size, device=chunks.device)
    return rows.flatten(-2)
