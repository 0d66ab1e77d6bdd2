"""Decode attention over ragged heads vs rectangular heads at the same mean length.

Head-wise budgets (Ada-KV, HeadKV) give each KV head its own number of tokens. What the storage
and kernels must make true before any such method is worth running: attending over ragged
heads costs what the same number of tokens costs in rectangular heads. Per mean length L and
layout, one decode step's attention over every layer of the SmolLM2-135M shape (30 layers, 9
query / 3 KV heads, D 64, fp32; each layer its own K/V, so the step streams them from memory as
a model's step does), one `methods.kernels.ragged_attention` call per layer over the rows read
in place (`Rows.in_place`):

  rect      every head holds L tokens (rectangular rows, what uniform SnapKV holds)
  ragged    heads hold L x (0.25, 1.0, 1.75) tokens in the first batch row's 3 heads, and so on
            rotated per layer (mean L, a spread as wide as Ada-KV's on RULER), built by
            `keep(index, valid=...)` from L x 1.75 tokens
  padded    the ragged heads padded to the longest with a dense additive mask through SDPA (what
            a rectangular store forces on a head-wise method: the first AdaKV's design)
  sdpa      rect through SDPA over `view()` (contiguous only: the model's own path)

Cells run in lockstep: step k of every cell back to back, the order rotating, `--steps` steps
per round; the figures are medians of per-step times, the ratios medians of paired per-step
ratios (ragged / rect, same step). The phase-2 goal is ragged Ada-KV vs uniform SnapKV decode
step <= 1.15x; the attention itself should sit near 1.0x here.

    python benchmarks/ragged_attention.py --lengths 1024 4096 --steps 30
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
import torch.nn.functional as F  # noqa: E402

from harness.store.results import write_json_atomic  # noqa: E402
from kvcore.paged import PagedKV  # noqa: E402
from kvcore.storage import ContiguousRows  # noqa: E402
from methods.kernels import ragged_attention as ra  # noqa: E402

LAYERS, H_Q, H_KV, HEAD_DIM = 30, 9, 3, 64  # SmolLM2-135M
SPREAD = (0.25, 1.0, 1.75)  # per-head share of the mean length (mean 1.0)


def layer_rows(layout: str, length: int, ragged: bool, layer: int, paged: PagedKV, gen):
    """One layer's K and V rows: `length` tokens per head, or ragged with mean `length`."""
    longest = int(length * max(SPREAD)) if ragged else length
    rows = []
    for name in ("keys", "values"):
        r = ContiguousRows() if layout == "contiguous" else paged.rows(layer, name)
        r.append(torch.randn(1, H_KV, longest, HEAD_DIM, generator=gen))
        rows.append(r)
    if ragged:
        shares = SPREAD[layer % H_KV:] + SPREAD[:layer % H_KV]
        valid = torch.tensor([[int(length * s) for s in shares]])
        index = torch.arange(longest).expand(1, H_KV, longest)
        for r in rows:
            r.keep(index, headroom=1, valid=valid)
    return rows


def cells_for(layout: str, length: int, gen) -> dict:
    paged = PagedKV(block_tokens=16)
    rect = [layer_rows(layout, length, False, i, paged, gen) for i in range(LAYERS)]
    ragged = [layer_rows(layout, length, True, i, paged, gen) for i in range(LAYERS)]
    query = torch.randn(1, H_Q, 1, HEAD_DIM, generator=gen)
    scaling = HEAD_DIM ** -0.5

    def kernel(layers):
        return lambda: [ra.ragged_attention(query, k.in_place(), v.in_place(), scaling)
                        for k, v in layers]

    masks = []
    for k, _ in ragged:  # built once: the cost measured is attention over the padded rows
        n = k.lengths()
        t = k.length
        dead = torch.arange(t).view(1, 1, 1, t) >= n.view(1, H_KV, 1, 1)
        mask = torch.zeros(1, H_KV, 1, t).masked_fill(dead, float("-inf"))
        masks.append(mask.repeat_interleave(H_Q // H_KV, dim=1))

    def padded():
        return [F.scaled_dot_product_attention(query, k.view(), v.view(), attn_mask=m,
                                               scale=scaling, enable_gqa=True)
                for (k, v), m in zip(ragged, masks)]

    cells = {"rect": kernel(rect), "ragged": kernel(ragged), "padded": padded}
    if layout == "contiguous":
        cells["sdpa"] = lambda: [F.scaled_dot_product_attention(
            query, k.view(), v.view(), scale=scaling, enable_gqa=True) for k, v in rect]
    tokens = {"rect": sum(int(k.lengths().sum()) for k, _ in rect),
              "ragged": sum(int(k.lengths().sum()) for k, _ in ragged)}
    return cells, tokens


def lockstep(cells: dict, steps: int) -> dict[str, list[float]]:
    names = list(cells)
    for fn in cells.values():  # warm-up (kernel build, first touches)
        fn()
    times = {name: [] for name in names}
    for k in range(steps):
        for name in names[k % len(names):] + names[:k % len(names)]:
            t0 = time.perf_counter()
            cells[name]()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the table as JSON here (atomically)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    load_before, t0 = os.getloadavg()[0], time.time()
    out = {"shape": {"layers": LAYERS, "h_q": H_Q, "h_kv": H_KV, "head_dim": HEAD_DIM},
           "spread": SPREAD, "steps": args.steps, "threads": torch.get_num_threads(),
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "rows": []}
    print(f"{'L':>6} {'layout':11} {'cell':7} {'ms/step':>8} {'x rect':>7} {'tokens':>8}")
    for length in args.lengths:
        for layout in ("contiguous", "paged"):
            cells, tokens = cells_for(layout, length, gen)
            times = lockstep(cells, args.steps)
            for name, ms in times.items():
                ratio = statistics.median(a / b for a, b in zip(ms, times["rect"]))
                row = {"mean_tokens": length, "layout": layout, "cell": name,
                       "ms_per_step": statistics.median(ms), "vs_rect_paired": ratio,
                       "kernel": ra.decode_kernel(torch.empty(1, H_Q, 1, HEAD_DIM),
                                                  *cells_kernel_probe(layout)),
                       "tokens": tokens.get(name, tokens["ragged"])}
                out["rows"].append(row)
                print(f"{length:6d} {layout:11} {name:7} {row['ms_per_step']:8.3f} "
                      f"{ratio:7.3f} {row['tokens']:8d}", flush=True)
    load = (load_before + os.getloadavg()[0]) / 2
    out.update(load_avg=round(load, 2), wall_s=round(time.time() - t0, 1))
    print(f"\n{LAYERS} layers x {H_Q}/{H_KV} heads x D {HEAD_DIM} fp32, {args.steps} lockstep "
          f"steps, threads {torch.get_num_threads()}, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY')}, load avg {load:.2f}")
    if args.json:
        write_json_atomic(Path(args.json), out)


def cells_kernel_probe(layout: str):
    """A tiny pair of rows of `layout`, to name the kernel a decode row gets."""
    paged = PagedKV(block_tokens=16)
    rows = [ContiguousRows() if layout == "contiguous" else paged.rows(0, n) for n in "kv"]
    for r in rows:
        r.append(torch.zeros(1, H_KV, 1, HEAD_DIM))
    return [r.in_place() for r in rows]


if __name__ == "__main__":
    main()
