"""Where an evicting method's decode step goes, per layer: attention kernel vs bookkeeping.

One layer in isolation at SmolLM2's shapes (3 KV heads, g = 3, head_dim 64), a cache of ~1K tokens
(the 1K-budget rows of decode_long_context.py), steady state (one token appended, one evicted per
step). Rows, alternated step by step, medians over `--steps` x `--rounds`:

  sdpa                 torch SDPA over 1025 tokens (what full@1K's layer runs)
  probs                attention_with_probs + group_column_sums (what H2O needs: probabilities)
  full_bookkeeping     the default layer's update (append in place), no attention
  streaming_bookkeeping  StreamingLLM 4+1020: append, sink rotation, argmin, evict one
  h2o_bookkeeping      H2O 1024: append, eviction (scores accumulated by `probs`, not timed here)

    python benchmarks/eviction_step_cost.py [--steps 300] [--rounds 3]
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

from methods import build_method  # noqa: E402
from methods.base import KVLayer, ModelInfo  # noqa: E402
from methods.scoring import attention_with_probs, group_column_sums  # noqa: E402

INFO = ModelInfo(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_positions=16384)
BUDGET = 1024


def layer_for(name: str) -> KVLayer:
    if name == "full":
        return KVLayer(5, INFO)
    if name == "streaming_llm":
        method = build_method("streaming_llm", sink_tokens=4, window_tokens=BUDGET - 4)
        method._inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))  # as prepare
    else:
        method = build_method("h2o", budget_tokens=BUDGET)
    return method.make_layer(5, INFO)


def bookkeeping(name: str, context: int):
    """A step function timing update + after_forward of a layer holding `context` tokens."""
    layer = layer_for(name)
    layer.update(torch.randn(1, 3, context, 64), torch.randn(1, 3, context, 64), None)
    layer.after_forward()

    new = torch.randn(64, 2, 1, 3, 1, 64).unbind(0)  # made outside the timed step
    count = iter(range(10 ** 9))

    def step() -> None:
        keys, values = new[next(count) % len(new)]
        layer.update(keys, values, None)
        layer.after_forward()
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    q = torch.randn(1, 9, 1, 64)
    k, v = torch.randn(1, 3, BUDGET + 1, 64), torch.randn(1, 3, BUDGET + 1, 64)
    rows = {
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "probs": lambda: group_column_sums(attention_with_probs(q, k, v, None, 0.125)[1], 3),
        "full_bookkeeping": bookkeeping("full", BUDGET),
        "streaming_bookkeeping": bookkeeping("streaming_llm", 8192),
        "h2o_bookkeeping": bookkeeping("h2o", 8192),
    }
    times = {name: [] for name in rows}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for _ in range(args.steps):
                for name, fn in rows.items():
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
    print(f"per layer, one decode step; threads {torch.get_num_threads()}, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY')}, load {os.getloadavg()[0]:.2f}")
    for name, ts in times.items():
        print(f"  {name:24s} {statistics.median(ts) * 1e6:8.1f} us")
    us = {name: statistics.median(ts) * 1e6 for name, ts in times.items()}
    print(f"  H2O's extra over full@1K per layer: probabilities {us['probs'] - us['sdpa']:.1f} us "
          f"+ bookkeeping {us['h2o_bookkeeping'] - us['full_bookkeeping']:.1f} us; "
          f"StreamingLLM's: bookkeeping "
          f"{us['streaming_bookkeeping'] - us['full_bookkeeping']:.1f} us")


if __name__ == "__main__":
    main()
