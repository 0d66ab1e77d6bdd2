"""Wall time of one lm-eval task through our `kvharness` LM (method=full) against lm-eval's HFLM.

Same loaded model object for both, same task objects (our offline YAMLs), same requests, batch 1.
Each round runs `lm_eval.simple_evaluate` once with HFLM and once with KVHarnessLM, alternating
which goes first (A/B, B/A, ...); the metric values must agree. Prints per-round seconds, the
medians and the ratio ours / HFLM (goal <= 1.5), plus the largest |delta loglikelihood| over the
task's requests.

    python benchmarks/lm_eval_vs_hflm.py [--model smollm2_135m] [--task copa] [--limit 20]
                                         [--num-fewshot 0] [--rounds 3] [--scoring chunked]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from harness.lm_eval import KVHarnessLM, offline_task_dir  # noqa: E402
from harness.session import of_methods  # noqa: E402
from kvcore.errors import ConfigError  # noqa: E402
from methods import build_method  # noqa: E402


def timed_eval(lm, task: str, limit: int, shots: int, manager: TaskManager) -> tuple[float, dict]:
    t0 = time.perf_counter()
    out = simple_evaluate(model=lm, tasks=[task], num_fewshot=shots, limit=limit,
                          task_manager=manager, log_samples=True, bootstrap_iters=0)
    seconds = time.perf_counter() - t0
    return seconds, out


def loglikelihoods(out: dict, task: str) -> list[float]:
    return [float(resp[0][0]) for s in out["samples"][task] for resp in s["resps"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--task", default="copa")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--num-fewshot", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scoring", default="chunked", choices=["chunked", "stepwise"])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)

    try:  # checked before the weights load
        session, settings = of_methods({"name": args.model, "device": "cpu"},
                                       {"full": build_method("full")})
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
    session.load("sdpa")
    model, tokenizer = session.model, session.tokenizer
    engine = session.engine(settings["full"])
    ours = KVHarnessLM(engine, scoring=args.scoring)
    hflm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1)
    manager = TaskManager(include_path=str(offline_task_dir()), include_defaults=False)
    timed_eval(ours, args.task, 2, args.num_fewshot, manager)  # warm-up (data, kernels)
    timed_eval(hflm, args.task, 2, args.num_fewshot, manager)

    times: dict[str, list[float]] = {"hflm": [], "kvharness": []}
    outs: dict[str, dict] = {}
    for r in range(args.rounds):
        order = [("hflm", hflm), ("kvharness", ours)]
        for name, lm in order if r % 2 == 0 else order[::-1]:
            seconds, outs[name] = timed_eval(lm, args.task, args.limit, args.num_fewshot, manager)
            times[name].append(seconds)
            print(f"round {r}: {name:9s} {seconds:7.2f} s", flush=True)
    a, b = loglikelihoods(outs["hflm"], args.task), loglikelihoods(outs["kvharness"], args.task)
    delta = max(abs(x - y) for x, y in zip(a, b))
    metrics = {n: {k: v for k, v in o["results"][args.task].items() if k.endswith(",none")}
               for n, o in outs.items()}
    med = {n: statistics.median(t) for n, t in times.items()}
    print(f"{args.model} {args.task} limit={args.limit} num_fewshot={args.num_fewshot} "
          f"scoring={args.scoring} requests={len(a)} threads={torch.get_num_threads()}")
    print(f"median s  hflm {med['hflm']:.2f}  kvharness {med['kvharness']:.2f}  "
          f"ratio kvharness/hflm {med['kvharness'] / med['hflm']:.2f}  (goal <= 1.5)")
    print(f"max |delta loglikelihood| {delta:.3g}   metrics hflm {metrics['hflm']}  "
          f"kvharness {metrics['kvharness']}")


if __name__ == "__main__":
    main()
