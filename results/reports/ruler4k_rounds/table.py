"""The 4K table from a sweep in rounds: each setting's samples pooled over the rounds it ran
(its folders in the ledger, `rounds.json`), accuracy and paired fidelity per setting, the
ledger's anytime-valid verdict against the full cache, the pairs among the top ten that each
figure orders, and what the rounds cost.

    python results/reports/ruler4k_rounds/table.py R/A R/B R/razor --floor R/floor \
        --withdraw c6dc3180167e3558=razor_attention > results/reports/ruler4k_rounds/table.md

`--withdraw LEDGER=METHOD` (repeatable): that ledger's rows and verdict of the method are left
out (named in the table), e.g. runs made with a bug, the method run again in a ledger of its
own. A method in two ledgers otherwise is an error.

Figures per sample (larger is worse, as harness.report.validation orients them): accuracy drop
(-100 x score), KL mean over the K teacher-forced tokens, top disagreement (1 - same-top ratio),
gold log-prob drop (the full cache's mean gold log-probability minus the setting's).
Intervals: 95 % percentile bootstrap over samples, stratified by sub-task (harness.stats
RESAMPLES and SEED). Pairs: the paired difference on the two settings' common samples, its
bootstrap p-value, Benjamini-Hochberg over the 45 pairs of each figure (FDR 5 %). The rounds
chose each setting's n by its comparison with the full cache, so these fixed-n pair tests are
descriptive; the ledger's confidence sequences are the ones valid under the rounds' looks.
The noise floor (`--floor`: the full cache run through eager attention, harness.report.compare's
floor): its paired accuracy difference from the sdpa full cache on their common samples; a
setting whose difference from the full cache lies within the floor's magnitude (the largest of
|difference| and the interval's ends) is marked "within the floor".
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

PROJECT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(PROJECT))
from harness.report.ledgers import LEDGER  # noqa: E402
from harness.stats import intervals as stats  # noqa: E402

FIGURES = ("accuracy", "kl_mean", "top_disagree", "gold_drop")
TOP = 10
REFERENCE = "full"


def worse(row: dict) -> dict[str, float]:
    f = row.get("fidelity") or {}
    gold = (f["gold_logprob_full"] - f["gold_logprob"]
            if f.get("gold_logprob") is not None else np.nan)
    return {"accuracy": -100.0 * row["score"], "kl_mean": f.get("kl_mean", np.nan),
            "top_disagree": 1.0 - f.get("top_agree_ratio", np.nan), "gold_drop": gold}


def name(ledger: dict, label: str) -> str:
    """The method of a ledger's setting: the last `method=` of the common overrides and the
    setting's own (a one-setting ledger labels its setting "setting")."""
    parts = [*ledger["common"], *ledger["settings"].get(label, [])]
    methods = [p.partition("=")[2] for p in parts if p.startswith("method=")]
    return methods[-1] if methods else label


def pooled(home: Path) -> tuple[dict, dict[str, dict[str, dict]], list[tuple]]:
    """The ledger; per setting, sample id -> row, over every round it ran; per round (number,
    settings with the full cache, answers, the sweep's wall seconds from its metrics.json)."""
    ledger = json.loads((home / LEDGER).read_text())
    rows: dict[str, dict[str, dict]] = {}
    cost = []
    for number, rnd in enumerate(ledger["rounds"], 1):
        folders = rnd["folders"]
        walls = set()
        for label, rel in folders.items():
            folder = home / rel
            key = REFERENCE if label == REFERENCE else name(ledger, label)
            for line in (folder / "samples.jsonl").read_text().splitlines():
                row = json.loads(line)
                rows.setdefault(key, {})[row["sample_id"]] = row
            walls.add(json.loads((folder / "metrics.json").read_text())["run"]["wall_s"])
        cost.append((number, len(folders), len(folders) * rnd["block"], max(walls)))
    return ledger, rows, cost


def draws(values: np.ndarray, strata: np.ndarray, resamples: int) -> np.ndarray:
    """Bootstrap means of `values`, each stratum resampled within itself."""
    rng = np.random.default_rng(stats.SEED)
    out = np.zeros(resamples)
    for s in np.unique(strata):
        v = values[strata == s]
        picks = rng.integers(0, len(v), size=(resamples, len(v)))
        out += v[picks].sum(axis=1)
    return out / len(values)


def summary(rows: dict[str, dict], resamples: int) -> dict[str, tuple[float, float, float]]:
    ids = sorted(rows)
    strata = np.array([rows[i]["subtask"] for i in ids])
    out = {}
    for f in FIGURES:
        v = np.array([worse(rows[i])[f] for i in ids], dtype=float)
        keep = np.isfinite(v)
        if not keep.any():
            continue
        d = draws(v[keep], strata[keep], resamples)
        out[f] = (float(v[keep].mean()), *stats.percentile(d))
    return out


def paired_draws(a: dict[str, dict], b: dict[str, dict], f: str, resamples: int
                 ) -> tuple[float, np.ndarray, int]:
    """Paired difference a - b of figure f on the common samples: its mean, its stratified
    bootstrap draws, n (nan, no draws, 0: no common finite value)."""
    ids = sorted(set(a) & set(b))
    d = np.array([worse(a[i])[f] - worse(b[i])[f] for i in ids], dtype=float)
    strata = np.array([a[i]["subtask"] for i in ids])
    keep = np.isfinite(d)
    if not keep.any():
        return np.nan, np.array([]), 0
    return float(d[keep].mean()), draws(d[keep], strata[keep], resamples), int(keep.sum())


def pair(a: dict[str, dict], b: dict[str, dict], f: str, resamples: int) -> tuple[float, float, int]:
    """Paired difference a - b of figure f on the common samples, bootstrap p, n."""
    mean, drawn, n = paired_draws(a, b, f, resamples)
    return mean, stats.bootstrap_p(drawn) if n else 1.0, n


def floor_rows(root: Path) -> dict[str, dict]:
    """Sample id -> row of the newest finished run under `root` (the eager full cache)."""
    runs = sorted(root.rglob("metrics.json"), key=lambda m: m.stat().st_mtime)
    if not runs:
        raise SystemExit(f"--floor {root}: no finished run (metrics.json) under it")
    rows = [json.loads(line) for line in (runs[-1].parent / "samples.jsonl").read_text().splitlines()]
    return {row["sample_id"]: row for row in rows}


def floor_line(full: dict[str, dict], eager: dict[str, dict], resamples: int
               ) -> tuple[str, float]:
    """The floor's table line and its magnitude (points)."""
    d, drawn, n = paired_draws(eager, full, "accuracy", resamples)  # larger is worse
    p, (low, high) = stats.bootstrap_p(drawn), stats.percentile(drawn)
    agree = sum(full[i]["prediction"] == eager[i]["prediction"] for i in set(full) & set(eager))
    magnitude = max(abs(d), abs(low), abs(high))
    # the accuracy drop is -100 x score: eager's score minus sdpa's is -d
    def pts(x: float) -> str:
        return f"{round(x, 1) + 0.0:+.1f}"  # no "-0.0"

    return (f"- **Noise floor** (the full cache through eager attention against sdpa, n = {n}): "
            f"accuracy difference {pts(-d)} [{pts(-high)}, {pts(-low)}] points (paired "
            f"bootstrap, p = {p:.2f}); the two give the same answer on {agree} of {n} samples. "
            f"Magnitude {magnitude:.1f} points.", magnitude)


def verdict(v: dict | None, magnitude: float | None) -> str:
    """The ledger's verdict, and whether the difference lies within the noise floor."""
    if not v:
        return "reference"
    within = magnitude is not None and abs(v["versus_reference"]["mean"]) <= magnitude
    return v["verdict"] + (" (within the floor)" if within else "")


def main(roots: list[str], resamples: int = stats.RESAMPLES, floor: str | None = None,
         withdrawn: tuple[tuple[str, str], ...] = ()) -> None:
    homes = sorted({p.parent for r in roots for p in Path(r).rglob(LEDGER)})
    settings: dict[str, dict] = {}
    verdicts: dict[str, dict] = {}
    costs = ["| ledger | round | settings (with the full cache) | answers | sweep wall s | "
             "wall-s per answer |", "|---|---|---|---|---|---|"]
    lines = ["# RULER 4K in rounds: the table", ""]
    for home in homes:
        ledger, rows, cost = pooled(home)
        costs += [f"| `{home.name}` | {r} | {s} | {a} | {w:.0f} | {w / a:.1f} |"
                  for r, s, a, w in cost]
        lines.append(f"- `{home.name}`: {len(ledger['rounds'])} round(s), {ledger['status']}; "
                     f"{sum(r['n'] for r in ledger['reported'].values())} (setting, sample) "
                     f"answers of {ledger['max_n'] * len(ledger['reported'])} at max_n")
        for ledger_id, method in withdrawn:
            if ledger_id == home.name and rows.pop(method, None) is not None:
                reported = ledger["reported"]
                for label in [k for k in reported if name(ledger, k) == method]:
                    del reported[label]
                lines.append(f"  - {method}: withdrawn from this ledger (its rows and verdict "
                             "are left out; see the README)")
        twice = sorted(set(rows) & set(settings) - {REFERENCE})
        if twice:
            raise SystemExit(f"{', '.join(twice)} in more than one ledger: --withdraw all but "
                             "one")
        ref = rows.pop(REFERENCE)
        if REFERENCE in settings:  # the full cache of each ledger: the same answers
            same = [i for i in ref if i in settings[REFERENCE]]
            agree = sum(ref[i]["prediction"] == settings[REFERENCE][i]["prediction"]
                        for i in same)
            lines.append(f"  - its full cache answers {agree} of the {len(same)} samples both "
                         "ledgers' full caches ran as the other's does")
            settings[REFERENCE].update(ref)
        else:
            settings[REFERENCE] = ref
        settings.update(rows)
        verdicts.update({name(ledger, k): v for k, v in ledger["reported"].items()})
    magnitude = None
    if floor is not None:
        line, magnitude = floor_line(settings[REFERENCE], floor_rows(Path(floor)), resamples)
        lines.append(line)
    shown = {k: summary(v, resamples) for k, v in settings.items()}
    order = sorted((k for k in settings if k != REFERENCE), key=lambda k: shown[k]["accuracy"][0])
    lines += ["", "| setting | n | accuracy | vs full (ledger CS) | verdict | KL mean | same-top "
              "| gold log-prob drop |", "|" + "---|" * 8]

    def cell(k, f, digits=3, shown_as=lambda x: x):
        """Figure f of setting k as shown (`shown_as`: a decreasing map turns the interval)."""
        if f not in shown[k]:
            return ""
        m, lo, hi = (round(shown_as(x), digits) + 0.0 for x in shown[k][f])  # no "-0.0"
        lo, hi = min(lo, hi), max(lo, hi)
        return f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"

    for k in [REFERENCE, *order]:
        v = verdicts.get(k)
        vs = (f"{v['versus_reference']['mean']:+.1f} [{v['versus_reference']['low']:+.1f}, "
              f"{v['versus_reference']['high']:+.1f}]" if v else "")
        lines.append(f"| {k} | {len(settings[k])} | {cell(k, 'accuracy', 1, lambda x: -x)} "
                     f"| {vs} | {verdict(v, magnitude)} "
                     f"| {cell(k, 'kl_mean', 4)} | {cell(k, 'top_disagree', 3, lambda x: 1 - x)} "
                     f"| {cell(k, 'gold_drop')} |")
    top = order[:TOP]
    lines += ["", f"Pairs among the top {len(top)} by accuracy ordered by each figure "
              "(on their common samples; BH over the pairs of each figure, FDR 5 %):", "",
              "| figure | ordered pairs | common n (min-max) |", "|---|---|---|"]
    detail = []
    for f in FIGURES:
        rows = [(a, b, *pair(settings[a], settings[b], f, resamples))
                for i, a in enumerate(top) for b in top[i + 1:]]
        q, hit = stats.benjamini_hochberg([r[3] for r in rows], 0.05)
        ns = [r[4] for r in rows]
        lines.append(f"| {f} | {sum(hit)} of {len(rows)} | {min(ns)}-{max(ns)} |")
        # d = a - b, larger is worse: d > 0 puts b first
        detail.append(f"- {f}: " + ", ".join(f"{b} > {a}" if d > 0 else f"{a} > {b}"
                                             for (a, b, d, _, _), h in zip(rows, hit) if h))
    lines += ["", "Ordered (better first):", "", *detail, "", "What each round cost (one "
              "process and thread per ledger, both on a 2-core machine):", "", *costs, ""]
    print("\n".join(lines))


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("roots", nargs="+", help="folders holding the ledgers (rounds.json)")
    ap.add_argument("--floor", help="the noise floor's results root")
    ap.add_argument("--withdraw", action="append", default=[], metavar="LEDGER=METHOD")
    args = ap.parse_args()
    bad = [w for w in args.withdraw if w.count("=") != 1]
    if bad:
        ap.error(f"--withdraw {bad[0]!r}: expected LEDGER=METHOD (a ledger id, a method name)")
    main(args.roots, floor=args.floor,
         withdrawn=tuple(tuple(w.split("=")) for w in args.withdraw))
