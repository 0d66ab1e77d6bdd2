"""What a method is told about the model: `ModelInfo` (before weights load) and
`PrepareContext` (what its offline `prepare` may use of the loaded model, as plain tensors and
callables: a method file never loads models or touches transformers)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from methods.layer import KVLayer

# RoPE variants whose rotation by delta positions is `delta * inv_freq` with unit attention
# scaling, so stored keys can be re-rotated (methods.rope); yarn/longrope scale cos/sin and
# dynamic changes the frequencies with the length.
REROTATABLE_ROPE_TYPES = ("default", "linear", "llama3")

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
    """Everything a method's offline `prepare` may use, built by the runner (harness.core.hf_adapter).

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
