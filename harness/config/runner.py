"""The runner's settings (`runner:` in the config) as one typed, frozen `RunnerSettings`, built
and checked once before anything loads (each knob's type, range and combination); the method x
task x protocol combinations that cannot give a real result (`protocol_reasons`), the KV storage
they size (`storage_reasons`), the tokenizer checks before weights (`check_prompts`) and the
engine's settings (`engine_settings`). One place, read by the session (harness.session), the API
and lm-eval; `harness.run` only runs what they passed.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from omegaconf import DictConfig, OmegaConf

from harness.config.config_check import closest, group_options
from harness.core.serving import check_admission
from kvcore.errors import ConfigError
from kvcore.paged import DEFAULT_BLOCK_TOKENS
from kvcore.typecheck import check_types
from methods.protocol import Protocol


def plain(node) -> dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def split_name(group: str, node, choice: str | None = None) -> tuple[str, dict[str, Any]]:
    """The group's name and options; `choice` is the config file the CLI chose for the group
    (by default, the running Hydra job's)."""
    options = plain(node)
    name = options.pop("name", None)
    choice = _choice(group) if choice is None else choice
    if not name:  # e.g. method=_shared: a fragment the choices include, not a choice
        raise ConfigError(f"{group}={choice!r} is not a {group} (its config sets no "
                          f"{group}.name); allowed: {', '.join(group_options(group))}")
    if choice in group_options(group) and str(name) != choice:  # settings of one, name of another
        raise ConfigError(f"{group}.name={name} overrides {group}={choice} (whose settings were "
                          f"composed); choose it as {group}={name}")
    return str(name), options


def _choice(group: str) -> str:
    try:
        from hydra.core.hydra_config import HydraConfig

        return str(HydraConfig.get().runtime.choices.get(group))
    except Exception:  # composed outside the CLI (tests)
        return "?"


AttnImpl = Literal["sdpa", "eager"]
KvOffload = Literal["none", "cpu"]
ATTN_IMPLS = typing.get_args(AttnImpl)
KV_OFFLOADS = typing.get_args(KvOffload)
MAX_SHARDS = 1000  # a SLURM array's default index limit; local shards: one per CPU at most
_POSITIVE = ("prefill_chunk_tokens", "batch_size", "threads", "kv_block_tokens", "shards",
             "sweep_decode_batch", "decode_interval_tokens")  # > 0 (or null, where typed so)


@dataclass(frozen=True)
class RunnerSettings:
    """The runner's settings (conf/runner/default.yaml, in its order, with its defaults; a test
    holds the two to each other): built once from the composed config (`of`), checked when built
    (types by kvcore.typecheck, as method knobs, then ranges and combinations), read as
    attributes. `as_dict()` is the plain mapping, for what records or groups the runner."""

    results_root: str = "results"  # run folders land in <results_root>/<task>/<model>/...
    output_dir: str | None = None  # the run folder exactly (a new or empty folder)
    overwrite: bool = False  # replace a previous run at output_dir
    prefill_chunk_tokens: int = 512  # tokens per prefill forward (a memory knob)
    batch_size: int = 1  # requests decoded together
    attn_impl: AttnImpl = "sdpa"  # the model's attention kernel
    seed: int = 0  # torch, numpy and Python seed; numpy's legacy seeding takes [0, 2**32)
    threads: int | None = None  # torch intra-op threads (None: all cores)
    check_budget: bool = True  # fail when a layer holds more KV than its budget
    debug: bool = False  # full Python tracebacks for errors
    diagnostics: bool = False  # attention-mass recall + KL vs a shadow full cache
    diagnostics_every_steps: int = 16  # sample every N decode steps (with diagnostics only)
    kv_offload: KvOffload = "none"  # cpu: full K/V on the host
    kv_layout: Literal["contiguous", "paged"] = "contiguous"  # paged: blocks of a shared pool
    kv_block_tokens: int = DEFAULT_BLOCK_TOKENS  # tokens per block (kv_layout=paged only)
    kv_device_limit_mib: float | None = None  # device KV limit, MiB (paged; None: no limit)
    kv_admission: Literal["request", "layerkv"] = "request"  # how requests are admitted under it
    sweep_engine: bool = True  # a multirun prefills each prompt once for every setting
    shards: int = 1  # a multirun's samples split over this many processes
    sweep_decode_batch: int = 1  # a sweep's settings decoded together (a memory knob)
    skip_existing: bool = False  # reuse a complete run with the same resolved config
    dense_layers: tuple[int, ...] = ()  # layers every method leaves uncompressed
    prefill: Literal["dense", "chunked", "sparse"] = "dense"  # how a prompt meets the method
    budget_basis: Literal["final", "seen"] = "final"  # what a budget_ratio is a fraction of
    decode_interval_tokens: int | None = None  # recompress every N decoded tokens (None: never)

    @classmethod
    def of(cls, runner: Mapping[str, Any]) -> "RunnerSettings":
        """The settings from a runner mapping (the composed config's, or one built in code);
        a key it leaves out keeps its default. One ConfigError line for an unknown key or a bad
        value."""
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in runner if k not in allowed]
        if unknown:
            near = closest(unknown[0], allowed)
            hint = f"; the closest allowed name is runner.{near}" if near else ""
            raise ConfigError(f"runner.{unknown[0]} is not a runner key{hint}; allowed: "
                              f"{', '.join(allowed)}")
        return cls(**runner)

    def __post_init__(self) -> None:
        check_types(type(self), self._given(), "runner")
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))  # a list from YAML
        for check in (_check_positive, _check_ranges, _check_combinations):
            check(self)

    def _given(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def as_dict(self) -> dict[str, Any]:
        """The plain mapping in conf/runner/default.yaml's order, as the composed config holds
        it (dense_layers a list): what records, groups or identifies the runner."""
        return {**self._given(), "dense_layers": list(self.dense_layers)}

    def protocol(self) -> Protocol:
        """The protocol these settings make (the same for every method of a comparison)."""
        return Protocol(dense_layers=self.dense_layers, prefill=self.prefill,
                        budget_basis=self.budget_basis,
                        decode_interval_tokens=self.decode_interval_tokens)


def _default(key: str) -> Any:
    return RunnerSettings.__dataclass_fields__[key].default


def _check_positive(r: RunnerSettings) -> None:
    keys = _POSITIVE + (("diagnostics_every_steps",) if r.diagnostics else ())
    for key in keys:
        value = getattr(r, key)
        if value is not None and value <= 0:
            raise ConfigError(f"runner.{key}={value!r} must be a positive integer")


def _check_ranges(r: RunnerSettings) -> None:
    if r.shards > MAX_SHARDS:
        raise ConfigError(f"runner.shards={r.shards}: allowed 1..{MAX_SHARDS} (one process "
                          "or SLURM array task each; SLURM's default MaxArraySize is 1001)")
    cpus = os.cpu_count() or 1
    if r.threads is not None and r.threads > cpus:
        raise ConfigError(f"runner.threads={r.threads} is more than this machine's {cpus} "
                          f"CPUs; allowed: 1..{cpus} (or null: all of them)")
    if not 0 <= r.seed < 2**32:  # numpy's legacy seeding (seed_everything)
        raise ConfigError(f"runner.seed={r.seed!r} must be an integer in [0, 2**32 - 1]")
    if any(i < 0 for i in r.dense_layers):
        raise ConfigError(f"runner.dense_layers={list(r.dense_layers)!r} must be a list of layer "
                          "indices >= 0 (e.g. [0,1]) or []")
    for key in ("output_dir", "results_root"):
        value = getattr(r, key)
        if value is not None and not value.strip():
            default = ("null: <results_root>/<task>/<model>/<method>/<time>"
                       if key == "output_dir" else "the default: results")
            raise ConfigError(f"runner.{key}={value!r} is empty; give a folder (or {default})")


def _check_combinations(r: RunnerSettings) -> None:
    if r.batch_size != 1 and r.diagnostics:
        raise ConfigError(f"runner.batch_size={r.batch_size} with runner.diagnostics: the "
                          "fidelity shadow cache follows one sequence; use runner.batch_size=1")
    if r.kv_layout != "paged" and r.kv_block_tokens != _default("kv_block_tokens"):
        raise ConfigError(f"runner.kv_block_tokens={r.kv_block_tokens} applies to "
                          "runner.kv_layout=paged only (contiguous buffers have no blocks); "
                          "set runner.kv_layout=paged or drop it")
    check_admission(r.as_dict())
    if not r.diagnostics and r.diagnostics_every_steps != _default("diagnostics_every_steps"):
        raise ConfigError(f"runner.diagnostics_every_steps={r.diagnostics_every_steps} "
                          "applies with runner.diagnostics=true only; set it or drop this")
    if r.overwrite and not r.output_dir:
        raise ConfigError("runner.overwrite=true applies to runner.output_dir only (a run under "
                          "runner.results_root always gets a new folder); set "
                          "runner.output_dir or drop it")


def protocol_reasons(method, task, info, protocol: Protocol,
                     runner: RunnerSettings | None = None) -> list[str]:
    """Method x task x protocol combinations that cannot give a real result (before weights)."""
    caps, reasons = method.capabilities, []
    beyond = [i for i in protocol.dense_layers if i >= info.num_layers]
    if beyond:
        reasons.append(f"runner.dense_layers={list(protocol.dense_layers)} names layer(s) {beyond} "
                       f"but the model has {info.num_layers} layers")
    if protocol.prefill not in caps.prefill_modes:
        reasons.append(f"runner.prefill={protocol.prefill} but method={method.name} can only run "
                       f"with runner.prefill={'|'.join(caps.prefill_modes)}")
    batch = runner.batch_size if runner else 1
    if batch > 1 and not task.batches:
        reasons.append(f"runner.batch_size={batch} but task={task.name} feeds one sequence at a "
                       "time (it scores one stream or rewinds a shared context); use "
                       "runner.batch_size=1")
    if runner and runner.kv_device_limit_mib is not None and not task.batches:
        reasons.append(f"runner.kv_device_limit_mib={runner.kv_device_limit_mib} but "
                       f"task={task.name} does not send its requests through the serving "
                       "scheduler (it feeds one stream or rewinds a shared context); use "
                       "runner.kv_device_limit_mib=null")
    phases = task.phases()
    reasons += decode_interval_reasons(method, task, protocol)
    if caps.needs_prompt and "prefill" not in phases:
        reasons.append(f"method={method.name} compresses only over a prefilled prompt, but "
                       f"task={task.name} "
                       "(with these options) feeds every token as a decode step: the method would "
                       "never act" + (f" (set {task.prompt_option} to give it a prompt)"
                                      if task.prompt_option else ""))
    if not caps.acts_during_decode and "decode" not in phases:
        reasons.append(f"method={method.name} compresses once the prompt is over, but "
                       f"task={task.name} (with these options) scores only prompt tokens: every "
                       "scored logit comes before the method acts")
    elif caps.compresses and protocol.prefill == "dense" and "decode" not in phases:
        reasons.append(f"runner.prefill=dense: every method attends a prompt in full and "
                       f"compresses it once it is over, but task={task.name} (with these options) "
                       "scores only prompt tokens, so method={method.name} would never act; use "
                       "runner.prefill=chunked (compress after every prefill chunk) or "
                       "runner.prefill=sparse (every prompt row under the budget)"
                       .replace("{method.name}", method.name))
    elif caps.compresses and protocol.prefill == "chunked" and "decode" not in phases and runner:
        longest, chunk = task.longest_prompt_tokens(), runner.prefill_chunk_tokens
        if longest is not None and chunk and longest <= chunk:
            reasons.append(f"runner.prefill=chunked: method={method.name} compresses after each "
                           f"prefill chunk, but task={task.name} (with these options) scores "
                           f"prompts of at most {longest} tokens, each one chunk "
                           f"(runner.prefill_chunk_tokens={chunk}): every scored logit comes "
                           "before the method acts; lower runner.prefill_chunk_tokens or use "
                           "runner.prefill=sparse")
    return reasons


def decode_interval_reasons(method, task, protocol: Protocol) -> list[str]:
    """runner.decode_interval_tokens for a method that cannot compress again while decoding, or
    a task that decodes nothing."""
    interval = protocol.decode_interval_tokens
    if interval is None:
        return []
    caps = method.capabilities
    if not caps.recompresses_during_decode:
        how = ("compresses while decoding by its own rule (every step, or an interval knob of "
               "its own)" if caps.acts_during_decode and caps.compresses else
               "does not compress again while decoding (only once-per-prompt scorers declaring "
               "it do)")
        return [f"runner.decode_interval_tokens={interval} but method={method.name} {how}; use "
                "runner.decode_interval_tokens=null"]
    if "decode" not in task.phases():
        return [f"runner.decode_interval_tokens={interval} but task={task.name} (with these "
                "options) feeds no token after a prompt: the interval would never pass"]
    return []


def setting_reasons(method, task, info, runner: RunnerSettings, device=None) -> list[str]:
    """Why a setting cannot run on this model, before weights: method x task x protocol x
    storage, the one list the CLI's `Session`, the API's `cache` and the benchmarks refuse by.
    `task.validate` where the task has one (the API's `generate` loop has none); the storage
    only where the device is known."""
    task_reasons = task.validate(info, method) if hasattr(task, "validate") else []
    return (method.validate(info, runner.as_dict()) + task_reasons
            + protocol_reasons(method, task, info, runner.protocol(), runner)
            + (storage_reasons(runner, info, device) if device is not None else []))


def storage_reasons(runner: RunnerSettings, info, device) -> list[str]:
    """KV storage sized by runner knobs that cannot fit the model or the machine (before
    weights): a paged block longer than any sequence can be, or the first block of every layer
    and sequence beyond the memory available (kvcore.guards estimates every later allocation)."""
    from kvcore.guards import available_bytes, fmt_bytes

    if runner.kv_layout != "paged":
        return []
    block = runner.kv_block_tokens
    if info.max_positions and block > info.max_positions:
        return [f"runner.kv_block_tokens={block} is larger than the model's max positions "
                f"({info.max_positions}): no sequence fills one block; allowed: 1.."
                f"{info.max_positions}"]
    first = runner.batch_size * block * info.kv_bytes_per_token()
    if runner.kv_offload == "cpu":
        first *= 2  # the host tier pages the same blocks
    free = available_bytes(device)
    if free is not None and first > free:
        return [f"runner.kv_block_tokens={block} with runner.batch_size="
                f"{runner.batch_size}: one block per layer and sequence needs "
                f"{fmt_bytes(first)} but {fmt_bytes(free)} of {device.type} memory is available"]
    return []


def engine_settings(runner: RunnerSettings):
    from harness.core.engine import EngineSettings

    return EngineSettings(
        prefill_chunk_tokens=runner.prefill_chunk_tokens, batch_size=runner.batch_size,
        check_budget=runner.check_budget,
        diagnostics_every=runner.diagnostics_every_steps if runner.diagnostics else 0,
        kv_offload=runner.kv_offload, protocol=runner.protocol(), kv_layout=runner.kv_layout,
        kv_block_tokens=runner.kv_block_tokens, kv_device_limit_mib=runner.kv_device_limit_mib,
        kv_admission=runner.kv_admission)


def check_prompts(task, spec, info, method, config, tokenizer=None) -> None:
    """Checks that need the tokenizer, before any weights load: its vocabulary fits the model's
    embedding, and the task's prompt sizes. `tokenizer`: the model's, when the caller has it
    (a session checks every setting with one), else loaded here."""
    from harness.core.models import check_vocab
    from tasks import Task

    if tokenizer is None:
        tokenizer = checking_tokenizer(spec)
    if tokenizer is None:
        return  # load_model reports why the tokenizer cannot load, before reading weights
    check_vocab(tokenizer, config.vocab_size, spec.source)
    if type(task).check_prompts is Task.check_prompts:
        return
    reasons = task.check_prompts(tokenizer, info, method)
    if reasons:
        raise ConfigError("; ".join(reasons))


def checking_tokenizer(spec):
    """The model's tokenizer for the checks before weights, or None when it cannot load yet."""
    from transformers import AutoTokenizer

    source = spec.extra.get("converted_dir") if spec.kind == "gguf" else spec.source
    try:  # a GGUF model not converted yet has no tokenizer folder: checked during evaluation
        return AutoTokenizer.from_pretrained(source) if source else None
    except Exception:  # noqa: BLE001 - load_model reports any tokenizer failure in one line
        return None
