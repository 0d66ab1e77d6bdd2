"""Does per-sample fidelity order settings that accuracy cannot?
`python -m harness.report.validation <runs dir> [--top 10] [--out folder]`.

Over the settings of one task column (one model, protocol and task; every setting scored on the
full cache's samples, paired by content id as harness.stats.uncertainty.pair pairs them), each
setting gets four figures, all oriented so that larger is worse:

* accuracy drop: the full cache's task metric minus the setting's (the setting's minus the full
  cache's for a lower-is-better metric such as perplexity), on the task's own design (RULER's
  sub-task x length weights, LongBench's dataset weights, exp of the mean NLL);
* KL mean: the mean over samples of the per-sample mean KL(full || setting) over the K
  teacher-forced tokens (`fidelity.kl_mean`);
* top disagreement: 1 - the mean over samples of `fidelity.top_agree_ratio` (shown as the same-top
  ratio);
* gold log-prob drop: the mean over samples of `gold_logprob_full - gold_logprob` (samples with a
  gold answer).

Uncertainty: one bootstrap over samples shared by every setting and figure (paired): each resample
draws, in every stratum of the task's design, as many sample ids as it has, with replacement
(numpy's Generator, harness.stats.intervals' RESAMPLES and SEED), and recomputes every figure of
every setting from the same ids. A sample is the resampled unit (a perplexity stream's tokens and a
conversation's turns go together with their sample); fidelity means pool the drawn samples.

Statistics:
1. per setting: each figure with its 95 % percentile interval (the drop is the paired difference);
2. across settings (the full cache left out: its figures are 0 by definition): Spearman's rho
   (scipy.stats.spearmanr) and Kendall's tau-b (scipy.stats.kendalltau) between the accuracy drop
   and each fidelity figure, a positive value meaning the fidelity figure worsens as accuracy
   does; their 95 % percentile intervals from the same resamples (resamples where a figure is
   constant over settings leave the correlation undefined and are counted, not used);
3. among the top-k settings by accuracy (the full cache left out), for each figure and each of
   the k(k-1)/2 pairs: the paired difference over the same resamples, its 95 % interval and
   two-sided bootstrap p-value (harness.stats.intervals.bootstrap_p); the pairs of one figure
   adjusted together with the project's multiplicity function,
   harness.stats.intervals.benjamini_hochberg (FDR 5 %; under no true difference at all it bounds
   the chance of any false ordering by 5 % too). A pair is ordered when it is rejected. A fidelity
   ordering contradicts accuracy when both order a pair, in opposite directions.
Accuracy ranks the settings; fidelity is validated beside it, never instead of it.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats as sps

from harness.report.collect import REFERENCE
from harness.stats import intervals as stats
from harness.stats.uncertainty import PairingError, pair
from kvcore.errors import ConfigError

FDR = 0.05
TOP = 10
MIN_SETTINGS = 3  # a rank correlation over fewer settings says nothing
# figure -> its label; every figure is oriented so that larger is worse
FIGURES = {"accuracy": "accuracy drop", "kl_mean": "KL mean",
           "top_agree_ratio": "same-top ratio", "gold_logprob": "gold log-prob drop"}
FIDELITY = ("kl_mean", "top_agree_ratio", "gold_logprob")
SHOWN_PAIRS = 5  # ordered pairs named per figure in the markdown (all of them in the JSON)
_CHUNK_CELLS = 4_000_000  # resamples x samples x settings drawn at once (memory bound)


def _worse(record: dict, figure: str) -> float:
    """One sample's fidelity figure, larger = worse (NaN where the record lacks it)."""
    if figure == "kl_mean":
        value = record.get("kl_mean")
    elif figure == "top_agree_ratio":
        value = None if record.get("top_agree_ratio") is None else 1 - record["top_agree_ratio"]
    else:
        gold, full = record.get("gold_logprob"), record.get("gold_logprob_full")
        value = None if gold is None or full is None else full - gold
    return float("nan") if value is None else float(value)


@dataclass
class Column:
    """One task column's settings on the full cache's samples, per sample."""
    label: str
    higher: bool  # the task metric: higher is better
    names: list[str]  # (k,) the settings, the full cache left out
    runs: list[str]  # (k,)
    reference_run: str
    score_sums: np.ndarray  # (n, k + 1) per sample: its units' score sum; column 0: full cache
    score_counts: np.ndarray  # (n,) units per sample
    strata: np.ndarray  # (n,) stratum index of each sample
    weights: np.ndarray  # (S,) the task's weight of each stratum
    transform: str  # "identity" or "exp" (perplexity from mean NLL)
    fidelity: dict[str, np.ndarray]  # figure -> (n, k) per sample, larger = worse; NaN: missing
    left_out: list[str] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return int(self.score_counts.size)


# --- the shared bootstrap -------------------------------------------------------------------

def _figures_at(c: Column, picks: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Every figure of every setting for a batch of resamples: `picks[s]` is (b, m_s) sample
    indices drawn in stratum s. -> figure -> (b, k), larger = worse."""
    b = picks[0].shape[0]
    score = np.zeros((b, c.score_sums.shape[1]))
    fid = {f: [np.zeros((b, len(c.names))), np.zeros((b, 1))] for f in c.fidelity}
    # (n,) the samples every setting has the figure for
    known = {f: np.isfinite(v).all(axis=1) for f, v in c.fidelity.items()}
    filled = {f: np.where(known[f][:, None], v, 0.0) for f, v in c.fidelity.items()}  # (n, k)
    for s, pick in enumerate(picks):
        score += (c.weights[s] * c.score_sums[pick].sum(axis=1)
                  / c.score_counts[pick].sum(axis=1)[:, None])
        for f in c.fidelity:  # pooled over strata: the plain mean over the drawn samples
            fid[f][0] += filled[f][pick].sum(axis=1)
            fid[f][1] += known[f][pick].sum(axis=1)[:, None]
    score = np.exp(score) if c.transform == "exp" else score
    drop = score[:, :1] - score[:, 1:] if c.higher else score[:, 1:] - score[:, :1]
    out = {"accuracy": drop}
    with np.errstate(invalid="ignore", divide="ignore"):  # a resample with no gold: NaN
        out.update({f: total / count for f, (total, count) in fid.items()})
    return out


def _members(c: Column) -> list[np.ndarray]:
    return [np.nonzero(c.strata == s)[0] for s in range(c.weights.size)]


def point(c: Column) -> dict[str, np.ndarray]:
    """figure -> (k,) each setting's figure on the samples as they are."""
    return {f: v[0] for f, v in _figures_at(c, [m[None, :] for m in _members(c)]).items()}


def draws(c: Column, resamples: int = stats.RESAMPLES, seed: int = stats.SEED
          ) -> dict[str, np.ndarray]:
    """figure -> (resamples, k): every figure recomputed on the same resampled sample ids for
    every setting (each stratum keeps its count), so that differences are paired."""
    rng = np.random.default_rng(seed)
    members = _members(c)
    step = max(1, _CHUNK_CELLS // max(1, c.samples * (len(c.names) + 1)))
    parts: dict[str, list[np.ndarray]] = {}
    for start in range(0, resamples, step):
        b = min(step, resamples - start)
        picks = [m[rng.integers(0, m.size, size=(b, m.size))] for m in members]
        for f, v in _figures_at(c, picks).items():
            parts.setdefault(f, []).append(v)
    return {f: np.concatenate(v) for f, v in parts.items()}


def _interval(x: np.ndarray) -> list[float] | None:
    x = x[np.isfinite(x)]
    return list(stats.percentile(x)) if x.size else None


# --- rank correlations across settings ------------------------------------------------------

def _spearman_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(b,) Spearman's rho per row of (b, k) arrays: Pearson's r of the average ranks (what
    scipy.stats.spearmanr computes); NaN where a row is constant."""
    rx, ry = sps.rankdata(x, axis=1), sps.rankdata(y, axis=1)
    rx, ry = rx - rx.mean(axis=1, keepdims=True), ry - ry.mean(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (rx * ry).sum(axis=1) / np.sqrt((rx ** 2).sum(axis=1) * (ry ** 2).sum(axis=1))


def _kendall_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(b,) Kendall's tau-b per row of (b, k) arrays (as scipy.stats.kendalltau); NaN where a
    row is constant."""
    i, j = np.triu_indices(x.shape[1], k=1)
    sx, sy = np.sign(x[:, i] - x[:, j]), np.sign(y[:, i] - y[:, j])  # (b, pairs)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (sx * sy).sum(axis=1) / np.sqrt((sx != 0).sum(axis=1) * (sy != 0).sum(axis=1))


def _defined(statistic) -> float | None:
    value = float(statistic)
    return value if np.isfinite(value) else None


def correlations(at: dict[str, np.ndarray], boot: dict[str, np.ndarray]) -> dict[str, dict]:
    """Per fidelity figure: Spearman's rho and Kendall's tau-b with the accuracy drop across
    settings, each with its bootstrap interval and the number of resamples where it is
    undefined (a figure constant over settings)."""
    out = {}
    for f in FIDELITY:
        if f not in at or not np.all(np.isfinite(at[f])):
            continue
        rho = _spearman_rows(boot["accuracy"], boot[f])
        tau = _kendall_rows(boot["accuracy"], boot[f])
        with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", sps.ConstantInputWarning)  # undefined: None below
            point_rho = sps.spearmanr(at["accuracy"], at[f]).statistic
            point_tau = sps.kendalltau(at["accuracy"], at[f]).statistic
        out[f] = {"spearman": _defined(point_rho), "spearman_ci95": _interval(rho),
                  "kendall_tau_b": _defined(point_tau), "kendall_ci95": _interval(tau),
                  "undefined_resamples": int(np.sum(~np.isfinite(rho)))}
    return out


# --- ordered pairs among the top settings ---------------------------------------------------

def top_settings(at: dict[str, np.ndarray], top: int) -> list[int]:
    """Indices of the `top` settings with the smallest accuracy drop, best first."""
    return [int(i) for i in np.argsort(at["accuracy"], kind="stable")[:top]]


def ordered_pairs(names: list[str], chosen: list[int], at: dict[str, np.ndarray],
                  boot: dict[str, np.ndarray]) -> dict[str, dict]:
    """Per figure, every pair of the chosen settings: paired difference (a - b, larger = a
    worse) with its interval and bootstrap p-value, BH-adjusted over that figure's pairs; the
    rejected pairs are ordered, the better setting first."""
    out = {}
    pairs = [(a, b) for i, a in enumerate(chosen) for b in chosen[i + 1:]]
    for f in FIGURES:
        if f not in at or not np.all(np.isfinite(at[f])):
            continue
        rows = []
        for a, b in pairs:
            diff = boot[f][:, a] - boot[f][:, b]
            diff = diff[np.isfinite(diff)]
            rows.append({"a": names[a], "b": names[b],
                         "difference": float(at[f][a] - at[f][b]),
                         "difference_ci95": _interval(diff),
                         "p_value": stats.bootstrap_p(diff) if diff.size else 1.0})
        q, rejected = stats.benjamini_hochberg([r["p_value"] for r in rows], FDR)
        for r, qv, hit in zip(rows, q, rejected):
            r["q_value"], r["ordered"] = qv, bool(hit)
            better, worse = (r["a"], r["b"]) if r["difference"] < 0 else (r["b"], r["a"])
            r["order"] = f"{better} > {worse}" if hit else ""
        out[f] = {"total": len(rows), "ordered": sum(r["ordered"] for r in rows),
                  "which": [r["order"] for r in rows if r["ordered"]], "pairs": rows}
    return out


def contradictions(pairs: dict[str, dict]) -> dict[str, list[str]]:
    """Per fidelity figure, the pairs accuracy orders significantly that the figure orders
    significantly the other way."""
    acc = pairs.get("accuracy", {}).get("pairs", [])
    out = {}
    for f in FIDELITY:
        if f not in pairs:
            continue
        out[f] = [a["order"] + f" (accuracy) vs {fid['order']} ({FIGURES[f]})"
                  for a, fid in zip(acc, pairs[f]["pairs"])
                  if a["ordered"] and fid["ordered"]
                  and (a["difference"] < 0) != (fid["difference"] < 0)]
    return out


def validate(c: Column, top: int = TOP, resamples: int = stats.RESAMPLES,
             seed: int = stats.SEED) -> dict[str, Any]:
    """Every statistic of one column (the module's docstring says what each is)."""
    stats.check_resamples(resamples, len(c.names) + 1)
    at, boot = point(c), draws(c, resamples, seed)
    settings = [{"setting": name, "run": run,
                 **{f: _defined(at[f][i]) for f in at},
                 **{f"{f}_ci95": _interval(boot[f][:, i]) for f in at}}
                for i, (name, run) in enumerate(zip(c.names, c.runs))]
    chosen = top_settings(at, top)
    pairs = ordered_pairs(c.names, chosen, at, boot)
    return {"column": c.label, "n_samples": c.samples, "settings_k": len(c.names),
            "top_k": len(chosen), "reference_run": c.reference_run,
            "resamples": resamples, "seed": seed, "settings": settings,
            "correlations": correlations(at, boot), "pairs": pairs,
            "contradictions": contradictions(pairs), "left_out": c.left_out}


# --- runs -> columns ------------------------------------------------------------------------

def _name(e: dict) -> str:
    return " ".join(filter(None, (e["method"], e["setting"], e["variant"],
                                  f"batch={e['batch']}" if e["batch"] != 1 else "")))


def _per_sample(pairing, run_values: np.ndarray) -> tuple[list[str], np.ndarray, np.ndarray,
                                                             np.ndarray]:
    """(sample ids, (n,) units per sample, (n,) stratum label index, (n,) run's score sums):
    a task's units (tokens, turns, samples) gathered per sample."""
    sids = [k[0] for k in pairing.units.keys]
    order = list(dict.fromkeys(sids))
    index = {s: i for i, s in enumerate(order)}
    at = np.array([index[s] for s in sids])
    counts = np.bincount(at, minlength=len(order)).astype(float)
    sums = np.zeros(len(order))
    np.add.at(sums, at, run_values)
    return order, counts, at, sums


def _strata(units, sample_of_unit: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(n,) each sample's stratum index and (S,) the strata's weights (the task's; equal when
    it gives none; one stratum when it has none)."""
    if units.strata is None:
        return np.zeros(n, dtype=int), np.ones(1)
    label_of = {}
    for u, s in zip(sample_of_unit, units.strata):
        label_of.setdefault(int(u), s)
    labels = sorted(set(label_of.values()), key=str)
    index = {lab: i for i, lab in enumerate(labels)}
    raw = np.array([float((units.weights or {}).get(lab, 1.0)) for lab in labels])
    return np.array([index[label_of[i]] for i in range(n)]), raw / raw.sum()


def column(label: str, reference: dict, settings: list[tuple[str, dict]]) -> Column | str:
    """A Column from the full cache's row and the settings' (name, row); a one-line reason
    when fewer than MIN_SETTINGS settings carry fidelity records on the full cache's samples."""
    from harness.report.compare import samples_of

    ref_samples = samples_of(reference)
    if not ref_samples:
        return f"{label}: the full cache has no samples.jsonl"
    kept, left_out, fidelity_rows, run_sums = [], [], [], []
    base = None
    for name, r in settings:
        samples = samples_of(r) or []
        records = {str(s.get("sample_id")): s["fidelity"] for s in samples if s.get("fidelity")}
        if not records:
            left_out.append(f"{name}: no fidelity records (task.fidelity_tokens=0)")
            continue
        try:
            pairing = pair(r["task"], ref_samples, samples)
        except (PairingError, ValueError, KeyError) as exc:
            left_out.append(f"{name}: not paired ({exc})")
            continue
        sids, counts, at, sums = _per_sample(pairing, pairing.run)
        base = base or (sids, counts, at, _per_sample(pairing, pairing.reference)[3], pairing)
        kept.append((name, r))
        run_sums.append(sums)
        fidelity_rows.append([records.get(s, {}) for s in sids])
    if len(kept) < MIN_SETTINGS:
        return (f"{label}: {len(kept)} of {len(settings)} settings carry per-sample fidelity "
                f"paired with the full cache, at least {MIN_SETTINGS} needed"
                + (f" ({'; '.join(left_out[:3])})" if left_out else ""))
    sids, counts, at, ref_sums, pairing = base
    strata, weights = _strata(pairing.units, at, len(sids))
    fidelity = {f: np.array([[_worse(rec, f) for rec in recs] for recs in fidelity_rows]).T
                for f in FIDELITY}  # (n, k)
    fidelity = {f: v for f, v in fidelity.items() if np.isfinite(v).all(axis=1).sum() >= 2}
    return Column(label, reference["higher_is_better"], [n for n, _ in kept],
                  [r["run"] for _, r in kept], reference["run"],
                  np.stack([ref_sums, *run_sums], axis=1), counts, strata, weights,
                  pairing.units.transform, fidelity, left_out)


def columns(board: list[dict], rows: list[dict]) -> tuple[list[Column], list[str]]:
    """(the columns that can be validated, one reason per column that cannot)."""
    from harness.report.leaderboard import sections

    by_run = {r["run"]: r for r in rows}
    ready, reasons = [], []
    for (model, protocol), entries in sections(board).items():
        for name in sorted({c for e in entries for c in e["cells"]}):
            label = f"{model} · {protocol} · {name}"
            have = [e for e in entries if name in e["cells"]]
            full = next((e for e in have if e["method"] == REFERENCE and e["batch"] == 1), None)
            if full is None:
                reasons.append(f"{label}: no full-cache run")
                continue
            got = column(label, by_run[full["cells"][name]],
                         [(_name(e), by_run[e["cells"][name]]) for e in have if e is not full])
            (ready if isinstance(got, Column) else reasons).append(got)
    return ready, reasons


# --- output ---------------------------------------------------------------------------------

def _f(x) -> str:
    return "" if x is None else f"{x:.3g}"


def _ci(pair_) -> str:
    return f" [{_f(pair_[0])}, {_f(pair_[1])}]" if pair_ else ""


def _shown(s: dict, f: str) -> str:
    """A setting's figure as the table shows it: the same-top ratio itself, not 1 - ratio."""
    if f == "top_agree_ratio" and s.get(f) is not None:
        low_high = s.get(f"{f}_ci95")
        flipped = [1 - low_high[1], 1 - low_high[0]] if low_high else None
        return f"{_f(1 - s[f])}{_ci(flipped)}"
    return f"{_f(s.get(f))}{_ci(s.get(f + '_ci95'))}" if f in s else ""


def methods_line(result: dict) -> str:
    return (f"n = {result['n_samples']} samples, k = {result['settings_k']} settings (full cache "
            f"left out), top {result['top_k']} by accuracy for the pairs. Intervals: 95 % "
            f"percentile of one paired bootstrap over sample ids shared by every setting "
            f"({result['resamples']} resamples, seed {result['seed']}). Correlations: Spearman's "
            f"rho (scipy.stats.spearmanr) and Kendall's tau-b (scipy.stats.kendalltau) across "
            f"settings, positive = the figure worsens with accuracy. Pairs: paired bootstrap "
            f"p-value, Benjamini-Hochberg over the pairs of each figure "
            f"(harness.stats.intervals.benjamini_hochberg, FDR {FDR:.0%}).")


def column_markdown(result: dict) -> list[str]:
    """One column's tables: settings, correlations, ordered pairs."""
    out = [f"### {result['column']}", "", methods_line(result), ""]
    cols = ["setting", *(FIGURES[f] if f != "top_agree_ratio" else "same-top ratio"
                         for f in FIGURES)]
    out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for s in result["settings"]:
        out.append("| " + " | ".join([s["setting"], *(_shown(s, f) for f in FIGURES)]) + " |")
    out += ["", "| fidelity figure | Spearman rho [95 %] | Kendall tau-b [95 %] | "
            "ordered pairs | contradicts accuracy |", "|---|---|---|---|---|"]
    pairs = result["pairs"]
    acc = pairs.get("accuracy")
    for f in FIDELITY:
        c, p = result["correlations"].get(f), pairs.get(f)
        if c is None or p is None:
            continue
        rho, tau = (_f(c[k]) or "undefined (a figure constant over settings)"
                    for k in ("spearman", "kendall_tau_b"))
        out.append(f"| {FIGURES[f]} | {rho}{_ci(c['spearman_ci95'])} | "
                   f"{tau}{_ci(c['kendall_ci95'])} | "
                   f"{p['ordered']} of {p['total']} | {len(result['contradictions'][f])} |")
    if acc:
        out.append(f"| (accuracy itself) | | | {acc['ordered']} of {acc['total']} | |")
    out.append("")
    for f, p in pairs.items():
        if p["which"]:
            more = len(p["which"]) - SHOWN_PAIRS
            out.append(f"- ordered by {FIGURES[f]}: {'; '.join(p['which'][:SHOWN_PAIRS])}"
                       + (f" (+{more} more in validation.json)" if more > 0 else ""))
    for f, found in result["contradictions"].items():
        out += [f"- contradiction: {x}" for x in found]
    if result["left_out"]:
        out.append(f"- left out: {'; '.join(result['left_out'])}")
    return out + [""]


def markdown(results: list[dict], reasons: list[str]) -> str:
    out = ["Does per-sample fidelity to the full cache order settings that accuracy cannot? "
           "(accuracy ranks; fidelity is shown beside it)", ""]
    for r in results:
        out += column_markdown(r)
    out += [f"- not validated: {x}" for x in reasons]
    return "\n".join(out).rstrip() + "\n"


def section(board: list[dict], rows: list[dict], resamples: int = stats.RESAMPLES,
            top: int = TOP) -> str:
    """The report's validation section: "" unless some column has >= MIN_SETTINGS settings
    with fidelity."""
    ready, _ = columns(board, rows)
    if not ready:
        return ""
    return ("\n## Fidelity validation\n\n"
            + markdown([validate(c, top, resamples) for c in ready], []))


def run(patterns: list[str], top: int = TOP, resamples: int = stats.RESAMPLES
        ) -> tuple[list[dict], list[str]]:
    """(one result per validated column, reasons for the others). ConfigError: no column can be
    validated, in one line naming what is missing."""
    from harness.report import collect, compare, leaderboard

    if top < 2:
        raise ConfigError(f"--top {top}: at least 2 (a pair)")
    stats.check_resamples(resamples, 1)
    rows = collect.collect(patterns)
    compare.attach(rows)  # marks the noise-floor runs the board leaves out
    ready, reasons = columns(leaderboard.build(rows), rows)
    if not ready:
        raise ConfigError("no fidelity validation: no task column has a full-cache run and "
                          f">= {MIN_SETTINGS} settings with per-sample fidelity records "
                          "(re-run them with task.fidelity_tokens=K > 0): " + "; ".join(reasons))
    return [validate(c, top, resamples) for c in ready], reasons


def main(argv: list[str] | None = None) -> int:
    from harness.store.results import check_writable, write_json_atomic, write_text_atomic

    ap = argparse.ArgumentParser(prog="python -m harness.report.validation",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="results folders, globs of run folders, or files")
    ap.add_argument("--top", type=int, default=TOP, help=f"settings in the pairs (default {TOP})")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for validation.md / validation.json "
                         "(default: <first folder>/_validation)")
    ap.add_argument("--resamples", type=int, default=stats.RESAMPLES)
    args = ap.parse_args(argv)
    out = args.out or (Path(args.paths[0]) / "_validation" if Path(args.paths[0]).is_dir()
                       else Path("results") / "_validation")
    try:
        check_writable(out, f"--out {out}")
        results, reasons = run(args.paths, args.top, args.resamples)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = markdown(results, reasons)
    write_text_atomic(out / "validation.md", text)
    write_json_atomic(out / "validation.json", {"columns": results, "not_validated": reasons})
    sys.stdout.write(text)
    print(f"-> {out / 'validation.md'}, {out / 'validation.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
