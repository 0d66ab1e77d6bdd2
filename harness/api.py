"""Use a KV method in your own code: a transformers cache for the model's own `generate`.

    from harness import api
    cache = api.cache(model, tokenizer, "snapkv", budget_ratio=0.2)
    out = model.generate(**inputs, cache=cache, max_new_tokens=32, do_sample=False)
    cache.report()  # {"kv": {"held_ratio": ...}, "transfer": {...}}: metrics.json's figures
    cache.close()   # or `with api.cache(...) as cache:`

The protocol is the runner's (harness.core.engine), so a method gives here the tokens it gives under
`python -m harness`: dense prefill (the prompt attended in full, compressed once when it is
over), decode steps as the method says, the one budget rule checked after every forward, the
same refusals (one line, before anything runs) and the same accounting. transformers' `generate`
feeds a prompt in one forward and then one token per forward, so here a forward of several tokens
(or the first one) is a whole prompt, compressed at its end, and a one-token forward is a decode
step; a caller's own loop (`model(input_ids=..., cache=cache)`) follows the same rule. The runner
feeds long prompts in chunks of `runner.prefill_chunk_tokens`: under dense prefill the method
acts at the same point either way.

One cache serves one sequence (batch 1, no padding), as one request of the engine; the runner's
`runner.batch_size` batches many. Opening a cache switches the model to the harness's attention
(the same arithmetic as transformers' sdpa or eager while no cache is bound) and installs its
forward hooks; `close()` (or leaving the `with` block) removes them and restores the model.

What it refuses, each with a `ConfigError` naming what it needs (nothing runs, the cache and the
model untouched):
* a model it cannot drive: None, not a transformers causal LM (`PreTrainedModel` with
  `generate`), or one whose decoder layers are not `model.model.layers[i].self_attn`;
* a forward that breaks the one-sequence contract: a batch of several, padding (an
  `attention_mask` holding zeros), `use_cache=False` (transformers then re-feeds the whole
  sequence every step), a second prompt after the first (a second `generate`, or a multi-token
  forward after decoding began), tokens beyond the model's positions (max_position_embeddings),
  and `reset()`, `crop()` or beam search's reordering: one cache is one sequence, for one
  `generate`; open a new cache for the next (there is no reset);
* a closed cache: any use after `close()`;
* a method changed after it was built: a built `KVMethod` handed in is rebuilt from its knobs
  (so they are checked as `build_method` checks them) and the cache runs that copy; changing
  `cache.method`'s knobs afterwards is refused at the next forward. Built methods are thus
  re-validated when used, never trusted as mutated.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from harness.core import forward, hf_adapter
from harness.core.accounting import KVLedger
from harness.report.methods_table import serving_requirements
from harness.core.prompting import close_prompt, open_prompt
from harness.config.runner import RunnerSettings, engine_settings, setting_reasons
from harness.run import kv_figures
from kvcore.errors import ConfigError
from methods import build_method
from methods.base import KVMethod

# The decoder families the harness's attention seams are tested on (tests/models.py and
# tests/harness/test_architecture_refusals.py): each keeps its layers at model.model.layers[i],
# attention at .self_attn.
TESTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "phi3", "olmo2", "granite")


@dataclass(frozen=True)
class GenerateLoop:
    """transformers' `generate` seen as a task by the runner's refusals: each call feeds one
    prompt, then decode steps, one sequence at a time."""

    name: ClassVar[str] = "generate"
    batches: ClassVar[bool] = False
    prompt_option: ClassVar[str | None] = None

    def phases(self) -> tuple[str, ...]:
        return ("prefill", "decode")

    def longest_prompt_tokens(self) -> int | None:
        return None


def runner_options(dense_layers=(), budget_basis: str = "final", kv_offload: str = "none",
                   check_budget: bool = True, decode_interval_tokens: int | None = None
                   ) -> RunnerSettings:
    """The runner's settings (checked) with the protocol knobs this API takes; every other
    runner knob keeps its default (batch 1, contiguous storage, dense prefill)."""
    return RunnerSettings(dense_layers=list(dense_layers), budget_basis=budget_basis,
                          kv_offload=kv_offload, check_budget=check_budget,
                          decode_interval_tokens=decode_interval_tokens)


def cache(model, tokenizer, method: str | KVMethod, *, dense_layers=(),
          budget_basis: str = "final", kv_offload: str = "none", check_budget: bool = True,
          decode_interval_tokens: int | None = None, **hyperparameters) -> "MethodKVCache":
    """A cache running `method` (a name, with its hyperparameters as keywords, e.g.
    `budget_ratio=0.2`, or a built `KVMethod`) for one sequence of `model`'s own `generate` or
    forward loop. The protocol knobs are the runner's (`runner.dense_layers`,
    `runner.budget_basis`, `runner.kv_offload`, `runner.check_budget`,
    `runner.decode_interval_tokens`). Refusals raise
    `ConfigError` with the runner's one-line messages, before the method prepares or the
    model is touched (module docstring: what else it refuses)."""
    check_model(model)
    if isinstance(method, str):
        method = build_method(method, **hyperparameters)
    elif isinstance(method, KVMethod):
        if hyperparameters:
            raise ConfigError(f"hyperparameters {sorted(hyperparameters)} given with a built "
                              f"method ({method.name}): pass its name instead, or build it with "
                              "them")
        method = rebuilt(method)
    else:
        raise ConfigError(f"method={method!r}: give a method name (e.g. 'snapkv') or a KVMethod "
                          "built by methods.build_method")
    runner = runner_options(dense_layers, budget_basis, kv_offload, check_budget,
                            decode_interval_tokens)
    dtype = next(model.parameters()).dtype
    try:
        info = hf_adapter.model_info(model.config, dtype)
    except (AttributeError, TypeError, ValueError) as exc:
        raise ConfigError(f"model {type(model).__name__}: its config does not describe a "
                          f"decoder the harness can size ({exc})") from None
    settings = engine_settings(runner)
    reasons = setting_reasons(method, GenerateLoop(), info, runner, next(model.parameters()).device)
    if reasons:
        raise ConfigError("; ".join(dict.fromkeys(reasons)))  # each once
    return MethodKVCache(model, tokenizer, method, info, settings)


def check_model(model) -> None:
    """A `ConfigError` unless `model` is a transformers causal LM whose decoder layers sit where
    the harness's attention seams reach them (model.model.layers[i].self_attn)."""
    from transformers import GenerationMixin, PreTrainedModel

    families = ", ".join(TESTED_FAMILIES)
    if not isinstance(model, PreTrainedModel) or not isinstance(model, GenerationMixin):
        raise ConfigError(f"model={type(model).__name__ if model is not None else None}: "
                          "api.cache needs a transformers causal LM (AutoModelForCausalLM."
                          f"from_pretrained(...)); families tested: {families}")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers) or \
            not all(hasattr(layer, "self_attn") for layer in layers):
        kind = getattr(model.config, "model_type", type(model).__name__)
        raise ConfigError(f"model {type(model).__name__} ({kind}): no decoder layers at "
                          "model.model.layers[i].self_attn, where the harness's attention seams "
                          f"attach; families tested: {families}")


def rebuilt(method: KVMethod) -> KVMethod:
    """A fresh copy of a built method from its current knobs, checked as `build_method` checks
    them (a knob set after construction is validated here, not trusted)."""
    from kvcore.typecheck import check_types

    knobs = {f.name: getattr(method, f.name) for f in dataclasses.fields(method) if f.init}
    check_types(type(method), knobs, "method")  # its own class: a method defined outside too
    return type(method)(**knobs)


class MethodKVCache(hf_adapter.MethodCache):
    """A `MethodCache` that runs the engine's request protocol around the model's own forwards
    (`hf_adapter.watch_forwards`). Use it as `cache=` of `generate` or of each forward."""

    def __init__(self, model, tokenizer, method: KVMethod, info, settings):
        from harness.core import models
        from harness.core.engine import Engine

        self.model, self.method = model, method
        self.engine = Engine(model, tokenizer, method, info, settings)
        # our attention first: a prepare that runs forwards (captures) reads them through it
        hf_adapter.attach_attention(model)
        try:  # the runner's order: prepare (offline artefacts), then the request's layers
            self.prepared = (hf_adapter.prepare(method, model, tokenizer, info,
                                                data_dir=models.SHARED_DIR / "data")
                             if method.needs_prepare() else {})
        except BaseException:
            hf_adapter.detach_attention(model)
            raise
        super().__init__(method, info, self.engine.tier, settings.protocol)
        self.pos = 0  # tokens fed so far (the engine's Request.pos)
        self._forward: tuple[contextlib.ExitStack, bool, int] | None = None
        self._knobs = method.hyperparameters()  # as built: a later change is refused
        self.closed = False
        # the contract check first: hooks run in the order registered
        self._handles = [model.register_forward_pre_hook(self._check_forward, with_kwargs=True),
                         *hf_adapter.watch_forwards(model, self)]

    # --- the one-sequence contract, checked before a forward given this cache ----------------
    def _check_forward(self, module, args, kwargs) -> None:
        if not any(kwargs.get(k) is self for k in hf_adapter.CACHE_ARGUMENTS):
            return
        self._check_open()
        name = self.method.name
        if kwargs.get("use_cache") is False:
            raise ConfigError(f"use_cache=False with a {name} cache: transformers then feeds the "
                              "whole sequence again at every step; leave use_cache on")
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and not mask.is_floating_point() and \
                not bool(mask.all()):
            raise ConfigError(f"a {name} cache serves one unpadded sequence; this forward's "
                              "attention_mask has zeros (padding): one cache per sequence, "
                              "without padding")
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        q_len = (ids if ids is not None else embeds).shape[1]
        if q_len > 1 and self.pos:
            raise ConfigError(f"a {name} cache serves one sequence: it holds {self.pos} tokens "
                              f"and this forward feeds a new prompt of {q_len} (a second "
                              "generate?); open a new cache for each generate")
        limit = self.info.max_positions
        if limit and self.pos + q_len > limit and not self.method.bounds_positions():
            raise ConfigError(f"{self.pos + q_len} tokens are beyond the model's {limit} "
                              "positions (max_position_embeddings); shorten the prompt or "
                              "max_new_tokens")
        changed = {k: v for k, v in self.method.hyperparameters().items() if self._knobs[k] != v}
        if changed:
            raise ConfigError(f"method.{next(iter(changed))} of this {name} cache changed after "
                              f"it was built ({', '.join(f'{k}={v!r}' for k, v in changed.items())}"
                              "); build a new cache with the knobs you want")

    def _check_open(self) -> None:
        if getattr(self, "closed", False):  # (transformers' Cache.__init__ runs before it is set)
            raise ConfigError(f"this {self.method.name} cache is closed; open a new one "
                              "(api.cache)")

    # transformers' Cache calls: refused when closed; never reset, cropped or reordered
    def update(self, *args, **kwargs):
        self._check_open()
        return super().update(*args, **kwargs)

    def get_seq_length(self, *args, **kwargs) -> int:
        self._check_open()
        return super().get_seq_length(*args, **kwargs)

    def get_mask_sizes(self, *args, **kwargs):
        self._check_open()
        return super().get_mask_sizes(*args, **kwargs)

    def _one_sequence(self, what: str):
        raise ConfigError(f"a {self.method.name} cache serves one sequence and cannot be "
                          f"{what}; open a new cache (api.cache) instead")

    def reset(self):
        self._one_sequence("reset")

    def crop(self, *args, **kwargs):
        self._one_sequence("cropped")

    def reorder_cache(self, *args, **kwargs):
        self._one_sequence("reordered (beam search)")

    def batch_repeat_interleave(self, *args, **kwargs):
        self._one_sequence("repeated over a batch (beam search, num_return_sequences)")

    def batch_select_indices(self, *args, **kwargs):
        self._one_sequence("reindexed over a batch")

    # --- the forward driver (harness.core.forward), split around the model's own forward -----------
    # transformers' generate calls the model itself: the driver cannot wrap that call as
    # `forward.run` does, so its halves run from the model's hooks (hf_adapter.watch_forwards).
    def before_forward(self, input_ids: torch.Tensor | None, q_len: int) -> None:
        self._check_open()
        self._unbind()  # a forward that raised left its binding
        if input_ids is not None and input_ids.shape[0] != 1:
            raise ConfigError(f"a {self.method.name} cache serves one sequence; this forward "
                              f"has {input_ids.shape[0]} (one cache per sequence, or the "
                              "runner's runner.batch_size)")
        prompt = q_len > 1 or self.pos == 0
        engine = self.engine
        forward.start()
        forward.begin_step([engine], decode=not prompt)
        if prompt:
            open_prompt(self.kv_layers, self.pos + q_len)
        if self.needs_token_ids:
            if input_ids is None:
                raise ConfigError(f"method={self.method.name} reads token ids; pass input_ids "
                                  "(not inputs_embeds)")
            for layer in self.kv_layers:
                layer.observe_token_ids(input_ids)
        stack = contextlib.ExitStack()
        stack.enter_context(torch.inference_mode())
        stack.enter_context(hf_adapter.bind(self.model, self))
        if self.method.capabilities.lookahead or engine.tier.offload:
            stack.enter_context(hf_adapter.lookahead(self.model))
        self._forward = (stack, prompt, q_len)

    def after_forward(self) -> None:
        stack, prompt, q_len = self._forward
        self._forward = None
        engine = self.engine
        with stack:
            forward.finish([self], [q_len], decode=not prompt)
            if prompt:
                engine.prefill_tokens += q_len
                close_prompt(engine, self.kv_layers)
            else:
                engine.decode_tokens += 1

    def _unbind(self) -> None:
        if self._forward is not None:
            self._forward[0].close()
            self._forward = None

    # --- figures and lifetime -----------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """The run's figures as `python -m harness` writes them to metrics.json: `kv` (held and
        attended: `held_ratio`, `attended_fraction_sparse_layers`, bytes and tokens per layer,
        `method_active`) and `transfer` (bytes moved between tiers), for this sequence so far;
        `serving`: what a serving engine must offer the method (harness.report.methods_table)."""
        self.engine.ledger = KVLedger(self.info)
        if self.pos:
            self.engine.ledger.record(self.kv_layers, check=False)
        return {"method": self.method.name, "tokens_seen": self.pos,
                "serving": serving_requirements(self.method),
                "kv": kv_figures(self.engine, self.method),
                "transfer": {"kv_offload": self.engine.settings.kv_offload,
                             **self.engine.transfers.summary()}}

    def close(self) -> None:
        """Remove the hooks, restore the model's attention, give the storage back."""
        if self.closed:
            return
        self.closed = True
        self._unbind()
        for handle in self._handles:
            handle.remove()
        hf_adapter.detach_attention(self.model)
        for kv in self.kv_layers:
            kv.release()

    def __enter__(self) -> "MethodKVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def info(self):
        return self.engine.info
