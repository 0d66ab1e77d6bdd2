"""Streaming-perplexity table across methods and budgets (one run per row, through the runner).

    python benchmarks/perplexity_table.py --preset baselines [--max-tokens 2048] [--dataset essays]
    python benchmarks/perplexity_table.py --preset families --dataset wikitext2 --max-tokens 1024

Each row is a normal harness run (its folder under --results-root); the table is printed as
markdown from the runs' metrics.json files: ppl, KV tokens/bytes held, compression vs the full
cache, and decode ms/token.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PRESETS = {
    "baselines": [
        ["method=full"],
        *[["method=streaming_llm", "method.sink_tokens=4", f"method.window_tokens={w}"]
          for w in (252, 508, 1020)],
        *[["method=streaming_llm", "method.sink_tokens=0", f"method.window_tokens={w + 4}"]
          for w in (252, 508, 1020)],
        *[["method=h2o", f"method.budget_ratio={r}"] for r in (0.1, 0.2, 0.5)],
        ["method=kivi", "method.k_bits=2", "method.v_bits=2"],
        ["method=kivi", "method.k_bits=4", "method.v_bits=4"],
        *[["method=oracle_topk", f"method.budget_ratio={r}"] for r in (0.1, 0.2, 0.5)],
    ],
    # InfiniGen, measured like-for-like: every row runs with the same
    # protocol dense layers (InfiniGen's 0 and 1, `runner.dense_layers=[0,1]`, added by main()),
    # and "@density" rows take the sparse-layer attended fraction measured for InfiniGen's
    # defaults, so the oracle and H2O attend as much as InfiniGen does where it selects.
    "infinigen": [
        ["method=full"],
        *[["method=infinigen", f"method.alpha={a}", "method.budget_ratio=0.2"]
          for a in (4.0, 5.0, 6.0)],
        ["method=infinigen", "method.alpha=5.0", "method.budget_ratio=0.2", "method.skewing=false"],
        ["method=infinigen", "method.alpha=5.0", "method.budget_ratio=0.2",
         "method.column_score=q"],
        ["method=infinigen", "method.alpha=5.0", "method.budget_ratio=0.2",
         "method.group_reduce=prob_mean"],
        ["method=oracle_topk", "method.budget_ratio=0.2"],
        ["method=h2o", "@density"],
        ["method=oracle_topk", "@density"],
    ],
}
PROTOCOL = {"infinigen": ["runner.dense_layers=[0,1]"], "families": ["runner.dense_layers=[0,1]"]}
FAMILY_BUDGETS = (0.2, 0.5)  # budget_ratio of every budgeted method
FAMILY_BITS = (2, 4)  # k_bits = v_bits of the quantizers


REFERENCES = ("method=full", "method=oracle_topk", "method=h2o", "method=infinigen")


def only_methods(rows: list[list[str]], methods: list[str] | None) -> list[list[str]]:
    """The rows of `methods` (and full), or all rows when none are given."""
    if not methods:
        return rows
    return [r for r in rows if r[0] == "method=full" or r[0].removeprefix("method=") in methods]


def select_rows(rows: list[list[str]], methods: list[str] | None) -> list[list[str]]:
    """`only_methods`, the references first, so a table cut short still has what the others
    are read against."""
    return sorted(only_methods(rows, methods),
                  key=lambda r: REFERENCES.index(r[0]) if r[0] in REFERENCES else len(REFERENCES))


def _heads_within(cls, budget_ratio: float) -> list[str]:
    """Full-cache heads alone hold `retrieval_head_ratio` of the cache; where the method's default
    already reaches the budget (DuoAttention's 0.5) the method refuses, so they get half of it."""
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    if "retrieval_head_ratio" not in fields:
        return []
    default = fields["retrieval_head_ratio"]
    default = 0.5 if default is None else default  # null: DuoAttention's official GQA share
    if default < budget_ratio:
        return []
    return [f"method.retrieval_head_ratio={budget_ratio / 2:g}"]


def _short_prompts_compressed(cls) -> list[str]:
    """A method that leaves prompts under an official length threshold dense (ShadowKV: > 4096
    tokens) would sit idle on the family's 512-4096-token texts, and the runner flags an idle run;
    the family rows compress every prompt instead, a deviation the row's label and the method's
    provenance label both show."""
    names = {f.name for f in dataclasses.fields(cls)}
    return ["method.compress_above_tokens=0"] if "compress_above_tokens" in names else []


def family_rows(budgets=FAMILY_BUDGETS, bits=FAMILY_BITS, streamed=True) -> list[list[str]]:
    """Every registered method that compresses, at each budget (or bit width), read from its
    declared knobs: `budget_ratio` when it has one, else `k_bits`/`v_bits`, else its defaults.
    `streamed`: only the methods that can act on a streamed text (prefill-only compressors never
    act there and the runner refuses them; they are measured on needle prompts instead)."""
    from methods import available_methods, method_class

    rows = [["method=full"]]
    for name in available_methods():
        cls = method_class(name)
        caps, knobs = cls.capabilities, cls.hyperparameter_names()
        if not caps.compresses:
            continue
        if streamed and caps.needs_prompt:
            continue
        if "budget_ratio" in knobs:
            rows += [[f"method={name}", f"method.budget_ratio={r}"]
                     + (["method.budget_tokens=null"] if "budget_tokens" in knobs else [])
                     + _heads_within(cls, r) + _short_prompts_compressed(cls) for r in budgets]
        elif "k_bits" in knobs:
            rows += [[f"method={name}", f"method.k_bits={b}", f"method.v_bits={b}"]
                     for b in bits]
        else:
            rows.append([f"method={name}"])
    return rows
DENSITY_SOURCE = "infinigen alpha=5.0 budget_ratio=0.2"


def ppl_overrides(model: str, dataset: str, max_tokens: int, results_root: str,
                  extra=(), prefill_tokens: int | None = None) -> list[str]:
    """The overrides every row shares: streaming perplexity of the first `max_tokens` tokens
    (after a prompt of `prefill_tokens`, if given)."""
    prompt = [] if prefill_tokens is None else [f"task.prefill_tokens={prefill_tokens}"]
    return [f"model={model}", "task=perplexity", "task.mode=streaming", f"task.dataset={dataset}",
            f"task.max_tokens={max_tokens}", *prompt, f"runner.results_root={results_root}",
            *extra]


def existing(cfg, task: str) -> Path | None:
    """The complete run of exactly this config under its runner.results_root
    (runner.skip_existing's rule), or None; a config the method's own knobs refuse raises its
    ConfigError as a run would."""
    from harness.config.runner import split_name
    from harness.config.multirun import config_hash, find_complete
    from methods import build_method

    name, options = split_name("method", cfg.method)
    build_method(name, **options)
    root = Path(cfg.runner.results_root) / task / cfg.model.name / name
    return find_complete(root, config_hash(cfg))


def label(overrides: list[str]) -> str:
    return " ".join(o.replace("method.", "") for o in overrides).replace("method=", "")


def row(metrics: dict, name: str) -> str:
    acc, kv, speed = metrics["accuracy"], metrics["kv"], metrics["speed"]
    tokens = sum(kv["tokens_per_layer"]) / len(kv["tokens_per_layer"])
    fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
    return (f"| {name} | {acc['ppl']:.3f} | {tokens:.0f} | {kv['bytes_total'] / 2**20:.2f} | "
            f"{fmt(kv.get('held_ratio'))} | {fmt(kv.get('attended_fraction_sparse_layers'))} | "
            f"{fmt(kv.get('attended_fraction_all_layers'))} | "
            f"{speed['decode_ms_per_token_median']:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="baselines", choices=sorted(PRESETS) + ["families"])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--dataset", default="essays")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--results-root", default=str(ROOT / "results" / "ppl_table"))
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every run")
    ap.add_argument("--start", type=int, default=0, help="skip the preset's first N rows")
    ap.add_argument("--budgets", type=float, nargs="+", default=list(FAMILY_BUDGETS),
                    help="families: budget_ratio values")
    ap.add_argument("--bits", type=int, nargs="*", default=list(FAMILY_BITS),
                    help="families: k_bits = v_bits values of the quantizers")
    ap.add_argument("--prefill-tokens", type=int, default=None,
                    help="task.prefill_tokens: the first N tokens as one prompt, scored after it "
                         "(families: prompt compressors included)")
    ap.add_argument("--methods", nargs="*", default=None,
                    help="families: only these methods (and full)")
    args = ap.parse_args()

    from hydra import compose, initialize_config_dir

    from harness.run import run
    from kvcore.errors import ConfigError

    prompt = (f" (a prompt of the first {args.prefill_tokens}, the rest streamed and scored)"
              if args.prefill_tokens else "")
    lines = [f"Streaming perplexity, {args.model}, {args.dataset}, first {args.max_tokens} tokens"
             + prompt,
             f"protocol: {' '.join(PROTOCOL.get(args.preset, [])) or 'runner defaults'}",
             "", "| method | ppl | KV tokens/layer (end) | KV MiB (end) | KV held | "
             "attended (sparse layers) | attended (all layers) | decode ms/tok |",
             "|---|---|---|---|---|---|---|---|"]
    densities: dict[str, float] = {}
    rows = (family_rows(args.budgets, args.bits, streamed=args.prefill_tokens is None)
            if args.preset == "families" else PRESETS[args.preset])
    if args.preset == "families":  # the presets' rows depend on each other (@density)
        rows = only_methods(rows, args.methods)
    for overrides in rows[args.start:]:
        if "@density" in overrides:  # InfiniGen's measured attended fraction in sparse layers
            ratio = round(densities[DENSITY_SOURCE], 4)
            overrides = [o for o in overrides if o != "@density"] + [f"method.budget_ratio={ratio}"]
        common = ppl_overrides(args.model, args.dataset, args.max_tokens, args.results_root,
                               [*PROTOCOL.get(args.preset, []), *args.extra], args.prefill_tokens)
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=common + overrides)
        try:
            folder = run(cfg)
        except ConfigError as refusal:  # e.g. a budget a method's own knobs cannot meet
            lines.append(f"| {label(overrides)} | refused before loading: {refusal} |||||||")
            print(lines[-1], flush=True)
            continue
        metrics = json.loads((folder / "metrics.json").read_text())
        densities[label(overrides)] = metrics["kv"].get("attended_fraction_sparse_layers") or 1.0
        lines.append(row(metrics, label(overrides)))
        print("\n".join(lines), flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
