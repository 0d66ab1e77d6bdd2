"""Serving speed beside vLLM: the same requests to vLLM (its CPU build, full cache) and to our
engine (full cache, contiguous and paged KV), measured in one run, as ratios.

For each prompt length L (RULER niah_single prompts built by tasks/ruler.py, distinct samples)
and each batch size B: B requests arrive at once, each generates exactly `--new-tokens` greedy
tokens (no stop token, so every sequence carries the same work). Per engine and cell:
  * throughput: B x new tokens / wall time from the arrival to the last token (tokens/s);
  * TTFT: time from the arrival to each request's first token (median over requests);
  * ITL: the gaps between consecutive tokens of a request, p50 and p90 over all requests.
vLLM: its token arrival times, read in the worker as the engine steps (scripts/vllm_worker.py);
its scheduler runs the B requests with continuous batching and chunked prefill, prefix caching
off: RULER prompts share their haystack's opening and a cell repeats the last cell's prompts, so
a prefix cache would skip prefill work our engine does (a deployment would keep it on; our
engine has no prefix cache).
Ours: one static batch of B (harness.core.batch): the B prompts prefilled together, then one decode
step per token for all B; TTFT = the batch's prefill (+ its first token), ITL = the decode steps.

Within a cell the engines alternate (vLLM, ours contiguous, ours paged), `--rounds` rounds,
medians over rounds; ratios are ours / vLLM in the same round. The load average (before and
after each cell) and the thread policy of both engines are recorded with the numbers.

    python benchmarks/serving_vs_vllm.py --lengths 1024 4096 --batches 1 4 16 32 \\
        --new-tokens 64 --json results/reports/vllm/serving_vs_vllm.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from harness.core import hf_adapter
from harness.core import models  # noqa: E402
from harness.core.engine import Engine, EngineSettings  # noqa: E402
from harness.store.results import write_json_atomic  # noqa: E402
from harness.engines.vllm_engine import VllmKnobs, model_folder, started  # noqa: E402
from methods import build_method  # noqa: E402
from tasks import build_task  # noqa: E402

LAYOUTS = ("contiguous", "paged")
ENGINES = ("vllm", *(f"ours_{layout}" for layout in LAYOUTS))


def prompts_for(tokenizer, length: int, count: int, new_tokens: int) -> list[list[int]]:
    """`count` distinct RULER niah_single prompts, each at most `length` - `new_tokens` tokens
    (RULER's length rule), 5 depths per sample index."""
    task = build_task("ruler", subtasks=["niah_single"], lengths=[length],
                      samples_per_cell=-(-count // 5), max_new_tokens=new_tokens)
    return [list(s.input_ids) for s in task.build_samples(tokenizer)[:count]]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def cell_of(wall_s: float, tokens: int, ttft_ms: list[float], itl_ms: list[float]) -> dict:
    return {"throughput_tok_s": tokens / wall_s, "wall_s": wall_s,
            "ttft_ms_p50": statistics.median(ttft_ms), "ttft_ms_max": max(ttft_ms),
            "itl_ms_p50": percentile(itl_ms, 50), "itl_ms_p90": percentile(itl_ms, 90)}


def vllm_generate(worker, prompts: list[list[int]], new_tokens: int) -> dict:
    """The worker's answer for `prompts` sent at once, exactly `new_tokens` each (no stop)."""
    answer = worker.call({"op": "generate", "requests": [
        {"prompt_ids": p, "max_new_tokens": new_tokens, "stop_token_ids": [],
         "ignore_eos": True} for p in prompts]})
    if any(len(o["token_ids"]) != new_tokens for o in answer["outputs"]):
        raise RuntimeError("vLLM stopped a request early despite ignore_eos")
    return answer


def run_vllm(worker, prompts: list[list[int]], new_tokens: int) -> dict:
    answer = vllm_generate(worker, prompts, new_tokens)
    outs = answer["outputs"]
    ttft = [1000 * o["token_s"][0] for o in outs]
    itl = [1000 * (b - a) for o in outs for a, b in zip(o["token_s"], o["token_s"][1:])]
    return cell_of(answer["wall_s"], len(prompts) * new_tokens, ttft, itl)


def run_ours(model, tokenizer, info, layout: str, prompts: list[list[int]], new_tokens: int
             ) -> dict:
    engine = Engine(model, tokenizer, build_method("full"), info,
                    EngineSettings(prefill_chunk_tokens=2048, batch_size=len(prompts),
                                   kv_layout=layout))
    t0 = time.perf_counter()
    with engine.batch(len(prompts)) as batch:
        outs = batch.generate(prompts, [new_tokens] * len(prompts), stop_ids=set())
    wall_s = time.perf_counter() - t0
    if any(len(o) != new_tokens for o in outs):
        raise RuntimeError("our engine stopped a request early with no stop ids")
    speed = engine.speed()
    first_ms = speed.prefill_ms_total  # all B prompts prefilled together: each waits for all
    # every decode step gives each of the B sequences its next token: the steps are the ITLs
    return cell_of(wall_s, len(prompts) * new_tokens, [first_ms] * len(prompts),
                   list(speed.decode_ms))


def ratio_table(cells: dict, lengths: list[int], batches: list[int]) -> str:
    lines = ["| prompt | batch | engine | tok/s | x vLLM | TTFT p50 ms | x vLLM | ITL p50 ms | "
             "ITL p90 ms | x vLLM (p50) | load |", "|" + "---|" * 11]
    for length in lengths:
        for b in batches:
            per = cells.get(str(length), {}).get(str(b))
            if not per:
                continue
            base = per["vllm"]
            for name in ENGINES:
                r = per[name]
                lines.append(
                    f"| {length} | {b} | {name} | {r['throughput_tok_s']:.1f} | "
                    f"{r['throughput_tok_s'] / base['throughput_tok_s']:.2f} | "
                    f"{r['ttft_ms_p50']:.0f} | {r['ttft_ms_p50'] / base['ttft_ms_p50']:.2f} | "
                    f"{r['itl_ms_p50']:.1f} | {r['itl_ms_p90']:.1f} | "
                    f"{r['itl_ms_p50'] / base['itl_ms_p50']:.2f} | "
                    f"{per['load_before']:.1f}->{per['load_after']:.1f} |")
    return "\n".join(lines)


def median_cell(rounds: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--skip", nargs="*", default=[], metavar="LENGTH:BATCH",
                    help="cells not to run (a reduced grid; recorded as skipped)")
    ap.add_argument("--threads", type=int, default=None,
                    help="our engine's torch threads (default: all cores)")
    ap.add_argument("--vllm-bind", default="auto",
                    help="VLLM_CPU_OMP_THREADS_BIND for vLLM's model runner (auto: its default)")
    ap.add_argument("--vllm-kv-space-gib", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if min(args.lengths + args.batches + [args.new_tokens, args.rounds]) <= 0:
        ap.error("--lengths, --batches, --new-tokens and --rounds take positive integers")
    skip = {tuple(int(x) for x in s.split(":")) for s in args.skip}
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = models.resolve_model({"name": "smollm2_135m", "device": "cpu"})
    folder = model_folder(spec)
    model, tokenizer = models.load_model(spec, "sdpa")
    info = hf_adapter.model_info(model.config, torch.float32)
    prompts = {n: prompts_for(tokenizer, n, max(args.batches), args.new_tokens)
               for n in args.lengths}
    out = {"command": " ".join(sys.argv), "model": spec.description, "dtype": "float32",
           "new_tokens": args.new_tokens, "rounds": args.rounds,
           "lengths": args.lengths, "batches": args.batches,
           "skipped": [f"{a}:{b}" for a, b in sorted(skip)],
           "thread_policy": {"ours_torch_threads": torch.get_num_threads(),
                             "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                             "vllm_omp_threads_bind": args.vllm_bind, "cpus": os.cpu_count()},
           "prompt_tokens": {str(n): [len(p) for p in ps] for n, ps in prompts.items()},
           "cells": {}, "finished": False}
    knobs = VllmKnobs(kv_space_gib=args.vllm_kv_space_gib, max_num_seqs=max(args.batches),
                      max_model_len=max(args.lengths),
                      omp_threads_bind=args.vllm_bind, prefix_caching=False)
    with tempfile.TemporaryDirectory(prefix="kvh-serving-") as tmp, \
            started(knobs, folder, "float32", knobs.max_model_len, 0,
                    Path(tmp) / "vllm.log") as (worker, facts):
        out["vllm"] = facts
        run_vllm(worker, prompts[args.lengths[0]][:1], 4)  # warm-up: first-call set-up
        run_ours(model, tokenizer, info, "contiguous", prompts[args.lengths[0]][:1], 4)
        for length in args.lengths:
            for b in args.batches:
                if (length, b) in skip:
                    continue
                batch = prompts[length][:b]
                load_before = os.getloadavg()[0]
                rounds: dict[str, list[dict]] = {name: [] for name in ENGINES}
                for _ in range(args.rounds):
                    rounds["vllm"].append(run_vllm(worker, batch, args.new_tokens))
                    for layout in LAYOUTS:
                        rounds[f"ours_{layout}"].append(
                            run_ours(model, tokenizer, info, layout, batch, args.new_tokens))
                cell = {name: median_cell(rs) for name, rs in rounds.items()}
                cell.update(load_before=load_before, load_after=os.getloadavg()[0])
                out["cells"].setdefault(str(length), {})[str(b)] = cell
                print(f"  {length} x{b}: " + ", ".join(
                    f"{n} {cell[n]['throughput_tok_s']:.1f} tok/s" for n in ENGINES)
                    + f" (load {load_before:.1f}->{cell['load_after']:.1f})", flush=True)
                if args.json:  # after every cell: a cut run keeps what it measured
                    write_json_atomic(Path(args.json), out)
    out["finished"] = True
    out["table"] = ratio_table(out["cells"], args.lengths, args.batches)
    if args.json:
        write_json_atomic(Path(args.json), out)
    print(f"\nSmolLM2-135M fp32, {args.new_tokens} new tokens, {args.rounds} round(s); ours: "
          f"{torch.get_num_threads()} torch threads; vLLM {facts['vllm']}: OMP bind "
          f"{facts.get('omp_threads_bind')}, {facts.get('reserved_cpus') or 'default'} reserved "
          f"CPU(s); OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    print(out["table"])


if __name__ == "__main__":
    main()
