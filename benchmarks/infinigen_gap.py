"""Where InfiniGen loses against the exact top-k oracle at the same sparse-layer density.

    python benchmarks/infinigen_gap.py --model smollm2_135m --tokens 1024 \
        --variants "infinigen" "infinigen:partial_ratio=1.0" "oracle_topk:budget_ratio=@"

Each variant is `method[:key=value,...]`; `budget_ratio=@` takes the sparse-layer attended fraction
measured for the previous variant (matched density). Every run streams the first `--tokens`
tokens of WikiText-2 through the engine (one decode step per token, as `task=perplexity
task.mode=streaming`) with the same protocol dense layers for every method (`--dense-layers`,
default InfiniGen's 0 1), and prints: ppl, attended fraction in the sparse layers (decode steps,
ratio of sums), attention-mass recall vs a shadow full cache (sparse layers only, sampled every
`--every` steps), the worst sparse layers by recall, and wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_variant(spec: str) -> tuple[str, dict]:
    name, _, rest = spec.partition(":")
    kwargs = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        structured = value[:1] in "[{"
        kwargs[key] = value if value == "@" else json.loads(value) if structured else _scalar(value)
    return name, kwargs


def _scalar(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value, value)


def run_one(model, tok, info, ids, name, kwargs, dense, every, data_dir, **prepare_extras):
    import torch

    from harness import hf_adapter
    from harness.engine import Engine, EngineSettings
    from methods import build_method
    from methods.base import Protocol
    from tasks.perplexity import token_nll

    method = build_method(name, **kwargs)
    hf_adapter.prepare(method, model, tok, info, data_dir=data_dir, **prepare_extras)
    engine = Engine(model, tok, method, info, EngineSettings(
        protocol=Protocol(dense_layers=tuple(dense)), diagnostics_every=every))
    nll = torch.empty(ids.numel() - 1)
    t0 = time.time()
    with engine.request(final_tokens=ids.numel()) as req:  # the official cap: of length T
        for t in range(ids.numel() - 1):
            logits = req.step(ids[t:t + 1])[0, -1]
            nll[t] = token_nll(logits[None], ids[t + 1:t + 2])[0]
    wall = time.time() - t0
    frac = engine.attended.summary()
    label = ",".join(f"{k}={v}" for k, v in kwargs.items())
    out = {"variant": name + (":" + label if label else ""),
           "ppl": math.exp(float(nll.mean())),
           "attended_sparse": frac["attended_fraction_sparse_layers"],
           "attended_per_layer": frac["attended_fraction_per_layer"], "wall_s": round(wall, 1)}
    if engine.diagnostics is not None and engine.diagnostics.recall:
        per = torch.tensor(engine.diagnostics.recall).mean(0)  # (L, H_q)
        sparse = [i for i in range(per.shape[0]) if i not in set(engine.dense_layers)]
        out["recall_sparse"] = float(per[sparse].mean())
        out["recall_per_layer"] = [round(float(v), 4) for v in per.mean(1)]
        out["recall_per_layer_head"] = [[round(float(v), 4) for v in row] for row in per]
        out["kl_mean"] = engine.diagnostics.summary()["kl_mean"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--dataset", default="wikitext2")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--dense-layers", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--every", type=int, default=8, help="diagnostics every N steps (0 = off)")
    ap.add_argument("--variants", nargs="+", required=True)
    ap.add_argument("--json", default=None, help="also write all results (per-layer arrays) here")
    args = ap.parse_args()

    import torch

    from harness import hf_adapter, models
    from tasks.text_sources import load_text

    torch.manual_seed(0)
    spec = models.resolve_model({"name": args.model, "device": "cpu"})
    model, tok = models.load_model(spec)
    info = hf_adapter.model_info(model.config)
    data_dir = models.SHARED_DIR / "data"
    ids = torch.tensor(tok(load_text(args.dataset, None, str(data_dir)), verbose=False)["input_ids"]
                       [: args.tokens])
    print(f"{args.model} {args.dataset} first {ids.numel()} tokens, streaming; dense layers "
          f"{args.dense_layers}; threads {torch.get_num_threads()}", flush=True)
    print("| variant | ppl | attended (sparse layers) | recall (sparse layers) | KL | worst layers "
          "(recall) | s |\n|---|---|---|---|---|---|---|", flush=True)
    results, last_frac = [], None
    for spec_str in args.variants:
        name, kwargs = parse_variant(spec_str)
        for k, v in list(kwargs.items()):
            if v == "@":
                kwargs[k] = round(last_frac, 4)
        r = run_one(model, tok, info, ids, name, kwargs, args.dense_layers, args.every, data_dir)
        last_frac = r["attended_sparse"]
        worst = ""
        if "recall_per_layer" in r:
            order = sorted((v, i) for i, v in enumerate(r["recall_per_layer"])
                           if i not in args.dense_layers)[:3]
            worst = " ".join(f"L{i}:{v:.3f}" for v, i in order)
        print(f"| {r['variant']} | {r['ppl']:.3f} | {r['attended_sparse']:.4f} | "
              f"{r.get('recall_sparse', float('nan')):.4f} | "
              f"{r.get('kl_mean', float('nan')):.4f} | "
              f"{worst} | {r['wall_s']} |", flush=True)
        results.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
