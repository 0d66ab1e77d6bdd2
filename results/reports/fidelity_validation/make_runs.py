"""The runs behind the fidelity validation: does per-sample paired fidelity (KL to the full
cache, same top token, gold log-probability; `task.fidelity_tokens`) order settings that
accuracy cannot, at the same n?

Twelve methods that take a budget, at `budget_ratio` 0.5 (the level where the family report's
top ten could not be ordered: the settings nearest the full cache there, and the ones a first
look at fidelity could not order), and the full cache, on SmolLM2-135M with the family protocol (dense
layers 0 and 1, dense prefill, budget basis final), RULER at 1024 tokens, four sub-tasks
(niah_single, niah_multikey, niah_multivalue, vt), 25 samples each (n = 100, the same samples
for every setting), fidelity over the full cache's first 12 answer tokens. The settings are
split in two sweeps (A and B), each with the full cache, run side by side (one process each:
a shard answers only and its merge would compute every fidelity record in one process).

    python results/reports/fidelity_validation/make_runs.py A R &
    python results/reports/fidelity_validation/make_runs.py B R
    python -m harness.report.validation R --top 10 --out results/reports/fidelity_validation

`--samples-per-cell 1` is the pilot (4 samples) that sized the run.

Parts C and D are the rest of the method family on the same samples: every setting of the family
grid (benchmarks/sweep_cost.py's, as the family report runs it: each method at its defaults and,
where it takes a budget, at 0.2 and 0.5) that A and B did not run, alternating between the two,
each with the full cache. A part records each (setting, sample) as it completes: started again
on the same root, it resumes.

    python results/reports/fidelity_validation/make_runs.py C R &
    python results/reports/fidelity_validation/make_runs.py D R
"""
import argparse
import sys
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(PROJECT))
from hydra import compose, initialize_config_dir  # noqa: E402

from harness.sweep.run import run_sweep  # noqa: E402

BUDGET_RATIO = 0.5
# The family report's best settings at 0.5 (oracle_topk, TailorKV, KVzip, HeadKV, RazorAttention)
# and the ones neither accuracy at n = 102 nor a first look at fidelity (n = 7) could order
# (SnapKV, PyramidKV, AdaKV, ExpectedAttention, H2O), with StreamingLLM and KNorm. All 24
# budgeted methods at n = 100 would take about 14,000 CPU-s with fidelity (the pilot: 5.7 CPU-s
# per (setting, sample)); these 12 about 7,000.
METHODS = ["oracle_topk", "tailorkv", "kvzip", "headkv", "razor_attention", "snapkv",
           "pyramidkv", "adakv", "expected_attention", "h2o", "streaming_llm", "knorm"]
FIDELITY_TOKENS = 12


def settings() -> list[tuple[str, list[str]]]:
    """The full cache and METHODS at BUDGET_RATIO."""
    from methods import method_class

    budgeted = [m for m in METHODS if "budget_ratio" in method_class(m).hyperparameter_names()]
    out = [("full", [])] + [(m, [f"method.budget_ratio={BUDGET_RATIO}", *KNOBS.get(m, [])])
                            for m in budgeted]
    return [s for s in out if accepted(*s)]


# ShadowKV compresses only prompts over its official 4096 tokens: at 1K it would never act.
KNOBS = {"shadowkv": ["method.compress_above_tokens=0"]}


def accepted(method: str, knobs: list[str]) -> bool:
    """Whether the setting runs on this model and task (checked as a run checks it, before
    weights); a refused one is named and left out."""
    from harness.session import Session
    from kvcore.errors import ConfigError

    with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides("unused", 1),
                                                       f"method={method}", *knobs])
    try:
        one = Session.of([cfg])
        one.validate(one.settings[0])
    except ConfigError as exc:
        print(f"refused, left out: method={method} {' '.join(knobs)}: {exc}")
        return False
    return True


def family() -> list[tuple[str, list[str]]]:
    """The family grid's settings that `settings()` leaves out: each method at its defaults and
    at budget_ratio 0.2 and 0.5 where it takes one, less METHODS at BUDGET_RATIO (run already,
    a method whose default is BUDGET_RATIO included)."""
    sys.path.insert(0, str(PROJECT / "benchmarks"))
    import sweep_cost
    from methods import build_method

    grid = argparse.Namespace(task="ruler", methods=["all"], budgets=[0.2, 0.5], settings=None,
                              model="smollm2_135m", length=1024, limit=1, threads=1,
                              extra=["runner.dense_layers=[0,1]"])
    out = []
    for method, knobs in sweep_cost.runnable(grid):
        ratios = [float(k.split("=", 1)[1]) for k in knobs if k.startswith("method.budget_ratio=")]
        ratio = ratios[0] if ratios else getattr(build_method(method), "budget_ratio", None)
        if method == "full" or (method in METHODS and ratio == BUDGET_RATIO):
            continue
        out.append((method, [*knobs, *KNOBS.get(method, [])]))
    return [s for s in out if accepted(*s)]


def part(name: str) -> list[tuple[str, list[str]]]:
    """Half of the methods of A+B (the first validation) or C+D (the rest of the family),
    alternating so that both halves mix method kinds, each with the full cache."""
    first = settings()
    methods = first[1:] if name in "AB" else family()
    half = methods[0::2] if name in "AC" else methods[1::2]
    return [first[0], *half]


def overrides(root: str, samples_per_cell: int) -> list[str]:
    return ["model=smollm2_135m", "task=ruler", "task.lengths=[1024]", "task.depths=[50]",
            "task.subtasks=[niah_single,niah_multikey,niah_multivalue,vt]",
            f"task.samples_per_cell={samples_per_cell}", f"task.fidelity_tokens={FIDELITY_TOKENS}",
            "runner.sweep_decode_batch=10", "runner.dense_layers=[0,1]", "runner.threads=1",
            f"runner.results_root={root}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=["A", "B", "C", "D"])
    ap.add_argument("root")
    ap.add_argument("--samples-per-cell", type=int, default=25)
    ap.add_argument("--methods", nargs="+", help="only these of the part's methods (with the "
                    "full cache): a setting run again")
    ap.add_argument("--list", action="store_true", help="print the part's settings, run nothing")
    args = ap.parse_args()
    common = overrides(args.root, args.samples_per_cell)
    chosen = part(args.part)
    if args.methods:
        chosen = [s for s in chosen if s[0] == "full" or s[0] in args.methods]
    if args.list:
        for method, knobs in chosen:
            print(method, *knobs)
        return
    with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
        cfgs = [compose(config_name="config", overrides=[*common, f"method={m}", *knobs])
                for m, knobs in chosen]
    t0 = time.time()
    for outcome in run_sweep(cfgs):
        print(outcome.status, outcome.detail, flush=True)
    print(f"part {args.part}: {len(cfgs)} settings, wall {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
