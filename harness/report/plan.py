"""How many samples a sweep needs: from pilot runs, the n that gives each comparison with the full
cache a paired 95 % interval of the wanted half-width.

    python -m harness.report.plan <pilot results dir or runs> [...] --half-width 2

For every setting paired with its section's full cache (harness.report.compare), the pilot's
paired-bootstrap half-width h0 at n0 units scales as 1/sqrt(n): n = n0 (h0 / h)^2. For pass/fail
scores of independent samples the same n also follows from the pilot's discordance d and
difference D (the per-sample difference's variance is d - D^2), printed beside it. The
half-width is in the metric's own units (points for scores x100, ppl for perplexity).

With `--rounds-block B --rounds-max-n N` it also plans the sequential design (harness.sweep.rounds,
harness.stats.sequential): for every comparison of bounded per-sample scores, sweeps simulated from
the pilot's per-sample paired differences (drawn with replacement, fixed seed; the plain
per-sample mean, as the rounds decide on, not a task's weighted average) looked at every B samples
with the anytime-valid CS (alpha split over the comparisons, Bonferroni, as the rounds do),
stopped when it excludes 0 or lies inside +-`--margin`: the mean stopping n, the share decided
by N, the n at which the CS reaches the wanted half-width, and the n of a fixed-sample design
deciding the same question with the same power; "saved" is that n minus the mean stopping n,
and per task column the whole sweep's: a fixed-n sweep gives every setting one n, the n its
hardest comparison needs.

With `--fidelity-half-width KEY=H` (repeatable; KEY one of kl_mean, top_agree_ratio,
gold_logprob, in that figure's own units: nats, a ratio, nats per token) it also sizes the paired
fidelity figures (task.fidelity_tokens; harness.report.compare.fidelity_compare): per setting
whose pilot recorded them, the n for a paired 95 % interval of half-width H around the
difference to the full cache, scaled from the pilot's as above.
"""

from __future__ import annotations

import argparse
import math
import sys

from harness.stats import intervals as stats
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


def plan(paths: list[str], half_width: float, resamples: int = stats.RESAMPLES,
         rounds: dict | None = None) -> list[dict]:
    """One record per paired comparison of the pilot: its n, half-width, discordance and the n
    needed for `half_width`; with `rounds` (block, max_n, alpha, margin) the sequential
    design's figures too. ConfigError for bad arguments or a pilot that cannot be read."""
    check_arguments(half_width, resamples)
    if rounds:
        check_rounds(rounds["block"], rounds["max_n"], rounds["alpha"], rounds["margin"])
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
    if rounds:
        add_rounds(out, compared, rows, half_width, rounds["block"], rounds["max_n"],
                   rounds["alpha"], rounds["margin"])
    return out


FIDELITY_KEYS = tuple(key for key, _ in compare.FIDELITY_PAIRS)


def fidelity_targets(specs: list[str]) -> dict[str, float]:
    """`KEY=H` options -> {key: half-width}; ConfigError naming a bad one."""
    out = {}
    for spec in specs:
        key, _, value = spec.partition("=")
        try:
            width = float(value)
        except ValueError:
            width = math.nan
        if key not in FIDELITY_KEYS or not (math.isfinite(width) and width >= MIN_HALF_WIDTH):
            raise ConfigError(f"--fidelity-half-width {spec}: give KEY=H with KEY one of "
                              f"{', '.join(FIDELITY_KEYS)} and H a finite number of at least "
                              f"{MIN_HALF_WIDTH:g} in that figure's units")
        out[key] = width
    return out


def plan_fidelity(paths: list[str], targets: dict[str, float],
                  resamples: int = stats.RESAMPLES) -> list[dict]:
    """One record per (setting with fidelity, figure of `targets`): the pilot's n and paired
    half-width of the difference to the full cache, and the n for the wanted half-width."""
    rows = collect.collect(paths, warn=lambda text: print(text, file=sys.stderr))
    compare.attach(rows)
    out = []
    for r in rows:
        got = compare.fidelity_compare(r, resamples)
        for key, width in targets.items():
            c = (got or {}).get(key)
            if c is None or r["method"] == compare.REFERENCE:
                continue
            low, high = c["difference_ci95"]
            pilot = (high - low) / 2
            record = {"method": r["method"], "setting": r["budget"], "column": r["task"],
                      "figure": key, "n": c["n"],
                      "difference": c["difference"], "half_width": pilot, "wanted": width}
            try:
                record["needed"] = stats.n_for_half_width(c["n"], pilot, width)
            except ValueError:
                record["why"] = f"more than {stats.MAX_SAMPLES:.0e} samples"
            out.append(record)
    return out


def fidelity_table(records: list[dict]) -> str:
    cols = ["task", "method", "setting", "figure", "pilot n", "difference to full",
            "pilot half-width", "wanted half-width", "n needed"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in records:
        cells = [r["column"], r["method"], r["setting"], r["figure"], r["n"],
                 f"{r['difference']:.4g}", f"{r['half_width']:.3g}", f"{r['wanted']:g}",
                 r.get("needed", r.get("why"))]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def check_rounds(block: int | None, max_n: int | None, alpha: float, margin: float) -> None:
    """The sequential options (ConfigError naming the option), before any run is read."""
    if (block is None) != (max_n is None):
        raise ConfigError("--rounds-block and --rounds-max-n go together (samples per round, "
                          "the sample budget per setting)")
    if block is None:
        return
    if block < 1 or max_n < block:
        raise ConfigError(f"--rounds-block {block} --rounds-max-n {max_n}: allowed: "
                          "1 <= block <= max_n")
    if not 0 < alpha < 1:
        raise ConfigError(f"--alpha {alpha}: must lie in (0, 1)")
    if not (math.isfinite(margin) and margin >= 0):
        raise ConfigError(f"--margin {margin}: must be a number >= 0, in the metric's units")


def add_rounds(records: list[dict], compared: list[dict], rows: list[dict], half_width: float,
               block: int, max_n: int, alpha: float, margin: float) -> None:
    """The sequential design's figures on every record of bounded per-sample scores."""
    from harness.stats import sequential

    by_key = {(c["model"], c["protocol"], c["method"], c["setting"], c["column"]): c
              for c in compared}
    by_run = {r["run"]: r for r in rows}
    sized = [r for r in records if "needed" in r and r["unit"] == "samples"]
    per = alpha / max(1, len(sized))  # Bonferroni over the comparisons, as the rounds split it
    for r in sized:
        c = by_key[(r["model"], r["protocol"], r["method"], r["setting"], r["column"])]
        run = by_run[c["entry"]["cells"][c["column"]]]
        pairing = _paired_with_full(run, by_run[c["reference_run"]])
        if pairing is None or pairing.units.full_score is None:
            r["rounds_why"] = ("no full-cache run on the same samples" if pairing is None
                               else "scores without a bound")
            continue
        p = sequential.plan_rounds(pairing.run - pairing.reference, pairing.units.full_score,
                                   per, margin, block, max_n, half_width)
        r.update(rounds_expected_n=p.expected_n, rounds_power=p.power,
                 rounds_n_for_half_width=p.n_for_half_width,
                 fixed_n_same_power=p.fixed_n_same_power,
                 samples_saved=(None if p.fixed_n_same_power is None
                                else p.fixed_n_same_power - p.expected_n))


def _paired_with_full(run: dict, reference: dict):
    """The run's samples paired with the full-cache run its comparison used (the report's
    reference of its section and column), or None when they are not the same samples."""
    from harness.report.compare import samples_of
    from harness.stats.uncertainty import PairingError, pair

    try:
        return pair(run["task"], samples_of(reference) or [], samples_of(run) or [])
    except (PairingError, ValueError, KeyError):
        return None


def sweep_totals(records: list[dict]) -> list[str]:
    """Per task column, the whole sweep: the rounds' expected answers against a fixed-n sweep
    of the same power (every setting at the n its hardest comparison needs: a sweep gives all
    its settings one n). Columns where some comparison never decides say so."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if "rounds_expected_n" in r:
            groups.setdefault((r["model"], r["protocol"], r["column"]), []).append(r)
    lines = []
    for (model, protocol, column), rs in groups.items():
        rounds = sum(r["rounds_expected_n"] for r in rs)
        fixed = [r["fixed_n_same_power"] for r in rs]
        head = f"sweep {model} {protocol} {column}: rounds ~{rounds:.0f} (setting, sample) answers"
        if None in fixed:
            lines.append(f"{head}; a fixed-n sweep cannot match their power (a comparison the "
                         "rounds never decide by max_n)")
            continue
        lines.append(f"{head}; a fixed-n sweep of the same power: {len(rs)} x {max(fixed)} = "
                     f"{len(rs) * max(fixed)} (saved {len(rs) * max(fixed) - rounds:.0f})")
    return lines


def _rounds_cells(r: dict, max_n: int) -> list[str]:
    if "rounds_expected_n" not in r:
        return ["", "", "", "", r.get("rounds_why", "")]
    fixed = r["fixed_n_same_power"]
    return [f"{r['rounds_expected_n']:.0f}", f"{r['rounds_power']:.2f}",
            str(r["rounds_n_for_half_width"] or f"> {max_n}"),
            "" if fixed is None else str(fixed),
            "" if r["samples_saved"] is None else f"{r['samples_saved']:.0f}"]


def table(records: list[dict], half_width: float, max_n: int | None = None) -> str:
    cols = ["model", "protocol", "task column", "method", "setting", "pilot n",
            "pilot half-width", "discordance", f"n for ±{half_width:g}"]
    if max_n is not None:
        cols += ["rounds: mean n", f"decided by {max_n}", f"CS n for ±{half_width:g}",
                 "fixed n, same power", "saved"]
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
        cells += _rounds_cells(r, max_n) if max_n is not None else []
        cells += [""] * (len(cols) - len(cells))
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.report.plan",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="pilot results folders, globs of runs, or files")
    ap.add_argument("--half-width", type=float, required=True,
                    help="wanted 95 %% half-width of each paired difference, in the metric's "
                         "units (points for scores x100, ppl for perplexity)")
    ap.add_argument("--resamples", type=int, default=stats.RESAMPLES)
    ap.add_argument("--rounds-block", type=int, default=None,
                    help="also plan sequential rounds of this many samples (harness.sweep.rounds)")
    ap.add_argument("--rounds-max-n", type=int, default=None,
                    help="the rounds' sample budget per setting")
    ap.add_argument("--alpha", type=float, default=0.05,
                    help="the rounds' error over every comparison (default 0.05)")
    ap.add_argument("--fidelity-half-width", action="append", default=[], metavar="KEY=H",
                    help="also size the paired fidelity figures: KEY one of "
                         f"{', '.join(FIDELITY_KEYS)}, H the wanted half-width in its units")
    ap.add_argument("--margin", type=float, default=0.0,
                    help="the rounds' equivalence margin, in the metric's units (default 0)")
    args = ap.parse_args(argv)
    rounds = None
    if args.rounds_block is not None or args.rounds_max_n is not None:
        rounds = {"block": args.rounds_block, "max_n": args.rounds_max_n,
                  "alpha": args.alpha, "margin": args.margin}
    try:
        targets = fidelity_targets(args.fidelity_half_width)
        records = plan(args.paths, args.half_width, args.resamples, rounds)
        fidelity = plan_fidelity(args.paths, targets, args.resamples) if targets else []
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not records:
        print("error: no setting paired with a full-cache run in the pilot (run method=full on "
              "the same samples)", file=sys.stderr)
        return 2
    sys.stdout.write(table(records, args.half_width, args.rounds_max_n if rounds else None))
    for line in sweep_totals(records) if rounds else []:
        print(line)
    if targets:
        sys.stdout.write("\nPaired fidelity (difference to the full cache):\n\n"
                         + (fidelity_table(fidelity) if fidelity
                            else "no setting of the pilot recorded fidelity "
                                 "(task.fidelity_tokens=0)\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
