"""InfiniGen's speculation rules (the official count rule, the current token ranked among the
candidates, the group reductions of our per-KV-head variant) and the partial key cache they
score against; methods/infinigen.py wires them into its layer."""

from __future__ import annotations

import functools
import math

import torch

from methods.scoring import SERIAL_ELEMENTS, gather_tokens


def count_tokens(scores: torch.Tensor, cap: int, alpha: float, shared_count: bool,
                 head0_threshold: bool, least: int = 1) -> torch.Tensor:
    """The official count rule on speculated logits `scores (B, H, T)` (H selecting heads) ->
    `counts (B, H)`: a head needs the tokens scoring above its max - alpha (`head0_threshold`:
    head 0's max for every head, the official Llama simulation's `torch.max(attn, -1)[0][0]`);
    with `shared_count` every head takes the floor of the mean count over heads (one gather
    size); counts are clamped to [least, cap]. Strict `>` (the official system; its simulation
    counts `>=`)."""
    top = scores.amax(-1, keepdim=True)
    if head0_threshold:
        top = top[:, :1].expand_as(top)
    count = (scores > top - alpha).sum(-1)  # (B, H)
    if shared_count:  # the official int(mean) over heads, one buffer size for all
        count = count.float().mean().floor().long().expand_as(count)
    return count.clamp(least, cap)


def select_tokens(scores: torch.Tensor, cap: int, alpha: float, shared_count: bool,
                  head0_threshold: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`count_tokens`, and each head's slots `(B, H, cap)` best first."""
    count = count_tokens(scores, cap, alpha, shared_count, head0_threshold)
    return scores.topk(cap, dim=-1).indices, count


def rank_current(stored: torch.Tensor, current: torch.Tensor, cap: int, alpha: float,
                 shared_count: bool, head0_threshold: bool, least: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The official rule with the current token among the candidates (`current_token=ranked`):
    speculated logits of the stored tokens `(B, H, T)` and of the current one `(B, H)` -> how
    many of each head's best stored tokens it attends `(B, H)` and whether it attends the
    current token `(B, H)` bool. n' is counted over the T + 1 tokens and the head takes its top
    n' of them: the current token when it ranks among them (ties go to stored tokens), plus
    n' - 1 stored; otherwise n' stored. With `least=0` a count may be 0 (neither)."""
    every = torch.cat([stored, current[..., None]], -1)  # (B, H, T + 1)
    count = count_tokens(every, cap, alpha, shared_count, head0_threshold, least)
    kept = (stored >= current[..., None]).sum(-1) < count  # the current token's rank < n'
    return count - kept.long(), kept


def group_scores(scores: torch.Tensor, how: str) -> torch.Tensor:
    """(B, H_kv, g, T) speculated logits -> (B, H_kv, T) one score per KV head by `how`: the
    max or mean logit, or the log of the group mean of softmax probabilities (`prob_mean`)."""
    if how == "max":
        if scores[:, :, 0].numel() <= SERIAL_ELEMENTS:  # g - 1 serial elementwise maxima
            # cost less than one parallel reduction over the middle axis (a decode step)
            return functools.reduce(torch.maximum, scores.unbind(2))
        return scores.amax(2)
    if how == "mean":
        return scores.mean(2)
    # log of the group mean of softmax probabilities (the oracle's criterion)
    log_probs = scores - scores.logsumexp(-1, keepdim=True)
    return log_probs.logsumexp(2) - math.log(scores.shape[2])


class PartialKeys:
    """Layer i's partial keys K A[:, cols] `(B, H_s, k_u, T)` on the compute device,
    channel-major (a step's scores run along contiguous tokens: one q row x a (k_u, T) block),
    grown in place with amortised growth."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None  # (B, H_s, k_u, capacity)
        self.length = 0

    def view(self) -> torch.Tensor:
        return self.buffer[..., : self.length]

    def append(self, part: torch.Tensor) -> None:
        """Add the new tokens' partial keys `part (B, H_s, t, k_u)`."""
        b, h, t, width = part.shape
        if self.buffer is None or self.length + t > self.buffer.shape[3]:
            grown = part.new_empty(b, h, width, max(256, 2 * (self.length + t)))
            if self.buffer is not None:
                grown[..., : self.length] = self.view()
            self.buffer = grown
        self.buffer[..., self.length:self.length + t] = part.transpose(2, 3)
        self.length += t

    def keep(self, index: torch.Tensor) -> None:
        """Keep the tokens `index (B, H_kv, n)` (per KV head: repeated to its skewing heads)."""
        if self.buffer is None:
            return
        per_head = index.to(self.buffer.device).repeat_interleave(
            self.buffer.shape[1] // index.shape[1], 1)
        kept = gather_tokens(self.view().transpose(2, 3), per_head)  # (B, H_s, n, k_u)
        self.buffer[..., : index.shape[-1]] = kept.transpose(2, 3)
        self.length = index.shape[-1]

    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.view().nbytes
