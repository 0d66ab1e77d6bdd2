"""Collect runs into a leaderboard, figures and one self-contained page.

    python -m harness.report <results dir or glob> [<more> ...] [--out DIR]

Reads only `metrics.json` files (a run *is* its folder), each checked against the schema
(harness/store/schema.py): a corrupt or foreign file is skipped with a warning naming it, the rest are
reported; hidden folders (runs being written) are never read. Writes into --out (default
`<first dir>/_report`; a new folder, or one holding only an earlier report):
  * report.html      the page to open (self-contained): first, per budget level, the best
                     setting, those that cannot be told from it and the full cache, with their
                     cost (budgets); then the leaderboard grouped by budget with letters
                     (letters), the figures, every run
  * leaderboard.md/.csv  methods x tasks (main metric) per model and protocol, with KV held,
                     attended fraction, decode ms, bytes moved, provenance / operating point
  * report.md        the leaderboard and which figure answers which question, then every run
  * report.csv       one row per run
  * figures          figures.FIGURES (accuracy vs KV held / attended with the Pareto frontier,
                     RULER grid, decode ms vs context, throughput vs batch, capacity, NLL,
                     bytes per step); each PNG at most 3000 px a side

Modules: collect (runs -> rows, the axes), style (one colour/marker per method), figures,
leaderboard, compare (intervals, comparisons with the full cache), budgets (budget levels,
pairwise comparisons inside them), letters (the compact letter display), html, build (the
command), validation (`python -m harness.report.validation`: does per-sample fidelity to the full
cache order settings that accuracy cannot; a section of the report when >= 3 settings carry it),
ledgers (a sweep run in rounds: its ledger's anytime-valid table, a section of the report over
its runs).
"""

from harness.report.build import build_report, check_out, main
from harness.report.collect import (AXES, COLUMNS, find_runs, load_runs, main_metric, markdown,
                                    model_label, protocol_label, row, series_label, to_csv)

__all__ = ["AXES", "COLUMNS", "build_report", "check_out", "find_runs", "load_runs", "main",
           "main_metric", "markdown", "model_label", "protocol_label", "row", "series_label",
           "to_csv"]
