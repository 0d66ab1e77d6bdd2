"""The arithmetic of the vLLM projection (benchmarks/vllm_projection.py), apart from vLLM, torch
and the harness so that it is tested on its own.

Every figure made here is *projected*, never measured:

  c(r)        = c_full / r         requests a method holding r of the full cache fits in the
                                   memory M that holds c_full full requests
  upper(r)    = T(c(r))            vLLM's measured full-cache throughput at that concurrency,
                                   linear in log c between measured points, clamped (and said)
                                   outside them: the throughput the saving would buy if the
                                   method cost vLLM no compute
  engine(r,o) = upper / ((1 - s) + s * o)
                                   the method's decode steps `o` times the full cache's (its
                                   measured per-step overhead in our engine), its prefill as the
                                   full cache's; s = the decode share of vLLM's wall at c(r)
                                   (interpolated like T): only the decode steps carry the
                                   method's per-step cost, so only that share is scaled
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvcore.errors import ConfigError


def concurrency_in_memory(c_full: float, held_ratio: float) -> float:
    """Requests that fit in the memory of `c_full` full requests when each holds `held_ratio`
    of the full cache (a real number: vLLM admits whole requests, floor() of it)."""
    if not (math.isfinite(c_full) and c_full > 0):
        raise ConfigError(f"c_full={c_full}: must be a positive number of full requests")
    if not (math.isfinite(held_ratio) and held_ratio > 0):
        raise ConfigError(f"held_ratio={held_ratio}: the KV held ratio must be a positive "
                          "number (held bytes / the full cache's)")
    return c_full / held_ratio


def checked_curve(curve: Sequence[tuple[float, float]], name: str = "curve"
                  ) -> list[tuple[float, float]]:
    """(concurrency, value) points sorted by concurrency; refuses fewer than two points, a
    concurrency <= 0, a repeated concurrency or a non-finite value."""
    points = sorted((float(c), float(v)) for c, v in curve)
    if len(points) < 2:
        raise ConfigError(f"{name}: {len(points)} measured point(s); interpolating needs at "
                          "least 2 concurrencies")
    for c, v in points:
        if not (math.isfinite(c) and c > 0) or not math.isfinite(v):
            raise ConfigError(f"{name}: point (c={c}, {v}): the concurrency must be positive "
                              "and both finite")
    repeated = [a for (a, _), (b, _) in zip(points, points[1:]) if a == b]
    if repeated:
        raise ConfigError(f"{name}: concurrency {repeated[0]:g} measured twice; one value per "
                          "concurrency")
    return points


def interpolate_log_c(curve: Sequence[tuple[float, float]], c: float
                      ) -> tuple[float, str | None]:
    """The curve's value at concurrency `c`, linear in log c between the two measured points
    around it. Outside the measured range the nearest end's value (the curve is not
    extrapolated): returns (value, a note saying so), else (value, None)."""
    points = checked_curve(curve)
    if not (math.isfinite(c) and c > 0):
        raise ConfigError(f"concurrency {c}: must be a positive number")
    (c_lo, v_lo), (c_hi, v_hi) = points[0], points[-1]
    if c > c_hi:
        return v_hi, f"c={c:.3g} above the largest measured concurrency {c_hi:g}: clamped"
    if c < c_lo:
        return v_lo, f"c={c:.3g} below the smallest measured concurrency {c_lo:g}: clamped"
    for (a, va), (b, vb) in zip(points, points[1:]):
        if a <= c <= b:
            t = (math.log(c) - math.log(a)) / (math.log(b) - math.log(a))
            return va + t * (vb - va), None
    raise AssertionError("unreachable: c lies within the sorted points")


def projected_engine(upper_tok_s: float, decode_share: float, overhead_ratio: float) -> float:
    """Throughput with the decode steps `overhead_ratio` times as long and the rest unchanged:
    upper / ((1 - s) + s * o)."""
    if not (math.isfinite(overhead_ratio) and overhead_ratio > 0):
        raise ConfigError(f"overhead_ratio={overhead_ratio}: must be a positive number "
                          "(method step ms / full step ms)")
    if not 0 <= decode_share <= 1:
        raise ConfigError(f"decode_share={decode_share}: must lie in [0, 1]")
    return upper_tok_s / ((1 - decode_share) + decode_share * overhead_ratio)


def project(throughput: Sequence[tuple[float, float]], decode_share: Sequence[tuple[float, float]],
            c_full: float, held_ratio: float, overhead_ratio: float) -> dict:
    """One method's projected point: its concurrency in M, the upper bound and the projected
    engine throughput (tokens/s), and a note where the curve was clamped."""
    c = concurrency_in_memory(c_full, held_ratio)
    upper, note = interpolate_log_c(throughput, c)
    share, _ = interpolate_log_c(decode_share, c)
    return {"held_ratio": held_ratio, "concurrency": c, "upper_tok_s": upper,
            "decode_share": share, "overhead_ratio": overhead_ratio,
            "projected_tok_s": projected_engine(upper, share, overhead_ratio), "clamped": note}


STEP_GAP_S = 0.001  # stamps closer than this came out of one engine step (a step takes >= 10 ms)


def engine_steps(stamps: Sequence[float], gap_s: float = STEP_GAP_S) -> list[list[float]]:
    """Token stamps grouped into engine steps: the worker stamps each output of a step as it
    reads it (microseconds apart), a new step starts after a gap of at least `gap_s`."""
    steps: list[list[float]] = []
    for t in sorted(stamps):
        if steps and t - steps[-1][-1] < gap_s:
            steps[-1].append(t)
        else:
            steps.append([t])
    return steps


def step_profile(token_times_s: Sequence[Sequence[float]], wall_s: float) -> dict:
    """What vLLM's per-token arrival times say about one workload (all requests sent at once,
    each token stamped as the worker read it from its engine step; engine_steps groups them):

    * max_decoding: the most requests between their first and last token at one step (the
      concurrency the KV space allowed, from the outside: a request in prefill is not counted);
    * mean_decoding: the same, averaged over the steps weighted by their duration;
    * decode_share: the share of the wall in steps that gave no request its first token (pure
      decode steps; a prompt fitting one chunk is prefilled in the step that samples its first
      token, so every other step only decodes).
    """
    if wall_s <= 0:
        raise ConfigError(f"wall_s={wall_s}: must be positive")
    spans = [(ts[0], ts[-1]) for ts in token_times_s if ts]
    firsts = {first for first, _ in spans}
    steps = engine_steps([t for ts in token_times_s for t in ts])
    decode_s = weighted = 0.0
    most = 0
    previous = 0.0
    for stamps in steps:
        t = stamps[-1]
        duration = t - previous
        previous = t
        decoding = sum(1 for first, last in spans if first <= t and stamps[0] <= last)
        most = max(most, decoding)
        weighted += decoding * duration
        if not firsts.intersection(stamps):
            decode_s += duration
    return {"max_decoding": most, "mean_decoding": weighted / wall_s,
            "decode_share": min(1.0, decode_s / wall_s), "steps": len(steps)}
