"""Achieved memory bandwidth of the decode kernels on CUDA, against the device's peak.

A decode step's attention is memory-bound: its time is set by the bytes it must read. For each
kernel and shape (Llama-3-8B KV heads: H_kv 8, H_q 32, D 128; contexts and batches below):

  sparse   methods.kernels.sparse_attention: the N = ratio*T selected K and V rows per KV head
           (InfiniGen / H2O-offload gathers); bytes = index + selected K/V rows + query + output
  kivi     methods.kernels.kivi_attention (fused, 2-bit): packed key/value codes + fp16 scales and
           zeros + the fp residual rows + query + output
  kvquant  methods.kernels.kvquant_attention (fused, nuq4 keys and values, 1 % outliers each, one
           exact first token; batch 1 only: one sequence per call, rows after all others): codes
           + value scales/zeros + outliers (8 bytes each) and their per-token offsets + the cos/sin
           rows of every position + exact rows + query + output
  ragged   methods.kernels.ragged_attention (Triton): paged K/V (blocks of 16) with per-head
           lengths of T x (0.25 .. 1.75) (mean T; Ada-KV-like head budgets) read through
           per-head block tables in place; bytes = every head's own K/V rows + block tables +
           lengths + query + output
  copy     a plain device-to-device copy of 1 GiB (bytes read + written): what this device
           really reaches, next to the nominal `--peak-gbs` (H200 SXM: 4800 GB/s)

achieved GB/s = bytes / median kernel time (CUDA events, warm-up first); printed as a share of the
nominal peak and of the measured copy bandwidth. Goal: >= 70 % of the peak. CUDA only:
on CPU the Triton kernels run in the interpreter, which is a correctness tool, so nothing is
timed (the script says so and exits 0). `--json` is rewritten (atomically) after every row, so a
timeout keeps the rows measured so far (`complete_contexts`, `finished` say how far it got).

    python benchmarks/kernel_bandwidth.py --contexts 8192 32768 --batches 1 8 --json out.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from harness.store.results import write_json_atomic  # noqa: E402

H_KV, H_Q, HEAD_DIM = 8, 32, 128  # Llama-3-8B attention shape
GB = 1e9


def time_ms(fn, warmup: int = 5, iters: int = 30, cpu: bool = False) -> float:
    if cpu:  # --dry-run only: wall time of the interpreter, a rehearsal of the bookkeeping
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sparse_case(b: int, t: int, ratio: float, dtype, device: str = "cuda") -> tuple:
    from methods.kernels import sparse_attention as sa

    n = max(1, int(ratio * t))
    g = torch.Generator(device=device).manual_seed(0)
    query = torch.randn(b, H_Q, HEAD_DIM, device=device, dtype=dtype, generator=g)
    keys = torch.randn(b, H_KV, t, HEAD_DIM, device=device, dtype=dtype, generator=g)
    values = torch.randn_like(keys)
    index = torch.rand(b, H_KV, t, device=device, generator=g).topk(n, -1).indices.sort(-1).values
    index = index.to(torch.int32).contiguous()
    item = keys.element_size()
    nbytes = (index.nbytes + 2 * b * H_KV * n * HEAD_DIM * item + 2 * query.nbytes)
    want = sa.sparse_decode_attention_ref(query, keys, values, index.long(), HEAD_DIM ** -0.5)
    got = sa.sparse_decode_attention(query, keys, values, index, HEAD_DIM ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    return (lambda: sa.sparse_decode_attention(query, keys, values, index, HEAD_DIM ** -0.5)), nbytes


def kivi_case(b: int, t: int, dtype, device: str = "cuda", residual: int = 128,
              group: int = 32) -> tuple:
    from methods.kernels import kivi_attention as ka
    from methods.kernels import kivi_quant as kq

    g = torch.Generator(device=device).manual_seed(0)
    t_q = (t - residual) // group * group  # quantized tokens: whole groups
    keys = torch.randn(b, H_KV, t, HEAD_DIM, device=device, dtype=dtype, generator=g)
    values = torch.randn_like(keys)
    k_quant = kq.quantize_pack(keys[..., :t_q, :].transpose(-1, -2).contiguous(), 2, group)
    v_quant = kq.quantize_pack(values[..., :t_q, :].contiguous(), 2, group)
    cache = ka.KIVICache(k_quant, v_quant, keys[..., t_q:, :].contiguous(),
                         values[..., t_q:, :].contiguous(), 2, 2, group, group)
    query = torch.randn(b, H_Q, 1, HEAD_DIM, device=device, dtype=dtype, generator=g)
    nbytes = (k_quant.nbytes + v_quant.nbytes + cache.k_res.nbytes + cache.v_res.nbytes
              + 2 * query.nbytes)
    want = ka.decode_attention_torch(query, cache, HEAD_DIM ** -0.5)
    got = ka.decode_attention_triton(query, cache, HEAD_DIM ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    return (lambda: ka.decode_attention_triton(query, cache, HEAD_DIM ** -0.5)), nbytes


def kvquant_case(t: int, dtype, device: str = "cuda", bits: int = 4,
                 outlier_ratio: float = 0.01) -> tuple:
    from methods.kernels import kvquant_attention as ka

    g = torch.Generator(device=device).manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, device=device, generator=g)  # noqa: E731
    t_q, lanes = t - 1, H_KV * HEAD_DIM

    def codes():
        return ka.pack_bits(torch.randint(0, 1 << bits, (1, H_KV, t_q, HEAD_DIM), device=device,
                                          generator=g), bits)

    def outliers():
        n = int(outlier_ratio * t_q * lanes)
        flat = torch.randperm(t_q * lanes, device=device, generator=g)[:n].sort().values
        return ((flat // lanes + 1).to(torch.int32), (flat % lanes).to(torch.int16),
                (rand(n) * 6).half())

    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM))
    cos, sin = ka.rope_table(torch.arange(t, device=device), inv_freq)
    cache = ka.KVQuantCache(
        rand(1, H_KV, 1, HEAD_DIM).to(dtype), rand(1, H_KV, 1, HEAD_DIM).to(dtype), codes(),
        codes(), rand(1, 1, t_q, 1).abs().half() + 0.1, rand(1, 1, t_q, 1).half(),
        rand(H_KV, HEAD_DIM).abs() + 0.3, rand(H_KV, HEAD_DIM) * 0.5,
        rand(1 << bits).sort().values, rand(1 << bits).sort().values, outliers(), outliers(),
        inv_freq, cos, sin, bits, bits)
    query = torch.randn(1, H_Q, 1, HEAD_DIM, device=device, dtype=dtype, generator=g)
    sparse = sum(p.nbytes for p in cache.k_outliers + cache.v_outliers)
    offsets = 2 * (t + 1) * 4  # int32 per position, keys and values
    nbytes = (cache.k_codes.nbytes + cache.v_codes.nbytes + cache.v_scale.nbytes
              + cache.v_zero.nbytes + sparse + offsets + cos.nbytes + sin.nbytes
              + cache.exact_k.nbytes + cache.exact_v.nbytes + 2 * query.nbytes)
    want = ka.decode_attention_torch(query, cache, HEAD_DIM ** -0.5)
    got = ka.decode_attention_triton(query, cache, HEAD_DIM ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    return (lambda: ka.decode_attention_triton(query, cache, HEAD_DIM ** -0.5)), nbytes


def ragged_case(b: int, t: int, dtype, device: str = "cuda", block_tokens: int = 16) -> tuple:
    from kvcore.paged import BlockPool, PagedRows
    from methods.kernels import ragged_attention as ra

    g = torch.Generator(device=device).manual_seed(0)
    share = torch.linspace(0.25, 1.75, H_KV)  # per-head share of T, mean 1
    lengths = (share[torch.randperm(H_KV)] * t).long().expand(b, H_KV).contiguous().to(device)
    longest = int(lengths.max())
    rows = []
    for _ in range(2):  # K, V: each in its own pool of one-head blocks
        x = torch.randn(b, H_KV, longest, HEAD_DIM, device=device, dtype=dtype, generator=g)
        r = PagedRows(BlockPool(block_tokens))
        r.assign(x, lengths)
        rows.append(r)
    keys, values = (r.in_place() for r in rows)
    query = torch.randn(b, H_Q, 1, HEAD_DIM, device=device, dtype=dtype, generator=g)
    item = query.element_size()
    nbytes = (2 * int(lengths.sum()) * HEAD_DIM * item + keys.table.nbytes + values.table.nbytes
              + lengths.nbytes + 2 * query.nbytes)
    dense = [r.view() for r in rows]
    want = ra.ragged_attention_ref(query, *dense, lengths, HEAD_DIM ** -0.5)
    got = ra.ragged_decode_attention_triton(query, keys, values, HEAD_DIM ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    return (lambda: ra.ragged_decode_attention_triton(query, keys, values, HEAD_DIM ** -0.5),
            nbytes)


def copy_gbs(device: str = "cuda", nbytes: int = 2**30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / (time_ms(lambda: dst.copy_(src), cpu=device == "cpu") / 1e3) / GB


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--ratio", type=float, default=0.2, help="selected share for the sparse kernel")
    ap.add_argument("--peak-gbs", type=float, default=4800.0)
    ap.add_argument("--goal", type=float, default=0.7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true",
                    help="rehearsal on CPU (Triton interpreter, TRITON_INTERPRET=1, tiny sizes): "
                         "runs every step and writes the JSON, marked dry_run; timings mean "
                         "nothing")
    args = ap.parse_args()
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("kernel_bandwidth --dry-run: set TRITON_INTERPRET=1 (CPU interpreter)")
        device, name, dtype, iters = "cpu", "cpu (dry run)", torch.float32, 1
    elif not torch.cuda.is_available():
        print("kernel_bandwidth: needs CUDA (on CPU the Triton kernels only run in the "
              "interpreter, a correctness tool): nothing timed")
        return 0
    else:
        os.environ.setdefault("TRITON_INTERPRET", "0")
        device, name, dtype, iters = "cuda", torch.cuda.get_device_name(), torch.bfloat16, 30
    cpu = device == "cpu"
    copy = copy_gbs(device, 2**24 if cpu else 2**30)
    rows = []
    print(f"{name}: copy {copy:.0f} GB/s, nominal peak {args.peak_gbs:.0f}")
    print(f"{'kernel':8} {'B':>3} {'T':>7} {'MB':>9} {'us':>9} {'GB/s':>8} {'% peak':>7} {'% copy':>7}")
    out = {"device": name, "dry_run": args.dry_run, "copy_gbs": copy, "peak_gbs": args.peak_gbs,
           "goal_share": args.goal, "planned": {"contexts": args.contexts, "batches": args.batches},
           "complete_contexts": [], "finished": False, "rows": rows}
    def measure(kernel, b, t, case):
        fn, nbytes = case()
        ms = time_ms(fn, iters=iters, cpu=cpu)
        gbs = nbytes / (ms / 1e3) / GB
        rows.append({"kernel": kernel, "batch": b, "context": t, "bytes": nbytes,
                     "ms": ms, "gbs": gbs, "share_of_peak": gbs / args.peak_gbs,
                     "share_of_copy": gbs / copy,
                     "goal_met": gbs / args.peak_gbs >= args.goal})
        print(f"{kernel:8} {b:3d} {t:7d} {nbytes / 1e6:9.2f} {ms * 1e3:9.1f} {gbs:8.0f} "
              f"{100 * gbs / args.peak_gbs:6.1f}% {100 * gbs / copy:6.1f}%", flush=True)
        if args.json:  # after every row: a timeout keeps the rows measured so far
            write_json_atomic(Path(args.json), out)

    for t in args.contexts:
        for b in args.batches:
            measure("sparse", b, t, lambda: sparse_case(b, t, args.ratio, dtype, device))
            measure("kivi", b, t, lambda: kivi_case(b, t, dtype, device))
            measure("ragged", b, t, lambda: ragged_case(b, t, dtype, device))
        out["complete_contexts"].append(t)
    for t in args.contexts:  # reported after the goal rows (a timeout cuts these first)
        measure("kvquant", 1, t, lambda: kvquant_case(t, dtype, device))
    out["finished"] = True
    if args.json:
        write_json_atomic(Path(args.json), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
