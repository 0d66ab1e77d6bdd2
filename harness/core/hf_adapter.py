"""The only module that touches transformers internals (pinned: transformers==5.24.0).

Seams used, all public in 5.24:
  * a `Cache` whose layers bridge to our `KVLayer`s (the model calls `cache.update()` before
    attention, with post-RoPE keys);
  * `AttentionInterface` + `AttentionMaskInterface` registrations under our own names
    (`kvh_sdpa`, `kvh_eager`): without the mask registration the causal mask is None and a chunked
    prefill over a non-empty cache is silently wrong (HF's sdpa then slices keys as if causal);
  * a per-request binding of each attention module to its `KVLayer` (`bind`), always undone,
    renewed by every `forward` for its own cache;
  * each layer's attention mask built by the registered mask functions from that layer's own
    sizes (`sequence_mask`): the model builds one from the first layer's, which is wrong for a
    layer holding a different number of keys, and for ragged per-sequence caches (batches);
  * for methods declaring `needs_token_ids` only, the forward's input ids handed to every layer
    before the model runs (`forward`: every prefill chunk, decode step and batched step);
  * for methods declaring `observes_attention_block` only, torch forward hooks during a request's
    `bind`: a pre-hook on each decoder layer (its input) and a hook on its attention module (its
    output);
  * for a cache handed to the model's own `generate` (harness.api), a pre-hook and a hook on the
    model that run the request's protocol around every forward given that cache (`watch_forwards`:
    the forward's `cache` argument, 5.24's name, or the deprecated `past_key_values`).

`tests/harness/test_hf_adapter.py` pins these seams: upgrading transformers breaks it first.
"""

from __future__ import annotations

import contextlib
import hashlib
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from transformers import AttentionInterface, PretrainedConfig
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (AttentionMaskInterface, causal_mask_function, eager_mask,
                                        sdpa_mask, sliding_window_causal_mask_function)

from kvcore.errors import ConfigError
from methods.base import KVMethod
from methods.layer import KVLayer
from methods.model import ModelInfo, PrepareContext
from methods.protocol import Protocol
from methods.scoring import expand_kv

ATTN_IMPLEMENTATIONS = {"sdpa": "kvh_sdpa", "eager": "kvh_eager"}
_BOUND_ATTR = "_kvh_layer"
_BRIDGE_ATTR = "_kvh_bridge"
_LOOKAHEAD_ATTR = "_kvh_lookahead"  # [open requests, hook handles] while lookahead hooks are on
_BLOCK_ATTR = "_kvh_block_hooks"  # the same for the attention-block hooks


def eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Generic eager attention (matches HF's eager bit for bit; HF's is not in the registry)."""
    groups = query.shape[1] // key.shape[1]
    scaling = module.scaling if scaling is None else scaling
    scores = torch.matmul(query, expand_kv(key, groups).transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, expand_kv(value, groups)).transpose(1, 2).contiguous()
    return out, probs


_BASES = {"kvh_sdpa": sdpa_attention_forward, "kvh_eager": eager_attention}
_MASKS = {"kvh_sdpa": sdpa_mask, "kvh_eager": eager_mask}


def _make_attention(base):
    def attention(module, query, key, value, attention_mask, **kwargs):
        layer: KVLayer | None = getattr(module, _BOUND_ATTR, None)
        if layer is None:  # not inside a request (e.g. a plain forward): behave like the base
            return base(module, query, key, value, attention_mask, **kwargs)
        bridge: _BridgeLayer | None = getattr(module, _BRIDGE_ATTR, None)
        if bridge is not None and bridge.info is not None:
            attention_mask = bridge.own_mask(base, query)
        return layer.attend(module, query, key, value, attention_mask, base=base, **kwargs)

    return attention


def register_attention() -> None:
    """Register our attention and mask functions once (class-global, idempotent)."""
    for name, base in _BASES.items():
        AttentionInterface.register(name, _make_attention(base))
        AttentionMaskInterface.register(name, _MASKS[name])


def position_ids_from(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The forward kwargs reach `Cache.update` as one dict named `kwargs` (private in 5.24)."""
    inner = kwargs.get("kwargs") or {}
    return inner.get("position_ids")


class _BridgeLayer(DynamicLayer):
    """Presents one `KVLayer` to transformers as a cache layer.

    With `info`, it also sizes this layer's own attention mask: the model builds one mask per
    forward from the first layer's sizes, which is wrong for a layer holding a different number
    of keys (per-layer budgets, head-wise caches, dense protocol layers next to evicted ones).
    The sizes are read before `update`, as the KVLayer contract says they describe its output."""

    def __init__(self, kv, info: ModelInfo | None = None):
        super().__init__()
        self.kv, self.info = kv, info
        self.sizes: tuple[int, int, int, int] | None = None  # q_len, kv_length, kv_offset, q_offset

    def update(self, key_states, value_states, *args, **kwargs):
        self.is_initialized = True
        if self.info is not None:
            self.sizes = mask_sizes(self.kv, key_states.shape[-2])
        return self.kv.update(key_states, value_states, position_ids_from(kwargs))

    def own_mask(self, base, query: torch.Tensor):
        q_len, kv_length, kv_offset, q_offset = self.sizes
        return sequence_mask(self.info, base, self.kv.layer_idx, q_len, kv_length, q_offset,
                             kv_offset, query)

    def get_seq_length(self) -> int:
        return self.kv.seen_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kv.mask_sizes(query_length)


class MethodCache(Cache):
    """A transformers `Cache` whose layers are a method's fresh `KVLayer`s (one request)."""

    def __init__(self, method: KVMethod, info: ModelInfo, tier=None,
                 protocol: Protocol | None = None, host_layers: frozenset[int] = frozenset()):
        protocol = protocol or Protocol()
        dense = set(method.effective_dense_layers(info, protocol))
        # host_layers: placed whole on the host tier by the serving scheduler (LayerKV)
        self.kv_layers = [method.make_host_layer(i, info) if i in host_layers
                          else method.make_dense_layer(i, info) if i in dense
                          else method.make_layer(i, info) for i in range(info.num_layers)]
        for kv, nxt in zip(self.kv_layers, self.kv_layers[1:] + [None]):
            kv.tier, kv.next_layer, kv.protocol = tier, nxt, protocol
        super().__init__(layers=[_BridgeLayer(kv, info) for kv in self.kv_layers])
        self.observes_attention_block = method.capabilities.observes_attention_block
        self.needs_token_ids = method.capabilities.needs_token_ids

    # A recorded forward replayed on these layers (harness.sweep.replay): the two calls the
    # model's attention module makes through this cache, as it makes them.
    def replay_update(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor,
                      position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[layer_idx].update(keys, values, kwargs={"position_ids": position_ids})

    def layer_mask(self, layer_idx: int, base, query: torch.Tensor):
        """The mask this layer's attention gets after `replay_update` (see `_BridgeLayer`)."""
        return self.layers[layer_idx].own_mask(base, query)

    def layer_sizes(self, layer_idx: int) -> tuple[int, int, int, int] | None:
        """`mask_sizes` of this layer's last update: with the layer, the attention function and
        the query, all its mask is made from."""
        return self.layers[layer_idx].sizes


class BatchCache(Cache):
    """A batch of requests (`harness.core.batch`): one `FanOutLayer` per decoder layer, each routing
    batch rows to the sequences' own `MethodCache` layers (`caches`)."""

    def __init__(self, caches: list[MethodCache], fan_out_layers: list, routing):
        self.caches, self.kv_layers, self.routing = caches, fan_out_layers, routing
        # the sequences may hold different methods (a sweep's settings decoded together)
        self.observes_attention_block = any(c.observes_attention_block for c in caches)
        self.needs_token_ids = any(c.needs_token_ids for c in caches)
        for layer, nxt in zip(fan_out_layers, fan_out_layers[1:] + [None]):
            layer.next_layer = nxt
        super().__init__(layers=[_BridgeLayer(layer) for layer in fan_out_layers])



def mask_sizes(kv, q_len: int) -> tuple[int, int, int, int]:
    """(q_len, kv_length, kv_offset, q_offset) of a layer's own mask for `q_len` new tokens,
    read before its `update` (the KVLayer contract: they describe its output)."""
    return (q_len, *kv.mask_sizes(q_len), kv.seen_tokens)


def sequence_mask(info: ModelInfo, base, layer_idx: int, q_len: int, kv_length: int,
                  q_offset: int, kv_offset: int, query: torch.Tensor):
    """The mask transformers would build for one sequence alone at this layer (causal, or sliding
    on the model's sliding layers), from the layer's own sizes; None where sdpa may skip it."""
    kind = next(name for name, fn in _BASES.items() if fn is base)
    window = info.sliding_window_tokens if layer_idx in info.sliding_window_layers else None
    mask_function = (sliding_window_causal_mask_function(window) if window
                     else causal_mask_function)
    # local_size: sdpa may skip a causal mask, never a window narrower than the keys
    return _MASKS[kind](batch_size=1, q_length=q_len, kv_length=kv_length, q_offset=q_offset,
                        kv_offset=kv_offset, mask_function=mask_function, attention_mask=None,
                        local_size=window, allow_is_causal_skip=True, dtype=query.dtype,
                        use_vmap=False, device=query.device)


def _lookahead_hook(module, args, kwargs):
    layer: KVLayer | None = getattr(module, _BOUND_ATTR, None)
    if layer is None:
        return
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    positions = kwargs.get("position_ids")
    layer.prefetch(hidden, positions, ahead=False)
    if layer.next_layer is not None:
        layer.next_layer.prefetch(hidden, positions, ahead=True)


def lookahead(model) -> contextlib.AbstractContextManager:
    """Forward pre-hooks on every attention module: layer i's input reaches layers i and i+1
    (shared by the requests open side by side, `_shared_hooks`)."""
    return _shared_hooks(model, _LOOKAHEAD_ATTR, lambda: [
        m.register_forward_pre_hook(_lookahead_hook, with_kwargs=True)
        for m in attention_modules(model)])


@contextlib.contextmanager
def _shared_hooks(model, attr: str, register: Callable[[], list]) -> Iterator[None]:
    """Hooks on the model that every open request shares: registered by the first, removed with
    the last. Requests open side by side (a benchmark decoding several methods in lockstep, a
    sweep replaying a prompt into settings while it is recorded) each ask for them, but each
    call is dispatched to whatever layer the forward bound: a second set would make it run
    twice."""
    users = getattr(model, attr, None)  # [open requests, hook handles]
    if users is None:
        users = [0, register()]
        setattr(model, attr, users)
    users[0] += 1
    try:
        yield
    finally:
        users[0] -= 1
        if users[0] == 0:
            for handle in users[1]:
                handle.remove()
            delattr(model, attr)


def attention_modules(model) -> list[torch.nn.Module]:
    """The self-attention module of every decoder layer, in order (all family differences here)."""
    return [layer.self_attn for layer in decoder_layers(model)]


def decoder_layers(model) -> list[torch.nn.Module]:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: no decoder layers found (expected model.model.layers)")
    return list(layers)


def _attention_block_hooks(model) -> list:
    """Hooks handing each bound KVLayer its decoder layer's input (the residual stream, before the
    norm) and its attention block's output (`Capabilities.observes_attention_block`)."""
    handles = []
    for decoder, attn in zip(decoder_layers(model), attention_modules(model)):
        residual = {}

        def keep_input(module, args, kwargs, residual=residual):
            residual["x"] = kwargs.get("hidden_states", args[0] if args else None)

        def observe(module, args, kwargs, output, residual=residual):
            layer: KVLayer | None = getattr(module, _BOUND_ATTR, None)
            if layer is not None and "x" in residual:
                out = output[0] if isinstance(output, tuple) else output
                layer.observe_attention_block(residual.pop("x"), out)

        handles.append(decoder.register_forward_pre_hook(keep_input, with_kwargs=True))
        handles.append(attn.register_forward_hook(observe, with_kwargs=True))
    return handles


@contextlib.contextmanager
def bind(model, cache: MethodCache, hooks: bool = True) -> Iterator[MethodCache]:
    """Bind each attention module to its request's KVLayer; always restore what was bound before
    (nothing, or an outer request's layers while a shadow request runs), even on error. `hooks`:
    also the attention-block hooks a method asks for (a request's bind; `forward`'s re-binding
    for one forward adds none, so they never run twice)."""
    modules = attention_modules(model)
    attrs = (_BOUND_ATTR, _BRIDGE_ATTR)
    previous = [[getattr(m, a, None) for a in attrs] for m in modules]
    observes = hooks and getattr(cache, "observes_attention_block", False)
    block_hooks = (_shared_hooks(model, _BLOCK_ATTR, lambda: _attention_block_hooks(model))
                   if observes else contextlib.nullcontext())
    try:
        with block_hooks:
            for module, kv, bridge in zip(modules, cache.kv_layers, cache.layers):
                setattr(module, _BOUND_ATTR, kv)
                setattr(module, _BRIDGE_ATTR, bridge)
            yield cache
    finally:
        for module, prev in zip(modules, previous):
            for attr, value in zip(attrs, prev):
                if value is None:
                    if hasattr(module, attr):
                        delattr(module, attr)
                else:
                    setattr(module, attr, value)


def forward(model, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: Cache | None,
            logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
    """One model forward with explicit positions (5.24 has no `cache_position`). Returns logits
    of the last `logits_to_keep` rows (0: all), or of the row indices it lists (a 1-D tensor)."""
    # Attention finds its layer through the module binding: bind this forward's own cache, so
    # requests open side by side (nested contexts, a diagnostics shadow) never cross.
    ours = isinstance(cache, (MethodCache, BatchCache))
    if ours and cache.needs_token_ids:  # before the model runs: each layer's next update's ids
        for layer in cache.kv_layers:  # (a batch's fan-out layers route rows to sequences)
            layer.observe_token_ids(input_ids)
    with bind(model, cache, hooks=False) if ours else contextlib.nullcontext():
        out = model(input_ids=input_ids, position_ids=position_ids, cache=cache,
                    use_cache=cache is not None, logits_to_keep=logits_to_keep)
    return out.logits


CACHE_ARGUMENTS = ("cache", "past_key_values")  # a forward's cache: 5.24's name, the deprecated one
_API_USERS_ATTR = "_kvh_api_users"  # [open API caches, the attention implementation to restore]


def watch_forwards(model, owner) -> list:
    """Hooks on `model` calling `owner.before_forward(input_ids, q_len)` and
    `owner.after_forward()` around every forward given `owner` as its cache (transformers'
    `generate` passes it at every step; a caller's own loop does the same). `owner` is held
    weakly: the hooks never keep a cache alive. Returns the handles (`.remove()`).
    The owner runs the forward driver's halves there (harness.core.forward.start / finish): the
    model's forward is called by transformers, not by the driver, so these hooks are the only
    place around it; this module keeps to transformers' seams and leaves the steps to the owner."""
    ref = weakref.ref(owner)

    def given(kwargs) -> bool:
        cache = next((kwargs[k] for k in CACHE_ARGUMENTS if kwargs.get(k) is not None), None)
        return cache is not None and cache is ref()

    def before(module, args, kwargs):
        if given(kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            embeds = kwargs.get("inputs_embeds")
            q_len = (ids if ids is not None else embeds).shape[1]
            ref().before_forward(ids, q_len)

    def after(module, args, kwargs, output):
        if given(kwargs):
            ref().after_forward()

    return [model.register_forward_pre_hook(before, with_kwargs=True),
            model.register_forward_hook(after, with_kwargs=True)]


def attach_attention(model) -> None:
    """Switch a model loaded with transformers' sdpa or eager attention to ours (`set_attention`;
    the same arithmetic while no request is bound) for as long as some API cache is open on it;
    `detach_attention` restores the model's own when the last one closes."""
    users = getattr(model, _API_USERS_ATTR, None)
    if users is None:
        current = getattr(model.config, "_attn_implementation", None)
        ours = {v: k for k, v in ATTN_IMPLEMENTATIONS.items()}
        kind = ours.get(current, current)
        if kind not in ATTN_IMPLEMENTATIONS:
            raise ConfigError(f"the model attends with attn_implementation={current!r}; the "
                              "harness's attention seams wrap transformers' sdpa or eager "
                              "attention (methods needing attention weights compute their own): "
                              "load it with attn_implementation='sdpa' or 'eager'")
        set_attention(model, kind)
        users = [0, current]
        setattr(model, _API_USERS_ATTR, users)
    users[0] += 1


def detach_attention(model) -> None:
    users = getattr(model, _API_USERS_ATTR, None)
    if users is None:
        return
    users[0] -= 1
    if users[0] == 0:
        delattr(model, _API_USERS_ATTR)
        model.set_attn_implementation(users[1])


def set_attention(model, kind: str) -> None:
    """Switch the model to our registered attention (`kind` in ATTN_IMPLEMENTATIONS)."""
    register_attention()
    model.set_attn_implementation(ATTN_IMPLEMENTATIONS[kind])


def model_info(config: PretrainedConfig, dtype: torch.dtype = torch.float32) -> ModelInfo:
    """ModelInfo from a config alone (no weights), so validation runs before loading."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope, rope_type = _rope_parameters(config)
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    window, sliding = _sliding_window(config)
    return ModelInfo(
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        max_positions=getattr(config, "max_position_embeddings", 0) or 0,
        dtype=dtype,
        rope_theta=theta,
        model_type=getattr(config, "model_type", "unknown"),
        rope_type=rope_type,
        rotary_ratio=float(rope.get("partial_rotary_factor",
                                    getattr(config, "partial_rotary_factor", None) or 1.0)),
        sliding_window_tokens=window,
        sliding_window_layers=sliding,
        cache_format="latent" if getattr(config, "kv_lora_rank", None) else "heads",
        attention_quirks=_attention_quirks(config),
    )


def unknown_rope_types(config: PretrainedConfig) -> list[str]:
    """The config's RoPE types transformers cannot build (it would fail inside the model's
    constructor with a bare KeyError), each once."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = getattr(config, "rope_parameters", None) or {}
    rope = rope if isinstance(rope, dict) else {}
    tables = [p for p in rope.values() if isinstance(p, dict)] or [rope]
    known = ("default", *ROPE_INIT_FUNCTIONS)
    found = [str(p.get("rope_type", "default")) for p in tables]
    return sorted({kind for kind in found if kind not in known})


def rope_type_names() -> list[str]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ["default", *sorted(ROPE_INIT_FUNCTIONS)]


def _rope_parameters(config: PretrainedConfig) -> tuple[dict[str, Any], str]:
    """(RoPE parameters, rope_type). Gemma-3 keys its `rope_parameters` by layer type
    ({"sliding_attention": {...}, "full_attention": {...}}): a RoPE model all the same, whose
    layers rotate with different parameters (one `inv_freq` per type, none shared), which the
    methods rotating keys themselves cannot reproduce: named as its own rope_type."""
    rope = getattr(config, "rope_parameters", None) or {}
    rope = rope if isinstance(rope, dict) else {}
    per_type = {kind: p for kind, p in rope.items() if isinstance(p, dict)}
    if not per_type or "rope_theta" in rope:
        return rope, str(rope.get("rope_type", "default"))
    described = ", ".join(f"{kind}: {p.get('rope_type', 'default')} theta {p.get('rope_theta')}"
                          for kind, p in sorted(per_type.items()))
    return next(iter(per_type.values())), f"per layer type ({described})"


def _attention_quirks(config: PretrainedConfig) -> tuple[str, ...]:
    # Soft-capping (Gemma-2) is applied inside transformers' own eager function only; our seams
    # and the methods' score computations do not apply it. (A non-default query scale arrives as
    # the `scaling` argument and is honoured.)
    cap = getattr(config, "attn_logit_softcapping", None)
    return (f"attention logit soft-capping ({cap})",) if cap else ()


def _sliding_window(config: PretrainedConfig) -> tuple[int | None, tuple[int, ...]]:
    """(window, layers it masks). `layer_types` (Qwen2, Gemma2/3) names the sliding layers;
    without it a set `sliding_window` applies to every layer (Mistral, Phi-3) unless
    `use_sliding_window` is false. A window as long as the positions never masks anything."""
    window = getattr(config, "sliding_window", None)
    layers = config.num_hidden_layers
    max_positions = getattr(config, "max_position_embeddings", 0) or 0
    if not window or (max_positions and window >= max_positions):
        return None, ()
    types = getattr(config, "layer_types", None)
    if types:
        sliding = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    elif getattr(config, "use_sliding_window", True) is False:
        sliding = ()
    else:
        sliding = tuple(range(layers))
    return (int(window), sliding) if sliding else (None, ())


def rope_inv_freq(model) -> torch.Tensor | None:
    """The model's RoPE inverse frequencies `(D/2,)` fp32 (None for a model without RoPE).

    Taken from the model's own rotary embedding, so scaled variants (llama3, linear) are right.
    Rotating a key rotated at p by angles delta*inv_freq gives the key rotated at p + delta.
    """
    inner = getattr(model, "model", model)
    rotary = getattr(inner, "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is None:
        return None
    if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        raise ValueError("re-rotation assumes attention_scaling == 1 (plain RoPE frequencies)")
    return inv_freq.detach().float().clone()


def query_projector(model):
    """(layer, x (B, T, hidden)) -> pre-RoPE queries (B, H_q, T, D) with the model's own weights.

    Fused projections (Phi-3's `qkv_proj`) are sliced to their query rows; biases (Qwen2) kept;
    a query norm before RoPE (`q_norm`: per head in Qwen3 / Gemma-3, across all heads in OLMo-2)
    applied as the model applies it, so the query is the one its attention will use.
    """
    modules = attention_modules(model)

    def project(layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        attn = modules[layer_idx]
        head_dim = attn.head_dim
        if hasattr(attn, "q_proj"):
            q = attn.q_proj(x)
        elif hasattr(attn, "qkv_proj"):
            rows = attn.config.num_attention_heads * head_dim
            q = torch.nn.functional.linear(x, attn.qkv_proj.weight[:rows],
                                           None if attn.qkv_proj.bias is None
                                           else attn.qkv_proj.bias[:rows])
        else:
            raise TypeError(f"{type(attn).__name__}: no q_proj or qkv_proj to speculate with")
        b, t, _ = x.shape
        norm = getattr(attn, "q_norm", None)
        if norm is None:
            return q.view(b, t, -1, head_dim).transpose(1, 2)
        weight = getattr(norm, "weight", None)
        if weight is not None and weight.numel() != head_dim:  # one norm over all heads
            return norm(q).view(b, t, -1, head_dim).transpose(1, 2)
        return norm(q.view(b, t, -1, head_dim)).transpose(1, 2)

    return project


def fingerprint(model) -> str:
    """Config + a strided sample of every query projection's weights (artefact cache keys)."""
    h = hashlib.sha256(model.config.to_json_string().encode())
    for module in attention_modules(model):
        proj = getattr(module, "q_proj", None) or getattr(module, "qkv_proj")
        w = proj.weight.detach().float().flatten()
        h.update(w[:: max(1, w.numel() // 4096)].cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def capture_forward(model, info: ModelInfo):
    """A callable running ids (T,) at positions start..start+T-1 through fresh layers of a
    method, returning those layers (`start` > 0: layers that already stand for `start` tokens,
    e.g. wrapping a request's own, as KVzip's reconstruction forward does)."""

    def capture(method: KVMethod, ids: torch.Tensor, start: int = 0) -> list[KVLayer]:
        cache = MethodCache(method, info)
        device = next(model.parameters()).device
        positions = torch.arange(start, start + ids.numel(), device=device)[None]
        with torch.inference_mode(), bind(model, cache):
            forward(model, ids[None].to(device), positions, cache, logits_to_keep=1)
        return cache.kv_layers

    return capture


def _plain_rope(model) -> torch.Tensor | None:
    try:
        return rope_inv_freq(model)
    except ValueError:  # scaled attention (e.g. YaRN): re-rotating methods must refuse it
        return None


def _probe_vocab(model, tokenizer) -> int:
    """Token ids a method may draw at random (probes, synthetic calibration): the tokenizer's,
    where the embedding has padding rows past it (Qwen2: 151936 rows for 151665 tokens) that
    no text ever reaches."""
    rows = int(getattr(model.config, "vocab_size", 0) or 256)
    return min(rows, len(tokenizer)) if tokenizer is not None else rows


def prepare_context(model, tokenizer, info: ModelInfo | None = None, *,
                    data_dir: Path | None = None, cache_dir: Path | None = None,
                    calibration_ids: torch.Tensor | None = None) -> PrepareContext:
    """What a method's `prepare` may know of the loaded model, as plain tensors and callables."""
    info = info or model_info(model.config)
    return PrepareContext(
        info=info, tokenizer=tokenizer, device=next(model.parameters()).device,
        fingerprint=fingerprint(model), rope_inv_freq=_plain_rope(model),
        project_query=query_projector(model), capture=capture_forward(model, info),
        vocab_size=_probe_vocab(model, tokenizer),
        data_dir=data_dir, cache_dir=cache_dir, calibration_ids=calibration_ids,
        model_id=getattr(model.config, "_name_or_path", None) or None)


def prepare(method: KVMethod, model, tokenizer, info: ModelInfo | None = None, **extras) -> dict:
    """Run `method.prepare` on a loaded model (the one call site pattern for runner and tests)."""
    return method.prepare(prepare_context(model, tokenizer, info, **extras))
