"""Anytime-valid intervals for sequential rounds: a paired mean difference watched after every
round, stopped when its question is answered, its interval still valid at the stopping time.

The interval is the hedged-capital confidence sequence (CS) of Waudby-Smith & Ramdas,
"Estimating means of bounded random variables by betting" (JRSS-B 2024, arXiv 2010.09686),
on the per-sample paired difference D = score(setting) - score(reference) of scores bounded in
[0, R] (RULER and LongBench: x100, R = 100), mapped to Y = (D + R) / 2R in [0, 1]. For every
candidate mean m two bettors stake on "above m" and "below m" with a predictable plug-in
fraction (from the samples before, never the current one), truncated so no bet can lose
everything; their averaged wealth is a nonnegative martingale when m is the true mean, so by
Ville's inequality it ever reaches 1/alpha with probability at most alpha. The CS is every m
whose wealth has not (running intersection: a value once rejected stays rejected), computed on
a grid of m and widened by one grid step each side so the grid never cuts the truth off.

Why this one: it needs nothing but the bound (no variance assumption, valid for pass/fail and
graded scores alike), it adapts to the variance of the differences (pairs that agree on most
samples, the common case here, give low-variance differences and narrow sets), and among the
published CSs for bounded means it is the tightest in the authors' comparisons (against
empirical-Bernstein stitching and the predictable-mixture bounds); an alpha-spending rule would
fix the looks in advance, while a CS allows any number of rounds, of any size, and stopping for
any reason. The price against a fixed-n interval is a wider interval at the same n (about
1.5x for pass/fail differences at n = 200): that is what keeps repeated looks honest.

Rounds: the bets are fixed for a round (from the samples of the rounds before) and the CS is
looked at, and intersected, at round ends only. The samples come in the task's order (RULER's
round-robin over its cells), so their means differ from sample to sample; when a round holds
every cell equally often (a block that is a multiple of the number of cells), a round's
expected wealth factor, a product of (1 + lambda * delta_i) with the deltas summing to 0, is at
most 1 (the AM-GM inequality), so the wealth at round ends is a nonnegative supermartingale and
the CS covers the equal-weight mean over the cells (not RULER's average, which weighs
sub-tasks equally) exactly. Bets changed sample by sample (the paper's) need identically
distributed samples.

Questions and their error: every setting is compared with the reference (decided "worse" or
"better" when its CS excludes 0, "indistinguishable" when it lies inside +-margin), and with
`top_k`, every pair of settings of one budget level (ordered when its paired CS excludes 0,
equal when it lies inside +-margin) and every setting's membership of its level's top k (in:
fewer than k others are not shown below it; out: k others are shown above it; tied: neither,
but every pair in the way is shown equal within the margin, so the top k is not unique).
alpha is split evenly over every CS that may be looked at (Bonferroni over the settings and
the pairs, fixed before the first round so an interval never depends on when others stop):
the chance that any reported CS, at any round, misses its mean is at most alpha. A setting is
sampled while any question it is part of is undecided (its own, or another's membership
resting on a pair with it that is neither ordered nor equal); once it stops, its data and so
its interval are fixed for good.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# Grid of candidate means on [0, 1] (for Y); 2000 steps: 0.1 points on a x100 difference.
GRID_STEPS = 2000
# Bets are at most this fraction of the wealth over the gap to the bound (the paper's c).
BET_CAP = 0.5
# Wealth is split evenly between the bettor on "above m" and the one on "below m" (theta).
HEDGE = 0.5


@dataclass(frozen=True)
class Interval:
    """A difference's CS at `n` samples, in the scores' units (low <= mean <= high)."""

    low: float
    high: float
    mean: float
    n: int

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def within(self, margin: float) -> bool:
        return margin > 0 and -margin < self.low and self.high < margin

    def as_dict(self) -> dict:
        return {"low": self.low, "high": self.high, "mean": self.mean, "n": self.n}


def _grid(steps: int) -> np.ndarray:
    return np.linspace(0.0, 1.0, steps + 1)[1:-1]  # (G,): interior points, bets need 0 < m < 1


def _plug_in_bets(y: np.ndarray, alpha: float, block: int = 1) -> np.ndarray:
    """(n,) predictable bet sizes: sqrt(2 log(2/alpha) / (sigma2 t log(1+t))) with the running
    mean and variance estimates seeded at 1/2 and 1/4 (the paper's eq. 26), t and sigma2 taken
    at the start of each block of `block` samples (block 1: every sample, the paper's)."""
    n = y.size
    t = np.arange(1, n + 1, dtype=float)
    mu = (0.5 + np.cumsum(y)) / (t + 1)  # mu_hat_t, uses y_1..y_t
    var = (0.25 + np.cumsum((y - mu) ** 2)) / (t + 1)  # sigma2_hat_t
    var_before = np.concatenate([[0.25], var])  # sigma2_hat_{s} for s = 0..n
    start = (np.arange(n) // block) * block  # samples before each one's block
    first = start + 1.0  # the block's first t
    return np.sqrt(2 * math.log(2 / alpha) / (var_before[start] * first * np.log1p(first)))


def rejected_at(y, alpha: float, steps: int = GRID_STEPS,
                block: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """For Y in [0, 1] (n,), the grid (G,) and, per candidate mean, the first t (1-based, a
    multiple of `block`) at which its hedged wealth reached 1/alpha (n + 1: never)."""
    y = np.asarray(y, dtype=float)
    m = _grid(steps)
    n = y.size
    first = np.full(m.size, n + 1)
    if n == 0:
        return m, first
    lam = _plug_in_bets(y, alpha, block)[:, None]  # (n, 1)
    width = max(1, _CHUNK_CELLS // n)  # candidates at once: memory stays bounded at any n
    for lo in range(0, m.size, width):
        first[lo:lo + width] = _first_hits(y, lam, m[lo:lo + width], alpha, block)
    return m, first


# (samples x candidate means) held at once by `rejected_at`: about 32 MB per float array
_CHUNK_CELLS = 4_000_000


def _first_hits(y: np.ndarray, lam: np.ndarray, m: np.ndarray, alpha: float,
                block: int) -> np.ndarray:
    """(g,) first block end t at which each candidate's hedged wealth reached 1/alpha (n + 1:
    never). Only block ends are looked at: within a block the wealth is no martingale when the
    block's samples have different means (RULER's cells), across whole blocks it is one."""
    up = np.minimum(lam, BET_CAP / m[None, :])  # (n, g): never bet more than wealth allows
    down = np.minimum(lam, BET_CAP / (1 - m[None, :]))
    gap = y[:, None] - m[None, :]
    log_up = np.cumsum(np.log1p(up * gap), axis=0)
    log_down = np.cumsum(np.log1p(-down * gap), axis=0)
    wealth = np.logaddexp(math.log(HEDGE) + log_up, math.log(1 - HEDGE) + log_down)
    ends = np.arange(block - 1, y.size, block)  # rows of the block ends
    hit = wealth[ends] >= math.log(1 / alpha)  # (blocks, g)
    out = np.full(m.size, y.size + 1)
    any_hit = hit.any(axis=0)
    out[any_hit] = (ends[hit[:, any_hit].argmax(axis=0)] + 1)
    return out


def _hull(m: np.ndarray, alive: np.ndarray, y_mean: float) -> tuple[float, float]:
    """The CS's hull in Y, one grid step wider each side (the truth may lie between points)."""
    kept = np.flatnonzero(alive)
    if kept.size == 0:  # every grid point rejected: the truth lies between two (a zero-width CS)
        nearest = int(np.argmin(np.abs(m - y_mean)))
        kept = np.array([nearest])
    lo = m[kept[0] - 1] if kept[0] > 0 else 0.0
    hi = m[kept[-1] + 1] if kept[-1] + 1 < m.size else 1.0
    return float(lo), float(hi)


def sequence(differences, bound: float, alpha: float, looks=None, steps: int = GRID_STEPS,
             block: int = 1) -> list[Interval]:
    """The CS of the mean paired difference after each look.

    Args:
        differences: (n,) per-sample differences, each in [-bound, bound].
        bound: R, the scores' range (scores in [0, R]).
        alpha: this CS's error (already split over the questions).
        looks: the sample counts to report at, multiples of `block` (default: every block end).
        steps: grid resolution on [0, 1].
        block: samples per round: bets are fixed for a round and the CS is looked at (and
            intersected) at round ends only. 1: every sample (i.i.d. differences).

    Returns:
        One Interval per look, in the differences' units.
    """
    d = np.asarray(differences, dtype=float)
    check_differences(d, bound)
    looks = list(range(block, d.size + 1, block)) if looks is None else list(looks)
    if any(k < 0 or k > d.size or k % block for k in looks):
        raise ValueError(f"looks must be multiples of block={block} in [0, {d.size}]")
    y = (d + bound) / (2 * bound)
    m, first = rejected_at(y, alpha, steps, block)
    out = []
    for k in looks:
        if k == 0:
            out.append(Interval(-bound, bound, 0.0, 0))
            continue
        lo, hi = _hull(m, first > k, float(y[:k].mean()))
        out.append(Interval(lo * 2 * bound - bound, hi * 2 * bound - bound,
                            float(d[:k].mean()), k))
    return out


def check_differences(d: np.ndarray, bound: float) -> None:
    if not (math.isfinite(bound) and bound > 0):
        raise ValueError(f"bound={bound!r} must be a positive finite number")
    if d.ndim != 1 or not np.all(np.isfinite(d)) or np.any(np.abs(d) > bound * (1 + 1e-9)):
        raise ValueError(f"differences must be finite and within [-{bound:g}, {bound:g}]")


# --- questions and decisions ---------------------------------------------------------------------

@dataclass(frozen=True)
class Design:
    """The rounds' statistical knobs: `alpha` over every question, the equivalence `margin`
    (scores' units; 0: never "indistinguishable"), `top_k` per budget level (None: the question
    is not asked), the scores' bound R and the samples per round."""

    alpha: float = 0.05
    margin: float = 0.0
    top_k: int | None = None
    bound: float = 100.0
    block: int = 1  # samples per round (bets fixed per round, looks at round ends)

    def __post_init__(self) -> None:
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"block={self.block!r} must be an integer >= 1")
        if not (0 < self.alpha < 1):
            raise ValueError(f"alpha={self.alpha!r} must lie in (0, 1)")
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise ValueError(f"margin={self.margin!r} must be a finite number >= 0")
        if self.top_k is not None and (isinstance(self.top_k, bool) or self.top_k < 1):
            raise ValueError(f"top_k={self.top_k!r} must be a positive integer or None")


def pairs(levels: dict[str, str]) -> list[tuple[str, str]]:
    """Every unordered pair of settings sharing a budget level (sorted, stable)."""
    names = sorted(levels)
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:] if levels[a] == levels[b]]


def per_question_alpha(design: Design, levels: dict[str, str]) -> float:
    """Bonferroni: alpha over every CS that may be looked at, fixed before the first round."""
    questions = len(levels) + (len(pairs(levels)) if design.top_k is not None else 0)
    return design.alpha / max(1, questions)


@dataclass
class State:
    """Where every question stands after a round (what the rounds ledger records)."""

    versus_reference: dict[str, Interval] = field(default_factory=dict)
    verdict: dict[str, str] = field(default_factory=dict)  # worse|better|indistinguishable|undecided
    pair_interval: dict[tuple[str, str], Interval] = field(default_factory=dict)
    membership: dict[str, str] = field(default_factory=dict)  # in|out|tied|undecided (top_k)
    active: set[str] = field(default_factory=set)


def verdict_of(interval: Interval, margin: float) -> str:
    if interval.excludes_zero():
        return "better" if interval.low > 0 else "worse"
    if interval.within(margin):
        return "indistinguishable"
    return "undecided"


def _membership(name: str, levels: dict[str, str], above: set[tuple[str, str]], k: int) -> str:
    """`above` holds (a, b) for every pair whose CS shows a above b."""
    rivals = [o for o in levels if o != name and levels[o] == levels[name]]
    if sum((o, name) in above for o in rivals) >= k:
        return "out"
    if sum((name, o) not in above for o in rivals) <= k - 1:
        return "in"
    return "undecided"


def decide(scores: dict[str, list[float]], reference: list[float], levels: dict[str, str],
           design: Design, higher_is_better: bool = True, steps: int = GRID_STEPS) -> State:
    """Every question after a round, from the scores so far.

    Args:
        scores: per setting, its per-sample scores on the first n_s samples of the common order.
        reference: the reference's scores on the first max(n_s) samples (at least).
        levels: per setting, its budget level (pairs and top k are taken inside a level).
        design: the knobs; the per-CS alpha is split over all settings and pairs of `levels`.
        higher_is_better: the direction that "above" (top k) follows.

    Returns:
        The State: each setting's CS against the reference and its verdict, every pair's CS, each
        membership, and the settings to sample next round.
    """
    alpha = per_question_alpha(design, levels)
    state = State()
    for name in sorted(scores):
        n = len(scores[name])
        if len(reference) < n:
            raise ValueError(f"reference has {len(reference)} scores, {name} has {n}")
        d = np.asarray(scores[name], dtype=float) - np.asarray(reference[:n], dtype=float)
        interval = sequence(d, design.bound, alpha, [n], steps, design.block)[0]
        state.versus_reference[name] = interval
        state.verdict[name] = verdict_of(interval, design.margin)
    unsettled: dict[str, set[str]] = {name: set() for name in scores}
    if design.top_k is not None:
        above, unsettled = _pair_questions(scores, levels, design, alpha, higher_is_better,
                                           steps, state)
        for name in scores:
            membership = _membership(name, levels, above, design.top_k)
            # only pairs shown equal within the margin stand in the way: a tie, decided
            state.membership[name] = ("tied" if membership == "undecided"
                                      and not unsettled[name] else membership)
    for name in scores:
        own = state.verdict[name] != "undecided" and state.membership.get(name) != "undecided"
        needed = any(state.membership.get(o) == "undecided" for o in unsettled[name])
        if not own or needed:
            state.active.add(name)
    return state


def _pair_questions(scores: dict[str, list[float]], levels: dict[str, str], design: Design,
                    alpha: float, higher_is_better: bool, steps: int, state: State
                    ) -> tuple[set[tuple[str, str]], dict[str, set[str]]]:
    """Every pair's CS (into `state`), the pairs shown ordered ((a, b): a above b) and, per
    setting, its rivals still unsettled: neither ordered nor shown equal within the margin."""
    above: set[tuple[str, str]] = set()
    unsettled: dict[str, set[str]] = {name: set() for name in scores}
    for a, b in pairs(levels):
        n = min(len(scores[a]), len(scores[b]))
        d = np.asarray(scores[a][:n], dtype=float) - np.asarray(scores[b][:n], dtype=float)
        interval = sequence(d, design.bound, alpha, [n], steps, design.block)[0]
        state.pair_interval[(a, b)] = interval
        if interval.excludes_zero():
            a_higher = interval.low > 0  # the difference a - b is positive
            above.add((a, b) if a_higher == higher_is_better else (b, a))
        elif not interval.within(design.margin):
            unsettled[a].add(b)
            unsettled[b].add(a)
    return above, unsettled


class Rounds:
    """The rounds' bookkeeping: scores appended round by round for the sampled settings only,
    every question decided again after each round, and each setting's report fixed when it stops.

    A stopped setting is never given samples again (`add` refuses them), so its CS, computed
    from its own first n samples and the reference's, is the one at its stopping time for good.
    """

    def __init__(self, levels: dict[str, str], design: Design, higher_is_better: bool = True,
                 steps: int = GRID_STEPS):
        if not levels:
            raise ValueError("no settings to sample")
        self.levels, self.design = dict(levels), design
        self.higher_is_better, self.steps = higher_is_better, steps
        self.scores: dict[str, list[float]] = {name: [] for name in levels}
        self.reference: list[float] = []
        self.active: set[str] = set(levels)
        self.reported: dict[str, dict] = {}
        self.history: list[dict] = []
        self.state: State | None = None

    def add(self, scores: dict[str, list[float]], reference: list[float]) -> State:
        """One round: the next block's scores of exactly the active settings and the reference
        (all on the same samples, in the same order). Returns the State after it."""
        if set(scores) != self.active:
            extra, missing = sorted(set(scores) - self.active), sorted(self.active - set(scores))
            raise ValueError(f"a round samples the active settings only: extra {extra}, "
                             f"missing {missing}")
        if len(reference) == 0 or any(len(v) != len(reference) for v in scores.values()):
            raise ValueError("every setting of a round scores the reference's samples")
        if len(reference) != self.design.block:
            raise ValueError(f"a round adds design.block={self.design.block} samples, not "
                             f"{len(reference)}")
        for name, values in scores.items():
            self.scores[name].extend(float(x) for x in values)
        self.reference.extend(float(x) for x in reference)
        ran = sorted(self.active)
        self.state = decide(self.scores, self.reference, self.levels, self.design,
                            self.higher_is_better, self.steps)
        for name in ran:
            if name not in self.state.active:
                self.reported[name] = self.report(name, len(self.history) + 1)
        self.active = set(self.state.active)
        self.history.append(self.summary(ran))
        return self.state

    def report(self, name: str, round_: int) -> dict:
        """The setting's figures as they stand (fixed once it stops)."""
        state = self.state
        return {"round": round_, "n": len(self.scores[name]),
                "versus_reference": state.versus_reference[name].as_dict(),
                "verdict": state.verdict[name],
                **({"membership": state.membership[name]} if state.membership else {})}

    def summary(self, ran: list[str]) -> dict:
        """What the ledger keeps of a round: who ran, n per setting, every CS and decision."""
        state = self.state
        return {"round": len(self.history) + 1, "ran": ran,
                "n": {name: len(v) for name, v in self.scores.items()},
                "reference_n": len(self.reference),
                "versus_reference": {k: v.as_dict() for k, v in state.versus_reference.items()},
                "verdict": dict(state.verdict),
                "membership": dict(state.membership),
                "pairs": [{"a": a, "b": b, **v.as_dict(), "ordered": v.excludes_zero()}
                          for (a, b), v in state.pair_interval.items()],
                "active_next": sorted(state.active)}

    def done(self) -> bool:
        return not self.active


# --- planning: the rounds' expected cost against a fixed-n design ---------------------------------

@dataclass(frozen=True)
class RoundsPlan:
    """What the rounds would cost one comparison: the mean stopping n (`expected_n`, capped at
    max_n), the share of simulated sweeps decided by max_n (`power`), the n at which the median
    CS half-width reaches the wanted one (None: not by max_n), and the fixed-n design deciding
    the same question with the same power (None: no effect to power)."""

    expected_n: float
    power: float
    n_for_half_width: int | None
    fixed_n_same_power: int | None


def plan_rounds(differences, bound: float, alpha: float, margin: float, block: int,
                max_n: int, half_width: float, sims: int = 100, seed: int = 0,
                steps: int = 400) -> RoundsPlan:
    """Simulated sweeps (fixed seed) of one comparison, each drawing its per-sample differences
    from a pilot's (`differences`, with replacement): looks every `block` samples, stopped when
    the CS excludes 0 or lies inside +-margin."""
    pilot = np.asarray(differences, dtype=float)
    check_differences(pilot, bound)
    if pilot.size == 0:
        raise ValueError("no pilot differences to plan from")
    rng = np.random.default_rng(seed)
    looks = list(range(block, max_n + 1, block))
    stops, widths = [], []
    for _ in range(sims):
        seq = sequence(rng.choice(pilot, max_n - max_n % block), bound, alpha, looks, steps,
                       block)
        decided = [k for k, iv in zip(looks, seq) if verdict_of(iv, margin) != "undecided"]
        stops.append(decided[0] if decided else None)
        widths.append([(iv.high - iv.low) / 2 for iv in seq])
    median = np.median(np.asarray(widths), axis=0)
    reach = [k for k, w in zip(looks, median) if w <= half_width]
    power = sum(s is not None for s in stops) / sims
    return RoundsPlan(float(np.mean([s if s is not None else max_n for s in stops])), power,
                      reach[0] if reach else None,
                      fixed_n_for_power(float(pilot.mean()), float(pilot.std()), alpha, power,
                                        margin))


def fixed_n_for_power(mean: float, sd: float, alpha: float, power: float,
                      margin: float) -> int | None:
    """The n of a fixed-sample two-sided z test at level alpha (|mean| > margin: is it not 0) or
    of an equivalence test (two one-sided tests at alpha, |mean| < margin) with this power; the
    power is capped at 0.995 (a simulated 100 % is not a certainty); None at power 0 (the
    rounds never decided: nothing to match) or when neither question applies."""
    from statistics import NormalDist

    if power <= 0:
        return None
    z = NormalDist().inv_cdf
    power = min(power, 0.995)
    if sd == 0:
        return 1
    if abs(mean) > margin and mean != 0:
        return math.ceil(((z(1 - alpha / 2) + z(power)) * sd / abs(mean)) ** 2)
    if margin > abs(mean):
        return math.ceil(((z(1 - alpha) + z((1 + power) / 2)) * sd / (margin - abs(mean))) ** 2)
    return None
