"""Contiguous vs paged KV storage (runner.kv_layout): decode ms per step and memory waste.

A batch of `--batch` ragged essay prompts (the longest `--context` tokens, the others shorter,
evenly spaced down to half) is decoded together (engine.batch) for `--new-tokens` steps, per
method and layout. Lockstep: in each round every (method, layout) cell's batch is prefilled and
open side by side, then step k of every cell runs back to back (the order rotating each step),
so a burst of machine noise hits every cell alike. Per cell: the median decode ms per step over
all steps of all rounds, the storage waste when each sequence ended (harness.core.accounting: used /
allocated K/V bytes) and the paged pools' figures. Per method, the ratio to read: the median
over (round, step) of paged step k / contiguous step k (paired, same round). Goal:
full <= 1.05x (decode reads the paged blocks in place: methods.layer.FullLayer); H2O still
gathers its blocks (its fused kernel reads a contiguous tensor), reported without a goal.
`full_sdpa` is the full cache as it was before (the model's SDPA over `keys`/`values`, paged: a
gather): `full` vs `full_sdpa` per layout shows what the in-place reads changed.

    python benchmarks/paged_layout.py --context 1024 --batch 4 --new-tokens 32 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
from dataclasses import dataclass
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from harness.store.results import write_json_atomic  # noqa: E402
from harness.session import of_methods  # noqa: E402
from kvcore.errors import ConfigError  # noqa: E402
from methods import build_method  # noqa: E402
from methods.full import Full  # noqa: E402
from methods.layer import KVLayer  # noqa: E402
from methods.model import ModelInfo  # noqa: E402
from tasks.text_sources import load_essays  # noqa: E402

METHODS = {"full": ("full", {}), "full_sdpa": ("full_sdpa", {}),
           "h2o_0.2": ("h2o", {"budget_ratio": 0.2})}
GOALS = {"full": 1.05}  # paged / contiguous decode step, paired median


@dataclass(kw_only=True)
class FullSDPA(Full):
    """The full cache as it was before in-place paged reads: the base KVLayer, whose decode
    steps attend with the model's SDPA over `keys`/`values` (paged: a gather of the blocks)."""

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return KVLayer(layer_idx, info)


def make_method(name: str):
    method, kw = METHODS[name]
    return FullSDPA() if method == "full_sdpa" else build_method(method, **kw)
LAYOUTS = ("contiguous", "paged")


def lockstep(session, settings: dict, prompts, new_tokens: int) -> dict:
    """One round: every (method, layout) cell's batch (cell -> harness.session Setting)
    prefilled, then decoded in lockstep. Returns per cell the decode ms of each step and the
    storage figures at the end."""
    cells = list(settings)
    engines = {cell: session.engine(settings[cell]) for cell in cells}
    seqs = list(range(len(prompts)))
    with contextlib.ExitStack() as stack:
        batches = {cell: stack.enter_context(engines[cell].batch(len(prompts))) for cell in cells}
        tokens = {cell: batches[cell].prefill(prompts).argmax(-1).tolist() for cell in cells}
        for k in range(new_tokens):
            for cell in cells[k % len(cells):] + cells[:k % len(cells)]:
                tokens[cell] = batches[cell].step(seqs, tokens[cell]).argmax(-1).tolist()
    out = {}
    for cell in cells:
        engine = engines[cell]
        kv = engine.ledger.summary()
        out[cell] = {"step_ms": engine.speed().decode_ms,
                     "storage_bytes_used": kv["storage_bytes_used"],
                     "storage_bytes_allocated": kv["storage_bytes_allocated"],
                     "storage_waste_ratio": kv["storage_waste_ratio"],
                     "paged_pools": engine.tier.paged.summary() if engine.tier.paged else None}
    return out


def open_cells(model_name: str, make, names, batch: int, block_tokens: int,
               threads: int | None):
    """A session of one setting per (method, layout) cell (`make(name)`: a new method), batches
    of `batch`, every setting checked before the weights load (a refused one: one line), the
    model loaded with `threads` torch threads. Returns (session, cell -> setting, the essays'
    token ids)."""
    if threads:
        torch.set_num_threads(threads)
    cells = [(name, layout) for name in names for layout in LAYOUTS]
    try:
        session, settings = of_methods(
            {"name": model_name, "device": "auto"}, {cell: make(cell[0]) for cell in cells},
            row_knobs={cell: {"kv_layout": cell[1]} for cell in cells},
            prefill_chunk_tokens=512, batch_size=batch, kv_block_tokens=block_tokens)
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
    session.load("sdpa")
    return session, settings, session.tokenizer(load_essays(), verbose=False)["input_ids"]


def batch_prompts(essays: list[int], context: int, batch: int, info, new_tokens: int):
    """`batch` essay prompts, the longest `context` tokens (capped so that `new_tokens` fit the
    positions), the others evenly shorter down to half: (lengths, prompts)."""
    context = min(context, info.max_positions - new_tokens)
    lengths = [context - i * context // (2 * batch) for i in range(batch)]
    return lengths, [essays[i * 97: i * 97 + n] for i, n in enumerate(lengths)]


def paired_ratio(rounds: list[dict], cell: tuple, reference: tuple) -> float:
    """Median over (round, step) of cell's step k / reference cell's step k (same round)."""
    return statistics.median(a / b for r in rounds for a, b in
                             zip(r[cell]["step_ms"], r[reference]["step_ms"]))


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
    methods = [name for name in METHODS if name in args.methods]
    session, settings, essays = open_cells(args.model, make_method, methods, args.batch,
                                           args.block_tokens, args.threads)
    info = session.info
    lengths, prompts = batch_prompts(essays, args.context, args.batch, info, args.new_tokens)
    load_before = os.getloadavg()[0]
    t0 = time.time()
    rounds = []
    for r in range(args.rounds):
        rounds.append(lockstep(session, settings, prompts, args.new_tokens))
        print(f"  round {r + 1}: " + ", ".join(
            f"{name}/{layout} {statistics.median(v['step_ms']):.2f}"
            for (name, layout), v in rounds[-1].items())
            + f" ms/step (load {os.getloadavg()[0]:.1f})", flush=True)
    load = (load_before + os.getloadavg()[0]) / 2
    print(f"\n{args.model}, batch {args.batch} ragged prompts {lengths} + {args.new_tokens} new, "
          f"blocks of {args.block_tokens}, {args.rounds} lockstep rounds, threads "
          f"{torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"load avg {load:.2f}")
    print(f"{'method':9} {'layout':11} {'decode ms':>9} {'paged/contig':>12} "
          f"{'used MiB':>9} {'alloc MiB':>9} {'waste':>7} {'pool blocks':>11}  goal")
    rows = {}
    for name in methods:
        for layout in LAYOUTS:
            last = rounds[-1][name, layout]
            rows[f"{name}/{layout}"] = {
                **{k: v for k, v in last.items() if k != "step_ms"},
                "decode_ms": statistics.median(ms for rd in rounds
                                               for ms in rd[name, layout]["step_ms"]),
                "decode_ms_rounds": [statistics.median(rd[name, layout]["step_ms"])
                                     for rd in rounds]}
        paged = rows[f"{name}/paged"]
        ratio = paired_ratio(rounds, (name, "paged"), (name, "contiguous"))
        paged["decode_paged_vs_contiguous"] = ratio
        goal = GOALS.get(name)
        if goal is not None:
            paged["goal"], paged["goal_met"] = goal, ratio <= goal
        for layout in LAYOUTS:
            row = rows[f"{name}/{layout}"]
            pools = row["paged_pools"]
            shown = f"{ratio:.3f}" if layout == "paged" else ""
            note = "" if layout != "paged" or goal is None else (
                f"<= {goal:.2f}: {'met' if ratio <= goal else 'NOT met'}")
            print(f"{name:9} {layout:11} {row['decode_ms']:9.2f} {shown:>12} "
                  f"{row['storage_bytes_used'] / 2**20:9.2f} "
                  f"{row['storage_bytes_allocated'] / 2**20:9.2f} "
                  f"{row['storage_waste_ratio']:7.3f} "
                  f"{pools['blocks_allocated'] if pools else '':>11}  {note}")
    if "full" in methods and "full_sdpa" in methods:  # the in-place reads vs before, per layout
        for layout in LAYOUTS:
            ratio = paired_ratio(rounds, ("full", layout), ("full_sdpa", layout))
            rows[f"full/{layout}"]["decode_vs_full_sdpa"] = ratio
            print(f"full/{layout} vs full_sdpa/{layout} (before in-place reads): {ratio:.3f}")
    out = {"model": args.model, "lengths": lengths, "new_tokens": args.new_tokens,
           "block_tokens": args.block_tokens, "rounds": args.rounds,
           "threads": torch.get_num_threads(), "load_avg": round(load, 2),
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
           "wall_s": round(time.time() - t0, 1), "rows": rows}
    if args.json:
        write_json_atomic(Path(args.json), out)


if __name__ == "__main__":
    main()
