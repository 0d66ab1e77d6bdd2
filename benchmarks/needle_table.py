"""Needle table across methods and budgets (RULER niah_single, one run per row, through the runner).

    python benchmarks/needle_table.py [--budgets 0.2 0.5] [--bits 2 4] [--lengths 1024 2048 4096]
                                      [--depths 10 30 50 70 90] [--dense-layers 0 1] [--methods ...]
    python benchmarks/needle_table.py --rows "method=quest method.budget_ratio=0.05" ...

Every compressing method (prefill-only compressors included: a needle prompt is prefilled) at
each budget_ratio, the quantizers at each bit width, and full — under one protocol for all rows
(`runner.dense_layers`, dense prefill, greedy decoding, the same samples: one index per cell, so
every method sees the same needle keys). Each row is a normal harness run (its folder under
--results-root, reused with `runner.skip_existing=true` when the same config already ran); the
table is printed as markdown from the runs' metrics.json: found / samples per length and in all,
KV held at the end, attended fraction in the sparse layers, decode ms per token and host-tier
bytes moved per decode step.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from perplexity_table import existing, family_rows, label, select_rows  # noqa: E402


def found(accuracy: dict, length: int, samples: int) -> str:
    cell = accuracy.get("per_length", {}).get(str(length))
    if cell is None:
        return "n/a"
    return f"{round(cell['niah_single'] / 100 * samples)}/{samples}"


def moved_per_step(metrics: dict) -> str:
    """Host-to-device bytes per decode step (the offload ledger), MiB; '-' for device-only runs."""
    transfer = metrics.get("transfer") or {}
    per_step = transfer.get("bytes_per_decode_step")
    return "-" if not per_step else f"{per_step / 2**20:.2f}"


def table_row(metrics: dict, name: str, lengths: list[int], per_length: int) -> str:
    acc, kv, speed = metrics["accuracy"], metrics["kv"], metrics["speed"]
    cells = [found(acc, n, per_length) for n in lengths]
    total = round(acc["niah_single"] / 100 * acc["samples"])
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    ms = speed.get("decode_ms_per_token_median")
    return (f"| {name} | " + " | ".join(cells) + f" | {total}/{acc['samples']} | "
            f"{fmt(kv.get('held_ratio'))} | {fmt(kv.get('attended_fraction_sparse_layers'))} | "
            f"{'n/a' if ms is None else f'{ms:.1f}'} | {moved_per_step(metrics)} |")


def _csv(xs) -> str:
    return "[" + ",".join(str(x) for x in xs) + "]"


def needle_overrides(model: str, lengths, depths, dense_layers, results_root: str,
                     batch_size: int = 1, threads: int | None = None, extra=()) -> list[str]:
    """The overrides every row of the table shares (its protocol and where runs live)."""
    return [f"model={model}", "task=ruler", "task.subtasks=[niah_single]",
            f"task.lengths={_csv(lengths)}", f"task.depths={_csv(depths)}",
            f"runner.dense_layers={_csv(dense_layers)}", f"runner.batch_size={batch_size}",
            f"runner.results_root={results_root}", "runner.skip_existing=true",
            *([f"runner.threads={threads}"] if threads else []), *extra]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.2, 0.5])
    ap.add_argument("--bits", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--depths", type=int, nargs="+", default=[10, 30, 50, 70, 90])
    ap.add_argument("--dense-layers", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--methods", nargs="*", default=None, help="only these methods (and full)")
    ap.add_argument("--rows", nargs="*", default=None,
                    help="explicit rows instead of the family, each a quoted override list")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every run")
    ap.add_argument("--results-root", default=str(ROOT / "results" / "needle_table"))
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    ap.add_argument("--existing-only", action="store_true",
                    help="run nothing: tabulate the rows whose run already exists (others: "
                         "'not measured')")
    args = ap.parse_args()

    from hydra import compose, initialize_config_dir

    from harness.store.results import write_text_atomic
    from harness.run import run
    from kvcore.errors import ConfigError

    if args.rows is not None:
        rows = [shlex.split(r) for r in args.rows]
    else:
        rows = family_rows(args.budgets, args.bits, streamed=False)
        rows = select_rows(rows, args.methods)
    common = needle_overrides(args.model, args.lengths, args.depths, args.dense_layers,
                              args.results_root, args.batch_size, args.threads, args.extra)
    per_length = len(args.depths)
    head = " | ".join(f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in args.lengths)
    lines = [f"Needle (RULER niah_single), {args.model}, lengths {args.lengths} x depths "
             f"{args.depths} %, runner.dense_layers={_csv(args.dense_layers)} for every row, "
             "dense prefill, greedy", "",
             f"| method | {head} | all | KV held | attended (sparse layers) | decode ms/tok | "
             "host MiB moved/step |", "|---|" + "---|" * (len(args.lengths) + 5)]
    for overrides in rows:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=common + overrides)
        try:
            folder = existing(cfg, "ruler") if args.existing_only else run(cfg)
            if folder is None:
                lines.append(f"| {label(overrides)} | not measured |" + " |" * (len(args.lengths) + 4))
                continue
        except ConfigError as refusal:  # e.g. a budget a method's own knobs cannot meet
            lines.append(f"| {label(overrides)} | refused before loading: {refusal} |"
                         + " |" * (len(args.lengths) + 4))
            print(lines[-1], flush=True)
            continue
        metrics = json.loads((folder / "metrics.json").read_text())
        lines.append(table_row(metrics, label(overrides), args.lengths, per_length))
        print(lines[-1], flush=True)
        if args.out:
            write_text_atomic(Path(args.out), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
