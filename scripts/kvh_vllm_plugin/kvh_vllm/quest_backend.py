"""Quest at decode inside vLLM 0.32's CPU attention: a subclass of `CPUAttentionBackend` whose
metadata builder marks the decode rows of each batch with their token budget, and whose impl lets
vLLM's own kernel compute every row, then recomputes the decode rows of the sparse layers with
Quest (kvh_vllm.quest_math) over the request's keys read through its block table.

Why this shape:
  * prefill rows (and the dense layers) stay exactly vLLM's: the harness's Quest attends prompts
    densely too;
  * a Quest page is a logical span of `page_size` tokens of the request, computed from the keys
    every decode step: nothing is kept per block id, so block reuse after a request ends needs no
    bookkeeping (each step costs a read of the request's keys, as a dense step does);
  * the budget rule needs each request's prompt length, which the attention metadata lacks: the
    builder records it per request, keyed by the request's first block id, from the rows still
    in prefill (`is_prefilling`: computed tokens < prompt tokens; the last prefill chunk ends at
    the prompt's end). A first block is the request's own only without prefix caching, so the
    harness turns it off for this backend. A request preempted and recomputed would re-record a
    longer "prompt" (its generated tokens too): size the scheduler so none is (max_num_seqs
    requests of the longest length fit the KV space)
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from kvh_vllm import quest_math
from kvh_vllm.settings import QUEST_ENV, layer_index, quest_settings


@dataclass
class QuestCPUMetadata(CPUAttentionMetadata):
    # the batch rows decoding one token (request indices), their token index in the batch and
    # each one's budget (tokens per head); empty: no row is a Quest step
    decode_rows: torch.Tensor | None = None  # (R,) int64
    decode_tokens: torch.Tensor | None = None  # (R,) int64
    decode_budgets: torch.Tensor | None = None  # (R,) int64


class QuestCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings = quest_settings(os.environ.get(QUEST_ENV, ""))
        self.prompts = quest_math.PromptLengths()

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        rows, tokens, budgets = self._decode_rows(common_attn_metadata)
        base = {f.name: getattr(meta, f.name) for f in fields(CPUAttentionMetadata)}
        return QuestCPUMetadata(**base, decode_rows=rows, decode_tokens=tokens,
                                decode_budgets=budgets)

    def _decode_rows(self, common) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = common.num_reqs
        starts = common.query_start_loc_cpu[:n + 1].long()
        if common.is_prefilling is None:  # a builder call without it (a dummy run): all dense
            empty = torch.zeros(0, dtype=torch.int64)
            return empty, empty, empty
        rows, prompts = self.prompts.decode_rows(
            (starts[1:] - starts[:-1]).tolist(), common.seq_lens[:n].cpu().tolist(),
            common.is_prefilling[:n].cpu().bool().tolist(),
            common.block_table_tensor[:n, 0].cpu().tolist())
        rows_t = torch.tensor(rows, dtype=torch.int64)
        budgets = quest_math.step_budget(torch.tensor(prompts, dtype=torch.int64),
                                         self.settings.budget_ratio, self.settings.budget_tokens)
        return rows_t, starts[rows_t], budgets


class QuestCPUImpl(CPUAttentionBackendImpl):
    announced = False  # the first Quest step of this process is logged (the run's vllm.log)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings = quest_settings(os.environ.get(QUEST_ENV, ""))
        if self.is_fp8_kv_cache:
            raise ValueError("the kv-harness Quest backend reads the keys as stored: KV cache "
                             f"dtype {self.kv_cache_dtype} would need dequantizing (use auto)")
        self.layout_checked = False

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                              output_scale, output_block_scale)
        rows = getattr(attn_metadata, "decode_rows", None)
        if rows is None or rows.numel() == 0 or self.attn_type != "decoder":
            return out
        if layer_index(layer.layer_name) in self.settings.dense_layers:
            return out
        self._quest_rows(layer, query, key, kv_cache, attn_metadata, output)
        return out

    def _quest_rows(self, layer, query, key, kv_cache, meta, output) -> None:
        """Recompute the decode rows' outputs with Quest (vLLM's kernel already wrote them)."""
        key_cache, value_cache = quest_math.cpu_cache_views(kv_cache)
        rows, tokens = meta.decode_rows, meta.decode_tokens
        lengths = meta.seq_lens[rows].long()
        longest = int(lengths.max())
        table = meta.block_table[rows]
        keys = quest_math.gather_paged(key_cache, table, longest)  # (R, H_kv, T, D)
        values = quest_math.gather_paged(value_cache, table, longest)
        if not self.layout_checked:
            self.isa_seen = getattr(layer, "isa", None)
            self._check_layout(keys, key[tokens], lengths)
        q = query[tokens]  # (R, H_q, D)
        s = self.settings
        output[tokens] = quest_math.quest_decode(q, keys, values, lengths, meta.decode_budgets,
                                                 self.scale, s.page_size, s.min_pages)

    def _check_layout(self, keys, newest, lengths) -> None:
        """Once per layer: the newest token's key read back through the block table is the key
        vLLM just wrote (the cache layout is what this backend reads)."""
        read = keys[torch.arange(keys.shape[0]), :, lengths - 1]  # (R, H_kv, D)
        if not torch.equal(read, newest.to(read.dtype)):
            raise RuntimeError("kv-harness Quest backend: the keys read through the block table "
                               "are not the keys vLLM wrote (this attention ISA, "
                               f"{getattr(self, 'isa_seen', '?')}, stores another layout than "
                               "quest_math.cpu_cache_views reads)")
        if not QuestCPUImpl.announced:
            print(f"kv-harness Quest: first decode step in process {os.getpid()} ({keys.shape[0]} "
                  f"rows; the keys read through the block table are vLLM's)", file=sys.stderr,
                  flush=True)
            QuestCPUImpl.announced = True
        self.layout_checked = True


class QuestCPUBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[QuestCPUImpl]:
        return QuestCPUImpl

    @staticmethod
    def get_builder_cls() -> type[QuestCPUMetadataBuilder]:
        return QuestCPUMetadataBuilder
