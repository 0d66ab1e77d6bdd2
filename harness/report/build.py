"""`python -m harness.report`: runs -> leaderboard, figures, report.html, in one output folder."""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from harness.stats import intervals as stats
from harness.report import budgets, collect, compare, figures, html, leaderboard, ledgers
from harness.store.results import check_writable, write_text_atomic
from kvcore.errors import ConfigError

OUTPUTS = ("report.md", "report.csv", "leaderboard.md", "leaderboard.csv", "report.html",
           "comparisons.csv")
_FIGURE_FILE = re.compile(r"(%s)(_\d+)?\.png$" % "|".join(figures.FIGURES))
# Files earlier versions of the report wrote (replaced by the names above).
_OLD = {"ruler_heatmap.png"}


def is_report_file(name: str) -> bool:
    return name in OUTPUTS or name in _OLD or bool(_FIGURE_FILE.fullmatch(name))


def check_out(out: Path) -> None:
    """--out must be a new folder or one holding only an earlier report (never a user's files)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; allowed: a new folder or an earlier report's")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir()
                         if not is_report_file(p.name) and not p.name.startswith("."))
        if foreign:
            raise ConfigError(f"--out {out} holds files that are not a report "
                              f"({', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}); "
                              "choose a new or empty folder")
    check_writable(out, f"--out {out}")  # a read-only place: one line, before any work


def default_out(patterns: list[str]) -> Path:
    first = Path(patterns[0])
    return first / "_report" if first.is_dir() else Path("results") / "_report"


def board_markdown(board: list[dict], paired: str) -> str:
    """leaderboard.md: the tables (cells "value [95 % interval] n=N #rank interval"), then the
    paired comparisons with the full cache, the noise floor and the flags."""
    return (leaderboard.markdown(board) + "\nCells: value [95 % interval] n=<units> "
            "#<rank interval> (bootstrap ranks inside the section and column).\n\n"
            "## Paired comparison with the full cache\n\n" + paired)


def notes(board: list[dict], made: list[Path], paired: str, answer: str = "") -> str:
    """report.md: the answer per budget level, the leaderboard, then which figure answers which
    question."""
    lines = ["# kv-harness report", "", "## Which setting at this budget", "", answer,
             "## Leaderboard", "", board_markdown(board, paired),
             "## Figures", ""]
    lines += [f"- `{p.name}`: {figures.question(p)}" for p in made]
    return "\n".join(lines) + "\n"


def source_name(pattern: str) -> str:
    """A source as the report names it: a folder by its name, never the machine's absolute
    path (a relative glob as given)."""
    path = Path(pattern)
    return path.name if path.is_absolute() or path.is_dir() else pattern


def shown_folder(folder: Path, patterns: list[str]) -> str:
    """A folder as the report names it: by the name of the folder given that holds it and the
    path inside it, else by its parent's name and its own; never by an absolute path."""
    folder = Path(folder).resolve()
    roots = [Path(p).resolve() for p in patterns if Path(p).is_dir()]
    root = next((q for q in roots if q == folder or q in folder.parents), None)
    return (str(Path(root.name) / folder.relative_to(root)) if root
            else f"{folder.parent.name}/{folder.name}")


def shown_runs(rows: list[dict], patterns: list[str]) -> None:
    """Runs outside the first folder (another folder given, or an absolute glob) named as
    `shown_folder` names them."""
    for r in rows:
        if Path(r["run"]).is_absolute() or r["run"].startswith(".."):
            r["run"] = shown_folder(r["_folder"], patterns)


def build_report(patterns: list[str], out: Path | None = None, warn=None,
                 resamples: int = stats.RESAMPLES) -> tuple[list[dict], Path, list[Path]]:
    """Rows, the output folder and the figures made. ConfigError (bad paths, no valid run)."""
    out = out or default_out(patterns)
    stats.check_resamples(resamples, 1)  # the count alone, before a file is read
    check_out(out)
    rows = collect.collect(patterns, warn)
    shown_runs(rows, patterns)
    compare.attach(rows)
    board = leaderboard.build(rows)
    stats.check_resamples(resamples, compare.widest_column(board))  # before any draw
    compare.rank_intervals(board, rows, resamples)
    compared, floors = compare.comparisons(board, rows, resamples)
    for c in compared:
        c["entry"].setdefault("verdicts", {})[c["column"]] = c["verdict"]
    paired = compare.markdown(compared, floors, compare.flags(board, compared),
                              compare.distinguishable(board), resamples)
    # beside the paired fidelity table: does fidelity order settings accuracy cannot (columns
    # with >= 3 settings carrying fidelity; "" otherwise). Imported here: the package imports
    # build, and `python -m harness.report.validation` must find validation not yet imported.
    from harness.report import validation

    paired += validation.section(board, rows, resamples)
    paired += ledgers.section([r["_folder"] for r in rows],
                              lambda home: shown_folder(home, patterns),
                              warn or (lambda text: print(text, file=sys.stderr)))
    answers = budgets.attach(board, rows, floors, resamples)
    answer = budgets.markdown(answers)
    out.mkdir(parents=True, exist_ok=True)
    made = figures.draw_all(rows, out)
    for stale in out.iterdir():  # figures of an earlier report these runs no longer make
        if stale.suffix == ".png" and is_report_file(stale.name) and stale not in made:
            stale.unlink()
    write_text_atomic(out / "report.csv", collect.to_csv(rows))
    write_text_atomic(out / "leaderboard.csv", leaderboard.to_csv(board))
    write_text_atomic(out / "comparisons.csv", compare.to_csv(compared))
    write_text_atomic(out / "leaderboard.md", "## Which setting at this budget\n\n" + answer
                      + "\n## Leaderboard\n\n" + board_markdown(board, paired))
    write_text_atomic(out / "report.md", notes(board, made, paired, answer)
                      + "\n## Every run\n\n" + collect.markdown(rows))
    write_text_atomic(out / "report.html", html.page(
        rows, board, made, [source_name(p) for p in patterns], time.strftime("%Y-%m-%d %H:%M"),
        paired, answers))
    return rows, out, made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m harness.report",
        description="Collect runs (metrics.json) into a leaderboard, figures and report.html.")
    ap.add_argument("paths", nargs="+", help="results folders, globs of run folders, or files")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default <first folder>/_report)")
    ap.add_argument("--resamples", type=int, default=stats.RESAMPLES,
                    help=f"bootstrap resamples per interval and comparison "
                         f"(default {stats.RESAMPLES})")
    args = ap.parse_args(argv)
    try:
        rows, out, made = build_report(args.paths, args.out, resamples=args.resamples)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the disk filled, or --out changed, while the report was written
        print(f"error: writing the report failed ({exc.strerror or exc}: {exc.filename})",
              file=sys.stderr)
        return 2
    sys.stdout.write((out / "leaderboard.md").read_text())
    print(f"\n{len(rows)} runs -> {out / 'report.html'} (+ report.md, leaderboard.md/.csv, "
          f"report.csv), {len(made)} figures: {', '.join(p.name for p in made)}")
    return 0
