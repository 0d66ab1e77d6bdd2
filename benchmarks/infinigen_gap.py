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


def run_one(engine, ids, name, kwargs):
    """Stream `ids` through `engine` (variant `name` with `kwargs`): its figures."""
    import torch

    from tasks.perplexity import token_nll

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

    from harness.core import models
    from harness.session import OwnFeed, Session, runner_of, setting
    from kvcore.errors import ConfigError
    from methods import build_method
    from tasks.text_sources import load_text

    class Stream(OwnFeed):
        """Every token a decode step, one sequence (task=perplexity task.mode=streaming)."""

        name = "stream"
        batches = False

        def phases(self) -> frozenset[str]:
            return frozenset({"decode"})

    torch.manual_seed(0)
    model_cfg = {"name": args.model, "device": "cpu"}
    runner = runner_of(dense_layers=list(args.dense_layers), diagnostics=args.every > 0,
                       diagnostics_every_steps=args.every or 16)

    def open_variant(name, kwargs):
        return setting(model_cfg, runner, build_method(name, **kwargs), Stream())

    def checked(session, spec_str, one):
        try:
            session.validate(one)
        except ConfigError as exc:
            raise SystemExit(f"error: {spec_str}: {exc}") from None
        return one

    variants = [parse_variant(s) for s in args.variants]
    known = {}  # every variant whose knobs are known, checked before the weights load
    for i, (name, kwargs) in enumerate(variants):
        try:
            if "@" not in kwargs.values():
                known[i] = open_variant(name, kwargs)
        except ConfigError as exc:
            raise SystemExit(f"error: {args.variants[i]}: {exc}") from None
    try:
        session = Session(list(known.values()))
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
    for i, one in known.items():
        checked(session, args.variants[i], one)
    session.load("sdpa")
    tok = session.tokenizer
    data_dir = models.SHARED_DIR / "data"
    ids = torch.tensor(tok(load_text(args.dataset, None, str(data_dir)), verbose=False)["input_ids"]
                       [: args.tokens])
    print(f"{args.model} {args.dataset} first {ids.numel()} tokens, streaming; dense layers "
          f"{args.dense_layers}; threads {torch.get_num_threads()}", flush=True)
    print("| variant | ppl | attended (sparse layers) | recall (sparse layers) | KL | worst layers "
          "(recall) | s |\n|---|---|---|---|---|---|---|", flush=True)
    results, last_frac = [], None
    for i, (spec_str, (name, kwargs)) in enumerate(zip(args.variants, variants)):
        one = known.get(i)
        if one is None:  # matched density: checked once the previous variant has measured it
            kwargs = {k: round(last_frac, 4) if v == "@" else v for k, v in kwargs.items()}
            try:
                one = open_variant(name, kwargs)
            except ConfigError as exc:
                raise SystemExit(f"error: {spec_str}: {exc}") from None
            checked(session, spec_str, one)
        r = run_one(session.engine(one), ids, name, kwargs)
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
