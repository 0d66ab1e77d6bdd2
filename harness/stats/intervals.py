"""Intervals, paired comparisons, multiplicity and ranks: pure functions on arrays.

Every interval is two-sided 95 % unless asked otherwise. Libraries: scipy.stats for what has an
exact or closed form (Wilson's score interval via `binomtest(...).proportion_ci`, the exact
McNemar test as a two-sided binomial test on the discordant pairs, Student's t); numpy's
`Generator` for the bootstrap. `scipy.stats.bootstrap` is not used: it resamples observations,
not strata and clusters jointly, and cannot share one resampling across several runs, which the
paired comparisons and the rank intervals need.

The bootstrap works on a `Design`: the cell's units (samples, tokens) grouped into clusters
(a block of contiguous tokens, a conversation's turns; one unit per cluster otherwise) nested in
strata (sub-tasks, datasets) with the official weight of each stratum. The estimate is the
weighted mean over strata of each stratum's pooled mean (sum of scores / number of units),
optionally through a transform (exp: perplexity from mean NLL). One resample draws, in every
stratum, as many clusters as it has, with replacement; k runs scored on the same units sit side
by side as k columns and are resampled together (paired).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvcore.errors import ConfigError

CONFIDENCE = 0.95
RESAMPLES = 10_000
MIN_RESAMPLES = 100  # below this a 95 % percentile interval rests on two or three draws
SEED = 0
_CHUNK_CELLS = 4_000_000  # resamples x clusters x columns drawn at once (memory bound)
# What one bootstrap (draws, rank intervals) may hold at once; resample counts needing more are
# refused before any draw (a 2 CPU / 24 GiB machine is shared by several jobs).
MEMORY_LIMIT_BYTES = 2 * 2**30
MAX_SAMPLES = 10**12  # a sample size beyond this is no plan (and overflows float arithmetic)


def _scipy_stats():
    """scipy.stats, imported when an interval is first computed: importing it takes about a
    second, and every run imports this module (through the results writer) before it checks
    its configuration, so a refused command would wait for it."""
    from scipy import stats

    return stats


# --- closed forms -----------------------------------------------------------------------------

def wilson(successes: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval of a proportion (scipy's `proportion_ci(method="wilson")`)."""
    if n <= 0:
        raise ValueError("wilson: n must be positive")
    test = _scipy_stats().binomtest(int(successes), int(n))
    ci = test.proportion_ci(confidence, method="wilson")
    return float(ci.low), float(ci.high)


def clt_interval(values, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Mean +- t * s / sqrt(n) (Student's t with n - 1 degrees of freedom)."""
    x = np.asarray(values, dtype=float)
    if x.size < 2:
        raise ValueError("clt_interval: needs at least 2 values")
    t = _scipy_stats().t.ppf(0.5 + confidence / 2, x.size - 1)
    half = t * x.std(ddof=1) / math.sqrt(x.size)
    return float(x.mean() - half), float(x.mean() + half)


def mcnemar_exact(lost: int, gained: int) -> float:
    """Two-sided exact McNemar p-value: under H0 each of the `lost + gained` discordant pairs
    (pass -> fail, fail -> pass) goes either way with probability 1/2. 1.0 with none."""
    total = int(lost) + int(gained)
    if total == 0:
        return 1.0
    return float(_scipy_stats().binomtest(int(lost), total, 0.5).pvalue)


def discordance(a, b) -> float:
    """The fraction of paired samples whose score changed."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.size == 0:
        raise ValueError("discordance: two non-empty arrays of one shape")
    return float(np.mean(a != b))


def benjamini_hochberg(pvalues, fdr: float = 0.05) -> tuple[list[float], list[bool]]:
    """(adjusted p-values, rejected) under the Benjamini-Hochberg step-up procedure: the
    hypotheses with the k smallest p are rejected for the largest k with p_(k) <= k / m * fdr."""
    p = np.asarray(pvalues, dtype=float)
    m = p.size
    if m == 0:
        return [], []
    order = np.argsort(p, kind="stable")
    scaled = p[order] * m / np.arange(1, m + 1)
    adjusted_sorted = np.minimum(1.0, np.minimum.accumulate(scaled[::-1])[::-1])
    adjusted = np.empty(m)
    adjusted[order] = adjusted_sorted
    below = np.nonzero(p[order] <= np.arange(1, m + 1) / m * fdr)[0]
    rejected = np.zeros(m, dtype=bool)
    if below.size:
        rejected[order[: below[-1] + 1]] = True
    return adjusted.tolist(), rejected.tolist()


def _whole_n(n: float, what: str) -> int:
    """ceil(n) for a sample size, refused (ValueError) when it is beyond MAX_SAMPLES or not a
    number (a tiny half-width overflows the float arithmetic)."""
    if not n <= MAX_SAMPLES:  # also inf and NaN
        raise ValueError(f"{what} needs more than {MAX_SAMPLES:.0e} samples")
    return max(1, math.ceil(n))


def n_for_half_width(pilot_n: int, pilot_half_width: float, half_width: float) -> int:
    """Samples needed for a 95 % half-width, from a pilot's: a half-width shrinks as 1/sqrt(n).
    ValueError when the answer exceeds MAX_SAMPLES."""
    if not (half_width > 0 and math.isfinite(half_width)):
        raise ValueError("half_width must be a finite number above 0")
    if pilot_half_width <= 0:
        return 1  # no variation in the pilot: any n gives a zero-width interval
    ratio = pilot_half_width / half_width  # inf for a wanted width of 1e-320
    n = pilot_n * ratio * ratio if ratio < 1e150 else math.inf  # ratio ** 2 would raise
    return _whole_n(n, f"a half-width of {half_width:g}")


def half_width_for_n(pilot_n: int, pilot_half_width: float, n: float) -> float:
    """The half-width a sample of n reaches, from a pilot's (the inverse of n_for_half_width)."""
    return pilot_half_width * math.sqrt(pilot_n / n)


def n_for_paired_binary(discordance_: float, difference: float, half_width: float,
                        confidence: float = CONFIDENCE) -> int:
    """Samples needed for a paired pass/fail difference's half-width (same units as
    `difference`, a fraction): the per-sample difference is -1, 0 or +1, its variance the
    discordance minus the squared mean difference. ValueError beyond MAX_SAMPLES."""
    if not (half_width > 0 and math.isfinite(half_width)):
        raise ValueError("half_width must be a finite number above 0")
    # a Python float: overflow gives inf, quietly
    z = float(_scipy_stats().norm.ppf(0.5 + confidence / 2))
    variance = max(discordance_ - difference ** 2, 0.0)
    n = z * z * variance / half_width / half_width  # inf, never 1 / 0, for a tiny width
    return _whole_n(n, f"a half-width of {half_width:g}")


def bootstrap_bytes(resamples: int, columns: int) -> int:
    """Peak memory of `draws` plus `rank_intervals` on `columns` runs: the (resamples, columns)
    draws and their copies (transform, ranks, quantile sorts: ~6 float64 arrays), the
    (resamples, columns, columns) comparison of rank_intervals, and one chunk of picks."""
    return resamples * (6 * 8 * columns + columns * columns) + 3 * 8 * _CHUNK_CELLS


def check_resamples(resamples: int, columns: int, key: str = "--resamples") -> None:
    """ConfigError unless `resamples` is an integer in [MIN_RESAMPLES, the count whose bootstrap
    of `columns` runs fits MEMORY_LIMIT_BYTES]: checked before any draw."""
    if not isinstance(resamples, int) or isinstance(resamples, bool) or \
            resamples < MIN_RESAMPLES:
        raise ConfigError(f"{key} {resamples}: at least {MIN_RESAMPLES}")
    need = bootstrap_bytes(resamples, max(1, columns))
    if need > MEMORY_LIMIT_BYTES:
        fits = (MEMORY_LIMIT_BYTES - 3 * 8 * _CHUNK_CELLS) // (6 * 8 * columns + columns ** 2)
        raise ConfigError(f"{key} {resamples}: the bootstrap of {columns} run(s) side by side "
                          f"would hold about {need / 2**30:.3g} GiB, above the "
                          f"{MEMORY_LIMIT_BYTES / 2**30:g} GiB limit "
                          f"(harness.stats.intervals.MEMORY_LIMIT_BYTES); at most {fits} here")


# --- the bootstrap design ---------------------------------------------------------------------

@dataclass(frozen=True)
class Design:
    """Clusters of units in weighted strata; `sums` holds k runs' scores side by side."""
    sums: np.ndarray  # (m, k) per cluster: sum of its units' scores, one column per run
    counts: np.ndarray  # (m,) units per cluster
    strata: np.ndarray  # (m,) stratum index of each cluster, 0..S-1
    weights: np.ndarray  # (S,) official weight of each stratum, summing to 1
    transform: str = "identity"  # or "exp" (mean NLL -> perplexity)

    @property
    def units(self) -> int:
        return int(self.counts.sum())

    @property
    def clusters(self) -> int:
        return int(self.counts.size)


def design(values, strata=None, weights=None, clusters=None, transform: str = "identity"
           ) -> Design:
    """A Design from per-unit scores `values` ((n,) or (n, k): k runs on the same units),
    `strata` labels (default: one stratum), `weights` {label: weight} (default: equal per
    stratum, the official mean of sub-task means) and `clusters` labels (default: each unit its
    own cluster; a cluster never spans two strata)."""
    v = np.asarray(values, dtype=float)
    v = v[:, None] if v.ndim == 1 else v
    n = v.shape[0]
    if n == 0:
        raise ValueError("design: no units")
    if not np.all(np.isfinite(v)):
        raise ValueError("design: scores must be finite")
    strata = np.zeros(n, dtype=int) if strata is None else np.asarray(strata)
    labels, stratum = np.unique(strata, return_inverse=True)
    if clusters is None:
        cluster = np.arange(n)
    else:  # a cluster label is read inside its stratum
        index: dict = {}
        cluster = np.array([index.setdefault((int(s), c), len(index))
                            for s, c in zip(stratum, np.asarray(clusters).tolist())])
    first = np.unique(cluster, return_index=True)[1]
    m = first.size
    sums = np.zeros((m, v.shape[1]))
    np.add.at(sums, cluster, v)
    counts = np.bincount(cluster, minlength=m).astype(float)
    if weights is None:
        w = np.full(labels.size, 1.0 / labels.size)
    else:
        missing = [str(lab) for lab in labels if lab not in weights]
        if missing:
            raise ValueError(f"design: no weight for stratum {missing[0]!r}")
        w = np.array([float(weights[lab]) for lab in labels])
        w = w / w.sum()
    if transform not in ("identity", "exp"):
        raise ValueError(f"design: transform={transform!r}; allowed: identity, exp")
    return Design(sums, counts, stratum[first], w, transform)


def _finish(means: np.ndarray, transform: str) -> np.ndarray:
    return np.exp(means) if transform == "exp" else means


def estimate(d: Design) -> np.ndarray:
    """(k,) the estimate of each column."""
    total = np.zeros(d.sums.shape[1])
    for s, w in enumerate(d.weights):
        inside = d.strata == s
        total += w * d.sums[inside].sum(axis=0) / d.counts[inside].sum()
    return _finish(total, d.transform)


def draws(d: Design, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """(resamples, k): the estimate of each column in every bootstrap resample (columns share
    each resample's clusters: paired)."""
    rng = np.random.default_rng(seed)
    k = d.sums.shape[1]
    total = np.zeros((resamples, k))
    for s, w in enumerate(d.weights):
        sums, counts = d.sums[d.strata == s], d.counts[d.strata == s]
        m = counts.size
        step = max(1, _CHUNK_CELLS // max(1, m * k))
        for start in range(0, resamples, step):
            b = min(step, resamples - start)
            pick = rng.integers(0, m, size=(b, m))
            total[start:start + b] += w * sums[pick].sum(axis=1) / counts[pick].sum(axis=1)[:, None]
    return _finish(total, d.transform)


def percentile(samples, confidence: float = CONFIDENCE) -> tuple[float, float]:
    low, high = np.quantile(np.asarray(samples, dtype=float),
                            [0.5 - confidence / 2, 0.5 + confidence / 2])
    return float(low), float(high)


def bootstrap_interval(d: Design, resamples: int = RESAMPLES, seed: int = SEED,
                       confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Percentile interval of a one-column design's estimate."""
    return percentile(draws(d, resamples, seed)[:, 0], confidence)


def bootstrap_p(differences) -> float:
    """Two-sided p-value of "no difference" from bootstrap draws of a difference: twice the
    smaller share of draws on either side of 0 (the percentile interval's inversion), counted
    as (k + 1) / (B + 1) so that B draws never claim p = 0."""
    x = np.asarray(differences, dtype=float)
    if np.all(x == 0):
        return 1.0
    side = min(np.sum(x <= 0), np.sum(x >= 0))
    return float(min(1.0, 2 * (side + 1) / (x.size + 1)))


@dataclass(frozen=True)
class Paired:
    """A run (column 1) against its reference (column 0) on the same units."""
    reference: float
    value: float
    difference: float  # value - reference
    difference_ci95: tuple[float, float]
    retained: float | None  # value / reference
    retained_ci95: tuple[float, float] | None
    p_value: float
    test: str


def paired(d: Design, resamples: int = RESAMPLES, seed: int = SEED,
           confidence: float = CONFIDENCE, lost_gained: tuple[int, int] | None = None) -> Paired:
    """The paired difference and retained fraction of a two-column design, with percentile
    intervals from one shared resampling; the exact McNemar p-value when `lost_gained` (the
    discordant pass/fail counts) is given, else the bootstrap p-value."""
    if d.sums.shape[1] != 2:
        raise ValueError("paired: a design of two columns (reference, run)")
    point = estimate(d)
    boot = draws(d, resamples, seed)
    diff = boot[:, 1] - boot[:, 0]
    retained = retained_ci = None
    if point[0] != 0:
        retained = float(point[1] / point[0])
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = boot[:, 1] / boot[:, 0]
        ratio = ratio[np.isfinite(ratio)]
        retained_ci = percentile(ratio, confidence) if ratio.size else None
    if lost_gained is not None:
        p, test = mcnemar_exact(*lost_gained), "exact McNemar"
    else:
        p, test = bootstrap_p(diff), "paired bootstrap"
    return Paired(float(point[0]), float(point[1]), float(point[1] - point[0]),
                  percentile(diff, confidence), retained, retained_ci, p, test)


def rank_intervals(samples, higher_is_better: bool, confidence: float = CONFIDENCE
                   ) -> list[tuple[int, int]]:
    """(best, worst) rank of each of M entries from (resamples, M) bootstrap draws: ranks are
    taken in every resample (1 = best; ties share the better rank) and their percentile interval
    reported, so entries that cannot be told apart share a rank range."""
    x = np.asarray(samples, dtype=float)
    x = -x if higher_is_better else x
    ranks = (x[:, None, :] < x[:, :, None]).sum(axis=2) + 1  # entries strictly better, + 1
    low, high = np.quantile(ranks, [0.5 - confidence / 2, 0.5 + confidence / 2], axis=0,
                            method="inverted_cdf")
    return [(int(a), int(b)) for a, b in zip(low, high)]
