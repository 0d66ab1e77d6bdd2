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
from harness.report.loggers import log_run
from harness.report.methods_table import capability_values, serving_requirements
from harness.core.projection import project
from harness.store.schema import stamp
from harness.config.runner import RunnerSettings, plain
from harness.session import Session
from harness.config.multirun import multirun_job, record_status, resolve_output
from methods.protocol import compression_timing

log = logging.getLogger("harness")
ACCOUNTING = ("harness.core.accounting: held = bytes on every tier / full cache in the model dtype; "
              "attended = tokens attended / tokens seen at decode steps, ratio of sums, sparse "
              "layers = all but the effective dense layers")


def output_dir(runner: RunnerSettings, task: str, model_name: str, method: str) -> Path:
    if runner.output_dir:
        return Path(runner.output_dir)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return Path(runner.results_root) / task / model_name / method / stamp


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run(cfg: DictConfig) -> Path:
    """Run one (model, method, task) and return the result folder."""
    t_start = time.time()
    session = Session.of([cfg])
    setting = session.settings[0]
    runner = setting.runner
    if runner.shards != 1:
        raise ConfigError(f"runner.shards={runner.shards} splits the samples of a multirun "
                          "(python -m harness -m ...); a single run is one process: add -m or "
                          "drop it")
    if runner.sweep_decode_batch != 1:
        raise ConfigError(f"runner.sweep_decode_batch={runner.sweep_decode_batch} decodes the "
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

    from harness.core.profiling import reset_peak_memory

    if runner.threads:
        torch.set_num_threads(runner.threads)
    seed_everything(runner.seed)
    session.load(runner.attn_impl)
    engine = session.engine(setting)
    reset_peak_memory(engine.device)
    result = setting.task.evaluate(engine)
    metrics = build_metrics(session, setting, engine, result, t_start)
    return write_result(setting, out, metrics, result, engine)


def build_metrics(session, setting, engine, result, t_start: float,
                  run_extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """metrics.json of one setting (harness.store.schema), from its engine's accounting and its task
    result: the one construction for a single run and for each setting of a sweep."""
    from harness.core import models
    from harness.core.env import environment
    from harness.core.profiling import peak_memory
    from harness.stats.uncertainty import cell_uncertainty

    cfg, runner, method, spec, info = (setting.cfg, setting.runner, setting.method,
                                       session.spec, session.info)
    metrics = {
        "accuracy": result.metrics,
        "uncertainty": cell_uncertainty(setting.task_name, result.metrics, result.samples),
        "speed": engine.speed().as_dict(),
        "memory": task_peak_memory(engine) or peak_memory(engine.device),
        "kv": kv_figures(engine, method),
        "transfer": {"kv_offload": runner.kv_offload, **engine.transfers.summary()},
        "model": {**model_section(spec, info, engine.device),
                  "parameters": models.parameter_count(session.model)},
        "method": {**method_section(setting),
                   "capabilities": capability_values(method.capabilities),
                   "prepare": setting.prepared, "side_files": setting.side_files,
                   "serving": serving_requirements(method)},
        "task": {"name": setting.task_name, "options": setting.task.options()},
        "protocol": {**result.protocol, "dense_layers": list(engine.dense_layers),
                     "dense_layers_runner": list(runner.dense_layers),
                     "prefill": engine.settings.protocol.prefill,
                     "budget_basis": engine.settings.protocol.budget_basis,
                     "decode_interval_tokens": engine.settings.protocol.decode_interval_tokens,
                     "compression_timing": compression_timing(engine.settings.protocol),
                     "accounting": ACCOUNTING,
                     "attention_kernel": ("the method's own eager attention with probabilities "
                                          "(needs_attn_scores)" if method.capabilities.needs_attn_scores
                                          else runner.attn_impl),
                     "prefill_chunk_tokens": runner.prefill_chunk_tokens,
                     "batch_size": runner.batch_size, "attn_impl": runner.attn_impl,
                     "positions": "text positions, explicit position_ids", "seed": runner.seed},
        "env": environment(Path(__file__).resolve().parents[1]),
        "run": {**run_section(t_start, setting.identity), **(run_extra or {})},
    }
    if engine.diagnostics is not None:
        metrics["diagnostics"] = engine.diagnostics.summary()
    if setting.task.options().get("fidelity_tokens"):
        metrics["fidelity"] = fidelity_section(setting, result.samples)
        # its wall time (outside every figure of the setting), with the run's own
        metrics["run"]["fidelity_ms"] = round(fidelity_ms(engine), 3)
    projected = project(plain(cfg.hardware), metrics["speed"], metrics["transfer"])
    if projected is not None:
        metrics["projected"] = projected
    return stamp(metrics)


def fidelity_section(setting, samples: list[dict]) -> dict[str, Any]:
    """metrics.json's `fidelity` (task.fidelity_tokens > 0, harness.core.fidelity): the KL and
    top-token statistics with their intervals (harness.stats.fidelity)."""
    from harness.stats import fidelity

    section = fidelity.summary(samples) or {"samples": 0, "tokens": 0}
    return {**section, "fidelity_tokens": setting.task.options()["fidelity_tokens"],
            "reference": "the full cache on the same model (dense prefill, the run's chunks): "
                         "its greedy continuation teacher-forced through the setting; not timed "
                         "in the setting's figures"}


def fidelity_ms(engine) -> float:
    from harness.core import fidelity

    return fidelity.fidelity_ms(engine)


def task_peak_memory(engine) -> dict[str, Any] | None:
    """The peak memory before a fidelity pass ran (harness.core.fidelity), or None."""
    from harness.core import fidelity

    return fidelity.task_peak_memory(engine)


def model_section(spec, info, device) -> dict[str, Any]:
    """metrics.json's `model`: what ran, whichever engine ran it."""
    return {"name": spec.name, "description": spec.description, "source": spec.source,
            "config_hash": spec.extra.get("identity", {}).get("config_hash"),
            "dtype": str(spec.dtype).replace("torch.", ""), "device": str(device),
            "num_layers": info.num_layers, "num_heads": info.num_heads,
            "num_kv_heads": info.num_kv_heads, "head_dim": info.head_dim,
            "max_positions": info.max_positions}


def method_section(setting) -> dict[str, Any]:
    """metrics.json's `method`, what names the setting (the report's row and curve), whichever
    engine ran it."""
    method = setting.method
    return {"name": setting.method_name, "hyperparameters": method.hyperparameters(),
            "provenance": method.provenance_label(), "operating_point": method.operating_point,
            "axis_keys": list(method.axis_keys), "variant_keys": list(method.variant_keys)}


def run_section(t_start: float, identity: str) -> dict[str, Any]:
    """metrics.json's `run`: when it started, how long it took, its config identity."""
    return {"started": datetime.fromtimestamp(t_start).isoformat(timespec="seconds"),
            "wall_s": round(time.time() - t_start, 3), "config_hash": identity, "status": "ok"}


def write_result(setting, out: Path, metrics: dict[str, Any], result, engine) -> Path:
    """The run folder, written atomically (staged, mirrored, committed); returns where."""
    from harness.store.results import RunFolder

    cfg, runner = setting.cfg, setting.runner
    key = "runner.output_dir" if runner.output_dir else "runner.results_root"
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
        final = folder.commit(overwrite=runner.overwrite)
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
    logger = plain(cfg.logger)
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
    """The one accounting (harness.core.accounting) of what the method held and attended."""
    from harness.core.accounting import activity

    kv = {**engine.ledger.summary(), **engine.attended.summary()}
    paged = engine.tier.paged
    kv["kv_layout"] = engine.settings.kv_layout
    kv["paged_pools"] = None if paged is None else paged.summary()
    if engine.settings.kv_device_limit_mib is not None:  # requests queued under a device limit
        kv["kv_admission"] = engine.settings.kv_admission
    return {**kv, **activity(method.capabilities.compresses, kv)}


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
    if nonfinite:  # harness.report.check never passes such a run
        lines.append(f"  NOT FINITE  {', '.join(f'{k}={acc[k]}' for k in nonfinite)}: the "
                     "model's outputs overflowed or hold NaN; this is no result")
    diag = metrics.get("diagnostics")
    if diag and diag.get("steps_sampled"):
        lines.append(f"  fidelity  attention recall {_fmt(diag['attention_recall_mean'])}, "
                     f"KL(full||method) mean {_fmt(diag['kl_mean'])} over {diag['steps_sampled']} steps")
    fid = metrics.get("fidelity")
    if fid and fid.get("tokens"):
        lines.append(f"  fidelity  KL(full||setting) mean {_fmt(fid['kl_mean']['value'])}, median "
                     f"{_fmt(fid['kl_median']['value'])}, p99 {_fmt(fid['kl_p99']['value'])}, "
                     f"same top token {_fmt(fid['top_agree_percent']['value'])} % over "
                     f"{fid['tokens']} tokens of {fid['samples']} samples"
                     + (f"; gold log-prob {_fmt(fid['gold_logprob_mean']['value'])} (full "
                        f"{_fmt(fid['gold_logprob_full_mean']['value'])})"
                        if fid.get("gold_samples") else ""))
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
