"""The KV method interface: a method is hyperparameters + a factory of per-layer cache objects.

* `KVMethod` holds hyperparameters and prepared artefacts only; it is read-only during a run,
  and checks the knobs every method shares by name (seeds, position counts).
* Its layers (`methods.layer.KVLayer`) hold the per-request, per-layer state; what it declares
  is in `methods.capabilities`, what it is told about the model in `methods.model`, how a run
  goes in `methods.protocol`, and the one budget rule in `methods.budget`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from kvcore.errors import ConfigError
from methods._sidefiles import empty_path_reasons, path_kind_reasons
from methods.capabilities import Capabilities, ServingNeeds
from methods.layer import FullLayer, KVLayer
from methods.model import REROTATABLE_ROPE_TYPES, ModelInfo, PrepareContext
from methods.protocol import Protocol

# official code: read in (and checked against) the authors' repository; paper: from the paper
# alone (no code released); reconstruction: neither gives the method as a runnable rule (ours fills
# the gaps, named in its docstring); reference: the harness's own baselines and bounds.
PROVENANCES = ("official code", "paper", "reconstruction", "reference")


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
    # Its line in the README method table (harness.report.methods_table): the family, one sentence of
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
    # them share one prefill of each prompt (harness.sweep.plan). Declare a knob only when
    # its layers neither read it nor keep anything derived from it before `on_prefill_end`.
    prompt_end_knobs: ClassVar[tuple[str, ...]] = ()
    # The knobs its `prepare` reads, where preparing is costly (a calibration forward): a sweep's
    # settings of this method equal in them are prepared once, the others take its artefacts
    # (harness.session; tests/methods/contract/test_prepare_knobs.py holds every other knob to
    # changing nothing `prepare` makes). None: each setting prepares itself.
    prepare_knobs: ClassVar[tuple[str, ...] | None] = None
    # The attributes its `prepare` sets (its artefacts: calibrated tables, RoPE frequencies,
    # head classes): what a sweep hands to another setting of the same `prepare_key` instead of
    # preparing it again (`artefacts` / `adopt_artefacts`, harness.session). A method with a
    # `prepare` declares every attribute it sets (tests/methods/contract/test_artefacts.py).
    artefact_names: ClassVar[tuple[str, ...]] = ()

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

    def artefacts(self) -> dict[str, Any]:
        """What `prepare` made (`artefact_names`), by name: another setting of the same
        `prepare_key` takes them with `adopt_artefacts` instead of preparing."""
        return {name: getattr(self, name) for name in self.artefact_names}

    def adopt_artefacts(self, artefacts: dict[str, Any]) -> None:
        """Take another setting's `artefacts()` as this method's own (shared, not copied: a
        method is read-only during a run)."""
        unknown = sorted(set(artefacts) - set(self.artefact_names))
        if unknown:
            raise ValueError(f"method={self.name} declares no artefact {unknown[0]!r} "
                             f"(artefact_names: {', '.join(self.artefact_names) or 'none'})")
        for name, value in artefacts.items():
            setattr(self, name, value)

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
