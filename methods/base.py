"""The KV method interface: a method is hyperparameters + a factory of per-layer cache objects.

* `KVMethod` holds hyperparameters and prepared artefacts only; it is read-only during a run.
* `KVLayer` holds the per-request, per-layer state (the kept K/V and whatever a method needs).
  It never imports transformers: `harness.hf_adapter` bridges it to the model's cache and
  attention seams, so a method file stays plain torch.

Shapes: keys/values `(B, H_kv, T, D)`, query `(B, H_q, q_len, D)`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch

from kvcore.errors import ConfigError
from kvcore.storage import KV_LAYOUTS, ContiguousRows, HeadBlocks, Rows, grown_capacity
from methods._sidefiles import empty_path_reasons, path_kind_reasons
from methods.kernels import ragged_attention, ragged_attention_cpu
from methods.scoring import plain_attention, plain_decode_row

AttentionFn = Callable[..., tuple[torch.Tensor, Any]]
SERVING_UNITS = ("token", "page", "head", "layer")  # ServingNeeds.granularity


@dataclass(frozen=True)
class Capabilities:
    """What a method can do; the runner refuses impossible combinations before loading weights.
    Every field is read by those checks or by the engine; what only a serving engine would need
    is `ServingNeeds`, and what the code already says is derived (`needs_prompt`,
    `KVMethod.needs_prepare`, a `make_host_layer` of its own, `EvictionLayer.compress_at`)."""

    acts_during_decode: bool = True  # False: prefill-only compression
    needs_attn_scores: bool = False  # computes attention probabilities itself
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
    depends on it; harness.methods_table derives the serving requirements (the README method
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

# official code: read in (and checked against) the authors' repository; paper: from the paper
# alone (no code released); reconstruction: neither gives the method as a runnable rule (ours fills
# the gaps, named in its docstring); reference: the harness's own baselines and bounds.
PROVENANCES = ("official code", "paper", "reconstruction", "reference")
PREFILL_MODES = ("dense", "chunked", "sparse")
BUDGET_BASES = ("final", "seen")
# When a method may compress a prompt, per prefill mode (Protocol.prefill; metrics.json records it).
COMPRESSION_TIMING = {
    "dense": "prompt attended in full and compressed once, when it ends; decode steps per method",
    "chunked": "compressed after every prefill chunk (memory-bounded; chunk size in the protocol)",
    "sparse": "every prompt row attends under the budget, as a decode step would",
}


def compression_timing(protocol: "Protocol") -> str:
    """When a method may compress under `protocol`, as metrics.json records it."""
    timing = COMPRESSION_TIMING[protocol.prefill]
    if protocol.decode_interval_tokens is not None:
        timing += (f"; then every {protocol.decode_interval_tokens} tokens after the prompt, "
                   "brought back to the budget by the method's own scorer")
    return timing


# RoPE variants whose rotation by delta positions is `delta * inv_freq` with unit attention
# scaling, so stored keys can be re-rotated (methods.rope); yarn/longrope scale cos/sin and
# dynamic changes the frequencies with the length.
REROTATABLE_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Protocol:
    """How every method of a comparison is run (runner.*), the same for all of them.

    dense_layers: layers left uncompressed (the full cache, attended in full) for every method;
        the effective set also holds a method's own structural dense layers (`own_dense_layers`).
    prefill: when a method may compress a prompt, whatever `runner.prefill_chunk_tokens` is:
        "dense" (default) = the whole prompt is attended in full and every method compresses it
        once, when it ends (the official TOVA, SnapKV, DuoAttention and kvpress protocol); decode
        steps then act as the method says. "chunked" = memory-bounded prefill: a method that
        compresses during a prompt does so after every chunk of `prefill_chunk_tokens` (the
        chunk size is then part of the protocol). "sparse" = every prompt row attends under the
        method's budget, exactly as a decode step would (the engine feeds the prompt one token
        at a time unless the method declares `Capabilities.sparse_prefill_chunked`).
    budget_basis: what a ratio budget (`budget_ratio`) is a fraction of: "final" (default) = the
        sequence's final length, fixed from the start (a prompt's length for prompt tasks, the
        whole scored text for a stream): what papers mean by "a 20 % KV budget" (InfiniGen's
        mask simulation, Quest, TailorKV, kvpress); nothing is evicted or skipped until that many
        tokens are held. "seen" = a fraction of the tokens seen so far, from the first token.
        `budget_tokens` is absolute under both.
    decode_interval_tokens: None (default) = a once-per-prompt compressor keeps every generated
        token; N = every N tokens fed after the prompt's end, its cache is brought back to its
        budget by its own scorer (kvpress's DecodingPress), so it never holds more than the
        budget plus N (methods declaring `Capabilities.recompresses_during_decode`).
    """

    dense_layers: tuple[int, ...] = ()
    prefill: str = "dense"
    budget_basis: str = "final"
    decode_interval_tokens: int | None = None


@dataclass(frozen=True)
class ModelInfo:
    """What a method may know about the model, available before weights load."""

    num_layers: int
    num_heads: int  # query heads H_q
    num_kv_heads: int  # H_kv
    head_dim: int  # D
    max_positions: int
    dtype: torch.dtype = torch.float32
    rope_theta: float | None = None  # None: the model has no RoPE
    model_type: str = "llama"
    rope_type: str = "default"  # transformers' rope_type (default, linear, llama3, yarn, ...)
    rotary_ratio: float = 1.0  # share of head_dim that RoPE rotates (partial_rotary_factor)
    sliding_window_tokens: int | None = None  # the window of the sliding-window layers
    sliding_window_layers: tuple[int, ...] = ()  # layers whose attention is masked to the window
    # "heads": K and V of shape (B, H_kv, T, D) per layer; "latent": multi-head latent attention
    # (DeepSeek-V2/V3), whose cache holds what its attention chooses (transformers 5.24: the
    # no-RoPE key part per head and the shared RoPE key part), not K and V heads.
    cache_format: str = "heads"
    # Attention-score tweaks our attention seams do not reproduce (Gemma-2's logit soft-capping):
    # such models are refused, never served wrong.
    attention_quirks: tuple[str, ...] = ()

    @property
    def group_size(self) -> int:
        """Query heads per KV head (g = H_q / H_kv)."""
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of K and V for one token over all layers, in `dtype` (default: the model's)."""
        itemsize = torch.empty((), dtype=dtype or self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


@dataclass
class PrepareContext:
    """Everything a method's offline `prepare` may use, built by the runner (harness.hf_adapter).

    A method file never loads models or touches transformers; what it needs of the loaded model
    arrives here as plain tensors and callables.
    """

    info: ModelInfo
    tokenizer: Any | None  # None for models built in code (tests)
    device: torch.device
    fingerprint: str  # identifies the config and weights (artefact cache keys)
    rope_inv_freq: torch.Tensor | None  # (D/2,) fp32, the model's own (scaled) frequencies
    # (layer, x (B, T, hidden)) -> pre-RoPE queries (B, H_q, T, D), bias included
    project_query: Callable[[int, torch.Tensor], torch.Tensor]
    # one forward of ids (T,) through fresh layers of `method` (bound like any request), at
    # positions start.. (the optional third argument, default 0); returns the layers. Also
    # callable during a request (bindings nest): KVzip's reconstruction forward over its cache
    capture: Callable[..., list["KVLayer"]]
    vocab_size: int  # ids a method may draw at random: the tokenizer's (embedding rows if none)
    data_dir: Path | None = None  # the shared data folder (default calibration texts), if present
    cache_dir: Path | None = None  # root for cached artefacts (None: ~/.cache/kv-harness)
    calibration_ids: torch.Tensor | None = None  # benchmarks may hand calibration tokens directly
    # the loaded model's hub id or folder (transformers' `_name_or_path`), for methods whose
    # authors ship per-model artefacts (TailorKV's layer lists); None for models built in code
    model_id: str | None = None


class KVLayer:
    """Per-request, per-layer KV state. It stores everything (the full cache), `update` returns
    the stored K/V as tensors and `attend` calls the model's attention: the base every method's
    layer extends. A method's default layer is `FullLayer` (the same storage, decode rows read
    in place).

    Contract (checked by tests on eager attention and chunked prefill):
      * `seen_tokens` counts every token ever given to `update` (positions never depend on how
        many were evicted);
      * `mask_sizes(q_len)` is called before `update` and describes what `update` will return:
        `(kept + q_len, seen - kept)`;
      * `update()` returns the K/V to attend over this step (kept + new).
    """

    def __init__(self, layer_idx: int, info: ModelInfo):
        self.layer_idx = layer_idx
        self.info = info
        self.seen_tokens = 0
        # K and V as `Rows` (kvcore.storage), created at the first write in the run's layout
        # (runner.kv_layout, via the tier): a decode step writes its row in place instead of
        # concatenating (copying) the whole cache. See `keys` / `values`.
        self._kv: dict[str, Rows] = {}
        # The request's context, set once by the cache that builds its layers
        # (harness.hf_adapter.MethodCache) right after `make_layer`, whose signature a method
        # keeps free of it: the request's kvcore.offload.Tier (placement, ledger, side stream),
        # the run's Protocol, and the following layer (built after this one).
        self.tier = None
        self.protocol = Protocol()
        self.next_layer: KVLayer | None = None
        # Per-prompt state, set by harness.prompting.open_prompt / close_prompt: a prompt is
        # being fed, and the length a ratio budget is a fraction of (budget_basis="final").
        self.prompt_open = False
        self.final_tokens: int | None = None

    # --- protocol (read by every method alike) ------------------------------------------------
    def holding_prompt(self) -> bool:
        """True while a prompt is fed under `runner.prefill=dense`: it is held and attended in
        full, and compressed once, at `on_prefill_end` (never after a prefill chunk)."""
        return self.prompt_open and self.protocol.prefill == "dense"

    def basis_tokens(self, seen: int | None = None) -> int | None:
        """The length a ratio budget is a fraction of now (Protocol.budget_basis): the
        sequence's final length ("final", set by the engine; None until a prompt is fed or a
        stream declares it), or the tokens seen ("seen"; `seen` overrides `seen_tokens` for a
        layer sizing a step before its update). Pass it to `budget_for`."""
        if self.protocol.budget_basis == "seen":
            return self.seen_tokens if seen is None else seen
        return self.final_tokens

    # --- stored K/V (the default storage; subclasses read and assign these) -------------------
    def kv_rows(self, name: str, growth: Callable[[int, int], int] = grown_capacity) -> Rows:
        """The storage of `name` ("keys", "values"), created in the run's layout on first use:
        paged when the tier carries block pools (runner.kv_layout=paged), else contiguous with
        `growth` sizing its buffer."""
        rows = self._kv.get(name)
        if rows is None:
            paged = getattr(self.tier, "paged", None)
            rows = paged.rows(self.layer_idx, name) if paged is not None else ContiguousRows(growth)
            self._kv[name] = rows
        return rows

    @property
    def keys(self) -> torch.Tensor | None:
        """The stored keys `(B, H_kv, T, D)`: contiguous layout: a view of the valid rows of the
        buffer (writes to it are stored); paged: a gather of the blocks into a fresh tensor
        (read-only; write through `kv_rows("keys").write_at`). Assigning replaces the content:
        contiguous: the tensor becomes the buffer (no copy); paged: blocks beyond its length
        are freed and the rest rewritten."""
        rows = self._kv.get("keys")
        return None if rows is None else rows.view()

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self.kv_rows("keys").assign(tensor)

    @property
    def values(self) -> torch.Tensor | None:
        """The stored values `(B, H_kv, T, D)` (as `keys`)."""
        rows = self._kv.get("values")
        return None if rows is None else rows.view()

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self.kv_rows("values").assign(tensor)

    def storage_stats(self) -> dict[str, int]:
        """The K/V storage's figures for the waste accounting (harness.accounting):
        `kv_bytes_used` (valid tokens) and `kv_bytes_allocated` (with the unused capacity or
        block slots); empty without stored K/V."""
        if not self._kv:
            return {}
        return {"kv_bytes_used": sum(rows.used_bytes() for rows in self._kv.values()),
                "kv_bytes_allocated": sum(rows.allocated_bytes() for rows in self._kv.values())}

    def release(self) -> None:
        """Give the storage back (paged: blocks return to the pool); called when a request ends."""
        for rows in self._kv.values():
            rows.release()

    # --- cache seam -------------------------------------------------------------------------
    def update(self, keys: torch.Tensor, values: torch.Tensor, position_ids: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new K/V `(B, H_kv, q_len, D)` and return what attention sees this step."""
        self.append_kv(keys, values)
        return self.keys, self.values

    def append_kv(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append the new K/V `(B, H_kv, q_len, D)` to the stored rows (ragged rows: after each
        head's own tokens) and count them as seen."""
        self.seen_tokens += keys.shape[-2]
        self.kv_rows("keys").append(keys)
        self.kv_rows("values").append(values)

    def kept_tokens(self) -> int:
        """Tokens stored now (before the next update)."""
        rows = self._kv.get("keys")
        return 0 if rows is None else rows.length

    def mask_sizes(self, q_len: int) -> tuple[int, int]:
        kept = self.kept_tokens()
        return kept + q_len, self.seen_tokens - kept

    def prefetch(self, hidden_states: torch.Tensor, position_ids: torch.Tensor | None,
                 ahead: bool) -> None:
        """Called before this layer's attention (`ahead=False`, with this layer's input) and one
        layer earlier (`ahead=True`, with the previous layer's attention input x_{i-1}), so a
        method can speculate and start moving K/V while the previous layer still computes.
        Only called for methods with `lookahead` or when the runner offloads the KV."""

    def observe_attention_block(self, residual: torch.Tensor,
                                attention_output: torch.Tensor) -> None:
        """Called after this layer's attention block at every forward, for methods declaring
        `observes_attention_block`: `residual` is the decoder layer's input (the residual stream
        before its norm) and `attention_output` what the attention block adds to it (after the
        output projection), both `(B, q_len, hidden)`."""

    def observe_token_ids(self, ids: torch.Tensor) -> None:
        """Called before every forward for methods declaring `needs_token_ids`: the ids `(B, q)`
        whose K/V this layer's next `update` receives (a prefill chunk, a decode step; in a batch,
        this sequence's real ids only, so `q` is its own count)."""

    def attended_tokens(self) -> int:
        """Tokens the last decode step attended to (for the density / relative-KV-size figure)."""
        return self.kept_tokens()

    def after_forward(self) -> None:
        """Called by the engine after every model forward: evict here (attention has run), unless
        `holding_prompt()` (the prompt is compressed once, at `on_prefill_end`)."""

    def score_prompt(self) -> None:
        """Called for every layer, in order, once a prompt has been fed in full and before any
        `on_prefill_end`: the prompt's-end work that reads no prompt-end knob
        (`KVMethod.prompt_end_knobs`), such as KVzip's reconstruction scores. A sweep calls it
        once for the settings sharing a prompt state and hands each its copy, so it must leave
        that state equal for all of them (recompute in `on_prefill_end` what a knob changes);
        called again, it does nothing."""

    def on_prefill_end(self) -> None:
        """Called once after each prompt has been fed in full (whatever the chunking), before the
        first decode step: every method that compresses a prompt does it here under
        `runner.prefill=dense` (`holding_prompt()` was true for the prompt's forwards)."""

    def kept_positions(self) -> torch.Tensor:
        """Text positions of the tokens attention used at the last step, `(B, H_kv, T)` (or (T,)).

        Non-evicting layers keep every position; eviction/selection methods override this.
        """
        return torch.arange(self.kept_tokens())

    # --- attention seam ---------------------------------------------------------------------
    def attend(self, module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               attention_mask: torch.Tensor | None, base: AttentionFn, **kwargs):
        """Attention over what `update` returned; `base` is the model's own attention function."""
        return base(module, query, keys, values, attention_mask, **kwargs)

    # --- accounting -------------------------------------------------------------------------
    def allowed_tokens(self) -> int | None:
        """Most tokens this layer may hold (or, for selection methods, attend) now under the
        method's budget; None: unbounded. Checked by the engine after every forward."""
        return None

    def facts(self) -> dict[str, float]:
        """What this layer's method chose for the request, as numbers to sum (e.g. FastGen's
        heads per policy), read when the request ends: summed over the request's layers, then
        averaged over requests into metrics.json `kv.method_facts` (harness.accounting)."""
        return {}

    def stats(self) -> dict[str, int]:
        """Tokens and bytes really held by this layer now (per KV head, tokens are the max).

        Selection methods (which keep everything but attend to a subset) add `selected_tokens`:
        the most tokens attended at one step; the budget is then checked against it. Methods
        holding part of their state on the host tier add `kv_bytes_device` (the compute-device
        share of `kv_bytes`). `kv_bytes` counts the valid tokens only; layers storing K/V in
        `Rows` add `storage_stats()`: `kv_bytes_used` and `kv_bytes_allocated` (including unused
        capacity or block slots).
        """
        storage = self.storage_stats()
        keys = self._kv.get("keys")
        return {"kv_tokens": 0 if keys is None else keys.length,
                "kv_bytes": storage.get("kv_bytes_used", 0),
                "kv_bytes_used": 0, "kv_bytes_allocated": 0, **storage}


class FullLayer(KVLayer):
    """The full cache, the default layer (`KVMethod.make_layer` / `make_dense_layer`): KVLayer's
    storage, with decode steps that attend over the stored rows where they are
    (`Rows.in_place`: the contiguous buffer, or the paged blocks through per-head block tables —
    no gather), one methods.kernels.ragged_attention call per layer and step: the C kernel on CPU
    (fp32, both layouts, so paged and contiguous give the same bits), Triton on CUDA for the paged
    layout (contiguous keeps SDPA's fused kernels there). Everything else — prefill chunks, masked
    or non-plain calls (sliding windows, soft-capping, eager's explicit mask), dtypes or devices
    no kernel serves — takes `base` over `keys` / `values`, as KVLayer does.

    `update` then returns `kvcore.storage.HeadBlocks` instead of tensors (only this class's
    `attend` receives them; subclasses of KVLayer keep getting tensors)."""

    def update(self, keys, values, position_ids):
        self.append_kv(keys, values)
        if keys.shape[-2] == 1 and self.reads_in_place(keys):
            blocks = self._kv["keys"].in_place(), self._kv["values"].in_place()
            if None not in blocks:
                return blocks
        return self.keys, self.values

    def reads_in_place(self, keys: torch.Tensor) -> bool:
        """Whether this decode step's attention reads the rows in place (see the class)."""
        if self.layer_idx in self.info.sliding_window_layers:  # the window mask: base
            return False
        if keys.device.type == "cpu":
            return keys.dtype == torch.float32 and ragged_attention_cpu.library() is not None
        return keys.is_cuda and getattr(self.tier, "paged", None) is not None

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        if isinstance(keys, HeadBlocks) and not plain_decode_row(query, attention_mask, kwargs):
            keys, values = self.keys, self.values  # a masked or non-plain call: the tensors
        return exact_attention(module, query, keys, values, attention_mask, base, **kwargs)


def exact_attention(module, query: torch.Tensor, keys, values, attention_mask, base: AttentionFn,
                    **kwargs):
    """The full cache's attention, one arithmetic for every layer that attends to everything it
    holds (FullLayer, the host-tier full cache, a lossless method's exact path), so they give
    the same bits.

    `keys`/`values` are `(B, H_kv, T, D)` tensors or rows read in place (`HeadBlocks`, ragged or
    not). Rows in place always go through methods.kernels.ragged_attention: causal attention per
    head over its own tokens (the chunk's q tokens last; the model's mask for a sequence alone
    is that causal mask, rebuilt per head), plain calls only (no window, soft-capping, sinks:
    ValueError). Tensors: a plain decode row (`methods.scoring.plain_decode_row`) in fp32 on the
    CPU goes through the same kernel when it is built; anything else through `base`."""
    blocks = isinstance(keys, HeadBlocks)
    if blocks and not plain_attention(kwargs):
        raise ValueError("rows read in place attend with plain causal attention only (no "
                         "sliding window, soft-capping or sinks); pass tensors to the model's")
    if blocks or (plain_decode_row(query, attention_mask, kwargs) and keys.device.type == "cpu"
                  and keys.dtype == values.dtype == torch.float32
                  and ragged_attention_cpu.library() is not None):
        if not blocks:
            keys, values = HeadBlocks.of(keys), HeadBlocks.of(values)
        scaling = kwargs.get("scaling")
        scaling = module.scaling if scaling is None else scaling
        return ragged_attention.ragged_attention(query, keys, values, scaling), None
    return base(module, query, keys, values, attention_mask, **kwargs)


@dataclass(kw_only=True)
class KVMethod:
    """Hyperparameters + prepared artefacts; per-request state lives in `KVLayer`s.

    Subclasses are dataclasses whose fields are exactly the keys of `conf/method/<name>.yaml`
    (plus `name`), each with its unit in the name (`*_tokens`, `*_ratio`, `*_bits`).
    """

    name: ClassVar[str]
    # Where its behaviour comes from (PROVENANCES) and the setting its defaults are meant for (the
    # authors' models, contexts and budgets, with the source): shown in metrics.json, the report
    # and --help, so a number is read as what it is.
    provenance: ClassVar[str]
    operating_point: ClassVar[str]
    # Its line in the README method table (harness.methods_table): the family, one sentence of
    # mechanism, the paper and the authors' code (None: none released, or the harness's own).
    family: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    paper_url: ClassVar[str | None] = None
    code_url: ClassVar[str | None] = None
    # what the runner checks and the engine reads; what a serving engine must offer it
    capabilities: ClassVar[Capabilities] = Capabilities()
    serving_needs: ClassVar[ServingNeeds] = ServingNeeds()
    # Which knobs move the method along a size axis, and which name a separate variant (curve):
    # recorded in metrics.json so reports and gates never name a method's knobs themselves.
    axis_keys: ClassVar[tuple[str, ...]] = ("budget_ratio", "budget_tokens")
    variant_keys: ClassVar[tuple[str, ...]] = ()
    # Knobs that by design change nothing in a short compressing run, each with the reason
    # (tests/methods/contract/test_every_knob_acts.py holds every other knob to changing the
    # outputs).
    inert_knobs: ClassVar[dict[str, str]] = {}
    # Knob settings under which the same rule runs through other code (a fused kernel serving
    # only them): the shared contract runs each beside the defaults, so every path is checked.
    path_variants: ClassVar[tuple[dict[str, Any], ...]] = ()
    # Knobs its layers read from the prompt's end on only: under runner.prefill=dense they change
    # nothing a layer records while a prompt is fed, so a sweep's settings that differ only in
    # them share one prefill of each prompt (harness.sweep_engine). Declare a knob only when
    # its layers neither read it nor keep anything derived from it before `on_prefill_end`.
    prompt_end_knobs: ClassVar[tuple[str, ...]] = ()
    # The knobs its `prepare` reads, where preparing is costly (a calibration forward): a sweep's
    # settings of this method equal in them are prepared once, the others take its artefacts
    # (harness.session; tests/methods/contract/test_prepare_knobs.py holds every other knob to
    # changing nothing `prepare` makes). None: each setting prepares itself.
    prepare_knobs: ClassVar[tuple[str, ...] | None] = None

    def __post_init__(self) -> None:
        for reason in seed_reasons(self) + self.check_hyperparameters():
            raise ConfigError(reason)

    @classmethod
    def hyperparameter_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def lossless_hyperparameters(cls, seq_tokens: int) -> dict[str, Any]:
        """Hyperparameters under which this method must equal the full cache exactly for
        sequences of up to `seq_tokens` tokens (budget >= length). Checked for every method by
        tests/methods/contract/test_contract.py."""
        return {}

    @classmethod
    def compressing_hyperparameters(cls, seq_tokens: int) -> dict[str, Any]:
        """Hyperparameters under which this method really compresses a sequence of `seq_tokens`
        tokens (well below the length), for the contract test's compressing case. Default: the
        shared budget knob at about a sixth of the sequence; a method without one overrides this
        (or compresses under its defaults)."""
        names = cls.hyperparameter_names()
        if "budget_tokens" in names:
            return {"budget_tokens": max(4, seq_tokens // 6)}
        if "budget_ratio" in names:
            return {"budget_ratio": 0.2}
        return {}

    def hyperparameters(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def provenance_label(self) -> str:
        """`provenance` for this configuration (a knob may turn an official method into our
        reconstruction, e.g. DuoAttention's probe heads instead of its learned gates)."""
        return self.provenance

    def check_hyperparameters(self) -> list[str]:
        """Reasons the hyperparameters alone are invalid, each naming its key (`method.x`)."""
        return []

    def validate(self, info: ModelInfo, runner: dict[str, Any]) -> list[str]:
        """Reasons this method cannot run on this model/runner combination (before weights load)."""
        reasons = []
        if runner.get("kv_offload", "none") == "cpu" and not self.capabilities.offloads_kv:
            reasons.append(f"runner.kv_offload=cpu but method={self.name} cannot keep its KV on the "
                           "host tier (it does not declare offloads_kv); use runner.kv_offload=none")
        reasons += self.layout_reasons(runner)
        if runner.get("kv_admission", "request") == "layerkv" and \
                type(self).make_host_layer is KVMethod.make_host_layer:
            reasons.append(f"runner.kv_admission=layerkv but method={self.name} cannot place a "
                           "whole layer on the host tier (it has no make_host_layer; full "
                           "has); use runner.kv_admission=request")
        mode = getattr(self, "mode", None)
        if mode is not None and mode not in self.capabilities.modes:
            reasons.append(f"method.mode={mode!r}; allowed for {self.name}: "
                           f"{', '.join(self.capabilities.modes)}")
        return (reasons + empty_path_reasons(self) + path_kind_reasons(self)
                + position_knob_reasons(self, info)
                + self.architecture_reasons(info))

    def layout_reasons(self, runner: dict[str, Any]) -> list[str]:
        """Reasons this configuration cannot store its K/V in runner.kv_layout."""
        layout = runner.get("kv_layout", "contiguous")
        if layout == "contiguous":
            return []
        if layout not in self.capabilities.kv_layouts:
            return [f"runner.kv_layout={layout} but method={self.name} keeps its K/V in storage "
                    f"of its own (allowed: {', '.join(self.capabilities.kv_layouts)})"]
        return []

    def architecture_reasons(self, info: ModelInfo) -> list[str]:
        """Reasons this model's architecture cannot be served, from capabilities alone."""
        caps, model = self.capabilities, info.model_type
        if info.cache_format != "heads":  # every layer holds K/V heads (B, H_kv, T, D)
            return [f"method={self.name} needs per-head K/V caches (B, H_kv, T, D); {model} "
                    f"caches a {info.cache_format!r} format (multi-head latent attention)"]
        if info.attention_quirks:
            return [f"{model} uses {', '.join(info.attention_quirks)}, which the harness's "
                    "attention seams do not reproduce yet: refused rather than served wrong"]
        reasons = []
        if self.needs_rope():
            if info.rope_theta is None:
                reasons.append(f"method={self.name} applies RoPE itself and needs a RoPE model; "
                               f"{model} has none")
            elif info.rope_type not in REROTATABLE_ROPE_TYPES or info.rotary_ratio != 1:
                reasons.append(f"method={self.name} applies plain RoPE over the whole head itself; "
                               f"{model} uses rope_type={info.rope_type} on "
                               f"{info.rotary_ratio:g} of each head (allowed: "
                               f"{', '.join(REROTATABLE_ROPE_TYPES)} on the whole head)")
        if caps.selects_tokens and info.sliding_window_layers:
            reasons.append(f"method={self.name} evicts or selects tokens, but {model} has "
                           f"sliding-window attention ({info.sliding_window_tokens} tokens on "
                           f"{len(info.sliding_window_layers)} of {info.num_layers} layers): the "
                           "window already bounds those caches and its mask assumes the most "
                           "recent tokens, contiguous")
        return reasons

    def needs_rope(self) -> bool:
        """True when this configuration rotates keys or queries itself (re-rotation, speculation)."""
        return self.capabilities.needs_rope

    def bounds_positions(self) -> bool:
        """True when attention runs at in-cache positions, so a stream may outrun max positions
        (StreamingLLM re-rotating its keys)."""
        return False

    def prepare_key(self) -> str | None:
        """Settings with equal keys get the same artefacts and facts from `prepare`; None: this
        method does not say which knobs its `prepare` reads (`prepare_knobs`)."""
        if self.prepare_knobs is None:
            return None
        import json

        knobs = {k: getattr(self, k) for k in self.prepare_knobs}
        return json.dumps([self.name, knobs], sort_keys=True, default=str)

    def needs_prepare(self) -> bool:
        """True when this configuration has an offline step (its own `prepare`): the runner
        builds a PrepareContext and calls it only then."""
        return type(self).prepare is not KVMethod.prepare

    def prepare(self, ctx: PrepareContext) -> dict[str, Any]:
        """Offline step (idempotent; may cache artefacts on disk). Returns facts for metrics.json."""
        return {}

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        """A fresh per-request state object for one decoder layer (default: the full cache)."""
        return FullLayer(layer_idx, info)

    def make_host_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        """The per-request state of a layer placed whole on the host tier by the serving
        scheduler (LayerKV, runner.kv_admission=layerkv) and fetched whole at every step, with the
        same outputs: a lossless method that can be placed so defines it (full)."""
        raise NotImplementedError(f"method={self.name} has no make_host_layer")

    def own_dense_layers(self, info: ModelInfo) -> tuple[int, ...]:
        """Layers this method itself leaves dense (e.g. InfiniGen's first layers); they join
        runner.dense_layers and are recorded in metrics.json's protocol."""
        return ()

    def make_dense_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        """The per-request state of a dense layer (protocol): the full cache by default. A method
        whose dense layers must still do something (offload, prefetch) overrides this."""
        return FullLayer(layer_idx, info)

    def effective_dense_layers(self, info: ModelInfo, protocol: Protocol) -> tuple[int, ...]:
        """The effective dense layers: the protocol's and the method's own, sorted."""
        return tuple(sorted(set(protocol.dense_layers) | set(self.own_dense_layers(info))))


# Knobs every method shares by name, checked here once for all of them (a method's own
# `check_hyperparameters` adds what only it knows):
# - seeds (`seed`, `*_seed`): torch.Generator takes a signed 64-bit seed, so 2**70 would fail
#   only once the method draws, after the weights loaded;
# - knobs counting positions of one sequence (sinks, windows, a pooling kernel, the future
#   positions Expected Attention averages its rotation over): beyond the model's positions none
#   can ever be reached, and some size a table by themselves (future_tokens=10**9 allocates).
SEED_MAX = 2 ** 63 - 1
POSITION_KNOBS = ("sink_tokens", "window_tokens", "recent_tokens", "kernel_tokens",
                  "history_tokens", "future_tokens")


def seed_reasons(method: "KVMethod") -> list[str]:
    """Reasons a seed knob of `method` is not an integer in 0..2**63-1."""
    reasons = []
    for f in dataclasses.fields(method):
        if f.name == "seed" or f.name.endswith("_seed"):
            value = getattr(method, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= SEED_MAX:
                reasons.append(f"method.{f.name}={value!r} must be an integer in 0..2**63-1 "
                               "(a 64-bit generator seed)")
    return reasons


def position_knob_reasons(method: "KVMethod", info: ModelInfo) -> list[str]:
    """Reasons a position-counting knob of `method` (POSITION_KNOBS) exceeds the model's
    positions (a model that does not declare them is not bounded here)."""
    if not info.max_positions:
        return []
    reasons = []
    for name in POSITION_KNOBS:
        value = getattr(method, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > info.max_positions:
            reasons.append(f"method.{name}={value} is beyond the model's {info.max_positions} "
                           f"positions (max_position_embeddings): at most {info.max_positions}")
    return reasons


# The one budget rule of every method (methods.eviction.BudgetedMethod, README "Budgets"): the
# config knobs are `budget_tokens` (tokens per layer and KV head) and `budget_ratio` (a fraction of
# the protocol's budget basis, `KVLayer.basis_tokens()`: the sequence's final length by default,
# or the tokens seen so far); when `budget_tokens` is set it takes precedence over `budget_ratio`,
# so a sweep can set either without nulling the other. A method's own size knobs (StreamingLLM's
# `window_tokens`) apply only when both are null. The per-layer figure a layer reports is
# `KVLayer.allowed_tokens()`.
def check_budget(budget_ratio, budget_tokens) -> list[str]:
    """Shared budget checks: a positive token count, or a ratio in (0, 1]."""
    if budget_tokens is not None:
        if not isinstance(budget_tokens, int) or isinstance(budget_tokens, bool) or budget_tokens <= 0:
            return [f"method.budget_tokens={budget_tokens!r} must be a positive integer"]
        return []
    if budget_ratio is None:
        return ["method.budget_ratio or method.budget_tokens must be set"]
    if not isinstance(budget_ratio, (int, float)) or not 0 < budget_ratio <= 1:
        return [f"method.budget_ratio={budget_ratio!r} must be in (0, 1]"]
    return []


def budget_for(basis_tokens: int | None, budget_ratio: float | None, budget_tokens: int | None,
               minimum: int = 1) -> int:
    """Tokens allowed when a ratio budget applies to `basis_tokens` (`KVLayer.basis_tokens()`);
    `budget_tokens` takes precedence over the ratio (and needs no basis)."""
    if budget_tokens is not None:
        return budget_tokens
    return max(minimum, int(budget_ratio * require_basis(basis_tokens)))


def require_basis(basis_tokens: int | None) -> int:
    """The budget basis, or a clear error where a ratio budget has none to apply to."""
    if basis_tokens is None:
        raise RuntimeError(
            "a ratio budget under runner.budget_basis=final needs the sequence's final length, "
            "and none was given: a stream of decode steps declares it "
            "(Engine.request(final_tokens=N)); a prompt sets it when it is fed")
    return basis_tokens
