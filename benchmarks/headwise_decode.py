"""Decode step of a head-wise method vs its uniform counterpart at the same mean budget.

Ada-KV splits each layer's budget across its KV heads (ragged rows, methods/eviction.py) where
SnapKV gives every head the same count; both score with SnapKV's observation window and hold the
same number of tokens per layer. What the per-head storage and the ragged attention kernels must
make true: the ragged cache costs about what the rectangular one costs per decode step. Per
context, one round prefills a batch of `--batch` essay prompts (the longest `--context` tokens)
into every (method, layout) cell, then decodes them in lockstep (step k of every cell back to back,
the order rotating; benchmarks/paged_layout.lockstep); the ratio is the median over (round, step)
of adakv step k / snapkv step k (same layout, same round). Goal: <= 1.15x.

    python benchmarks/headwise_decode.py --contexts 1024 4096 --budget-ratio 0.2 --rounds 3
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from harness.store.results import write_json_atomic  # noqa: E402
from methods import build_method  # noqa: E402
from paged_layout import (  # noqa: E402
    LAYOUTS, batch_prompts, lockstep, open_cells, paired_ratio)

PAIR = ("adakv", "snapkv")  # (head-wise, uniform)
GOAL = 1.15  # head-wise / uniform decode step, paired median


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--budget-ratio", type=float, default=0.2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the figures as JSON here (atomically)")
    args = ap.parse_args()
    session, settings, essays = open_cells(
        args.model, lambda name: build_method(name, budget_ratio=args.budget_ratio), PAIR,
        args.batch, args.block_tokens, args.threads)
    info = session.info
    load_before, t0 = os.getloadavg()[0], time.time()
    out = {}
    print(f"{args.model}, {PAIR[0]} vs {PAIR[1]} at budget_ratio {args.budget_ratio}, batch "
          f"{args.batch}, {args.new_tokens} new tokens, {args.rounds} lockstep rounds, threads "
          f"{torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    print(f"{'context':>7} {'layout':11} {PAIR[0] + ' ms':>9} {PAIR[1] + ' ms':>10} "
          f"{'ratio':>6}  goal")
    for context in args.contexts:
        lengths, prompts = batch_prompts(essays, context, args.batch, info, args.new_tokens)
        context = lengths[0]
        rounds = [lockstep(session, settings, prompts, args.new_tokens)
                  for _ in range(args.rounds)]
        for layout in LAYOUTS:
            ms = {name: statistics.median(v for r in rounds for v in r[name, layout]["step_ms"])
                  for name in PAIR}
            ratio = paired_ratio(rounds, (PAIR[0], layout), (PAIR[1], layout))
            out[f"{context}/{layout}"] = {"decode_ms": ms, "ratio": ratio, "goal": GOAL,
                                          "goal_met": ratio <= GOAL,
                                          "storage_bytes_used": {
                                              n: rounds[-1][n, layout]["storage_bytes_used"]
                                              for n in PAIR}}
            print(f"{context:7d} {layout:11} {ms[PAIR[0]]:9.2f} {ms[PAIR[1]]:10.2f} "
                  f"{ratio:6.3f}  <= {GOAL}: {'met' if ratio <= GOAL else 'NOT met'}", flush=True)
    load = (load_before + os.getloadavg()[0]) / 2
    print(f"load avg {load:.2f}, {time.time() - t0:.0f} s")
    if args.json:
        write_json_atomic(Path(args.json), {
            "model": args.model, "pair": PAIR, "budget_ratio": args.budget_ratio,
            "batch": args.batch, "new_tokens": args.new_tokens, "rounds": args.rounds,
            "threads": torch.get_num_threads(), "load_avg": round(load, 2),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "rows": out})


if __name__ == "__main__":
    main()
