"""metrics.json's `fidelity` section: the statistics of the per-sample paired fidelity records
(harness.core.fidelity) with their intervals, llama.cpp's KLD summary (mean, median and 99th
percentile KL, same top token %) and the gold answer's log-probability."""

from __future__ import annotations

from typing import Any

import numpy as np

from harness.stats import intervals as stats

TOP_PERCENTILE = 99  # llama.cpp's KLD statistics: mean, median, 99th percentile, same top %
STATISTICS = ("kl_mean", "kl_median", f"kl_p{TOP_PERCENTILE}", "top_agree_percent",
              "gold_logprob_mean", "gold_logprob_full_mean")


def _quantile_draws(kl_rows: list[np.ndarray], resamples: int, seed: int) -> np.ndarray:
    """(resamples, 2): the median and 99th percentile of the pooled tokens of samples drawn
    with replacement (a sample's tokens together), as harness.stats.intervals.draws draws clusters."""
    n, longest = len(kl_rows), max(k.size for k in kl_rows)
    padded = np.full((n, longest), np.nan)  # (n, tokens), NaN past a sample's own tokens
    for i, k in enumerate(kl_rows):
        padded[i, :k.size] = k
    # the NaN-aware quantile is several times slower: only where a sample is shorter
    quantile = np.nanpercentile if np.isnan(padded).any() else np.percentile
    rng = np.random.default_rng(seed)
    step = max(1, 2_000_000 // padded.size)  # resamples drawn at once (memory bound)
    parts = []
    for start in range(0, resamples, step):
        pick = rng.integers(0, n, size=(min(step, resamples - start), n))
        pooled = padded[pick].reshape(pick.shape[0], -1)
        parts.append(quantile(pooled, [50, TOP_PERCENTILE], axis=1).T)
    return np.concatenate(parts)


def summary(samples: list[dict], resamples: int | None = None, seed: int | None = None
            ) -> dict[str, Any] | None:
    """llama.cpp's KLD statistics over every teacher-forced token of the run (mean, median and
    99th percentile KL(full || setting), same top token %) and the mean gold log-probability per
    sample, each with a 95 % percentile interval from the bootstrap over samples, a sample's
    tokens resampled together (the means through harness.stats' cluster design, the quantiles
    with the same draws of samples; its seed and resample count). None: no fidelity."""

    resamples = stats.RESAMPLES if resamples is None else resamples
    seed = stats.SEED if seed is None else seed
    rows = [s["fidelity"] for s in samples if s.get("fidelity") and s["fidelity"]["kl"]]
    if not rows:
        return None
    kl_rows = [np.asarray(r["kl"], dtype=float) for r in rows]
    pooled = np.concatenate(kl_rows)
    sample_of = np.repeat(np.arange(len(rows)), [k.size for k in kl_rows])  # token -> sample
    agree = 100 * np.concatenate([np.asarray(r["top_agree"], dtype=float) for r in rows])
    gold = [(r["gold_logprob"], r["gold_logprob_full"]) for r in rows
            if r.get("gold_logprob") is not None and r.get("gold_logprob_full") is not None]
    n = len(rows)
    means = {"kl_mean": (pooled, sample_of), "top_agree_percent": (agree, sample_of),
             "gold_logprob_mean": (np.array([g[0] for g in gold]), None),
             "gold_logprob_full_mean": (np.array([g[1] for g in gold]), None)}
    out: dict[str, Any] = {"samples": n, "tokens": int(pooled.size), "gold_samples": len(gold)}
    quantiles = _quantile_draws(kl_rows, resamples, seed) if n >= 2 else None
    for i, name in enumerate(STATISTICS):
        if name in means:
            values, clusters = means[name]
            if not values.size:
                out[name] = {"value": None, "ci95": None}
                continue
            design = stats.design(values, clusters=clusters)
            value = float(stats.estimate(design)[0])
            units = design.clusters
            ci = (list(stats.bootstrap_interval(design, resamples, seed)) if units >= 2
                  else None)
        else:
            q = 50 if name == "kl_median" else TOP_PERCENTILE
            value = float(np.percentile(pooled, q))
            ci = None if quantiles is None else list(stats.percentile(
                quantiles[:, 0 if q == 50 else 1]))
        out[name] = {"value": value, "ci95": ci}
    out["interval"] = (f"bootstrap over samples, a sample's tokens together; percentile, "
                       f"{resamples} resamples, seed {seed}" if n >= 2
                       else "none: fewer than 2 samples")
    return out
