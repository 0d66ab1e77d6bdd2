"""How many samples a sweep needs: from pilot runs, the n that gives each comparison with the full
cache a paired 95 % interval of the wanted half-width.

    python -m harness.plan <pilot results dir or runs> [...] --half-width 2

For every setting paired with its section's full cache (harness.report.compare), the pilot's
paired-bootstrap half-width h0 at n0 units scales as 1/sqrt(n): n = n0 (h0 / h)^2. For pass/fail
scores of independent samples the same n also follows from the pilot's discordance d and
difference D (the per-sample difference's variance is d - D^2), printed beside it. The
half-width is in the metric's own units (points for scores x100, ppl for perplexity).
"""

from __future__ import annotations

import argparse
import math
import sys

from harness import stats
from harness.report import collect, compare, leaderboard
from kvcore.errors import ConfigError


# A wanted half-width below this is beneath any metric's resolution here (scores are x100 with
# 4 decimals, perplexities a few digits): no sample could reach it.
MIN_HALF_WIDTH = 1e-6
# Columns side by side in one of plan's bootstraps: a paired comparison (reference, run).
_PAIRED_COLUMNS = 2


def check_arguments(half_width: float, resamples: int) -> None:
    """--half-width and --resamples, before any run is read (ConfigError naming the option)."""
    if not (math.isfinite(half_width) and half_width >= MIN_HALF_WIDTH):
        raise ConfigError(f"--half-width {half_width}: must be a finite number of at least "
                          f"{MIN_HALF_WIDTH:g}, in the metric's units (points for scores x100, "
                          "ppl for perplexity)")
    stats.check_resamples(resamples, _PAIRED_COLUMNS)


def _needed(c: dict, pilot: float, half_width: float) -> int:
    """The n for `half_width` from the pilot's; ConfigError when no sample size reaches it."""
    try:
        return stats.n_for_half_width(c["n"], pilot, half_width)
    except ValueError:
        reach = stats.half_width_for_n(c["n"], pilot, stats.MAX_SAMPLES)
        raise ConfigError(f"--half-width {half_width:g}: {c['method']} {c['setting']} on "
                          f"{c['column']} would need more than {stats.MAX_SAMPLES:.0e} "
                          f"{c['n_unit']} (pilot half-width {pilot:.3g} at n={c['n']}); ask for "
                          f"at least {reach:.3g}") from None


def plan(paths: list[str], half_width: float, resamples: int = stats.RESAMPLES) -> list[dict]:
    """One record per paired comparison of the pilot: its n, half-width, discordance and the n
    needed for `half_width`. ConfigError for bad arguments or a pilot that cannot be read."""
    check_arguments(half_width, resamples)
    rows = collect.collect(paths, warn=lambda text: print(text, file=sys.stderr))
    compare.attach(rows)
    board = leaderboard.build(rows)
    compared, _ = compare.comparisons(board, rows, resamples)
    out = []
    for c in compared:
        record = {k: c[k] for k in ("model", "protocol", "method", "setting", "column")}
        if not c["paired"]:
            out.append({**record, "why": c["why"]})
            continue
        low, high = c["difference_ci95"]
        pilot = (high - low) / 2
        if pilot == 0:  # every pair agreed, or every pair changed alike: no variance to scale
            out.append({**record, "why": f"no variation in the pilot's {c['n']} paired "
                                         f"{c['n_unit']} (difference {c['difference']:.4g} on "
                                         "every one): it cannot size a sweep"})
            continue
        record.update(n=c["n"], unit=c["n_unit"], half_width=pilot, discordance=c["discordance"],
                      needed=_needed(c, pilot, half_width))
        if "lost" in c:  # pass/fail: from the discordance, in the metric's units (x100 or x1)
            scale = 100.0 if "lm_eval" not in c["column"] else 1.0
            try:
                record["needed_from_discordance"] = stats.n_for_paired_binary(
                    c["discordance"], c["difference"] / scale, half_width / scale)
            except ValueError:  # beyond any sample size: the bootstrap's n already says so
                pass
        out.append(record)
    return out


def table(records: list[dict], half_width: float) -> str:
    cols = ["model", "protocol", "task column", "method", "setting", "pilot n",
            "pilot half-width", "discordance", f"n for ±{half_width:g}"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in records:
        if "why" in r:
            cells = [r["model"], r["protocol"], r["column"], r["method"], r["setting"],
                     "", "", "", r["why"] if r["why"].startswith("no variation")
                     else f"not paired: {r['why']}"]
        else:
            needed = f"{r['needed']} {r['unit']}" + (
                f" ({r['needed_from_discordance']} from the discordance)"
                if "needed_from_discordance" in r else "")
            cells = [r["model"], r["protocol"], r["column"], r["method"], r["setting"],
                     f"{r['n']} {r['unit']}", f"{r['half_width']:.3g}",
                     f"{r['discordance']:.3g}", needed]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.plan",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="pilot results folders, globs of runs, or files")
    ap.add_argument("--half-width", type=float, required=True,
                    help="wanted 95 %% half-width of each paired difference, in the metric's "
                         "units (points for scores x100, ppl for perplexity)")
    ap.add_argument("--resamples", type=int, default=stats.RESAMPLES)
    args = ap.parse_args(argv)
    try:
        records = plan(args.paths, args.half_width, args.resamples)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not records:
        print("error: no setting paired with a full-cache run in the pilot (run method=full on "
              "the same samples)", file=sys.stderr)
        return 2
    sys.stdout.write(table(records, args.half_width))
    return 0


if __name__ == "__main__":
    sys.exit(main())
