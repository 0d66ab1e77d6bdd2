"""The runner's settings (`runner:` in the config), checked before anything loads: each knob's
type and range (`check_runner`), the protocol they make (`protocol_from`), the method x task x
protocol combinations that cannot give a real result (`protocol_reasons`), the KV storage they
size (`storage_reasons`), the tokenizer checks before weights (`check_prompts`) and the engine's
settings (`engine_settings`). One place, read by the session (harness.session), the API and
lm-eval; `harness.run` only runs what they passed.
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness.config.config_check import group_options, yaml_defaults
from harness.core.serving import check_admission
from kvcore.errors import ConfigError
from kvcore.paged import DEFAULT_BLOCK_TOKENS
from kvcore.storage import KV_LAYOUTS
from methods.protocol import BUDGET_BASES, PREFILL_MODES, Protocol

ATTN_IMPLS = ("sdpa", "eager")
KV_OFFLOADS = ("none", "cpu")


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


MAX_SHARDS = 1000  # a SLURM array's default index limit; local shards: one per CPU at most


def check_runner(runner: dict[str, Any]) -> None:
    def positive_int(key: str, allow_none: bool = False) -> None:
        value = runner.get(key)
        if value is None and allow_none:
            return
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"runner.{key}={value!r} must be a positive integer")

    def one_of(key: str, allowed: tuple, default: Any = None) -> None:
        if runner.get(key, default) not in allowed:
            raise ConfigError(f"runner.{key}={runner.get(key)!r}; allowed: {', '.join(allowed)}")

    positive_int("prefill_chunk_tokens")
    positive_int("batch_size")
    positive_int("threads", allow_none=True)
    for key in ("shards", "sweep_decode_batch"):  # a runner dict built in code (lm-eval, the
        if key in runner:  # API) may leave them out
            positive_int(key)
    if runner.get("shards", 1) > MAX_SHARDS:
        raise ConfigError(f"runner.shards={runner['shards']}: allowed 1..{MAX_SHARDS} (one process "
                          "or SLURM array task each; SLURM's default MaxArraySize is 1001)")
    cpus = os.cpu_count() or 1
    if runner.get("threads") is not None and runner["threads"] > cpus:
        raise ConfigError(f"runner.threads={runner['threads']} is more than this machine's {cpus} "
                          f"CPUs; allowed: 1..{cpus} (or null: all of them)")
    if runner.get("batch_size") != 1 and runner.get("diagnostics"):
        raise ConfigError(f"runner.batch_size={runner.get('batch_size')} with runner.diagnostics: "
                          "the fidelity shadow cache follows one sequence; use runner.batch_size=1")
    one_of("kv_offload", KV_OFFLOADS, "none")
    one_of("kv_layout", KV_LAYOUTS, "contiguous")
    if "kv_block_tokens" in runner:
        positive_int("kv_block_tokens")
        if (runner.get("kv_layout", "contiguous") != "paged"
                and runner["kv_block_tokens"] != DEFAULT_BLOCK_TOKENS):
            raise ConfigError(f"runner.kv_block_tokens={runner['kv_block_tokens']} applies to "
                              "runner.kv_layout=paged only (contiguous buffers have no blocks); "
                              "set runner.kv_layout=paged or drop it")
    check_admission(runner)
    one_of("attn_impl", ATTN_IMPLS)
    if runner.get("diagnostics"):
        positive_int("diagnostics_every_steps")
    elif runner.get("diagnostics_every_steps", _declared("diagnostics_every_steps")) != \
            _declared("diagnostics_every_steps"):
        raise ConfigError(f"runner.diagnostics_every_steps={runner['diagnostics_every_steps']} "
                          "applies with runner.diagnostics=true only; set it or drop this")
    if runner.get("overwrite") is True and not runner.get("output_dir"):
        raise ConfigError("runner.overwrite=true applies to runner.output_dir only (a run under "
                          "runner.results_root always gets a new folder); set "
                          "runner.output_dir or drop it")
    seed = runner.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        # numpy's legacy seeding (seed_everything) takes 0 .. 2**32 - 1 only
        raise ConfigError(f"runner.seed={seed!r} must be an integer in [0, 2**32 - 1]")
    dense = runner.get("dense_layers")
    if dense is not None and (not isinstance(dense, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in dense)):
        raise ConfigError(f"runner.dense_layers={dense!r} must be a list of layer indices >= 0 "
                          "(e.g. [0,1]) or []")
    one_of("prefill", PREFILL_MODES, "dense")
    one_of("budget_basis", BUDGET_BASES, "final")
    positive_int("decode_interval_tokens", allow_none=True)
    for key in ("check_budget", "debug", "diagnostics", "skip_existing", "overwrite",
                "sweep_engine"):
        if not isinstance(runner.get(key, False), bool):
            raise ConfigError(f"runner.{key}={runner.get(key)!r} must be a boolean (true or false)")
    for key in ("output_dir", "results_root"):
        if runner.get(key) is not None and not isinstance(runner[key], str):
            raise ConfigError(f"runner.{key}={runner[key]!r} must be a path (a string)")
        if isinstance(runner.get(key), str) and not runner[key].strip():
            default = ("null: <results_root>/<task>/<model>/<method>/<time>"
                       if key == "output_dir" else "the default: results")
            raise ConfigError(f"runner.{key}={runner[key]!r} is empty; give a folder (or "
                              f"{default})")


def _declared(key: str) -> Any:
    """A runner knob's declared default (conf/runner/default.yaml)."""
    return yaml_defaults("runner", "default").get(key)


def protocol_from(runner: dict[str, Any]) -> Protocol:
    return Protocol(dense_layers=tuple(runner.get("dense_layers") or ()),
                    prefill=runner.get("prefill", "dense"),
                    budget_basis=runner.get("budget_basis", "final"),
                    decode_interval_tokens=runner.get("decode_interval_tokens"))


def protocol_reasons(method, task, info, protocol: Protocol,
                     runner: dict[str, Any] | None = None) -> list[str]:
    """Method x task x protocol combinations that cannot give a real result (before weights)."""
    caps, reasons = method.capabilities, []
    beyond = [i for i in protocol.dense_layers if i >= info.num_layers]
    if beyond:
        reasons.append(f"runner.dense_layers={list(protocol.dense_layers)} names layer(s) {beyond} "
                       f"but the model has {info.num_layers} layers")
    if protocol.prefill not in caps.prefill_modes:
        reasons.append(f"runner.prefill={protocol.prefill} but method={method.name} can only run "
                       f"with runner.prefill={'|'.join(caps.prefill_modes)}")
    batch = int(runner.get("batch_size", 1)) if runner else 1
    if batch > 1 and not task.batches:
        reasons.append(f"runner.batch_size={batch} but task={task.name} feeds one sequence at a "
                       "time (it scores one stream or rewinds a shared context); use "
                       "runner.batch_size=1")
    if runner and runner.get("kv_device_limit_mib") is not None and not task.batches:
        reasons.append(f"runner.kv_device_limit_mib={runner['kv_device_limit_mib']} but "
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
        longest, chunk = task.longest_prompt_tokens(), runner.get("prefill_chunk_tokens")
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


def storage_reasons(runner: dict[str, Any], info, device) -> list[str]:
    """KV storage sized by runner knobs that cannot fit the model or the machine (before
    weights): a paged block longer than any sequence can be, or the first block of every layer
    and sequence beyond the memory available (kvcore.guards estimates every later allocation)."""
    from kvcore.guards import available_bytes, fmt_bytes

    if runner.get("kv_layout", "contiguous") != "paged":
        return []
    block = runner.get("kv_block_tokens", DEFAULT_BLOCK_TOKENS)
    if info.max_positions and block > info.max_positions:
        return [f"runner.kv_block_tokens={block} is larger than the model's max positions "
                f"({info.max_positions}): no sequence fills one block; allowed: 1.."
                f"{info.max_positions}"]
    first = runner.get("batch_size", 1) * block * info.kv_bytes_per_token()
    if runner.get("kv_offload", "none") == "cpu":
        first *= 2  # the host tier pages the same blocks
    free = available_bytes(device)
    if free is not None and first > free:
        return [f"runner.kv_block_tokens={block} with runner.batch_size="
                f"{runner.get('batch_size', 1)}: one block per layer and sequence needs "
                f"{fmt_bytes(first)} but {fmt_bytes(free)} of {device.type} memory is available"]
    return []


def engine_settings(runner: dict[str, Any]):
    from harness.core.engine import EngineSettings

    return EngineSettings(
        prefill_chunk_tokens=runner["prefill_chunk_tokens"], batch_size=runner["batch_size"],
        check_budget=bool(runner.get("check_budget", True)),
        diagnostics_every=int(runner["diagnostics_every_steps"]) if runner.get("diagnostics") else 0,
        kv_offload=runner.get("kv_offload", "none"), protocol=protocol_from(runner),
        kv_layout=runner.get("kv_layout", "contiguous"),
        kv_block_tokens=runner.get("kv_block_tokens", DEFAULT_BLOCK_TOKENS),
        kv_device_limit_mib=runner.get("kv_device_limit_mib"),
        kv_admission=runner.get("kv_admission", "request"))


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
