"""What a method declares it can do (`Capabilities`: the runner refuses impossible combinations
before weights load; the engine reads it) and what a serving engine must offer it
(`ServingNeeds`): class-level declarations of every `KVMethod`."""

from __future__ import annotations

from dataclasses import dataclass

from kvcore.storage import KV_LAYOUTS

SERVING_UNITS = ("token", "page", "head", "layer")  # ServingNeeds.granularity


@dataclass(frozen=True)
class Capabilities:
    """What a method can do; the runner refuses impossible combinations before loading weights.
    Every field is read by those checks or by the engine; what only a serving engine would need
    is `ServingNeeds`, and what the code already says is derived (`needs_prompt`,
    `KVMethod.needs_prepare`, a `make_host_layer` of its own, `EvictionLayer.compress_at`)."""

    acts_during_decode: bool = True  # False: prefill-only compression
    needs_attn_scores: bool = False  # computes attention probabilities itself
    # Its layers attend a held prompt themselves, with probabilities
    # (methods.scoring.attention_with_probs), not through the model's attention: a sweep replays
    # the prompt's eager recording into it from the start, with the other such settings
    # (harness.sweep.replay.replay_prompts). Undeclared, the sweep finds out at the first
    # prompt (the model-attention replay diverges); declared wrongly, the replay diverges and
    # the setting prefills itself. Either way answers are the same; only time differs.
    eager_prompt_attention: bool = False
    modes: tuple[str, ...] = ("system",)  # subset of {"simulate", "system"}
    offloads_kv: bool = False  # keeps the full K/V on the slow tier (kvcore.offload)
    needs_rope: bool = False  # re-rotates keys (needs a rotary model)
    lookahead: bool = False  # wants prefetch(x_{i-1}) calls one layer ahead (InfiniGen, offload)
    compresses: bool = True  # False for the references (full, full_offload): never "inactive"
    # protocols it can honour (Protocol); "dense" alone: it compresses a prompt once it is over
    prefill_modes: tuple[str, ...] = ("dense", "sparse")
    sparse_prefill_chunked: bool = False  # honours prefill=sparse inside multi-token chunks
    # Attends to a subset of the tokens seen (eviction or selection). Refused on sliding-window
    # layers: the window already bounds the cache, and the model's window mask assumes the cache
    # holds the most recent tokens contiguously, so an evicted or selected set would be misplaced.
    selects_tokens: bool = False
    # Storage layouts of its K/V it honours (runner.kv_layout, kvcore.storage.KV_LAYOUTS): a
    # method storing K/V through the default layer storage (`KVLayer.kv_rows`: the `keys` /
    # `values` properties, or the scored-eviction template) and, on the host tier, through
    # `kvcore.offload.host_store` gets "paged" with no code of its own and declares it; one
    # keeping K/V in storage of its own (quantized codes, low-rank factors) does not.
    kv_layouts: tuple[str, ...] = ("contiguous",)
    # Wants `KVLayer.observe_attention_block(residual, attention_output)` at every forward: the
    # residual stream entering each decoder layer and its attention block's output
    # (SqueezeAttention).
    observes_attention_block: bool = False
    # Wants `KVLayer.observe_token_ids(ids)` before every forward: the forward's input ids, this
    # request's rows only (a batch: each sequence its own real ids, never padding) — for policies
    # on token identity (FastGen's special and punctuation tokens); the layers see K/V otherwise.
    needs_token_ids: bool = False
    # Honours runner.decode_interval_tokens: a once-per-prompt compressor whose scorer can run
    # again on a decoded cache, bringing it back to the budget every N generated tokens.
    recompresses_during_decode: bool = False

    @property
    def needs_prompt(self) -> bool:
        """Acts only over a prompt (compresses it once it is over): never on a token stream.
        Declared by honouring runner.prefill=dense alone (SnapKV, ShadowKV), or implied by
        acting only at the prompt's end."""
        return self.prefill_modes == ("dense",) or not self.acts_during_decode

    def __post_init__(self) -> None:
        unknown = set(self.kv_layouts) - set(KV_LAYOUTS)
        if unknown or "contiguous" not in self.kv_layouts:
            raise ValueError(f"Capabilities.kv_layouts={self.kv_layouts}: storage layouts, "
                             f"'contiguous' and any of {KV_LAYOUTS} (a model's cache format is "
                             "ModelInfo.cache_format)")


@dataclass(frozen=True)
class ServingNeeds:
    """What a serving engine (vLLM, SGLang) must offer a method beyond its `Capabilities`: no run
    depends on it; harness.report.methods_table derives the serving requirements (the README method
    table, each run's metrics.json) from both, and tests/harness/test_methods_table.py holds the
    cache and host-tier columns to what decoding does."""

    # decode steps may drop stored tokens (False: they keep every one and choose what to read)
    evicts_during_decode: bool = True
    granularity: str = "token"  # the unit it keeps, drops or selects (SERVING_UNITS)
    ragged_heads: bool = False  # KV heads of a layer hold different numbers of tokens
    needs_host_tier: bool = False  # part of its K/V always on the host tier
    # artefacts calibrated offline (a probe, calibration texts, the authors' files)
    needs_calibration: bool = False

    def __post_init__(self) -> None:
        if self.granularity not in SERVING_UNITS:
            raise ValueError(f"ServingNeeds.granularity={self.granularity!r}; allowed: "
                             f"{', '.join(SERVING_UNITS)}")
