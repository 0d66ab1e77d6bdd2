"""Serving shape: decode throughput and KV capacity per method versus batch size (issue 14).

For each method and batch size B: B different prompts of `--prompt-tokens` tokens (consecutive
slices of the essay text) are prefilled together (ragged-capable batch, harness.batch) and
decoded greedily for `--new-tokens` tokens with no stop token, so every step carries B rows. Per
cell: decode tokens/s (all sequences; tokens / decode wall time), decode ms per step (median:
each sequence's time per output token), prefill tokens/s, the KV bytes one sequence holds at
the end per tier (compute device and host), and the process peak memory (CUDA max allocated, or
CPU peak RSS, which includes the weights). Capacity: the largest batch whose compute-device KV
fits `--kv-memory-gib` at this length, from the measured per-sequence device bytes.

Methods alternate within each round (every method at B, then the next B), `--rounds` rounds,
medians over rounds; the load average and thread policy are printed with the table. Ratios are
against full at the same batch size, measured in the same rounds.

    python benchmarks/throughput.py --prompt-tokens 1024 --new-tokens 64 --batches 1 2 4 8 \\
        --methods full streaming_llm h2o kivi infinigen --json results/throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from harness import hf_adapter, models  # noqa: E402
from harness.engine import Engine, EngineSettings  # noqa: E402
from harness.profiling import peak_memory, reset_peak_memory  # noqa: E402
from methods import build_method  # noqa: E402
from tasks.text_sources import load_essays  # noqa: E402

# row -> (method, hyperparameters): the methods at their paper defaults, budgets at 20 %
METHODS = {
    "full": ("full", {}),
    "streaming_llm": ("streaming_llm", {"budget_ratio": 0.2}),
    "h2o": ("h2o", {"budget_ratio": 0.2}),
    "kivi": ("kivi", {}),
    "infinigen": ("infinigen", {}),
    "full_offload": ("full_offload", {}),
}
GIB = 2**30


def build(model, tok, info, name):
    method_name, kw = METHODS[name]
    method = build_method(method_name, **kw)
    hf_adapter.prepare(method, model, tok, info, data_dir=models.SHARED_DIR / "data")
    return method


def measure(model, tok, info, method, prompts: list[list[int]], new_tokens: int) -> dict:
    """One batch of len(prompts) sequences: prefill together, decode `new_tokens` greedily."""
    engine = Engine(model, tok, method, info,
                    EngineSettings(prefill_chunk_tokens=1024, batch_size=len(prompts)))
    reset_peak_memory(engine.device)
    with engine.batch(len(prompts)) as batch:
        outs = batch.generate(prompts, [new_tokens] * len(prompts), stop_ids=set())
        stats = [[kv.stats() for kv in cache.kv_layers] for cache in batch.caches]
    assert all(len(o) == new_tokens for o in outs)
    speed = engine.speed().as_dict()
    device = [sum(s.get("kv_bytes_device", s["kv_bytes"]) for s in seq) for seq in stats]
    total = [sum(s["kv_bytes"] for s in seq) for seq in stats]
    return {"decode_tokens_per_s": speed["decode_tokens_per_s"],
            "decode_ms_per_step": speed["decode_ms_per_token_median"],
            "prefill_tokens_per_s": speed["prefill_tokens_per_s"],
            "kv_bytes_device_per_seq": max(device), "kv_bytes_host_per_seq":
                max(t - d for t, d in zip(total, device)),
            "peak_bytes": peak_memory(engine.device)["peak_bytes"]}


def prompts_from(essays: list[int], batch: int, length: int) -> list[list[int]]:
    if batch * length > len(essays):
        raise SystemExit(f"--prompt-tokens {length} x batch {batch} needs {batch * length} "
                         f"tokens of text; the essays give {len(essays)}")
    return [essays[i * length:(i + 1) * length] for i in range(batch)]


def table(cells: dict, batches: list[int], kv_limit_gib: float) -> str:
    lines = ["| method | batch | decode tok/s | x full | ms/step | prefill tok/s | "
             "KV/seq device MiB | KV/seq host MiB | peak MiB | max batch in "
             f"{kv_limit_gib:g} GiB KV |", "|" + "---|" * 10]
    for name, per_batch in cells.items():
        for b in batches:
            r = per_batch.get(str(b))
            if r is None:
                continue
            full = cells.get("full", {}).get(str(b))
            ratio = (f"{r['decode_tokens_per_s'] / full['decode_tokens_per_s']:.2f}"
                     if full else "-")
            lines.append(f"| {name} | {b} | {r['decode_tokens_per_s']:.1f} | {ratio} | "
                         f"{r['decode_ms_per_step']:.1f} | {r['prefill_tokens_per_s']:.0f} | "
                         f"{r['kv_bytes_device_per_seq'] / 2**20:.2f} | "
                         f"{r['kv_bytes_host_per_seq'] / 2**20:.2f} | "
                         f"{(r.get('peak_bytes') or 0) / 2**20:.0f} | {r['max_batch_in_limit']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--kv-memory-gib", type=float, default=1.0,
                    help="compute-device memory for KV: the capacity column")
    ap.add_argument("--methods", nargs="+", default=["full", "streaming_llm", "h2o", "kivi",
                                                     "infinigen"], choices=list(METHODS))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default=None, help="write the results here (atomically)")
    args = ap.parse_args()
    spec = models.resolve_model({"name": args.model, "device": args.device})
    model, tok = models.load_model(spec, "sdpa")
    info = hf_adapter.model_info(model.config, spec.dtype)
    essays = tok(load_essays(), verbose=False)["input_ids"]
    methods = {name: build(model, tok, info, name) for name in args.methods}
    runs: dict[str, dict[str, list[dict]]] = {n: {} for n in args.methods}
    t0, load_before = time.time(), os.getloadavg()[0]
    for _ in range(args.rounds):
        for b in args.batches:
            prompts = prompts_from(essays, b, args.prompt_tokens)
            for name in args.methods:  # alternate within the round
                r = measure(model, tok, info, methods[name], prompts, args.new_tokens)
                runs[name].setdefault(str(b), []).append(r)
                print(f"  {name} B={b}: {r['decode_tokens_per_s']:.1f} tok/s, "
                      f"{r['decode_ms_per_step']:.1f} ms/step (load {os.getloadavg()[0]:.1f})",
                      flush=True)
    cells = {}
    for name, per_batch in runs.items():
        cells[name] = {}
        for b, rs in per_batch.items():
            cell = {key: statistics.median(r[key] for r in rs) for key in rs[0]
                    if rs[0][key] is not None}
            cell["decode_tokens_per_s_rounds"] = [r["decode_tokens_per_s"] for r in rs]
            per_seq = cell["kv_bytes_device_per_seq"]
            cell["max_batch_in_limit"] = (int(args.kv_memory_gib * GIB // per_seq)
                                          if per_seq else None)
            cells[name][b] = cell
    load = (load_before + os.getloadavg()[0]) / 2
    header = (f"{args.model} on {spec.device}, prompt {args.prompt_tokens} + {args.new_tokens} new "
              f"tokens, {args.rounds} round(s), threads {torch.get_num_threads()}, "
              f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, load avg {load:.2f}")
    print("\n" + header + "\n" + table(cells, args.batches, args.kv_memory_gib))
    out = {"model": args.model, "device": str(spec.device), "prompt_tokens": args.prompt_tokens,
           "new_tokens": args.new_tokens, "rounds": args.rounds,
           "threads": torch.get_num_threads(), "load_avg": round(load, 2),
           "kv_memory_gib": args.kv_memory_gib, "methods": {n: METHODS[n] for n in args.methods},
           "cells": cells, "wall_s": round(time.time() - t0, 1)}
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(out, indent=2))
        tmp.replace(path)


if __name__ == "__main__":
    main()
