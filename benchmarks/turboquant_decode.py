"""TurboQuant's decode step against KIVI-2's at long context, lockstep, paired ratios.

For each round: prefill the essay text through every row's method (one request per row, all
open side by side), then decode `--new-tokens` greedily in lockstep: step k of every row runs
back to back, the order rotating each step, so a burst of machine noise hits every row alike
(benchmarks/decode_long_context.py's `lockstep`). Per row: the median decode ms/token over all
steps of all rounds, the decode-attention kernel it ran and the KV held (x the full fp32 cache);
per TurboQuant row the median of the paired ratios (its step k / KIVI-2's step k, same round),
which the goal is judged on. Rows:

  kivi_2bit          KIVI-2 (k_bits = v_bits = 2, G 32, R 128), decode from its packed cache
  turboquant_2.5bit  keys TurboQuant_prod, values TurboQuant_mse, 2.5 bits (outlier split)
  turboquant_3.5bit  the same at 3.5 bits (the paper's quality-neutral setting)

Goal: every TurboQuant row <= 1.3x KIVI-2's decode step at 8K.

`--kernel-only`: the decode attention of one layer alone (SmolLM2's shapes: 3 KV heads, 9 query
heads, head_dim 64; random K/V, whose values do not change the cost), each row's kernel called
in turn `--repeats` times (alternating), median ms and the median paired ratio: seconds instead
of an 8K prefill per row, for a machine too loaded for the whole model.

The C kernels are built for this CPU (-march=native); `KVH_KERNEL_FLAGS` builds every kernel,
KIVI's too, as a variant: `KVH_KERNEL_FLAGS=-mno-avx512f` times TurboQuant's AVX2 path (and
KIVI without AVX-512) on an AVX-512 machine. The header names the TurboQuant path that ran.

    python benchmarks/turboquant_decode.py --contexts 8192 --new-tokens 8 --rounds 1
    python benchmarks/turboquant_decode.py --kernel-only --contexts 8192 --repeats 30
    KVH_KERNEL_FLAGS=-mno-avx512f python benchmarks/turboquant_decode.py --kernel-only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.decode_long_context import lockstep, open_rows, paired_ratio  # noqa: E402
from harness.store.results import write_json_atomic  # noqa: E402
from methods import build_method  # noqa: E402
from methods.kernels import turboquant_cpu  # noqa: E402
from tasks.text_sources import load_essays  # noqa: E402

REFERENCE = "kivi_2bit"
GOAL_RATIO = 1.30
ROWS = {
    "kivi_2bit": ("kivi", {"k_bits": 2, "v_bits": 2}),
    "turboquant_2.5bit": ("turboquant", {"k_bits": 2.5, "v_bits": 2.5}),
    "turboquant_3.5bit": ("turboquant", {"k_bits": 3.5, "v_bits": 3.5}),
}


def kernel_only(contexts: list[int], rows: list[str], repeats: int) -> dict:
    """Median ms of one layer's decode attention per row, and paired ratios to KIVI-2."""
    from methods.model import ModelInfo

    info = ModelInfo(num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64, max_positions=1 << 20)
    out = {}
    for ctx in contexts:
        g = torch.Generator().manual_seed(0)
        k, v = (torch.randn(1, 3, ctx, 64, generator=g) for _ in range(2))
        query = torch.randn(1, 9, 1, 64, generator=g)
        calls = {}
        for name in rows:
            method = build_method(ROWS[name][0], **ROWS[name][1])
            layer = method.make_layer(0, info)
            layer.update(k, v, None)  # the context (quantized where the method quantizes)
            layer.update(k[:, :, :1], v[:, :, :1], None)  # this step's token
            cache, attend = layer.step_cache, type(layer.step_cache).__module__
            module = sys.modules[attend]
            calls[name] = (lambda c=cache, m=module: m.decode_attention(query, c, 0.125))
        times = {name: [] for name in rows}
        for r in range(repeats):
            for name in rows[r % len(rows):] + rows[:r % len(rows)]:
                t0 = time.perf_counter()
                calls[name]()
                times[name].append((time.perf_counter() - t0) * 1e3)
        res = {}
        print(f"\ndecode attention of one layer at {ctx} tokens (SmolLM2 shapes), {repeats} "
              f"alternating calls, threads {torch.get_num_threads()}, load avg "
              f"{os.getloadavg()[0]:.2f}, {build_note()}")
        for name in rows:
            ratio = statistics.median(a / b for a, b in zip(times[name], times[REFERENCE]))
            res[name] = {"ms": statistics.median(times[name]), "ratio_to_reference": ratio}
            print(f"{name:18} {res[name]['ms']:8.2f} ms  {ratio:.3f}x {REFERENCE}")
        out[str(ctx)] = res
    return out


def kernel_label(prepared: dict) -> str:
    """A row's decode-attention kernel, with the C kernel's vector path where it names one."""
    path = prepared.get("decode_vector_path")
    return prepared.get("decode_attention", "-") + (f"/{path}" if path else "")


def build_note() -> str:
    """The C build the numbers depend on: TurboQuant's vector path and the extra flags."""
    return (f"TurboQuant C path {turboquant_cpu.vector_path() or 'not built'}, "
            f"KVH_KERNEL_FLAGS={os.environ.get('KVH_KERNEL_FLAGS', '') or '-'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192])
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None, help="write the table as JSON here (atomically)")
    ap.add_argument("--kernel-only", action="store_true",
                    help="time one layer's decode attention only (no model, no prefill)")
    ap.add_argument("--repeats", type=int, default=30, help="--kernel-only: calls per row")
    args = ap.parse_args()
    if REFERENCE not in args.rows:
        ap.error(f"--rows must include {REFERENCE} (the reference of every ratio)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kernel_only:
        table = kernel_only(args.contexts, args.rows, args.repeats)
        if args.json:
            write_json_atomic(Path(args.json), {"kernel_only": table, "build": build_note()})
        return
    session, settings = open_rows(args.model, {name: ROWS[name] for name in args.rows})
    info = session.info
    essays = session.tokenizer(load_essays(), verbose=False)["input_ids"]
    kernels = {name: kernel_label(one.prepared) for name, one in settings.items()}
    out = {"model": args.model, "threads": torch.get_num_threads(), "rounds": args.rounds,
           "build": build_note(),
           "new_tokens": args.new_tokens, "goal_ratio": GOAL_RATIO, "contexts": {}}
    t0 = time.time()
    for ctx in args.contexts:
        ctx = min(ctx, info.max_positions - args.new_tokens)
        load_before = os.getloadavg()[0]
        rounds = [lockstep(session, settings, lambda name: essays[:ctx], args.new_tokens)
                  for _ in range(args.rounds)]
        load = (load_before + os.getloadavg()[0]) / 2
        print(f"\ncontext {ctx} tokens + {args.new_tokens} new, {args.model}, {args.rounds} "
              f"round(s) of lockstep decoding, threads {torch.get_num_threads()}, "
              f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, load avg {load:.2f}, "
              f"{build_note()}")
        print(f"{'row':18} {'kernel':10} {'decode ms':>10} {'KV x full':>9}  "
              f"x {REFERENCE} (paired)")
        rows = {}
        for name in args.rows:
            steps = [ms for rd in rounds for ms in rd[name]["step_ms"]]
            row = {"decode_ms": statistics.median(steps), "kernel": kernels[name],
                   "kv_bytes_vs_full": rounds[-1][name]["kv_bytes_vs_full"]}
            note = ""
            if name != REFERENCE:
                ratio = paired_ratio(rounds, name, REFERENCE)
                row["ratio_to_reference"], row["goal_met"] = ratio, ratio <= GOAL_RATIO
                note = f"{ratio:.3f}x (goal <= {GOAL_RATIO:.2f}: " \
                       f"{'met' if row['goal_met'] else 'NOT met'})"
            rows[name] = row
            print(f"{name:18} {row['kernel']:10} {row['decode_ms']:10.2f} "
                  f"{row['kv_bytes_vs_full']:9.3f}  {note}")
        out["contexts"][str(ctx)] = {"load_avg": round(load, 2), "rows": rows}
    out["wall_s"] = round(time.time() - t0, 1)
    if args.json:
        write_json_atomic(Path(args.json), out)


if __name__ == "__main__":
    main()
