"""Decode speed of the engine (method=full) against transformers `generate` + DynamicCache.

Same model, same prompt (the first `--prompt-tokens` of the essays), same number of new tokens,
greedy, runs alternated A/B/A/B... Decode tokens/s is measured per token on both sides: the engine
times each decode step; for `generate`, a streamer timestamps every new token, and decode time is
from the first generated token to the last. Prints medians and the ratio. Goals: >= 0.95 at 2K;
>= 1.2 at 8K (the engine's default cache writes each step in place, transformers'
DynamicCache concatenates the whole cache every step).

    python benchmarks/decode_vs_hf.py --context 2048 [--new-tokens 32] [--rounds 3]
    python benchmarks/decode_vs_hf.py --context 8192
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
from transformers import DynamicCache  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from harness.core.engine import Engine  # noqa: E402
from harness.session import of_methods  # noqa: E402
from kvcore.errors import ConfigError  # noqa: E402
from methods import build_method  # noqa: E402
from tasks.text_sources import load_essays  # noqa: E402


class _Stamps(BaseStreamer):
    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def hf_decode_tps(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, list[int]]:
    stamps = _Stamps()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, streamer=stamps,
                             cache=DynamicCache(config=model.config), pad_token_id=0)
    token_times = stamps.times[1:]  # first put() is the prompt
    return (len(token_times) - 1) / (token_times[-1] - token_times[0]), out[0, ids.shape[1]:].tolist()


def engine_decode_tps(engine: Engine, ids: torch.Tensor, new_tokens: int) -> tuple[float, list[int]]:
    before = len(engine.timer.values("decode"))
    with engine.request() as req:
        new = req.generate(ids[0].tolist(), max_new_tokens=new_tokens, stop_ids=set())
    steps = engine.timer.values("decode")[before:]
    return len(steps) / (sum(steps) / 1e3), new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--context", "--prompt-tokens", dest="context", type=int, default=2048,
                    help="prompt tokens (capped at the model's max positions - new tokens)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    try:  # checked before the weights load
        session, settings = of_methods({"name": args.model, "device": "auto"},
                                       {"full": build_method("full")}, prefill_chunk_tokens=4096)
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
    session.load("sdpa")
    model, tok, info = session.model, session.tokenizer, session.info
    engine = session.engine(settings["full"])
    context = min(args.context, info.max_positions - args.new_tokens)
    ids = torch.tensor(tok(load_essays(), verbose=False)["input_ids"][:context])[None]
    ids = ids.to(engine.device)

    hf, ours = [], []
    for r in range(args.rounds):
        tps_hf, out_hf = hf_decode_tps(model, ids, args.new_tokens)
        tps_ours, out_ours = engine_decode_tps(engine, ids, args.new_tokens)
        assert out_hf == out_ours, "engine and generate produced different tokens"
        hf.append(tps_hf)
        ours.append(tps_ours)
        print(f"round {r + 1}: generate {tps_hf:.2f} tok/s | engine {tps_ours:.2f} tok/s | "
              f"ratio {tps_ours / tps_hf:.3f}", flush=True)
    ratios = [o / h for o, h in zip(ours, hf)]
    print(f"\n{args.model}, prompt {ids.shape[1]} tokens, {args.new_tokens} new tokens, "
          f"{args.rounds} alternating rounds, threads {torch.get_num_threads()}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, load {os.getloadavg()[0]:.2f}")
    print(f"median decode tok/s: generate {statistics.median(hf):.2f}, "
          f"engine {statistics.median(ours):.2f}")
    print(f"engine / generate decode tokens/s ratio: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}; goal >= "
          f"{1.2 if ids.shape[1] >= 8000 else 0.95})")


if __name__ == "__main__":
    main()
