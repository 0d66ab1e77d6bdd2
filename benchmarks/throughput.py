"""Serving shape: decode throughput and KV capacity per method versus batch size.

For each method and batch size B: B different prompts of `--prompt-tokens` tokens (consecutive
slices of the essay text) are prefilled together (ragged-capable batch, harness.core.batch) and
decoded greedily for `--new-tokens` tokens with no stop token, so every step carries B rows. Per
cell: decode tokens/s (all sequences; tokens / decode wall time), decode ms per step (median:
each sequence's time per output token), prefill tokens/s, the KV bytes one sequence holds at
the end per tier (compute device and host), and the process peak memory (CUDA max allocated, or
CPU peak RSS, which includes the weights). Capacity: the largest batch whose compute-device KV
fits `--kv-memory-gib` at this length, from the measured per-sequence device bytes.

Cells (context, batch) run in `--order` (`batch`: batch 1 at every length first); within a cell
the methods alternate, `--rounds` rounds, medians over rounds; the load average and thread
policy are printed with the table. Ratios are against full at the same batch size, measured in
the same rounds.

    python benchmarks/throughput.py --prompt-tokens 1024 --new-tokens 64 --batches 1 2 4 8 \\
        --methods full streaming_llm h2o kivi infinigen --json results/throughput.json
    python benchmarks/throughput.py --model random_llama_8b --device cuda --dtype bfloat16 \\
        --prompt-tokens 8192 32768 --batches 1 8 --methods full full_offload infinigen h2o_offload kivi

TTFT under load (LayerKV): with `--ttft-concurrency N ...`, N requests arrive at once
and are admitted under a device KV limit (`--kv-device-limit-mib`, default: two requests' full
KV at this length) by request-level admission (all layers' blocks or wait) and by LayerKV
(per-layer blocks, the rest of a request's layers on the host tier), method full, paged layout:
TTFT mean / max from the arrival, decode ms per step, end-to-end tokens/s, bytes moved.

    python benchmarks/throughput.py --prompt-tokens 1024 --new-tokens 64 --ttft-concurrency 1 2 4 8

`--json` is rewritten (atomically) after every measurement, so a run killed by a timeout keeps
what it measured: `complete_contexts` lists the lengths whose batch sizes are all done (each
context says `complete`), `finished` is true only after the last cell, `skipped` / `failed` name
cells not run (`--skip-cells`) or out of memory (the run goes on with the next cell).

Offload rows also report host->device MB per decode step, the copies' own duration (transfer ms)
and the part of it the consumer waited for (exposed ms), per decode step (prefill copies
included in both). `random_llama_1b` / `random_llama_8b`: random Llama-3 shapes for speed only.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.random_models import SHAPES, random_llama, random_prompt  # noqa: E402
from harness.core import hf_adapter
from harness.core import models  # noqa: E402
from harness.core.engine import Engine, EngineSettings  # noqa: E402
from harness.core.profiling import peak_memory, reset_peak_memory  # noqa: E402
from harness.store.results import write_json_atomic  # noqa: E402
from methods import build_method  # noqa: E402
from tasks.text_sources import load_essays  # noqa: E402

# row -> (method, hyperparameters, runner.kv_offload): paper defaults, budgets at 20 %
METHODS = {
    "full": ("full", {}, "none"),
    "streaming_llm": ("streaming_llm", {"budget_ratio": 0.2}, "none"),
    "h2o": ("h2o", {"budget_ratio": 0.2}, "none"),
    "kivi": ("kivi", {}, "none"),
    "infinigen": ("infinigen", {}, "none"),
    "full_offload": ("full_offload", {}, "none"),
    "h2o_offload": ("h2o", {"budget_ratio": 0.2}, "cpu"),
    # the rest of the compressing family, for the vLLM projection (benchmarks/vllm_projection.py)
    "snapkv": ("snapkv", {"budget_ratio": 0.2}, "none"),
    "pyramidkv": ("pyramidkv", {"budget_ratio": 0.2}, "none"),
    "tova": ("tova", {"budget_ratio": 0.2}, "none"),
    "quest": ("quest", {"budget_ratio": 0.2}, "none"),
    "kvquant": ("kvquant", {}, "none"),
    "turboquant": ("turboquant", {}, "none"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GIB = 2**30


def build(model, tok, info, name, calibration: list[int]):
    method_name, kw, _ = METHODS[name]
    method = build_method(method_name, **kw)
    calib = None if tok is not None else torch.tensor(calibration[:2048])
    hf_adapter.prepare(method, model, tok, info, data_dir=models.SHARED_DIR / "data",
                       calibration_ids=calib)
    return method


def measure(model, tok, info, name, method, prompts: list[list[int]], new_tokens: int) -> dict:
    """One batch of len(prompts) sequences: prefill together, decode `new_tokens` greedily."""
    engine = Engine(model, tok, method, info,
                    EngineSettings(prefill_chunk_tokens=2048, batch_size=len(prompts),
                                   kv_offload=METHODS[name][2]))
    reset_peak_memory(engine.device)
    with engine.batch(len(prompts)) as batch:
        outs = batch.generate(prompts, [new_tokens] * len(prompts), stop_ids=set())
        stats = [[kv.stats() for kv in cache.kv_layers] for cache in batch.caches]
    assert all(len(o) == new_tokens for o in outs)
    speed = engine.speed().as_dict()
    moved = engine.transfers.summary()
    steps = max(1, moved["decode_steps"])
    device = [sum(s.get("kv_bytes_device", s["kv_bytes"]) for s in seq) for seq in stats]
    total = [sum(s["kv_bytes"] for s in seq) for seq in stats]
    return {"decode_tokens_per_s": speed["decode_tokens_per_s"],
            "decode_ms_per_step": speed["decode_ms_per_token_median"],
            "prefill_tokens_per_s": speed["prefill_tokens_per_s"],
            "kv_bytes_device_per_seq": max(device), "kv_bytes_host_per_seq":
                max(t - d for t, d in zip(total, device)),
            "peak_bytes": peak_memory(engine.device)["peak_bytes"],
            "h2d_bytes_per_step": moved["bytes_per_decode_step"] or 0,
            # prefill copies included: exposed <= transfer, their ratio is the un-hidden share
            "transfer_ms_per_step": moved["transfer_ms"] / steps,
            "exposed_ms_per_step": moved["exposed_ms"] / steps}


def measure_ttft(model, tok, info, method, prompts: list[list[int]], new_tokens: int,
                 limit_mib: float, admission: str) -> dict:
    """N requests arriving together, admitted under the device limit (harness.core.serving)."""
    engine = Engine(model, tok, method, info,
                    EngineSettings(prefill_chunk_tokens=2048, batch_size=len(prompts),
                                   kv_layout="paged", kv_device_limit_mib=limit_mib,
                                   kv_admission=admission))
    t0 = time.perf_counter()
    outs = list(engine.generate_many(prompts, new_tokens, stop_ids=set()))
    wall_s = time.perf_counter() - t0
    assert all(len(o) == new_tokens for o in outs)
    speed, moved = engine.speed().as_dict(), engine.transfers.summary()
    pools = engine.tier.paged.summary()
    assert pools["device_bytes_held_peak"] <= pools["device_limit_bytes"]
    return {"ttft_ms_mean": speed["ttft_ms_mean"], "ttft_ms_max": speed["ttft_ms_max"],
            "decode_ms_per_step": speed["decode_ms_per_token_median"],
            "tokens_per_s_end_to_end": len(prompts) * new_tokens / wall_s,
            "device_mib_peak": pools["device_bytes_held_peak"] / 2**20,
            "h2d_mb_per_step": (moved["bytes_per_decode_step"] or 0) / 1e6,
            "outputs": outs}


def ttft_table(cells: dict, limit_mib: float) -> str:
    lines = [f"| admission | concurrent requests | TTFT mean ms | TTFT max ms | x request-level "
             f"(mean) | decode ms/step | end-to-end tok/s | device KV peak MiB (limit "
             f"{limit_mib:.1f}) | H2D MB/step |", "|" + "---|" * 9]
    for n, per in cells.items():
        for admission, r in per.items():
            base = per.get("request")
            ratio = f"{r['ttft_ms_mean'] / base['ttft_ms_mean']:.2f}" if base else "-"
            lines.append(f"| {admission} | {n} | {r['ttft_ms_mean']:.0f} | {r['ttft_ms_max']:.0f} | "
                         f"{ratio} | {r['decode_ms_per_step']:.1f} | "
                         f"{r['tokens_per_s_end_to_end']:.1f} | {r['device_mib_peak']:.1f} | "
                         f"{r['h2d_mb_per_step']:.2f} |")
    return "\n".join(lines)


def run_ttft(args, model, tok, info, text, vocab, out: dict) -> None:
    from harness.core.serving import ADMISSIONS, layer_bytes

    method = build_method("full")
    dtype_bytes = DTYPES[args.dtype].itemsize
    for length in args.prompt_tokens:
        need = info.num_layers * layer_bytes(info, length + args.new_tokens, 16, dtype_bytes)
        limit_mib = args.kv_device_limit_mib or 2 * need / 2**20
        load_before = os.getloadavg()[0]
        runs: dict[int, dict[str, list[dict]]] = {}
        for _ in range(args.rounds):
            for n in args.ttft_concurrency:
                prompts = prompts_from(text, vocab, n, length)
                outputs = {}
                for admission in ADMISSIONS:  # alternate within the round
                    r = measure_ttft(model, tok, info, method, prompts, args.new_tokens,
                                     limit_mib, admission)
                    outputs[admission] = r.pop("outputs")
                    runs.setdefault(n, {}).setdefault(admission, []).append(r)
                    print(f"  {length} N={n} {admission}: TTFT mean {r['ttft_ms_mean']:.0f} ms, "
                          f"{r['decode_ms_per_step']:.1f} ms/step (load "
                          f"{os.getloadavg()[0]:.1f})", flush=True)
                assert outputs["request"] == outputs["layerkv"], "LayerKV changed the outputs"
        cells = {n: {a: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                     for a, rs in per.items()} for n, per in runs.items()}
        load_avg = (load_before + os.getloadavg()[0]) / 2
        print(f"\nTTFT under a device KV limit of {limit_mib:.1f} MiB (two requests' full KV "
              f"unless set), {args.model} ({args.dtype}), prompt {length} + {args.new_tokens} new, "
              f"method full, paged (16-token blocks), {args.rounds} round(s), threads "
              f"{torch.get_num_threads()}, load avg {load_avg:.2f}; outputs equal under both")
        print(ttft_table(cells, limit_mib))
        out["ttft"][str(length)] = {"limit_mib": limit_mib, "load_avg": round(load_avg, 2),
                                    "cells": {str(n): c for n, c in cells.items()}}


def prompts_from(text: list[int] | None, vocab: int, batch: int, length: int) -> list[list[int]]:
    """`batch` different prompts: consecutive slices of the text, or random ids (random model)."""
    if text is None:
        return [random_prompt(vocab, length, seed=i) for i in range(batch)]
    if batch * length > len(text):
        raise SystemExit(f"--prompt-tokens {length} x batch {batch} needs {batch * length} "
                         f"tokens of text; the essays give {len(text)}")
    return [text[i * length:(i + 1) * length] for i in range(batch)]


def load(args):
    if args.model in SHAPES:
        device = args.device if args.device != "auto" else (
            "cuda" if torch.cuda.is_available() else "cpu")
        positions = max(args.prompt_tokens) + args.new_tokens + 8
        model, tok = random_llama(args.model, device, DTYPES[args.dtype], positions)
        return model, tok, device, None
    spec = models.resolve_model({"name": args.model, "device": args.device, "dtype": args.dtype})
    model, tok = models.load_model(spec, "sdpa")
    return model, tok, str(spec.device), tok(load_essays(), verbose=False)["input_ids"]


def table(cells: dict, batches: list[int], kv_limit_gib: float) -> str:
    """One row per method and batch; `x full` is against full at the same batch (same rounds)."""
    lines = ["| method | batch | decode tok/s | x full | ms/step | prefill tok/s | "
             "KV/seq device MiB | KV/seq host MiB | peak MiB | max batch in "
             f"{kv_limit_gib:g} GiB KV | H2D MB/step | transfer ms/step | exposed ms/step |",
             "|" + "---|" * 13]
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
                         f"{(r.get('peak_bytes') or 0) / 2**20:.0f} | "
                         f"{r['max_batch_in_limit'] or '-'} | {r['h2d_bytes_per_step'] / 1e6:.2f} | "
                         f"{r['transfer_ms_per_step']:.2f} | {r['exposed_ms_per_step']:.2f} |")
    return "\n".join(lines)


def summarize(runs: dict[str, dict[str, list[dict]]], kv_limit_gib: float) -> dict:
    """Medians over rounds per method and batch, plus the capacity column."""
    cells = {}
    for name, per_batch in runs.items():
        cells[name] = {}
        for b, rs in per_batch.items():
            cell = {key: statistics.median(r[key] for r in rs) for key in rs[0]
                    if rs[0][key] is not None}
            cell["decode_tokens_per_s_rounds"] = [r["decode_tokens_per_s"] for r in rs]
            per_seq = cell["kv_bytes_device_per_seq"]
            cell["max_batch_in_limit"] = int(kv_limit_gib * GIB // per_seq) if per_seq else None
            cells[name][b] = cell
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--kv-memory-gib", type=float, default=1.0,
                    help="compute-device memory for KV: the capacity column")
    ap.add_argument("--methods", nargs="+", default=["full", "streaming_llm", "h2o", "kivi",
                                                     "infinigen"], choices=list(METHODS))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--json", default=None,
                    help="write the results here (atomically, after every measured cell)")
    ap.add_argument("--order", default="context", choices=["context", "batch"],
                    help="context: each length's batches in turn; batch: every length at the "
                         "first batch size before the next batch size")
    ap.add_argument("--skip-cells", nargs="*", default=[], metavar="METHOD:CONTEXT:BATCH",
                    help="cells not to run (e.g. ones that would not fit in host memory)")
    ap.add_argument("--ttft-concurrency", type=int, nargs="*", default=None,
                    help="instead of the batch table: TTFT vs N concurrent requests (LayerKV)")
    ap.add_argument("--kv-device-limit-mib", type=float, default=None,
                    help="with --ttft-concurrency: the device KV limit (default: two requests)")
    args = ap.parse_args()
    for key in ("prompt_tokens", "batches", "ttft_concurrency"):
        values = getattr(args, key) or []
        if any(v <= 0 for v in values) or (key != "ttft_concurrency" and not values):
            ap.error(f"--{key.replace('_', '-')} {' '.join(map(str, values))}: each must be a "
                     "positive integer")
    for key in ("new_tokens", "rounds"):
        if getattr(args, key) <= 0:
            ap.error(f"--{key.replace('_', '-')} {getattr(args, key)}: must be a positive integer")
    if args.kv_memory_gib <= 0 or not math.isfinite(args.kv_memory_gib):
        ap.error(f"--kv-memory-gib {args.kv_memory_gib}: must be a positive number")
    skip = parse_skips(args.skip_cells)
    model, tok, device, text = load(args)
    info = hf_adapter.model_info(model.config, DTYPES[args.dtype])
    vocab = model.config.vocab_size
    calibration = text if text is not None else random_prompt(vocab, 2048, seed=99)
    if args.ttft_concurrency:
        out = {"model": args.model, "device": device, "dtype": args.dtype,
               "new_tokens": args.new_tokens, "rounds": args.rounds,
               "threads": torch.get_num_threads(), "ttft": {}}
        run_ttft(args, model, tok, info, text, vocab, out)
        if args.json:
            write_json_atomic(Path(args.json), out)
        return
    methods = {name: build(model, tok, info, name, calibration) for name in args.methods}
    t0, out = time.time(), {"model": args.model, "device": device, "dtype": args.dtype,
                            "new_tokens": args.new_tokens, "rounds": args.rounds,
                            "threads": torch.get_num_threads(),
                            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                            "kv_memory_gib": args.kv_memory_gib,
                            "methods": {n: METHODS[n] for n in args.methods},
                            "planned": {"contexts": args.prompt_tokens, "batches": args.batches,
                                        "order": args.order},
                            "skipped": {}, "failed": {}, "complete_contexts": [],
                            "finished": False, "contexts": {}}
    runs: dict[int, dict[str, dict[str, list[dict]]]] = {}
    load_before: dict[int, float] = {}
    finished_cells: set[tuple[int, int]] = set()
    for length, b in cell_order(args.prompt_tokens, args.batches, args.order):
        load_before.setdefault(length, os.getloadavg()[0])
        per_method = runs.setdefault(length, {n: {} for n in args.methods})
        prompts = prompts_from(text, vocab, b, length)
        for _ in range(args.rounds):
            for name in args.methods:  # alternate within the round
                if (name, length, b) in skip:
                    out["skipped"].setdefault(str(length), {}).setdefault(name, {})[str(b)] = \
                        "--skip-cells"
                    continue
                try:
                    r = measure(model, tok, info, name, methods[name], prompts, args.new_tokens)
                except (torch.OutOfMemoryError, RuntimeError) as exc:
                    # device or pinned-host memory: record the cell as failed, go on with the rest
                    if "out of memory" not in str(exc).lower():
                        raise
                    out["failed"].setdefault(str(length), {}).setdefault(name, {})[str(b)] = \
                        str(exc).splitlines()[0][:300]
                    print(f"  {length} {name} B={b}: out of memory ({str(exc).splitlines()[0]})",
                          flush=True)
                    free_memory()
                    record(args, out, runs, load_before, finished_cells, t0)
                    continue
                per_method[name].setdefault(str(b), []).append(r)
                print(f"  {length} {name} B={b}: {r['decode_tokens_per_s']:.1f} tok/s, "
                      f"{r['decode_ms_per_step']:.1f} ms/step (load "
                      f"{os.getloadavg()[0]:.1f})", flush=True)
                # after every measurement: a timeout or a crash later keeps what is measured
                record(args, out, runs, load_before, finished_cells, t0)
        finished_cells.add((length, b))
        record(args, out, runs, load_before, finished_cells, t0)
        if all((length, bb) in finished_cells for bb in args.batches):
            part = out["contexts"][str(length)]
            print(f"\n{args.model} on {device} ({args.dtype}), prompt {length} + "
                  f"{args.new_tokens} new tokens, {args.rounds} round(s), threads "
                  f"{torch.get_num_threads()}, "
                  f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
                  f"load avg {part['load_avg']:.2f}")
            print(table(part["cells"], args.batches, args.kv_memory_gib), flush=True)
    out["finished"] = True
    record(args, out, runs, load_before, finished_cells, t0)


def free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        # cached pinned blocks too (public API of the pinned torch; absent from older ones)
        empty_host = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if empty_host is not None:
            empty_host()


def cell_order(contexts: list[int], batches: list[int], order: str) -> list[tuple[int, int]]:
    """(context, batch) cells in run order: `context` (each context's batches in turn) or `batch`
    (each batch's contexts in turn: batch 1 at every length before the larger batches)."""
    if order == "batch":
        return [(t, b) for b in batches for t in contexts]
    return [(t, b) for t in contexts for b in batches]


def parse_skips(items: list[str]) -> set[tuple[str, int, int]]:
    """`METHOD:CONTEXT:BATCH` cells not to run (recorded under "skipped")."""
    skips = set()
    for item in items:
        try:
            name, length, batch = item.split(":")
            skips.add((name, int(length), int(batch)))
        except ValueError:
            raise SystemExit(f"--skip-cells {item!r}: want METHOD:CONTEXT:BATCH") from None
    return skips


def record(args, out: dict, runs: dict, load_before: dict, finished_cells: set, t0: float) -> None:
    """Summarise what is measured so far into `out` and write it (atomically) to --json: a
    context is in `complete_contexts` once all its batch sizes are done (each context's entry
    says `complete` too); `finished` is true only after the last cell."""
    for length, per_method in runs.items():
        measured = {n: pb for n, pb in per_method.items() if pb}
        complete = all((length, b) in finished_cells for b in args.batches)
        previous = out["contexts"].get(str(length), {})
        load_avg = previous.get("load_avg")
        if complete and load_avg is None:  # the load over the context's cells, once complete
            load_avg = round((load_before[length] + os.getloadavg()[0]) / 2, 2)
        out["contexts"][str(length)] = {"load_avg": load_avg, "complete": complete,
                                        "cells": summarize(measured, args.kv_memory_gib)}
    done = {t for t, part in out["contexts"].items() if part["complete"]}
    out["complete_contexts"] = [t for t in args.prompt_tokens if str(t) in done]
    out["wall_s"] = round(time.time() - t0, 1)
    if args.json:
        write_json_atomic(Path(args.json), out)


if __name__ == "__main__":
    main()
