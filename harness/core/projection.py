"""Projected decode time on another machine from this run's transfer ledger (`hardware=...`).

Labelled as projected, never as measured: a hardware profile (`conf/hardware/*.yaml`: achieved
host-to-device link bandwidth and device memory bandwidth) turns the measured bytes moved per
decode step into link time, which is combined with the compute time measured in this run:
  compute_ms   = measured decode ms/token - measured exposed transfer ms per decode step
  transfer_ms  = bytes host->device per decode step / link bandwidth
  serial_ms    = compute_ms + transfer_ms      (no overlap)
  overlapped_ms= max(compute_ms, transfer_ms)  (perfect overlap: a lower bound)
The prefetch is not hideable on PCIe (the overlap window is one layer's FFN: for OPT-13B ~0.8 ms
on an A6000 against ~7 ms to move a 10 % KV load on PCIe 3), so serial is the realistic figure;
the compute part is from *this* machine, so the projection answers "what would the moves cost
there", not "how fast is that GPU".

Capacity and throughput for another model shape, without weights or a GPU (the CLI):

    python -m harness.core.projection --model-config path/to/config.json --context-tokens 32768 \\
        [--runs results/...] [--hardware h200_sxm pcie4_a100 ...] [--dtype bfloat16] [--out f.md]

"How many requests of length L fit, and how many tokens per second, with method X on hardware
Y?" — answered from a config alone (the parameter count comes from the model built on the meta
device: no memory, no weights) and from each method's *measured* KV figures, read from the
metrics.json of runs you made on any model (`--runs`): the ratios below are per token and
transfer to another model of the same attention layout. Everything printed is labelled
projected; the formulas:

  full_bytes_per_token = 2 * layers * kv_heads * head_dim * itemsize           (exact)
  device_ratio   = kv.bytes_device_total / kv.full_cache_bytes   (measured: KV on the device)
  read_ratio     = min(kv.held_ratio, kv.attended_fraction_all_layers)   (bytes a step reads)
  moved_ratio    = transfer.bytes_per_decode_step / (seen tokens * full bytes per token)
  max_batch      = floor((device memory - weights - reserve) / (L * full_bytes * device_ratio))
  step_ms(B)     = (weights + B*L*full_bytes*read_ratio) / HBM bandwidth      (memory roofline)
                   + B*L*full_bytes*moved_ratio / link bandwidth                (serial link)
  tokens_per_s   = B / step_ms * 1000

A memory-bound roofline is the right first-order model for decode (one token per sequence per
step); it ignores kernel efficiency and compute, so real numbers are lower — measure with
scripts/gpu_check.sh where a GPU is available.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from harness import CONF_DIR
from harness.store import inputs
from kvcore.errors import ConfigError

RESERVE_FRACTION = 0.1  # device memory kept for activations, workspace and fragmentation
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Shape:
    name: str
    parameters: int
    layers: int
    kv_heads: int
    head_dim: int
    itemsize: int

    @property
    def full_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.itemsize

    @property
    def weight_bytes(self) -> int:
        return self.parameters * self.itemsize


@dataclass(frozen=True)
class MethodRatios:
    label: str  # method + its variant knobs, as measured
    device_ratio: float
    read_ratio: float
    moved_ratio: float
    source: str  # the run it was measured in


def shape_from_config(path: Path, dtype: str) -> Shape:
    """Layer shapes from the config and the exact parameter count from a meta-device model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from harness.core.hf_adapter import model_info

    if not path.is_file():
        raise ConfigError(f"--model-config {path}: no such file (a transformers config.json)")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model-config {path}: not a transformers config "
                          f"({str(exc).splitlines()[0]})") from None
    info = model_info(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    name = getattr(config, "_name_or_path", "") or path.parent.name
    return Shape(name or path.parent.name, params, info.num_layers, info.num_kv_heads,
                 info.head_dim, DTYPES[dtype])


def ratios_from_run(metrics: dict, source: str) -> MethodRatios | None:
    kv, transfer, method = metrics.get("kv", {}), metrics.get("transfer", {}), metrics["method"]
    full = kv.get("full_cache_bytes")
    seen = kv.get("seen_tokens_mean")
    if not full or not seen:
        return None
    held = kv.get("held_ratio", kv["bytes_total"] / full)
    attended = kv.get("attended_fraction_all_layers")
    per_token = full / seen
    moved = (transfer.get("bytes_per_decode_step") or 0.0) / (seen * per_token)
    hyper = method.get("hyperparameters", {})
    knobs = [k for k in method.get("axis_keys", []) + method.get("variant_keys", [])
             if hyper.get(k) is not None]
    label = " ".join([method["name"], *(f"{k}={hyper[k]}" for k in knobs)])
    return MethodRatios(label, kv.get("bytes_device_total", kv["bytes_total"]) / full,
                        min(held, attended) if attended is not None else held, moved, source)


def load_runs(patterns: list[str]) -> list[MethodRatios]:
    out: dict[str, MethodRatios] = {}
    for pattern in patterns:
        root = Path(pattern)
        files = [root] if root.is_file() else sorted(root.rglob("metrics.json"))
        if not files:
            raise ConfigError(f"--runs {pattern}: no metrics.json found")
        for f in files:
            try:  # kind and size first: a FIFO or a link to /dev/zero is skipped, never read
                metrics = inputs.strict_json(inputs.read_text(f, "--runs"))
                if not isinstance(metrics, dict):
                    raise ValueError(f"a JSON {inputs.json_type(metrics)}, not a run's metrics")
                ratios = ratios_from_run(metrics, str(f.parent))
            except (OSError, ValueError, KeyError) as exc:  # ConfigError is a ValueError
                print(f"warning: skipping {f}: {exc}", file=sys.stderr)
                continue
            metrics_kv = metrics.get("kv", {})
            if metrics_kv.get("method_active") is False:
                print(f"warning: skipping {f.parent}: the method did not act in that run "
                      f"({metrics_kv.get('inactive_reason')})", file=sys.stderr)
            elif ratios is not None:
                out[ratios.label] = ratios  # the last run of a label wins (sorted paths)
    return list(out.values())


def load_profile(name: str) -> dict:
    path = CONF_DIR / "hardware" / f"{name}.yaml"
    allowed = sorted(p.stem for p in path.parent.glob("*.yaml") if p.stem != "none")
    if name == "none" or not path.is_file():
        raise ConfigError(f"--hardware {name}: unknown; allowed: {', '.join(allowed)}")
    return yaml.safe_load(path.read_text())


def project(hardware: dict, speed: dict, transfer: dict) -> dict | None:
    if not hardware or hardware.get("name") in (None, "none"):
        return None
    decode_ms = speed.get("decode_ms_per_token_median")
    steps = transfer.get("decode_steps") or 0
    per_step = transfer.get("bytes_per_decode_step") or 0.0
    if decode_ms is None or not steps:
        return {"label": "projected", "hardware": hardware["name"], "note": "no decode steps"}
    exposed_per_step = (transfer.get("exposed_ms") or 0.0) / steps
    compute_ms = max(decode_ms - exposed_per_step, 0.0)
    transfer_ms = per_step / (float(hardware["link_gb_per_s"]) * 1e6)
    return {
        "label": "projected (compute measured on this run's device + modelled link time)",
        "hardware": hardware["name"],
        "link_gb_per_s": hardware["link_gb_per_s"],
        "compute_ms_measured": round(compute_ms, 4),
        "transfer_ms": round(transfer_ms, 4),
        "decode_ms_serial": round(compute_ms + transfer_ms, 4),
        "decode_ms_overlapped": round(max(compute_ms, transfer_ms), 4),
    }


def project_capacity(shape: Shape, hw: dict, ratios: MethodRatios, context_tokens: int) -> dict:
    memory = hw["device_memory_gib"] * 2**30 * (1 - RESERVE_FRACTION) - shape.weight_bytes
    per_request = context_tokens * shape.full_bytes_per_token * ratios.device_ratio
    if memory <= 0:
        batch = 0
    elif per_request <= 0:
        batch = None  # nothing on the device grows with the batch (all on the host tier)
    else:
        batch = int(memory // per_request)
    b = batch if batch else 1
    kv_read = b * context_tokens * shape.full_bytes_per_token * ratios.read_ratio
    moved = b * context_tokens * shape.full_bytes_per_token * ratios.moved_ratio
    step_ms = ((shape.weight_bytes + kv_read) / (hw["memory_gb_per_s"] * 1e9)
               + moved / (hw["link_gb_per_s"] * 1e9)) * 1e3
    return {"hardware": hw["name"], "method": ratios.label, "max_batch": batch,
            "step_ms_at_batch": round(step_ms, 3), "batch_used": b,
            "tokens_per_s": round(b / step_ms * 1e3, 1) if step_ms else math.inf,
            "label": "projected"}


def table(shape: Shape, rows: list[dict], context_tokens: int) -> str:
    lines = [f"Projected capacity and decode throughput (memory roofline + serial link; not "
             f"measured): {shape.name}, {shape.parameters / 1e9:.2f} B parameters, "
             f"{shape.full_bytes_per_token / 2**10:.0f} KiB full KV per token, context "
             f"{context_tokens} tokens", "",
             "| hardware | method | max batch that fits | ms/step at that batch | tokens/s |",
             "|---|---|---|---|---|"]
    for r in rows:
        fit = "host-resident KV (no device limit)" if r["max_batch"] is None else r["max_batch"]
        lines.append(f"| {r['hardware']} | {r['method']} | {fit} | {r['step_ms_at_batch']} | "
                     f"{r['tokens_per_s']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.core.projection", description=__doc__.splitlines()[0])
    ap.add_argument("--model-config", required=True, type=Path)
    ap.add_argument("--context-tokens", type=int, default=32768)
    ap.add_argument("--runs", nargs="*", default=[], help="result folders with measured methods")
    ap.add_argument("--hardware", nargs="*", default=["pcie3_a6000", "pcie4_a100", "h200_sxm"])
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = ap.parse_args(argv)
    try:
        if args.context_tokens <= 0:
            raise ConfigError(f"--context-tokens={args.context_tokens} must be positive")
        profiles = [load_profile(h) for h in args.hardware]
        shape = shape_from_config(args.model_config, args.dtype)
        methods = [MethodRatios("full (exact)", 1.0, 1.0, 0.0, "definition"),
                   *load_runs(args.runs)]
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = [project_capacity(shape, hw, m, args.context_tokens) for hw in profiles for m in methods]
    text = table(shape, rows, args.context_tokens)
    print(text)
    if args.out:
        from harness.store.results import write_text_atomic

        write_text_atomic(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
