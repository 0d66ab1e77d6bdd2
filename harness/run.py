"""The runner: compose -> validate (no weights) -> load -> prepare -> evaluate -> write atomically.

`run(cfg)` is the whole pipeline as a function (tests call it with a composed config);
`main` is the Hydra entry point behind `python -m harness`.
"""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvcore.errors import BudgetViolation, ConfigError, OutputError, UnsupportedCombination
from harness.loggers import log_run
from harness.methods_table import serving_requirements
from harness.projection import project
from harness.schema import stamp
from harness.serving import check_admission
from harness.sweep import group_options, multirun_job, record_status, resolve_output
from kvcore.paged import DEFAULT_BLOCK_TOKENS
from kvcore.storage import KV_LAYOUTS
from methods.base import BUDGET_BASES, PREFILL_MODES, Protocol, compression_timing

log = logging.getLogger("harness")
ATTN_IMPLS = ("sdpa", "eager")
KV_OFFLOADS = ("none", "cpu")
ACCOUNTING = ("harness.accounting: held = bytes on every tier / full cache in the model dtype; "
              "attended = tokens attended / tokens seen at decode steps, ratio of sums, sparse "
              "layers = all but the effective dense layers")


def _plain(node) -> dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def _split_name(group: str, node, choice: str | None = None) -> tuple[str, dict[str, Any]]:
    """The group's name and options; `choice` is the config file the CLI chose for the group
    (by default, the running Hydra job's)."""
    options = _plain(node)
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
    if runner.get("kv_offload", "none") not in KV_OFFLOADS:
        raise ConfigError(f"runner.kv_offload={runner.get('kv_offload')!r}; allowed: "
                          f"{', '.join(KV_OFFLOADS)}")
    if runner.get("kv_layout", "contiguous") not in KV_LAYOUTS:
        raise ConfigError(f"runner.kv_layout={runner.get('kv_layout')!r}; allowed: "
                          f"{', '.join(KV_LAYOUTS)}")
    if "kv_block_tokens" in runner:
        positive_int("kv_block_tokens")
        if (runner.get("kv_layout", "contiguous") != "paged"
                and runner["kv_block_tokens"] != DEFAULT_BLOCK_TOKENS):
            raise ConfigError(f"runner.kv_block_tokens={runner['kv_block_tokens']} applies to "
                              "runner.kv_layout=paged only (contiguous buffers have no blocks); "
                              "set runner.kv_layout=paged or drop it")
    check_admission(runner)
    if runner.get("attn_impl") not in ATTN_IMPLS:
        raise ConfigError(f"runner.attn_impl={runner.get('attn_impl')!r}; allowed: "
                          f"{', '.join(ATTN_IMPLS)}")
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
    if runner.get("prefill", "dense") not in PREFILL_MODES:
        raise ConfigError(f"runner.prefill={runner.get('prefill')!r}; allowed: "
                          f"{', '.join(PREFILL_MODES)}")
    if runner.get("budget_basis", "final") not in BUDGET_BASES:
        raise ConfigError(f"runner.budget_basis={runner.get('budget_basis')!r}; allowed: "
                          f"{', '.join(BUDGET_BASES)}")
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
    from harness.config_check import yaml_defaults

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
    from harness.engine import EngineSettings

    return EngineSettings(
        prefill_chunk_tokens=runner["prefill_chunk_tokens"], batch_size=runner["batch_size"],
        check_budget=bool(runner.get("check_budget", True)),
        diagnostics_every=int(runner["diagnostics_every_steps"]) if runner.get("diagnostics") else 0,
        kv_offload=runner.get("kv_offload", "none"), protocol=protocol_from(runner),
        kv_layout=runner.get("kv_layout", "contiguous"),
        kv_block_tokens=runner.get("kv_block_tokens", DEFAULT_BLOCK_TOKENS),
        kv_device_limit_mib=runner.get("kv_device_limit_mib"),
        kv_admission=runner.get("kv_admission", "request"))


def output_dir(runner: dict[str, Any], task: str, model_name: str, method: str) -> Path:
    if runner.get("output_dir"):
        return Path(runner["output_dir"])
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return Path(runner.get("results_root") or "results") / task / model_name / method / stamp


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run(cfg: DictConfig) -> Path:
    """Run one (model, method, task) and return the result folder."""
    from harness.session import Session

    t_start = time.time()
    session = Session.of([cfg])
    setting = session.settings[0]
    runner = setting.runner
    if runner.get("shards", 1) != 1:
        raise ConfigError(f"runner.shards={runner['shards']} splits the samples of a multirun "
                          "(python -m harness -m ...); a single run is one process: add -m or "
                          "drop it")
    if runner.get("sweep_decode_batch", 1) != 1:
        raise ConfigError(f"runner.sweep_decode_batch={runner['sweep_decode_batch']} decodes the "
                          "settings of a multirun together (python -m harness -m ..., through "
                          "the sweep engine); a single run has one setting (runner.batch_size "
                          "batches its samples): add -m or drop it")
    session.validate(setting)
    out = output_dir(runner, setting.task_name, session.spec.name, setting.method_name)
    done = resolve_output(runner, out, setting.identity)  # refuses a path it must not replace
    if done is not None:
        print(f"skipped: a complete result for this config ({setting.identity}) exists at {done}")
        return done

    import torch

    from harness.profiling import reset_peak_memory

    if runner.get("threads"):
        torch.set_num_threads(int(runner["threads"]))
    seed_everything(int(runner["seed"]))
    session.load(runner["attn_impl"])
    engine = session.engine(setting)
    reset_peak_memory(engine.device)
    result = setting.task.evaluate(engine)
    metrics = build_metrics(session, setting, engine, result, t_start)
    return write_result(setting, out, metrics, result, engine)


def build_metrics(session, setting, engine, result, t_start: float,
                  run_extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """metrics.json of one setting (harness.schema), from its engine's accounting and its task
    result: the one construction for a single run and for each setting of a sweep."""
    from harness import models
    from harness.env import environment
    from harness.profiling import peak_memory
    from harness.uncertainty import cell_uncertainty

    cfg, runner, method, spec, info = (setting.cfg, setting.runner, setting.method,
                                       session.spec, session.info)
    metrics = {
        "accuracy": result.metrics,
        "uncertainty": cell_uncertainty(setting.task_name, result.metrics, result.samples),
        "speed": engine.speed().as_dict(),
        "memory": peak_memory(engine.device),
        "kv": kv_figures(engine, method),
        "transfer": {"kv_offload": runner.get("kv_offload", "none"), **engine.transfers.summary()},
        "model": {"name": spec.name, "description": spec.description, "source": spec.source,
                  "config_hash": spec.extra.get("identity", {}).get("config_hash"),
                  "dtype": str(spec.dtype).replace("torch.", ""), "device": str(engine.device),
                  "num_layers": info.num_layers, "num_heads": info.num_heads,
                  "num_kv_heads": info.num_kv_heads, "head_dim": info.head_dim,
                  "max_positions": info.max_positions,
                  "parameters": models.parameter_count(session.model)},
        "method": {"name": setting.method_name, "hyperparameters": method.hyperparameters(),
                   "provenance": method.provenance_label(),
                   "operating_point": method.operating_point,
                   "axis_keys": list(method.axis_keys), "variant_keys": list(method.variant_keys),
                   "capabilities": vars(method.capabilities) if hasattr(method.capabilities, "__dict__")
                   else {}, "prepare": setting.prepared, "side_files": setting.side_files,
                   "serving": serving_requirements(method)},
        "task": {"name": setting.task_name, "options": setting.task.options()},
        "protocol": {**result.protocol, "dense_layers": list(engine.dense_layers),
                     "dense_layers_runner": list(runner.get("dense_layers") or []),
                     "prefill": engine.settings.protocol.prefill,
                     "budget_basis": engine.settings.protocol.budget_basis,
                     "decode_interval_tokens": engine.settings.protocol.decode_interval_tokens,
                     "compression_timing": compression_timing(engine.settings.protocol),
                     "accounting": ACCOUNTING,
                     "attention_kernel": ("the method's own eager attention with probabilities "
                                          "(needs_attn_scores)" if method.capabilities.needs_attn_scores
                                          else runner["attn_impl"]),
                     "prefill_chunk_tokens": runner["prefill_chunk_tokens"],
                     "batch_size": runner["batch_size"], "attn_impl": runner["attn_impl"],
                     "positions": "text positions, explicit position_ids", "seed": runner["seed"]},
        "env": environment(Path(__file__).resolve().parents[1]),
        "run": {"started": datetime.fromtimestamp(t_start).isoformat(timespec="seconds"),
                "wall_s": round(time.time() - t_start, 3), "config_hash": setting.identity,
                "status": "ok", **(run_extra or {})},
    }
    if engine.diagnostics is not None:
        metrics["diagnostics"] = engine.diagnostics.summary()
    projected = project(_plain(cfg.hardware), metrics["speed"], metrics["transfer"])
    if projected is not None:
        metrics["projected"] = projected
    return stamp(metrics)


def write_result(setting, out: Path, metrics: dict[str, Any], result, engine) -> Path:
    """The run folder, written atomically (staged, mirrored, committed); returns where."""
    from harness.results import RunFolder

    cfg, runner = setting.cfg, setting.runner
    key = "runner.output_dir" if runner.get("output_dir") else "runner.results_root"
    try:
        folder = RunFolder(out)
    except OSError as exc:
        raise OutputError(f"{key}: cannot create {out} ({exc.strerror or exc})") from None
    try:
        folder.write_text("config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        if engine.diagnostics is not None:
            folder.write_json("diagnostics.json", engine.diagnostics.arrays())
        if result.samples:
            folder.write_jsonl("samples.jsonl", result.samples)
        folder.write_json("metrics.json", metrics)  # the result, before any mirror
        mirror(cfg, folder, out, metrics, result.samples)
        final = folder.commit(overwrite=bool(runner.get("overwrite")))
    except OSError as exc:  # disk full, permissions: nothing half-written is left behind
        folder.abandon()
        raise OutputError(f"writing results to {out} failed ({exc.strerror or exc}); nothing was "
                          "written and any previous result there is untouched") from None
    except BaseException:
        folder.abandon()
        raise
    print(summary(metrics, final))
    logged = metrics.get("logger", {})
    if logged.get("mode") == "offline":
        print(f"wandb: offline run in {logged['dir']}; upload it with: wandb sync {logged['dir']}")
    elif logged.get("url"):
        print(f"wandb: {logged['url']}")
    return final


def mirror(cfg: DictConfig, folder, out: Path, metrics: dict[str, Any], samples) -> None:
    """Mirror the staged result to the logger (W&B) and record where in metrics.json. A mirror
    that fails, or whose record no longer fits on the disk, is dropped with one warning line:
    the result is written all the same."""
    logger = _plain(cfg.logger)
    if logger.get("name", "none") == "none":
        return
    job = multirun_job()
    try:
        logged = log_run(logger, folder.staging, OmegaConf.to_container(cfg, resolve=True),
                         metrics, samples, job[0].name if job else None)
        if logged:
            metrics["logger"] = {**logged, "dir": logged["dir"].replace(str(folder.staging),
                                                                        str(out))}
            folder.write_json("metrics.json", stamp(metrics))
    except Exception as exc:  # noqa: BLE001 - a mirror never costs the result
        metrics.pop("logger", None)
        shutil.rmtree(folder.staging / "wandb", ignore_errors=True)
        text = (str(exc).strip().splitlines() or [""])[0]
        print(f"warning: logger={logger.get('name')}: the mirror failed ({type(exc).__name__}: "
              f"{text}); the result is written without it", file=sys.stderr)


def kv_figures(engine, method) -> dict[str, Any]:
    """The one accounting (harness.accounting) of what the method held and attended."""
    from harness.accounting import activity

    kv = {**engine.ledger.summary(), **engine.attended.summary()}
    paged = engine.tier.paged
    kv["kv_layout"] = engine.settings.kv_layout
    kv["paged_pools"] = None if paged is None else paged.summary()
    if engine.settings.kv_device_limit_mib is not None:  # requests queued under a device limit
        kv["kv_admission"] = engine.settings.kv_admission
    return {**kv, **activity(method.capabilities.compresses, kv)}


def check_prompts(task, spec, info, method, config, tokenizer=None) -> None:
    """Checks that need the tokenizer, before any weights load: its vocabulary fits the model's
    embedding, and the task's prompt sizes. `tokenizer`: the model's, when the caller has it
    (a session checks every setting with one), else loaded here."""
    from harness.models import check_vocab
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


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _interval_line(cell: dict[str, Any]) -> list[str]:
    if not cell.get("ci95"):
        return []
    low, high = cell["ci95"]
    return [f"  interval  {cell['metric']} {_fmt(cell['value'])}, 95 % [{_fmt(low)}, "
            f"{_fmt(high)}], n={cell['n']} {cell['n_unit']} ({cell['interval'].split(';')[0]})"]


def held_words(held_ratio: float | None) -> str:
    """`held ratio 0.25, compression 4x`: compression (full / held) is named only when it is one,
    so a method holding more than the full cache never reads as compressing."""
    if held_ratio is None:
        return "held ratio unknown"
    if held_ratio > 1:
        return f"held ratio {_fmt(held_ratio)}: more than the full cache"
    if held_ratio < 1 and held_ratio > 0:
        return f"held ratio {_fmt(held_ratio)}, compression {_fmt(1 / held_ratio)}x"
    return f"held ratio {_fmt(held_ratio)}"


def summary(metrics: dict[str, Any], folder: Path) -> str:
    acc = {k: v for k, v in metrics["accuracy"].items() if not isinstance(v, (list, dict))}
    speed, mem, kv = metrics["speed"], metrics["memory"], metrics["kv"]
    lines = [
        f"kv-harness  task={metrics['task']['name']}  model={metrics['model']['name']}  "
        f"method={metrics['method']['name']}",
        "  accuracy  " + "  ".join(f"{k}={_fmt(v)}" for k, v in acc.items()),
        *_interval_line(metrics.get("uncertainty") or {}),
        f"  speed     prefill {_fmt(speed['prefill_ms_total'])} ms for {speed['prefill_tokens']} tok"
        f" | decode {_fmt(speed['decode_ms_per_token_median'])} ms/tok median "
        f"(p90 {_fmt(speed['decode_ms_per_token_p90'])}), {_fmt(speed['decode_tokens_per_s'])} tok/s",
        f"  memory    {mem['kind']} {_fmt((mem['peak_bytes'] or 0) / 2**20)} MiB",
    ]
    if kv:
        lines.append(f"  kv        {_fmt(kv['bytes_total'] / 2**20)} MiB held (full cache "
                     f"{_fmt(kv['full_cache_bytes'] / 2**20)} MiB, {held_words(kv.get('held_ratio'))}"
                     f"), mean tokens/layer "
                     f"{_fmt(sum(kv['tokens_per_layer']) / len(kv['tokens_per_layer']))}"
                     + (f"; on the compute device {_fmt(kv['bytes_device_total'] / 2**20)} MiB"
                        if kv.get("bytes_device_total") != kv["bytes_total"] else ""))
    if kv.get("attended_fraction_sparse_layers") is not None or kv.get("held_ratio") is not None:
        proto = metrics["protocol"]
        every = proto.get("decode_interval_tokens")
        lines.append(f"  protocol  dense layers {proto['dense_layers'] or 'none'}, prefill "
                     f"{proto['prefill']}, budget basis {proto.get('budget_basis', 'seen')}"
                     + (f", recompressed every {every} decoded tokens" if every else "")
                     + f" | held {_fmt(kv.get('held_ratio'))} of the full cache, "
                     f"attended {_fmt(kv.get('attended_fraction_sparse_layers'))} (sparse layers, "
                     f"decode steps)")
    if kv.get("method_active") is False:
        lines.append(f"  INACTIVE  the method did not act: {kv['inactive_reason']}")
    nonfinite = [k for k, v in acc.items() if isinstance(v, float) and not math.isfinite(v)]
    if nonfinite:  # harness.check never passes such a run
        lines.append(f"  NOT FINITE  {', '.join(f'{k}={acc[k]}' for k in nonfinite)}: the "
                     "model's outputs overflowed or hold NaN; this is no result")
    diag = metrics.get("diagnostics")
    if diag and diag.get("steps_sampled"):
        lines.append(f"  fidelity  attention recall {_fmt(diag['attention_recall_mean'])}, "
                     f"KL(full||method) mean {_fmt(diag['kl_mean'])} over {diag['steps_sampled']} steps")
    moved = metrics.get("transfer", {}).get("bytes_per_decode_step")
    if moved:
        lines.append(f"  transfer  {_fmt(moved / 2**20)} MiB host->device per decode step, exposed "
                     f"{_fmt(metrics['transfer']['exposed_ms'])} ms in total")
    lines.append(f"  written   {folder}")
    return "\n".join(lines)


def _inactive_reason(folder: Path) -> str | None:
    """A complete run whose method did not act is recorded as "inactive", never as plain ok."""
    import json

    try:
        kv = json.loads((Path(folder) / "metrics.json").read_text()).get("kv", {})
    except (OSError, ValueError):
        return None
    return f"{folder}: {kv.get('inactive_reason')}" if kv.get("method_active") is False else None


def traceback_wanted() -> bool:
    """HYDRA_FULL_ERROR=1 as the user set it (the CLI sets Hydra's own copy to 1 to catch its
    errors, and records the user's choice in KVH_FULL_ERROR)."""
    return os.environ.get("KVH_FULL_ERROR") == "1"


def report_error(exc: BaseException, debug: bool) -> int:
    if debug:
        raise exc
    print(f"error: {exc}", file=sys.stderr)
    return 2 if isinstance(exc, ConfigError) else 1


def _overrides() -> list[str]:
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except Exception:
        return []


def main_guarded(cfg: DictConfig) -> None:
    """Single run: one clear line and a non-zero exit on error. Sweep member: record the outcome
    (ok / skipped / failed) and return, so the other members go on."""
    debug = bool(OmegaConf.select(cfg, "runner.debug", default=False)) or traceback_wanted()
    sweeping = multirun_job() is not None
    try:
        folder = run(cfg)
        inactive = _inactive_reason(folder)
        record_status("inactive" if inactive else "ok", inactive or str(folder), _overrides())
    except UnsupportedCombination as exc:
        if not sweeping:
            sys.exit(report_error(exc, debug))
        print(f"skipped: {exc}")
        record_status("skipped", str(exc), _overrides())
    except KeyboardInterrupt:
        print("interrupted: no result written (the run folder is only created when complete)",
              file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - every failure is reported in one line
        if debug:
            raise
        if not sweeping:
            if isinstance(exc, (ConfigError, BudgetViolation)):
                sys.exit(report_error(exc, debug))
            raise
        print(f"failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        record_status("failed", f"{type(exc).__name__}: {exc}", _overrides())
