"""Quest's decode step in plain torch, for the rows of a vLLM batch: no vLLM import, so the
harness's tests check it against methods/quest.py in the harness's own venv.

The rule is the harness's default Quest (methods/quest.py, the official accuracy path):
  * pages of `page_size` consecutive tokens of the request (a logical span: vLLM's blocks are
    multiples of 32 tokens, so one block holds several pages); per page, KV head and channel the
    min and max of the cached (post-RoPE) keys, a partial last page bounded by the tokens it holds;
  * per query head, each page scored by the upper bound U = sum_d max(q_d M_d, q_d m_d);
  * per query head, the top K = min(max(min_pages, min(t, B) // page_size), P) pages (t tokens
    held, P pages, B the token budget), the partial current page competing as one page;
  * exact softmax over the chosen pages' tokens.
The token budget B comes from the shared rule: `budget_tokens` when set, else
max(1, int(budget_ratio * prompt_tokens)) (runner.budget_basis=final: the length when the prompt
ends, fixed for the whole generation).

Shapes: R decode rows (one per request), H_q query heads, H_kv KV heads, D head size, T the
longest row's tokens (padded), P = ceil(T / page_size).
"""

from __future__ import annotations

import torch


def step_budget(prompt_tokens: torch.Tensor, budget_ratio: float | None,
                budget_tokens: int | None) -> torch.Tensor:
    """Tokens attended per head `(R,)` int64 for requests whose prompts had `prompt_tokens (R,)`
    tokens: the harness's budget rule over the final-length basis."""
    if budget_tokens is not None:
        return torch.full_like(prompt_tokens, int(budget_tokens), dtype=torch.int64)
    # int() truncates toward zero as the harness's budget_for does; float64 keeps 0.2 * 1000 = 200
    ratio = (float(budget_ratio) * prompt_tokens.to(torch.float64)).to(torch.int64)
    return ratio.clamp(min=1)


class PromptLengths:
    """Each running request's prompt length, which vLLM's attention metadata lacks, recorded from
    the batches themselves, keyed by the request's first block id (its own while it runs, with
    no prefix cache): a row still in prefill (computed tokens < prompt tokens) records where its
    chunk ends; the last chunk ends at the prompt's end. A block reused by a later request is
    recorded afresh by that request's prefill. (A preempted request recomputed in one chunk
    would record its generated tokens too: the harness sizes the scheduler so none is.)"""

    def __init__(self) -> None:
        self.by_first_block: dict[int, int] = {}

    def decode_rows(self, query_lens: list[int], seq_lens: list[int], prefilling: list[bool],
                    first_blocks: list[int]) -> tuple[list[int], list[int]]:
        """(the rows decoding one token, their prompts' lengths) of one batch, after recording
        the prefill rows' chunk ends."""
        rows, prompts = [], []
        for i, (q, s, pre, block) in enumerate(zip(query_lens, seq_lens, prefilling,
                                                   first_blocks)):
            if pre:
                self.by_first_block[block] = s
            elif q == 1 and block in self.by_first_block:
                rows.append(i)
                prompts.append(self.by_first_block[block])
        return rows, prompts


def page_counts(lengths: torch.Tensor, budgets: torch.Tensor, page_size: int,
                min_pages: int) -> torch.Tensor:
    """Pages each head of a row reads `(R,)`: min(max(min_pages, min(t, B) // page_size), P)."""
    pages = (lengths + page_size - 1) // page_size
    wanted = torch.minimum(lengths, budgets) // page_size
    return torch.minimum(wanted.clamp(min=min_pages), pages)


def cpu_cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major views `(num_blocks, H_kv, block_size, D)` of K and V in one layer's cache of
    vLLM 0.32's CPU attention, `kv_cache (num_blocks, H_kv, block_size, 2 * D)`: per block and KV
    head, block_size * D key elements stored channel-major (`[D][block_size]`, as its vec and
    vec16 kernels read them; `cpu_attn_reshape_and_cache` writes them so), then block_size * D
    value elements token-major (`[block_size][D]`). Views, no copy."""
    blocks, heads, block_size, two_d = kv_cache.shape
    d = two_d // 2
    regions = kv_cache.view(blocks, heads, 2, block_size * d)
    keys = regions[:, :, 0].view(blocks, heads, d, block_size).transpose(2, 3)
    return keys, regions[:, :, 1].view(blocks, heads, block_size, d)


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, tokens: int) -> torch.Tensor:
    """The first `tokens` rows of each request from a paged cache `(num_blocks, H_kv,
    block_size, D)` through its `block_table (R, max_blocks)`: `(R, H_kv, tokens, D)` (rows past
    a request's own length hold whatever its table's blocks hold: mask them)."""
    block_size = cache.shape[2]
    n_blocks = -(-tokens // block_size)
    blocks = cache[block_table[:, :n_blocks].long()]  # (R, n_blocks, H_kv, block_size, D)
    r, _, h, _, d = blocks.shape
    return blocks.transpose(1, 2).reshape(r, h, n_blocks * block_size, d)[:, :, :tokens]


def page_bounds(keys: torch.Tensor, lengths: torch.Tensor, page_size: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-page channel min and max `(R, H_kv, P, D)` of `keys (R, H_kv, T, D)` over each row's
    first `lengths (R,)` tokens, and which pages hold a token `(R, P)`."""
    r, h, t, d = keys.shape
    pad = -t % page_size
    pages = (t + pad) // page_size
    held = torch.arange(t + pad, device=keys.device)[None] < lengths[:, None]  # (R, T + pad)
    if pad:
        keys = torch.cat([keys, keys.new_zeros(r, h, pad, d)], 2)
    outside = ~held[:, None, :, None]
    low = keys.masked_fill(outside, float("inf")).view(r, h, pages, page_size, d).amin(3)
    high = keys.masked_fill(outside, float("-inf")).view(r, h, pages, page_size, d).amax(3)
    return low, high, held.view(r, pages, page_size).any(2)


def page_scores(query: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
                page_held: torch.Tensor) -> torch.Tensor:
    """Quest's bound per query head and page `(R, H_q, P)` fp32 (pages holding no token: -inf).
    `query (R, H_q, D)` unscaled, the bounds `(R, H_kv, P, D)`."""
    r, h_q, d = query.shape
    h_kv, pages = low.shape[1], low.shape[2]
    q = query.float().view(r, h_kv, h_q // h_kv, 1, d)  # the g heads of a KV head, stacked
    mn, mx = low.float()[:, :, None], high.float()[:, :, None]  # (R, H_kv, 1, P, D)
    bound = torch.maximum(q * mn, q * mx).sum(-1).view(r, h_q, pages)
    return bound.masked_fill(~page_held[:, None], float("-inf"))


def chosen_tokens(scores: torch.Tensor, counts: torch.Tensor, lengths: torch.Tensor,
                  page_size: int) -> torch.Tensor:
    """Which tokens each query head attends `(R, H_q, T)`: the tokens of its top `counts (R,)`
    pages by `scores (R, H_q, P)`, within the row's `lengths (R,)`."""
    r, h_q, pages = scores.shape
    k = int(counts.max())
    top = scores.topk(k, dim=-1).indices  # (R, H_q, k), best first
    in_count = torch.arange(k, device=scores.device)[None, None] < counts[:, None, None]
    keep_pages = torch.zeros(r, h_q, pages, dtype=torch.bool, device=scores.device)
    keep_pages.scatter_(-1, top, in_count.expand(r, h_q, k))
    keep = keep_pages.repeat_interleave(page_size, dim=-1)  # (R, H_q, P * page_size)
    t = int(lengths.max())
    held = torch.arange(t, device=scores.device)[None] < lengths[:, None]  # (R, T)
    return keep[..., :t] & held[:, None]


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Exact softmax attention of each query head over its kept tokens: `query (R, H_q, D)`,
    `keys`/`values (R, H_kv, T, D)`, `keep (R, H_q, T)` -> `(R, H_q, D)` in the query's dtype."""
    r, h_q, d = query.shape
    h_kv, t = keys.shape[1], keys.shape[2]
    g = h_q // h_kv
    rows = (query.float() * scale).view(r, h_kv, g, d)
    logits = torch.matmul(rows, keys.float().transpose(2, 3))  # (R, H_kv, g, T)
    logits.masked_fill_(~keep.view(r, h_kv, g, t), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.matmul(probs, values.float()).view(r, h_q, d).to(query.dtype)


def quest_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 lengths: torch.Tensor, budgets: torch.Tensor, scale: float, page_size: int,
                 min_pages: int) -> torch.Tensor:
    """One Quest decode step for R rows: `query (R, H_q, D)` (each row's newest token),
    `keys`/`values (R, H_kv, T, D)` (row i's first `lengths[i]` tokens real, its newest included),
    `budgets (R,)` tokens per head -> `(R, H_q, D)`."""
    low, high, page_held = page_bounds(keys, lengths, page_size)
    scores = page_scores(query, low, high, page_held)
    counts = page_counts(lengths, budgets, page_size, min_pages)
    keep = chosen_tokens(scores, counts, lengths, page_size)
    return attend(query, keys, values, keep, scale)
