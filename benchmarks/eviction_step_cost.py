"""Where an evicting method's decode step goes, per layer: attention kernel vs bookkeeping.

One layer in isolation at SmolLM2's shapes (3 KV heads, g = 3, head_dim 64), a cache of ~1K tokens
(the 1K-budget rows of decode_long_context.py), steady state (one token appended, one evicted per
step). Rows, alternated in a shuffled order every step, medians over `--steps` x `--rounds`:

  full@1K step        the default layer holding 1K tokens: append + torch SDPA (full@1K's layer)
  h2o step            H2O 1024 at 8K: append + its attention + eviction, as it runs on CPU (the
                      fused C kernel: attention, scores added in place, victim picked)
  h2o step (eager)    the same with the eager path (attention_with_probs, column sums, argmin)
  streaming step      StreamingLLM 4+1020 at 8K: append + SDPA + sink rotation + eviction
  sdpa / eager probs / fused kernel   the attention alone over 1025 tokens

    python benchmarks/eviction_step_cost.py [--steps 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from methods import build_method  # noqa: E402
from methods.kernels import colsum_attention_cpu  # noqa: E402
from methods.layer import KVLayer  # noqa: E402
from methods.model import ModelInfo  # noqa: E402
from methods.scoring import attention_with_probs, group_column_sums  # noqa: E402

INFO = ModelInfo(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_positions=16384)
BUDGET = 1024
SCALING = 64 ** -0.5


def layer_for(name: str) -> KVLayer:
    if name == "full":
        return KVLayer(5, INFO)
    if name == "streaming_llm":
        method = build_method("streaming_llm", sink_tokens=4, window_tokens=BUDGET - 4)
        method._inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))  # as prepare
    else:
        method = build_method("h2o", budget_tokens=BUDGET)
    return method.make_layer(5, INFO)


def layer_step(name: str, context: int, eager: bool = False):
    """A step function: update, the layer's attention, after_forward, on a layer holding
    `context` tokens (steady state)."""
    layer = layer_for(name)
    layer.update(torch.randn(1, 3, context, 64), torch.randn(1, 3, context, 64), None)
    layer.after_forward()
    new = torch.randn(64, 3, 1, 9, 1, 64).unbind(0)  # (k, v, q), made outside the timed step
    count = iter(range(10 ** 9))
    plain = lambda *a: False  # noqa: E731

    def step() -> None:
        keys, values, query = new[next(count) % len(new)]
        keys, values = layer.update(keys[:, :3], values[:, :3], None)
        if name == "h2o":
            real = colsum_attention_cpu.applies
            colsum_attention_cpu.applies = plain if eager else real
            try:
                layer.attend(None, query, keys, values, None, None, scaling=SCALING)
            finally:
                colsum_attention_cpu.applies = real
        else:
            F.scaled_dot_product_attention(query, keys, values, enable_gqa=True)
        layer.after_forward()
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    q = torch.randn(1, 9, 1, 64)
    k, v = torch.randn(1, 3, BUDGET + 1, 64), torch.randn(1, 3, BUDGET + 1, 64)
    acc = torch.zeros(1, 3, BUDGET + 1)
    rows = {
        "full@1K step": layer_step("full", BUDGET),
        "h2o step": layer_step("h2o", 8192),
        "h2o step (eager)": layer_step("h2o", 8192, eager=True),
        "streaming step": layer_step("streaming_llm", 8192),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "eager probs": lambda: group_column_sums(
            attention_with_probs(q, k, v, None, SCALING)[1], 3),
    }
    if colsum_attention_cpu.library() is not None:
        rows["fused kernel"] = lambda: colsum_attention_cpu.decode_attention(q, k, v, SCALING, acc)
    else:
        print(f"fused kernel not built: {colsum_attention_cpu.build_error()}")
    times = {name: [] for name in rows}
    order = list(rows)
    with torch.inference_mode():
        for _ in range(args.rounds):
            for _ in range(args.steps):
                random.shuffle(order)  # no row always follows the same one
                for name in order:
                    start = time.perf_counter()
                    rows[name]()
                    times[name].append(time.perf_counter() - start)
    print(f"per layer, one decode step; threads {torch.get_num_threads()}, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY')}, load {os.getloadavg()[0]:.2f}")
    us = {name: statistics.median(ts) * 1e6 for name, ts in times.items()}
    for name, value in us.items():
        print(f"  {name:20s} {value:8.1f} us")
    base = us["full@1K step"]
    print(f"  extra over full@1K's layer step: h2o {us['h2o step'] - base:.1f} us "
          f"(eager {us['h2o step (eager)'] - base:.1f}), streaming "
          f"{us['streaming step'] - base:.1f} us")


if __name__ == "__main__":
    main()
