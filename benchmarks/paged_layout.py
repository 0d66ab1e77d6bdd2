"""Contiguous vs paged KV storage (runner.kv_layout): memory waste and decode ms/token.

A batch of `--batch` ragged essay prompts (the longest `--context` tokens, the others shorter,
evenly spaced down to half) is decoded together (engine.batch) for `--new-tokens` steps, once
per layout and method; layouts alternate within each round, `--rounds` rounds, medians over
rounds. Per method and layout: decode ms per step (each sequence's ms per output token), the
storage waste when each sequence ended (harness.accounting: used / allocated K/V bytes), and the
paged pools' figures. The ratio to read is paged / contiguous decode ms, measured in the same
rounds: on CPU paged reads gather the blocks into a contiguous tensor at every layer and step.

    python benchmarks/paged_layout.py --context 1024 --batch 4 --new-tokens 32 --rounds 3
"""

from __future__ import annotations

import argparse
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
from harness.results import write_json_atomic  # noqa: E402
from methods import build_method  # noqa: E402
from tasks.text_sources import load_essays  # noqa: E402

METHODS = {"full": ("full", {}), "h2o_0.2": ("h2o", {"budget_ratio": 0.2})}
LAYOUTS = ("contiguous", "paged")


def measure(model, tok, info, method, prompts, new_tokens, layout, block_tokens) -> dict:
    settings = EngineSettings(prefill_chunk_tokens=512, batch_size=len(prompts),
                              kv_layout=layout, kv_block_tokens=block_tokens)
    engine = Engine(model, tok, method, info, settings)
    with engine.batch(len(prompts)) as batch:
        batch.generate(prompts, [new_tokens] * len(prompts), stop_ids=set())
    kv = engine.ledger.summary()
    return {"decode_ms": engine.speed().as_dict()["decode_ms_per_token_median"],
            "storage_bytes_used": kv["storage_bytes_used"],
            "storage_bytes_allocated": kv["storage_bytes_allocated"],
            "storage_waste_ratio": kv["storage_waste_ratio"],
            "paged_pools": engine.tier.paged.summary() if engine.tier.paged else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--json", default=None, help="write the table as JSON here (atomically)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = models.resolve_model({"name": args.model, "device": "auto"})
    model, tok = models.load_model(spec, "sdpa")
    info = hf_adapter.model_info(model.config)
    essays = tok(load_essays(), verbose=False)["input_ids"]
    context = min(args.context, info.max_positions - args.new_tokens)
    lengths = [context - i * context // (2 * args.batch) for i in range(args.batch)]
    prompts = [essays[i * 97: i * 97 + n] for i, n in enumerate(lengths)]
    methods = {name: build_method(m, **kw) for name, (m, kw) in METHODS.items()
               if name in args.methods}
    load_before = os.getloadavg()[0]
    t0 = time.time()
    runs = {(name, layout): [] for name in methods for layout in LAYOUTS}
    for _ in range(args.rounds):
        for name, method in methods.items():
            for layout in LAYOUTS:  # alternate within the round
                r = measure(model, tok, info, method, prompts, args.new_tokens, layout,
                            args.block_tokens)
                runs[name, layout].append(r)
                print(f"  {name} {layout}: {r['decode_ms']:.2f} ms/step "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    load = (load_before + os.getloadavg()[0]) / 2
    print(f"\n{args.model}, batch {args.batch} ragged prompts {lengths} + {args.new_tokens} new, "
          f"blocks of {args.block_tokens}, {args.rounds} alternating rounds, threads "
          f"{torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"load avg {load:.2f}")
    print(f"{'method':9} {'layout':11} {'decode ms':>9} {'paged/contig':>12} "
          f"{'used MiB':>9} {'alloc MiB':>9} {'waste':>7} {'pool blocks':>11}")
    rows = {}
    for name in methods:
        for layout in LAYOUTS:
            rs = runs[name, layout]
            last = rs[-1]
            row = {**last, "decode_ms": statistics.median(r["decode_ms"] for r in rs),
                   "decode_ms_rounds": [r["decode_ms"] for r in rs]}
            rows[f"{name}/{layout}"] = row
        contiguous, paged = rows[f"{name}/contiguous"], rows[f"{name}/paged"]
        paged["decode_paged_vs_contiguous"] = paged["decode_ms"] / contiguous["decode_ms"]
        for layout, row in (("contiguous", contiguous), ("paged", paged)):
            pools = row["paged_pools"]
            ratio = f"{row['decode_paged_vs_contiguous']:.3f}" if layout == "paged" else ""
            print(f"{name:9} {layout:11} {row['decode_ms']:9.2f} {ratio:>12} "
                  f"{row['storage_bytes_used'] / 2**20:9.2f} "
                  f"{row['storage_bytes_allocated'] / 2**20:9.2f} "
                  f"{row['storage_waste_ratio']:7.3f} "
                  f"{pools['blocks_allocated'] if pools else '':>11}")
    out = {"model": args.model, "lengths": lengths, "new_tokens": args.new_tokens,
           "block_tokens": args.block_tokens, "rounds": args.rounds,
           "threads": torch.get_num_threads(), "load_avg": round(load, 2),
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
           "wall_s": round(time.time() - t0, 1), "rows": rows}
    if args.json:
        write_json_atomic(Path(args.json), out)


if __name__ == "__main__":
    main()
