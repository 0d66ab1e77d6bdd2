"""Like-for-like check: every method at one budget, one protocol, one accounting.

    python benchmarks/fairness.py [--budget-ratio 0.2] [--dense-layers 0 1] [--max-tokens 1024]
                                  [--model smollm2_135m] [--dataset wikitext2] [--methods ...]

Each row is a normal harness run (streaming perplexity, the same runner.dense_layers for every
method) read back from its metrics.json: the attended fraction in the sparse layers (decode
steps), KV held (bytes on every tier / full cache), ppl. Every method that selects or evicts by a
budget should attend within +-0.01 of it (the "ok" column; methods whose density follows another
knob — InfiniGen's alpha — are marked "n/a" and matched instead). For each method, the exact
top-k oracle is run at that method's measured sparse-layer fraction (reused when one within 0.01
exists) and the table says whether the oracle is at least as good, as an upper bound should be.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MATCH_TOLERANCE = 0.01  # attended fractions this close count as "the same density"


def run_one(common: list[str], overrides: list[str]) -> dict:
    from hydra import compose, initialize_config_dir

    from harness.run import run

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=common + overrides)
    return json.loads((run(cfg) / "metrics.json").read_text())


def budget_methods() -> list[str]:
    """Every method that takes the shared budget_ratio knob (the template's methods included)."""
    from methods import available_methods, method_class

    return [m for m in available_methods()
            if "budget_ratio" in method_class(m).hyperparameter_names()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-ratio", type=float, default=0.2)
    ap.add_argument("--dense-layers", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--dataset", default="wikitext2")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--methods", nargs="*", default=None, help="default: every budget method")
    ap.add_argument("--results-root", default=str(ROOT / "results" / "fairness"))
    args = ap.parse_args()

    dense = "[" + ",".join(str(i) for i in args.dense_layers) + "]"
    common = [f"model={args.model}", "task=perplexity", "task.mode=streaming",
              f"task.dataset={args.dataset}", f"task.max_tokens={args.max_tokens}",
              f"runner.dense_layers={dense}", f"runner.results_root={args.results_root}"]
    from kvcore.errors import ConfigError

    names = args.methods or budget_methods()
    rows = {"full": run_one(common, ["method=full"])}
    refused: dict[str, str] = {}
    for name in names:
        try:
            rows[name] = run_one(common, [f"method={name}",
                                          f"method.budget_ratio={args.budget_ratio}"])
        except ConfigError as exc:  # e.g. a prefill-only compressor on streaming perplexity
            refused[name] = str(exc)
    oracles: dict[float, dict] = {}
    if "oracle_topk" in rows:  # the oracle's own run is the oracle at its density
        oracles[rows["oracle_topk"]["kv"]["attended_fraction_sparse_layers"]] = rows["oracle_topk"]
    for metrics in [m for n, m in rows.items() if n != "full"]:
        f = metrics["kv"]["attended_fraction_sparse_layers"]
        near = [k for k in oracles if abs(k - f) <= MATCH_TOLERANCE / 2]
        if not near:
            oracles[f] = run_one(common, ["method=oracle_topk", f"method.budget_ratio={round(f, 4)}"])

    header = (f"Like-for-like, {args.model}, {args.dataset} first {args.max_tokens} tokens, "
              f"streaming; runner.dense_layers={dense}, prefill=dense, budget_ratio="
              f"{args.budget_ratio}")
    lines = [header, "", "| method | attended (sparse layers) | within ±0.01 | KV held | ppl | "
             "oracle ppl at the same density | oracle ≤ method |", "|---|---|---|---|---|---|---|"]
    for name, metrics in rows.items():
        kv, ppl = metrics["kv"], metrics["accuracy"]["ppl"]
        f = kv.get("attended_fraction_sparse_layers")
        budgeted = name != "full" and "budget_ratio" in metrics["method"].get("axis_keys", [])
        ok = ("yes" if abs(f - args.budget_ratio) <= MATCH_TOLERANCE else "NO") if budgeted else "n/a"
        if name == "full":
            oracle_ppl, better = "", ""
        else:
            key = min(oracles, key=lambda k: abs(k - f))
            oracle_ppl = oracles[key]["accuracy"]["ppl"]
            better = "yes" if oracle_ppl <= ppl else "NO"
            oracle_ppl = f"{oracle_ppl:.3f} (at {key:.4f})"
        lines.append(f"| {name} | {f:.4f} | {ok} | {kv['held_ratio']:.4f} | {ppl:.3f} | "
                     f"{oracle_ppl} | {better} |")
    lines += [f"| {name} | refused before loading: {why} | | | | | |"
              for name, why in refused.items()]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
