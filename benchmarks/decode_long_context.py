"""Decode latency at long context: full cache vs StreamingLLM and H2O with a 1K budget, plus
the KV bytes KIVI-2 holds vs the full cache.

For each context length: prefill the essay text through the method (chunked), then decode
`--new-tokens` greedily; the decode ms/token median and the KV bytes held come from the engine.
Methods run back to back at each length (A, B, C, then the next length), and the ratio to the full
cache is taken within the same length. Goals (issue 3): StreamingLLM/H2O <= 0.5x the full cache's
decode ms/token at 8K; KIVI-2 bytes <= 0.2x.

    python benchmarks/decode_long_context.py --contexts 4096 8192 --new-tokens 24
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from harness import hf_adapter, models  # noqa: E402
from harness.engine import Engine, EngineSettings  # noqa: E402
from methods import build_method  # noqa: E402
from tasks.text_sources import load_essays  # noqa: E402

METHODS = {
    "full": ("full", {}),
    "streaming_llm_1k": ("streaming_llm", {"sink_tokens": 4, "window_tokens": 1020}),
    "h2o_1k": ("h2o", {"budget_tokens": 1024}),
    "kivi_2bit": ("kivi", {"k_bits": 2, "v_bits": 2}),
}


def measure(model, tok, info, name, ids, new_tokens):
    method_name, kw = METHODS[name]
    method = build_method(method_name, **kw)
    hf_adapter.prepare(method, model, tok, info, data_dir=models.SHARED_DIR / "data")
    engine = Engine(model, tok, method, info, EngineSettings(prefill_chunk_tokens=1024))
    t0 = time.time()
    with engine.request() as req:
        req.generate(ids, max_new_tokens=new_tokens, stop_ids=set())
        held = sum(kv.stats()["kv_bytes"] for kv in req.cache.kv_layers)
    speed = engine.speed().as_dict()
    full_bytes = (len(ids) + new_tokens - 1) * info.kv_bytes_per_token()
    return {"decode_ms": speed["decode_ms_per_token_median"], "decode_ms_p90": speed["decode_ms_per_token_p90"],
            "prefill_s": speed["prefill_ms_total"] / 1e3, "kv_bytes": held,
            "kv_bytes_vs_full": held / full_bytes, "wall_s": time.time() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    spec = models.resolve_model({"name": args.model, "device": "auto"})
    model, tok = models.load_model(spec, "sdpa")
    info = hf_adapter.model_info(model.config)
    essays = tok(load_essays(), verbose=False)["input_ids"]
    out = {"model": args.model, "threads": torch.get_num_threads(),
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "contexts": {}}
    for ctx in args.contexts:
        ctx = min(ctx, info.max_positions - args.new_tokens)
        ids = essays[:ctx]
        rows = {name: measure(model, tok, info, name, ids, args.new_tokens) for name in args.methods}
        base = rows.get("full")
        print(f"\ncontext {ctx} tokens + {args.new_tokens} new, {args.model}, load "
              f"{os.getloadavg()[0]:.2f}")
        print(f"{'method':18} {'decode ms':>10} {'p90':>8} {'x full':>7} {'KV MiB':>8} {'KV x full':>9}")
        for name, r in rows.items():
            r["decode_vs_full"] = r["decode_ms"] / base["decode_ms"] if base else None
            print(f"{name:18} {r['decode_ms']:10.2f} {r['decode_ms_p90']:8.2f} "
                  f"{(r['decode_vs_full'] or float('nan')):7.3f} {r['kv_bytes'] / 2**20:8.2f} "
                  f"{r['kv_bytes_vs_full']:9.3f}")
        out["contexts"][str(ctx)] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
