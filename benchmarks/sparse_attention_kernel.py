"""Speed of one decode step's sparse attention: the Triton kernel against the torch paths.

Paths timed, per cache length T (N = ratio * T selected slots per KV head, plus the new token):
    kernel      methods.kernels.sparse_attention.sparse_decode_attention (gathers in the kernel)
    gather+ref  sparse_decode_attention_ref (gather (B, H_kv, N, D) rows, softmax, matmul)
    mask+dense  what InfiniGen's simulate mode does without the kernel: a (B, H, T) keep-mask and
                eager attention over all T keys (methods.scoring.attention_with_probs)
    sdpa full   torch SDPA over all T keys, no selection (the dense floor)
On CUDA: CUDA events, warm-up calls, the median of --iters timed calls; the kernel is checked
against the reference first. On CPU the kernel would only run in the Triton interpreter, which is
a correctness tool, not a speed measurement: only the torch paths are timed (perf_counter).

    python benchmarks/sparse_attention_kernel.py [--t 2048 8192 32768] [--ratio 0.2]
        [--b 1] [--h-q 32] [--h-kv 8] [--d 128] [--dtype auto] [--iters 50] [--warmup 10]
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

from methods.kernels import sparse_attention as sa  # noqa: E402
from methods.scoring import attention_with_probs, expand_kv  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def inputs(b, h_q, h_kv, t, n, d, dtype, device, seed=0):
    """query (B, H_q, D), keys/values (B, H_kv, T, D), index (B, H_kv, N+1): n sorted distinct
    past slots per KV head plus the new token's slot T-1 (as InfiniGen passes them)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    query = torch.randn(b, h_q, d, generator=g).to(device, dtype)
    keys = torch.randn(b, h_kv, t, d, generator=g).to(device, dtype)
    values = torch.randn(b, h_kv, t, d, generator=g).to(device, dtype)
    past = torch.rand(b, h_kv, t - 1, generator=g).topk(n, dim=-1).indices.sort(-1).values
    index = torch.cat([past, torch.full((b, h_kv, 1), t - 1)], dim=2).to(device)
    return query, keys, values, index


def mask_dense(query, keys, values, index, scaling):
    """InfiniGen simulate's torch path: keep-mask over T, eager masked attention."""
    keep = torch.zeros(keys.shape[:3], dtype=torch.bool, device=keys.device)
    keep.scatter_(2, index, True)
    keep = expand_kv(keep[..., None], query.shape[1] // keys.shape[1])[..., 0][:, :, None]
    out, _ = attention_with_probs(query[:, :, None], keys, values, None, scaling, keep=keep)
    return out[:, 0]


def sdpa_full(query, keys, values, index, scaling):
    """Dense attention over all T keys (SDPA, GQA by expanding K/V heads)."""
    groups = query.shape[1] // keys.shape[1]
    out = F.scaled_dot_product_attention(query[:, :, None], expand_kv(keys, groups),
                                         expand_kv(values, groups), scale=scaling)
    return out[:, :, 0]


def time_cuda(fn, args, warmup, iters) -> float:
    """Median milliseconds of `iters` calls, each bracketed by CUDA events."""
    for _ in range(warmup):
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_cpu(fn, args, warmup, iters) -> float:
    """Median milliseconds of `iters` calls (wall clock)."""
    for _ in range(warmup):
        fn(*args)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--t", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--ratio", type=float, default=0.2, help="selected share of the cache")
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--h-q", type=int, default=32)
    ap.add_argument("--h-kv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                    help="auto: fp16 on CUDA, fp32 on CPU (CPU half matmuls are not the point)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (
        torch.float16 if cuda else torch.float32)
    paths = {"gather+ref": sa.sparse_decode_attention_ref, "mask+dense": mask_dense,
             "sdpa full": sdpa_full}
    if cuda:
        paths = {"kernel": sa.sparse_decode_attention, **paths}
        timer = time_cuda
        print(f"device: {torch.cuda.get_device_name()}  (CUDA events, median of {args.iters})")
    else:
        timer = time_cpu
        print("device: CPU. The Triton kernel would run in the interpreter (TRITON_INTERPRET=1), "
              "which checks correctness and says nothing about speed: only torch paths are timed.")
    print(f"B={args.b} H_q={args.h_q} H_kv={args.h_kv} D={args.d} {dtype} "
          f"selected={args.ratio:.0%} of T (+ the new token)\n")
    header = f"{'T':>7} {'N':>6}  " + "  ".join(f"{name:>12}" for name in paths)
    base = "kernel" if cuda else "gather+ref"
    header += "  " + "  ".join(f"{name + ' / ' + base:>22}" for name in paths if name != base)
    print(header + ("  max|kernel-ref|" if cuda else ""))
    for t in args.t:
        n = max(1, int(args.ratio * t))
        call = inputs(args.b, args.h_q, args.h_kv, t, n, args.d, dtype, device)
        scaling = args.d ** -0.5
        with torch.inference_mode():
            ms = {name: timer(fn, (*call, scaling), args.warmup, args.iters)
                  for name, fn in paths.items()}
            if cuda:
                err = (sa.sparse_decode_attention(*call, scaling).float()
                       - sa.sparse_decode_attention_ref(*call, scaling).float()).abs().max()
        row = f"{t:>7} {n + 1:>6}  " + "  ".join(f"{ms[name]:>9.3f} ms" for name in paths)
        row += "  " + "  ".join(f"{ms[name] / ms[base]:>21.2f}x" for name in paths if name != base)
        print(row + (f"  {err.item():.2e}" if cuda else ""))


if __name__ == "__main__":
    main()
