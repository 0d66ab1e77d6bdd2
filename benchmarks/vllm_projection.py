"""What a method's KV saving buys in vLLM: vLLM's full-cache throughput measured against its KV
space, and each compressing method's projected throughput in a fixed memory.

1. vLLM's curve (measured). One workload: `--requests` RULER niah_single prompts at
   `--length` (built as benchmarks/serving_vs_vllm.py builds them: at most length - new tokens
   tokens), all sent at once, `--new-tokens` greedy tokens each (no stop), prefix caching off.
   For each c in `--concurrency` one vLLM start with the KV pool fixed at exactly the blocks of
   c whole requests (prompt + new tokens, rounded up to blocks) plus vLLM's null block
   (num_gpu_blocks_override: VLLM_CPU_KVCACHE_SPACE is whole GiB only); the block count is
   checked in the worker's facts and its log. Per point: blocks, the most requests decoding at
   once (from the token arrival times), throughput (all new tokens / the workload's wall),
   TTFT p50, vLLM's preemptions, the share of the wall in pure decode steps, the load average.
2. The methods (measured in our engine): one run of benchmarks/throughput.py (full and
   `--methods` at their defaults / budget_ratio 0.2, prompts of the same length, batch
   `--method-batch`): each method's KV held ratio r (KV bytes per sequence over the full
   cache's, both tiers) and its decode step overhead o (full decode tok/s over the method's:
   the mean step time ratio at the same batch, same round).
3. The projection (projected, never measured; benchmarks/vllm_projection_math.py): in the
   memory M of `--c-full` full requests a method fits c = c_full / r requests; its upper bound
   is vLLM's measured throughput at c (linear in log c, clamped beyond the measured range and
   said so); its projected engine throughput = upper / ((1 - s) + s * o), s = the decode share
   of vLLM's wall at c: the method's per-step cost scales vLLM's decode steps only.

Writes `<out>.json` (atomically, after every point: a cut run keeps what it measured; rerun
with `--resume` to measure only what is missing), `<out>.md` and `<out>.png`.

    python benchmarks/vllm_projection.py --out results/reports/vllm/projection
    python benchmarks/vllm_projection.py --out results/reports/vllm/projection --report-only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.vllm_projection_math import project, step_profile  # noqa: E402
from harness.store.results import write_json_atomic, write_text_atomic  # noqa: E402
from kvcore.errors import ConfigError  # noqa: E402

# the compressing family throughput.py measures, one or more per mechanism (eviction while
# decoding, prompt compression, selection, quantization); full is the reference, added always
METHODS = ("streaming_llm", "h2o", "tova", "snapkv", "pyramidkv", "quest", "infinigen", "kivi",
           "kvquant", "turboquant")
# vLLM log lines that prove the pool's size took effect, and the scheduler's state lines
LOG_FACTS = (r"Overriding num_gpu_blocks=\d+ with num_gpu_blocks_override=\d+",
             r"KV cache size: [\d,]+ tokens, Maximum concurrency for [\d,]+ tokens per request: "
             r"[\d.]+x")
RUNNING_LINE = re.compile(r"Running: (\d+) reqs, Waiting: (\d+) reqs.*?KV cache usage: ([\d.]+)%")


def blocks_per_request(prompt_tokens: int, new_tokens: int, block_size: int) -> int:
    """Blocks one request holds at its end (its last token's K/V is never written: it is
    sampled, not fed back)."""
    return math.ceil((prompt_tokens + new_tokens - 1) / block_size)


def pool_blocks(concurrency: int, per_request: int) -> int:
    """The pool for `concurrency` whole requests: vLLM keeps one block back (its null block)."""
    return concurrency * per_request + 1


def log_facts(text: str) -> dict:
    """What vLLM's log says about the pool and its scheduler (the stat logger's 5 s lines)."""
    found = {}
    for pattern in LOG_FACTS:
        match = re.search(pattern, text)
        found[pattern.split(" ")[0].lower()] = match.group(0) if match else None
    running = [(int(r), int(w), float(u)) for r, w, u in RUNNING_LINE.findall(text)]
    found["running_max_logged"] = max((r for r, _, _ in running), default=None)
    found["kv_usage_pct_max_logged"] = max((u for _, _, u in running), default=None)
    found["preemption_lines"] = len(re.findall(r"[Pp]reempt", text))
    return found


def measure_point(args, folder: str, prompts: list[list[int]], concurrency: int) -> dict:
    """One vLLM start with the pool for `concurrency` requests; the workload once."""
    from benchmarks.serving_vs_vllm import vllm_generate
    from harness.engines.vllm_engine import VllmKnobs, started

    per_request = blocks_per_request(max(map(len, prompts)), args.new_tokens, args.block_size)
    blocks = pool_blocks(concurrency, per_request)
    max_len = per_request * args.block_size
    knobs = VllmKnobs(kv_space_gib=1, max_num_seqs=len(prompts), max_model_len=max_len,
                      omp_threads_bind=args.vllm_bind, prefix_caching=False)
    pool = {"num_gpu_blocks": blocks, "block_size": args.block_size, "log_stats": True}
    with tempfile.TemporaryDirectory(prefix="kvh-projection-") as tmp:
        log = Path(tmp) / "vllm.log"
        t_start = time.perf_counter()
        with started(knobs, folder, "float32", max_len, 0, log, pool) as (worker, facts):
            if facts.get("num_gpu_blocks") != blocks or facts.get("block_size") != args.block_size:
                raise RuntimeError(f"vLLM took {facts.get('num_gpu_blocks')} blocks of "
                                   f"{facts.get('block_size')} tokens, asked {blocks} of "
                                   f"{args.block_size}")
            vllm_generate(worker, prompts[:1], 4)  # warm-up: the first call's set-up
            load_before = os.getloadavg()[0]
            answer = vllm_generate(worker, prompts, args.new_tokens)
            load_after = os.getloadavg()[0]
        text = log.read_text(errors="replace")
    outs = answer["outputs"]
    times = [o["token_s"] for o in outs]
    profile = step_profile(times, answer["wall_s"])
    return {"concurrency": concurrency, "blocks": blocks, "blocks_per_request": per_request,
            "kv_mib": blocks * args.block_size * args.kv_bytes_per_token / 2**20,
            "max_model_len": max_len,
            "throughput_tok_s": len(prompts) * args.new_tokens / answer["wall_s"],
            "wall_s": answer["wall_s"],
            "ttft_ms_p50": statistics.median(1000 * t[0] for t in times),
            "ttft_ms_max": max(1000 * t[0] for t in times),
            "max_decoding": profile["max_decoding"],
            "mean_decoding": profile["mean_decoding"],
            "decode_share": profile["decode_share"], "steps": profile["steps"],
            "preemptions": answer.get("preemptions"),
            "load_before": load_before, "load_after": load_after,
            "point_s": time.perf_counter() - t_start,
            "engine": facts, "log": log_facts(text),
            "token_s": times}  # per request, each token's arrival: the profile can be redone


def build_prompts(args) -> tuple[str, list[list[int]]]:
    """The model folder vLLM loads and the workload's prompts (tokenizer only: no weights)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from benchmarks.serving_vs_vllm import prompts_for
    from harness.core import hf_adapter
    from harness.core import models
    from harness.engines.vllm_engine import model_folder

    spec = models.resolve_model({"name": "smollm2_135m", "device": "cpu"})
    folder = model_folder(spec)
    info = hf_adapter.model_info(AutoConfig.from_pretrained(folder), torch.float32)
    args.kv_bytes_per_token = info.kv_bytes_per_token()  # one token's slot in vLLM's fp32 pool
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return folder, prompts_for(tokenizer, args.length, args.requests, args.new_tokens)


def run_methods(args, prompt_tokens: int, path: Path) -> None:
    """One run of benchmarks/throughput.py over full and the methods (our engine)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "throughput.py"),
           "--prompt-tokens", str(prompt_tokens), "--new-tokens", str(args.new_tokens),
           "--batches", str(args.method_batch), "--rounds", str(args.method_rounds),
           "--methods", "full", *args.methods, "--json", str(path)]
    print("  methods: " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def method_points(throughput_json: dict, batch: int) -> tuple[dict, dict]:
    """Per method: r (KV bytes per sequence over full's, both tiers), o (full decode tok/s over
    the method's), ours (decode and end-to-end tok/s at the batch); and the run's facts."""
    contexts = throughput_json["contexts"]
    length, part = next(iter(contexts.items()))
    cells = part["cells"]
    if "full" not in cells or str(batch) not in cells["full"]:
        raise ConfigError(f"the methods' throughput run has no full cache at batch {batch}")
    full = cells["full"][str(batch)]
    full_kv = full["kv_bytes_device_per_seq"] + full["kv_bytes_host_per_seq"]
    new = throughput_json["new_tokens"]
    points = {}
    for name, per_batch in cells.items():
        cell = per_batch.get(str(batch))
        if cell is None:
            continue
        kv = cell["kv_bytes_device_per_seq"] + cell["kv_bytes_host_per_seq"]
        wall_s = (batch * int(length) / cell["prefill_tokens_per_s"]
                  + batch * new / cell["decode_tokens_per_s"])
        points[name] = {"held_ratio": kv / full_kv,
                        "overhead_ratio": full["decode_tokens_per_s"] / cell["decode_tokens_per_s"],
                        "step_ms_median_ratio": cell["decode_ms_per_step"]
                        / full["decode_ms_per_step"],
                        "ours_decode_tok_s": cell["decode_tokens_per_s"],
                        "ours_end_to_end_tok_s": batch * new / wall_s}
    facts = {"prompt_tokens": int(length), "batch": batch, "new_tokens": new,
             "threads": throughput_json.get("threads"), "load_avg": part.get("load_avg"),
             "rounds": throughput_json.get("rounds"),
             "methods": throughput_json.get("methods")}
    return points, facts


def projections(curve: list[dict], methods: dict, c_full: float) -> dict:
    tput = [(p["concurrency"], p["throughput_tok_s"]) for p in curve]
    share = [(p["concurrency"], p["decode_share"]) for p in curve]
    return {name: {**project(tput, share, c_full, m["held_ratio"], m["overhead_ratio"]),
                   "ours_decode_tok_s": m["ours_decode_tok_s"],
                   "ours_end_to_end_tok_s": m["ours_end_to_end_tok_s"]}
            for name, m in methods.items()}


def curve_table(curve: list[dict], c_full: float) -> str:
    lines = ["| c (requests in the pool) | held ratio at M | blocks (MiB) | most decoding at "
             "once | tok/s | TTFT p50 ms | decode share | preemptions | vLLM start + run s | "
             "load |", "|" + "---|" * 10]
    for p in sorted(curve, key=lambda p: p["concurrency"]):
        lines.append(f"| {p['concurrency']} | {c_full / p['concurrency']:.3g} | {p['blocks']} "
                     f"({p['kv_mib']:.0f}) | "
                     f"{p['max_decoding']} | {p['throughput_tok_s']:.1f} | "
                     f"{p['ttft_ms_p50']:.0f} | {p['decode_share']:.2f} | "
                     f"{p['preemptions'] if p['preemptions'] is not None else '-'} | "
                     f"{p['point_s']:.0f} | {p['load_before']:.1f}->{p['load_after']:.1f} |")
    return "\n".join(lines)


def method_table(projected: dict) -> str:
    lines = ["| method | KV held r | c_full / r | upper bound tok/s (projected) | overhead o | "
             "projected tok/s | ours measured tok/s (batch, decode / end-to-end) | note |",
             "|" + "---|" * 8]
    for name, p in sorted(projected.items(), key=lambda kv: kv[1]["held_ratio"]):
        lines.append(f"| {name} | {p['held_ratio']:.3f} | {p['concurrency']:.2f} | "
                     f"{p['upper_tok_s']:.1f} | {p['overhead_ratio']:.2f} | "
                     f"{p['projected_tok_s']:.1f} | {p['ours_decode_tok_s']:.1f} / "
                     f"{p['ours_end_to_end_tok_s']:.1f} | {p['clamped'] or ''} |")
    return "\n".join(lines)


def draw(out: dict, path: Path) -> None:
    """Throughput vs KV held ratio (log): vLLM's measured curve and each method's two points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from harness.report.figures import save
    from harness.report.style import method_style

    c_full = out["c_full"]
    curve = sorted(out["curve"], key=lambda p: p["concurrency"])
    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    xs = [c_full / p["concurrency"] for p in curve]
    ax.plot(xs, [p["throughput_tok_s"] for p in curve], color="black", marker="o",
            linewidth=2, label=f"vLLM full cache, measured (c requests in M: held {c_full:g}/c)")
    for x, p in zip(xs, curve):
        ax.annotate(f"c={p['concurrency']}", (x, p["throughput_tok_s"]), fontsize=7,
                    textcoords="offset points", xytext=(4, -10))
    for name, p in sorted(out["projected"].items(), key=lambda kv: kv[1]["held_ratio"]):
        style = method_style(name)
        ax.plot([p["held_ratio"]] * 2, [p["upper_tok_s"], p["projected_tok_s"]], linestyle=":",
                color=style.colour, linewidth=1)
        ax.plot(p["held_ratio"], p["upper_tok_s"], linestyle="none", marker=style.marker,
                markerfacecolor="none", color=style.colour, markersize=8)
        ax.plot(p["held_ratio"], p["projected_tok_s"], linestyle="none", marker=style.marker,
                color=style.colour, markersize=7, label=f"{name} (r={p['held_ratio']:.2f})")
    ax.set_xscale("log")
    ticks = sorted({*xs, 1.0})  # the methods' own r are in the legend: theirs would crowd
    ax.set_xticks(ticks, [f"{t:.3g}" for t in ticks])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("KV held ratio (log; 1 = the full cache)")
    ax.set_ylabel("throughput, tokens/s (whole workload)")
    ax.set_title(f"What a method's KV saving buys in vLLM (PROJECTED points): memory M = "
                 f"{c_full:g} full requests\nhollow = upper bound (vLLM at c = {c_full:g}/r), "
                 "filled = projected with our engine's decode overhead", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best", ncol=2)
    fig.tight_layout()
    save(fig, path)
    plt.close(fig)


def report(out: dict) -> str:
    w = out["workload"]
    m = out.get("method_run") or {}
    eng = next((p["engine"] for p in out["curve"]), {})
    lines = [
        "# What a method's KV saving buys in vLLM (projected)", "",
        "SmolLM2-135M-Instruct (fp32) on the 2-core CPU machine. vLLM's curve is **measured**; "
        "every method figure beside it is **projected** (formulas below), never measured in "
        "vLLM.", "", "```bash", out["command"], "```", "",
        f"Workload: {w['requests']} RULER niah_single prompts at {w['length']} "
        f"({min(w['prompt_tokens'])}-{max(w['prompt_tokens'])} tokens), all sent at once, "
        f"{w['new_tokens']} greedy new tokens each (no stop), prefix caching off; one vLLM start "
        f"per point with the KV pool fixed at c whole requests' blocks "
        f"({w['block_size']}-token blocks, + vLLM's null block). Memory M = the KV space of "
        f"c_full = {out['c_full']:g} full requests.", "",
        f"Thread policy: vLLM {eng.get('vllm')} OMP bind `{eng.get('omp_threads_bind')}` "
        f"(on 2 cores: the model runner on one core, one reserved for its engine core), "
        f"OMP_WAIT_POLICY={out['omp_wait_policy']}; our engine (the methods' run) "
        f"{m.get('threads')} torch threads. Load averages per point in the table (other "
        "engineers' work shares the 2 cores).", "",
        "## vLLM's full cache vs its KV space (measured)", "",
        curve_table(out["curve"], out["c_full"]), "",
        "*most decoding at once*: the most requests between their first and last token at one "
        "engine step (from the token arrival times); *decode share*: the wall's share in steps "
        "that gave no request its first token. The block count is checked against the "
        "worker's facts and vLLM's log (`" + (next((p["log"].get("overriding")
                                                    for p in out["curve"]), None) or "-")
        + "` at the first point).", ""]
    if out.get("projected"):
        lines += [
            "## Per method: measured r and overhead, projected throughput", "",
            f"r and o from one run of `benchmarks/throughput.py` (our engine, prompts of "
            f"{m.get('prompt_tokens')} tokens of essay text, batch {m.get('batch')}, "
            f"{m.get('new_tokens')} new tokens, {m.get('rounds')} round(s) with the methods "
            f"alternating in each, medians; load {m.get('load_avg')}): r = KV bytes per "
            "sequence over the full cache's (both tiers), o = the full cache's decode tok/s "
            "over the method's (mean step time ratio at the same batch).", "",
            "```bash", f"python benchmarks/throughput.py --prompt-tokens {m.get('prompt_tokens')} "
            f"--new-tokens {m.get('new_tokens')} --batches {m.get('batch')} --rounds "
            f"{m.get('rounds')} --methods {' '.join(m.get('methods') or [])} --json "
            f"{m.get('source')}", "```", "",
            method_table(out["projected"]), "",
            "Formulas (benchmarks/vllm_projection_math.py): c = c_full / r; upper bound = vLLM's "
            "measured throughput at c, linear in log c between measured points (clamped beyond "
            "them, noted); projected = upper / ((1 - s) + s * o), s = vLLM's decode share at c. "
            "Only the decode steps carry a method's per-step cost in this model; its prompt-side "
            "work (SnapKV's scoring, KVQuant's calibration) and the cost of running its kernel "
            "inside vLLM's paged attention are left out. vLLM admits whole requests, so c is "
            "really floor(c_full / r); the continuous c is a smooth reading of that step. "
            "*ours measured* is our engine's own throughput for the method at that static batch "
            "(decode only / prefill + decode), not this workload.", ""]
    lines += ["![throughput vs KV held](projection.png)", ""]
    return "\n".join(lines)


def write_outputs(out: dict, stem: Path) -> None:
    write_json_atomic(stem.with_suffix(".json"), out)
    if out["curve"] and len(out["curve"]) >= 2 and out.get("method_points"):
        out["projected"] = projections(out["curve"], out["method_points"], out["c_full"])
        write_json_atomic(stem.with_suffix(".json"), out)
        draw(out, stem.with_suffix(".png"))
    write_text_atomic(stem.with_suffix(".md"), report(out))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/reports/vllm/projection",
                    help="path stem: <out>.json, <out>.md, <out>.png")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--length", type=int, default=1024, help="RULER length of the prompts")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--c-full", type=float, default=2.0,
                    help="the memory M in full requests")
    ap.add_argument("--block-size", type=int, default=128, help="vLLM's tokens per KV block")
    ap.add_argument("--vllm-bind", default="auto")
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--method-batch", type=int, default=4)
    ap.add_argument("--method-rounds", type=int, default=1,
                    help="throughput.py rounds (the methods alternate within a round; medians)")
    ap.add_argument("--methods-json", default=None,
                    help="throughput.py results to read (default: <out>_methods.json, run if absent)")
    ap.add_argument("--rerun-methods", action="store_true",
                    help="run throughput.py again even if its results exist")
    ap.add_argument("--resume", action="store_true",
                    help="keep the points <out>.json already has for this workload")
    ap.add_argument("--skip-curve", action="store_true", help="measure the methods only")
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite the .md and .png from <out>.json; run nothing")
    args = ap.parse_args(argv)
    for key in ("requests", "length", "new_tokens", "block_size", "method_batch",
                "method_rounds"):
        if getattr(args, key) <= 0:
            ap.error(f"--{key.replace('_', '-')} {getattr(args, key)}: must be a positive integer")
    if args.new_tokens >= args.length:
        ap.error(f"--new-tokens {args.new_tokens}: must be below --length {args.length}")
    if min(args.concurrency) <= 0 or len(set(args.concurrency)) < 2:
        ap.error(f"--concurrency {' '.join(map(str, args.concurrency))}: at least 2 distinct "
                 "positive integers")
    if max(args.concurrency) > args.requests:
        ap.error(f"--concurrency {max(args.concurrency)}: above --requests {args.requests} "
                 "(the pool would never fill)")
    if not (math.isfinite(args.c_full) and args.c_full > 0):
        ap.error(f"--c-full {args.c_full}: must be a positive number")
    from benchmarks.throughput import METHODS as MEASURABLE  # noqa: N811

    unknown = [m for m in args.methods if m not in MEASURABLE or m == "full"]
    if unknown:
        ap.error(f"--methods {' '.join(unknown)}: benchmarks/throughput.py measures "
                 f"{', '.join(m for m in MEASURABLE if m != 'full')}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    stem = Path(args.out)
    methods_path = Path(args.methods_json or f"{stem}_methods.json")
    if args.report_only:
        out = json.loads(stem.with_suffix(".json").read_text())
        write_outputs(out, stem)
        return 0
    folder, prompts = build_prompts(args)
    workload = {"requests": args.requests, "length": args.length, "new_tokens": args.new_tokens,
                "block_size": args.block_size, "prompt_tokens": [len(p) for p in prompts],
                "prefix_caching": False}
    out = {"command": "python " + " ".join(sys.argv), "model": "smollm2_135m", "dtype": "float32",
           "workload": workload, "c_full": args.c_full,
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "cpus": os.cpu_count(),
           "curve": [], "finished": False}
    if args.resume and stem.with_suffix(".json").is_file():
        previous = json.loads(stem.with_suffix(".json").read_text())
        if previous.get("workload") == workload:
            out["curve"] = [p for p in previous["curve"] if p["concurrency"] in args.concurrency]
            # the run that measured the kept points, then this one
            out["command"] = previous["command"] + "\n" + out["command"]
    done = {p["concurrency"] for p in out["curve"]}
    if args.rerun_methods or not methods_path.is_file():
        run_methods(args, args.length - args.new_tokens, methods_path)
    out["method_points"], out["method_run"] = method_points(
        json.loads(methods_path.read_text()), args.method_batch)
    out["method_run"]["source"] = str(methods_path)
    write_outputs(out, stem)
    for c in ([] if args.skip_curve else args.concurrency):
        if c in done:
            continue
        point = measure_point(args, folder, prompts, c)
        out["curve"].append(point)
        print(f"  c={c}: {point['blocks']} blocks, {point['throughput_tok_s']:.1f} tok/s, "
              f"TTFT p50 {point['ttft_ms_p50']:.0f} ms, most decoding {point['max_decoding']}, "
              f"preemptions {point['preemptions']} (load {point['load_before']:.1f}->"
              f"{point['load_after']:.1f})", flush=True)
        write_outputs(out, stem)  # after every point: a cut run keeps what it measured
    out["finished"] = {p["concurrency"] for p in out["curve"]} >= set(args.concurrency)
    write_outputs(out, stem)
    print(report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
