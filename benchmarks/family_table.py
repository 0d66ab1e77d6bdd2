"""One table of the method family: needle and streaming perplexity side by side.

    python benchmarks/family_table.py --needle-root <root> --ppl-root <root> [--out table.md]
    python benchmarks/family_table.py ... --budgets 0.05 0.1 0.2 --bits --methods quest infinigen
    python benchmarks/family_table.py ... --previous results/reports/issues12_13/tables.md

Runs nothing: every row of the family (each compressing method at each budget_ratio, the
quantizers at each bit width, full; benchmarks/perplexity_table.family_rows) is looked up in the
runs that benchmarks/needle_table.py and `perplexity_table.py --preset families` made, by config
identity (runner.skip_existing's rule), under one protocol for both tasks: `runner.dense_layers=
[0,1]`, dense prefill. A cell whose run is missing says "not measured"; a method that compresses
only over a prefilled prompt has no streamed perplexity (the runner refuses it there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from needle_table import found, moved_per_step, needle_overrides  # noqa: E402
from perplexity_table import (  # noqa: E402
    FAMILY_BUDGETS, existing, family_rows, label, ppl_overrides, select_rows)

DENSE_LAYERS = [0, 1]  # the protocol of both tables


def lookup(common: list[str], overrides: list[str], task: str) -> tuple[dict | None, str]:
    """(metrics of the run of exactly this config, '') or (None, why there is none)."""
    from hydra import compose, initialize_config_dir

    from kvcore.errors import ConfigError

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=common + overrides)
    try:
        folder = existing(cfg, task)
    except ConfigError as refusal:
        return None, f"refused: {refusal}"
    if folder is None:
        return None, "not measured"
    return json.loads((folder / "metrics.json").read_text()), ""


IDLE = " (idle)"  # the run's kv.inactive_reason is set: the method never compressed in it


def idle(metrics: dict) -> str:
    """IDLE for a run flagged inactive, re-judged by today's rule (harness.core.accounting.activity:
    runs recorded before a layer holding less counted as acting may carry a stale flag)."""
    from harness.core.accounting import activity

    kv = metrics["kv"]
    return IDLE if kv.get("inactive_reason") and not activity(True, kv)["method_active"] else ""


def cells(needle: dict | None, ppl: dict | None, why_needle: str, why_ppl: str,
          lengths: list[int], per_length: int, before: tuple[str, str] | None = None
          ) -> list[str]:
    """The row's cells between its label and its protocol; `before`: (needle all, ppl) of an
    earlier table, each placed after its new counterpart."""
    old_needle, old_ppl = ([before[0]], [before[1]]) if before is not None else ([], [])
    if needle is None:
        out = [why_needle] + [""] * len(lengths) + old_needle + ["", "", ""]
    else:
        acc, kv = needle["accuracy"], needle["kv"]
        fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
        out = [found(acc, n, per_length) for n in lengths]
        out += [f"{round(acc['niah_single'] / 100 * acc['samples'])}/{acc['samples']}"
                + idle(needle), *old_needle,
                fmt(kv.get("held_ratio")), fmt(kv.get("attended_fraction_sparse_layers")),
                moved_per_step(needle)]
    if ppl is None:
        return out + [why_ppl, *old_ppl, ""]
    attended = ppl["kv"].get("attended_fraction_sparse_layers")
    return out + [f"{ppl['accuracy']['ppl']:.2f}" + idle(ppl), *old_ppl,
                  "n/a" if attended is None else f"{attended:.3f}"]


def protocol_cell(needle: dict | None, ppl: dict | None) -> str:
    """When the runs compressed and what their ratio budgets were a fraction of (metrics.json's
    protocol; runs made before these were recorded compressed after every prefill chunk and
    budgeted on the tokens seen)."""
    cells = []
    for metrics in (needle, ppl):
        if metrics is not None:
            proto = metrics.get("protocol", {})
            cells.append(f"prefill={proto.get('prefill', 'dense')} "
                         f"basis={proto.get('budget_basis', 'seen')}")
    return " / ".join(dict.fromkeys(cells)) or "-"


def row_key(label_text: str) -> tuple[str, str | None]:
    """(method, its budget or bit-width setting) of a row label: what identifies a row across
    tables whose other overrides differ (a knob added since, a head share)."""
    words = label_text.split()
    setting = next((w for w in words[1:] if w.startswith(("budget_ratio=", "k_bits="))), None)
    return words[0], setting


def markdown_tables(text: str) -> list[list[list[str]]]:
    """Every markdown table of `text` as its rows of cells (header first, the rule left out)."""
    tables, current = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        if current is None:
            current = []
            tables.append(current)
        if not set(line.strip()) <= set("|-: "):
            current.append([c.strip() for c in line.strip().strip("|").split("|")])
    return tables


def previous_rows(path: Path, table: int = 1) -> dict[tuple[str, str | None], tuple[str, str]]:
    """From the `table`-th table (from 1) of an earlier family_table.py output: row key ->
    (needle all, ppl)."""
    tables = markdown_tables(path.read_text())
    if len(tables) < table or "needle all" not in tables[table - 1][0]:
        raise SystemExit(f"--previous {path}: table {table} is not a family table (a '| method "
                         "| ... | needle all |' header)")
    header, *rows = tables[table - 1]
    out = {}
    for cells in rows:
        got = dict(zip(header, cells))
        out.setdefault(row_key(cells[0]), (got.get("needle all", ""), got.get("ppl", "")))
    return out


def provenance_cell(needle: dict | None, ppl: dict | None) -> str:
    """Where the runs' behaviour comes from (metrics.json's method.provenance: official code /
    paper / reconstruction, with any deviation the method names)."""
    labels = [m["method"].get("provenance", "-") for m in (needle, ppl) if m is not None]
    return " / ".join(dict.fromkeys(labels)) or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--needle-root", required=True)
    ap.add_argument("--ppl-root", required=True)
    ap.add_argument("--budgets", type=float, nargs="+", default=list(FAMILY_BUDGETS))
    ap.add_argument("--bits", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--depths", type=int, nargs="+", default=[10, 30, 50, 70, 90])
    ap.add_argument("--dataset", default="wikitext2")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--methods", nargs="*", default=None, help="only these methods (and full)")
    ap.add_argument("--prefill-tokens", type=int, default=None,
                    help="the perplexity runs' task.prefill_tokens (a prompt, then streamed)")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    ap.add_argument("--previous", type=Path, default=None,
                    help="an earlier family table (markdown): its needle-all and ppl cells are "
                         "shown beside each row's, matched by method and budget (or bits)")
    ap.add_argument("--previous-table", type=int, default=1,
                    help="which table of --previous (from 1; e.g. 2: the prompt-protocol table)")
    args = ap.parse_args()
    before = previous_rows(args.previous, args.previous_table) if args.previous else None

    from harness.store.results import write_text_atomic
    from methods import method_class

    protocol = [f"runner.dense_layers=[{','.join(map(str, DENSE_LAYERS))}]"]
    needle_common = needle_overrides(args.model, args.lengths, args.depths, DENSE_LAYERS,
                                     args.needle_root)
    ppl_common = ppl_overrides(args.model, args.dataset, args.max_tokens, args.ppl_root, protocol,
                               args.prefill_tokens)
    rows = select_rows(family_rows(args.budgets, args.bits, streamed=False), args.methods)
    heads = " | ".join(f"needle {n // 1024}K" if n % 1024 == 0 else f"needle {n}"
                       for n in args.lengths)
    lines = [f"Method family, {args.model}: needle (RULER niah_single, lengths {args.lengths} x "
             f"depths {args.depths} %) and streaming perplexity ({args.dataset}, first "
             f"{args.max_tokens} tokens" + (f", a prompt of the first {args.prefill_tokens} then "
                                            "streamed, scored after the prompt"
                                            if args.prefill_tokens else "")
             + f"); {protocol[0]} for every row, dense prefill, greedy.",
             "KV held and attended fraction (sparse layers, decode steps) are the needle runs'; "
             "host MiB moved per decode step likewise ('-': nothing offloaded); ppl attended: the "
             "perplexity run's attended fraction (sparse layers); '(idle)': the run never "
             "compressed (its kv.inactive_reason), so the cell is the full cache's.", "",
             *([f"'before': the same method and budget in {args.previous}, table "
                f"{args.previous_table} (its own protocol; "
                "'-': no such row there).", ""] if before is not None else []),
             f"| method | {heads} | needle all | "
             + ("needle all before | " if before is not None else "")
             + "KV held | attended | host MiB/step | ppl | "
             + ("ppl before | " if before is not None else "")
             + "ppl attended | protocol | provenance |",
             "|---|" + "---|" * (len(args.lengths) + 8 + (2 if before is not None else 0))]
    for overrides in rows:
        needle, why_needle = lookup(needle_common, overrides, "ruler")
        if args.prefill_tokens or not method_class(overrides[0].removeprefix("method=")
                                                   ).capabilities.needs_prompt:
            ppl, why_ppl = lookup(ppl_common, overrides, "perplexity")
        else:
            ppl, why_ppl = None, "prefill-only: not streamed"
        old = None if before is None else [c or "-" for c in
                                           before.get(row_key(label(overrides)), ("-", "-"))]
        row = cells(needle, ppl, why_needle, why_ppl, args.lengths, len(args.depths), old)
        lines.append(f"| {label(overrides)} | " + " | ".join(row)
                     + f" | {protocol_cell(needle, ppl)} | {provenance_cell(needle, ppl)} |")
    text = "\n".join(lines) + "\n"
    if args.out:
        write_text_atomic(Path(args.out), text)
    print(text, end="")


if __name__ == "__main__":
    main()
