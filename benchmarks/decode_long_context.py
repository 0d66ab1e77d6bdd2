"""Decode latency at long context, every method's own cost side by side.

For each context length and round: prefill the essay text through every row's method (chunked,
one request per row, all open side by side), then decode `--new-tokens` greedily in lockstep:
step k of every row runs back to back (the order rotating each step), so a burst of machine
noise hits every row alike. Per row: the median decode ms/token (the engine's timer) over all
steps of all rounds; per goal: the median of the paired ratios (row's step k / reference row's
step k, same round), which is what the goal is judged on. Rows:

  full              the full cache at this context
  full@1K           the full cache at a 1K context (the physical floor of a 1K-budget method)
  streaming_llm_1k  sinks 4 + window 1020;  h2o_1k: budget 1024 tokens
  kivi_2bit         KIVI-2 (decode attention straight from the packed cache)
  full_offload      the whole KV on the host tier, fetched every step (FlexGen baseline)
  infinigen         InfiniGen system mode (speculated rows fetched from the host tier)

Goals: streaming_llm_1k and h2o_1k <= 1.10x full@1K; kivi_2bit <= 1.3x full;
infinigen <= 1.0x full_offload at 4K. The load average and thread policy are printed with the
table: on a shared machine the ratios (measured in the same rounds) are what to read.

    python benchmarks/decode_long_context.py --contexts 1024 4096 8192 --new-tokens 24 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from harness.core import batch as batching  # noqa: E402
from harness.core.progress import progress  # noqa: E402
from harness.store.results import write_json_atomic  # noqa: E402
from harness.session import of_methods  # noqa: E402
from kvcore.errors import ConfigError  # noqa: E402
from methods import build_method  # noqa: E402
from tasks.text_sources import load_essays  # noqa: E402

REFERENCE_TOKENS = 1024  # the context of the full@1K row
# row -> (method, hyperparameters, context override or None)
METHODS = {
    "full": ("full", {}, None),
    "full@1K": ("full", {}, REFERENCE_TOKENS),
    "streaming_llm_1k": ("streaming_llm", {"sink_tokens": 4, "window_tokens": 1020}, None),
    "h2o_1k": ("h2o", {"budget_tokens": 1024}, None),
    "kivi_2bit": ("kivi", {"k_bits": 2, "v_bits": 2}, None),
    "full_offload": ("full_offload", {}, None),
    "infinigen": ("infinigen", {}, None),
}
# row -> (reference row, goal ratio of decode ms/token, contexts the goal applies to or None)
GOALS = {
    "streaming_llm_1k": ("full@1K", 1.10, None),
    "h2o_1k": ("full@1K", 1.10, None),
    "kivi_2bit": ("full", 1.30, None),
    "infinigen": ("full_offload", 1.00, {4096}),
}


def open_rows(model: str, rows: dict[str, tuple[str, dict]]):
    """A session of one setting per row (row -> (method, hyperparameters)), prefill chunks of
    1024 tokens, every setting checked before the weights load (a refused one: one line), the
    model loaded and every method prepared. Returns (session, row -> setting)."""
    try:
        session, settings = of_methods(
            {"name": model, "device": "auto"},
            {name: build_method(method, **kw) for name, (method, kw) in rows.items()},
            prefill_chunk_tokens=1024)
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
    session.load("sdpa")
    for one in settings.values():
        session.engine(one)  # prepared here, before any timed step
    return session, settings


def lockstep(session, settings: dict, ids_for, new_tokens: int) -> dict[str, dict]:
    """One round: prefill every row (row -> harness.session Setting), then decode all rows in
    lockstep. Returns per row the decode ms of each step and the KV held at the end."""
    engines = {name: session.engine(one) for name, one in settings.items()}
    info = session.info
    names = list(settings)
    with contextlib.ExitStack() as stack:
        reqs = {name: stack.enter_context(engines[name].request()) for name in names}
        token = {}
        for name in names:
            token[name] = batching.greedy(reqs[name].prefill(ids_for(name))[0, -1], ())
        for k in progress(range(new_tokens), desc="lockstep decode", unit="step"):
            for name in names[k % len(names):] + names[:k % len(names)]:
                token[name] = batching.greedy(reqs[name].step(token[name])[0, -1], ())
        held = {name: sum(kv.stats()["kv_bytes"] for kv in reqs[name].cache.kv_layers)
                for name in names}
    out = {}
    for name in names:
        ids = ids_for(name)
        full_bytes = (len(ids) + new_tokens) * info.kv_bytes_per_token()
        out[name] = {"step_ms": engines[name].speed().decode_ms,
                     "kv_bytes": held[name], "kv_bytes_vs_full": held[name] / full_bytes}
    return out


def paired_ratio(rounds: list[dict], name: str, ref: str) -> float:
    """Median over (round, step) of row `name`'s step ms / row `ref`'s same step ms."""
    return statistics.median(a / b for r in rounds
                             for a, b in zip(r[name]["step_ms"], r[ref]["step_ms"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--json", default=None, help="write the table as JSON here (atomically)")
    args = ap.parse_args()
    session, settings = open_rows(args.model, {name: METHODS[name][:2] for name in args.methods})
    info = session.info
    essays = session.tokenizer(load_essays(), verbose=False)["input_ids"]
    out = {"model": args.model, "threads": torch.get_num_threads(), "rounds": args.rounds,
           "new_tokens": args.new_tokens, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
           "contexts": {}}
    t0 = time.time()
    for ctx in args.contexts:
        ctx = min(ctx, info.max_positions - args.new_tokens)
        load_before = os.getloadavg()[0]

        def ids_for(name, ctx=ctx):
            override = METHODS[name][2]
            return essays[: min(ctx, override) if override else ctx]

        rounds = []
        for r in range(args.rounds):
            rounds.append(lockstep(session, settings, ids_for, args.new_tokens))
            print(f"  {ctx} round {r + 1}: " + ", ".join(
                f"{n} {statistics.median(v['step_ms']):.1f}" for n, v in rounds[-1].items())
                + f" ms/token (load {os.getloadavg()[0]:.1f})", flush=True)
        rows = {name: {"decode_ms": statistics.median(ms for rd in rounds
                                                      for ms in rd[name]["step_ms"]),
                       "decode_ms_rounds": [statistics.median(rd[name]["step_ms"])
                                            for rd in rounds],
                       "kv_bytes": rounds[-1][name]["kv_bytes"],
                       "kv_bytes_vs_full": rounds[-1][name]["kv_bytes_vs_full"]}
                for name in args.methods}
        load = (load_before + os.getloadavg()[0]) / 2
        print(f"\ncontext {ctx} tokens + {args.new_tokens} new, {args.model}, {args.rounds} "
              f"rounds of lockstep decoding, threads {torch.get_num_threads()}, OMP_WAIT_POLICY="
              f"{os.environ.get('OMP_WAIT_POLICY')}, load avg {load:.2f}")
        print(f"{'method':18} {'decode ms':>10} {'x full':>7} {'KV x full':>9}  goal")
        for name, r in rows.items():
            base = rows.get("full")
            r["decode_vs_full"] = r["decode_ms"] / base["decode_ms"] if base else None
            goal = GOALS.get(name)
            note = ""
            if goal and goal[0] in rows and (goal[2] is None or ctx in goal[2]):
                ratio = paired_ratio(rounds, name, goal[0])
                r["goal_reference"], r["goal_ratio"] = goal[0], ratio  # paired, not of medians
                r["goal_met"] = ratio <= goal[1]
                note = (f"{ratio:.3f}x {goal[0]} (goal <= {goal[1]:.2f}: "
                        f"{'met' if r['goal_met'] else 'NOT met'})")
            print(f"{name:18} {r['decode_ms']:10.2f} {(r['decode_vs_full'] or float('nan')):7.3f} "
                  f"{r['kv_bytes_vs_full']:9.3f}  {note}")
        out["contexts"][str(ctx)] = {"load_avg": round(load, 2), "rows": rows}
    out["wall_s"] = round(time.time() - t0, 1)
    if args.json:
        write_json_atomic(Path(args.json), out)


if __name__ == "__main__":
    main()
