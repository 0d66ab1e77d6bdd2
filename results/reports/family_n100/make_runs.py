"""The runs behind the method-family report at n >= 100 per setting: every method of the harness
on SmolLM2-135M at its defaults (its authors' operating point) and, where it takes a budget, at
budget_ratio 0.2 and 0.5 (the settings benchmarks/sweep_cost.py times, refused ones named and
left out), on the family protocol (dense layers 0 and 1, dense prefill, budget basis final),
one sweep per task so that every setting is scored on the same samples; the full cache once
more with eager attention (the noise floor of harness.report).

    python results/reports/family_n100/make_runs.py ruler1k R --shard 0/2   # and 1/2, side by side
    python results/reports/family_n100/make_runs.py ruler1k R --merge 2     # then
    python -m harness.report R/... --out <folder>

niah4k: RULER's niah_single at 4096 tokens, needle at depths 10/50/90 %, 4 samples each (n = 12),
the methods that take a budget (ShadowKV compressing every prompt) and the full cache.
ppl_wikitext2, ppl_essays: streaming perplexity over the first 4097 tokens of the text (4096
scored), every token a decode step of the method, the settings stepped 32 at a time in
lockstep; the methods that only compress a prefilled prompt are refused (named) by the task.
One stream per text: these sweeps cannot be sharded, run them side by side.
ruler1k: RULER's six sub-tasks at 1024 tokens, 17 samples each (n = 102; niah_single at depth
50 %), RULER's own generation lengths, query-aware, settings decoded 10 at a time. A shard
records each (setting, sample) answer as it completes: started again, it resumes.
"""
import argparse
import sys
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(PROJECT))
sys.path.insert(0, str(PROJECT / "benchmarks"))
from hydra import compose, initialize_config_dir  # noqa: E402

from harness.sweep.run import run_sweep  # noqa: E402
from harness.sweep.shards import Shard  # noqa: E402

TASKS = {
    "ruler1k": ["task=ruler", "task.lengths=[1024]", "task.depths=[50]",
                "task.samples_per_cell=17", "runner.sweep_decode_batch=10"],
    "niah4k": ["task=ruler", "task.subtasks=[niah_single]", "task.lengths=[4096]",
               "task.depths=[10,50,90]", "task.samples_per_cell=4",
               "runner.sweep_decode_batch=10"],
    # niah4k's first 6 samples (2 per depth): the same prompts as its shard 0 of 2
    "niah4k_n6": ["task=ruler", "task.subtasks=[niah_single]", "task.lengths=[4096]",
                  "task.depths=[10,50,90]", "task.samples_per_cell=2",
                  "runner.sweep_decode_batch=10"],
    # 4097 tokens: 4096 scored, each streamed through the method as a decode step
    **{f"ppl_{data}": ["task=perplexity", f"task.dataset={data}", "task.mode=streaming",
                       "task.max_tokens=4097", "runner.sweep_decode_batch=32"]
       for data in ("wikitext2", "essays")},
}
# At 4K only the methods that take a budget, and the full cache they are compared with.
BUDGETED_ONLY = {"niah4k", "niah4k_n6"}
# ShadowKV compresses only prompts over its official 4096 tokens, so a 4K RULER prompt (4096
# tokens less the answer's) would leave it inactive: at 4K it compresses every prompt.
KNOBS_AT = {task: {"shadowkv": ["method.compress_above_tokens=0"]}
            for task in ("niah4k", "niah4k_n6")}


# The noise floor: the full cache again through the other attention path, on the same samples
# (a sweep of its own: a sweep loads the model with one attention implementation).
NOISE_FLOOR = ("full", ["runner.attn_impl=eager"])


def family_settings(task: str) -> list[tuple[str, list[str]]]:
    import sweep_cost
    from methods import method_class

    args = argparse.Namespace(task="ruler", methods=["all"], budgets=[0.2, 0.5], settings=None,
                              model="smollm2_135m", length=1024, limit=1, threads=1,
                              extra=["runner.dense_layers=[0,1]"])
    kept = sweep_cost.runnable(args)
    if task in BUDGETED_ONLY:
        kept = [(m, knobs) for m, knobs in kept if m == "full"
                or "budget_ratio" in method_class(m).hyperparameter_names()]
    extra = KNOBS_AT.get(task, {})
    kept = [(m, [*knobs, *extra.get(m, [])]) for m, knobs in kept]
    return [s for s in kept if accepted(task, *s)]


def accepted(task: str, method: str, knobs: list[str]) -> bool:
    """Whether the task takes the setting (checked as a run checks it, before weights): a
    method that only compresses a prefilled prompt is refused by streaming perplexity."""
    from harness.session import Session
    from kvcore.errors import ConfigError

    with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*common_overrides(task, "unused"),
                                                       f"method={method}", *knobs])
    try:
        one = Session.of([cfg])
        one.validate(one.settings[0])
    except ConfigError as exc:
        print(f"refused by {task}, left out: method={method} {' '.join(knobs)}: {exc}")
        return False
    return True


def common_overrides(task: str, root: str) -> list[str]:
    return ["model=smollm2_135m", *TASKS[task], "runner.dense_layers=[0,1]", "runner.threads=1",
            f"runner.results_root={root}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("task", choices=sorted(TASKS))
    ap.add_argument("root")
    ap.add_argument("--shard", help="i/n: answer and record shard i of n")
    ap.add_argument("--merge", type=int, default=0, help="n: write every setting's result "
                    "from the records of its n shards")
    ap.add_argument("--part", choices=["family", "floor"], action="append",
                    help="only these sweeps (default both: the family, then the noise floor)")
    ap.add_argument("--methods", nargs="+", help="the family's settings of only these methods "
                    "(with the full cache): settings run again")
    args = ap.parse_args()
    common = common_overrides(args.task, args.root)
    parts = args.part or ["family", "floor"]
    settings_per_sweep = [family_settings(args.task) if part == "family" else [NOISE_FLOOR]
                          for part in parts]
    if args.methods:
        settings_per_sweep = [[s for s in settings if s[0] == "full" or s[0] in args.methods]
                              for settings in settings_per_sweep]
    with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
        sweeps = [[compose(config_name="config", overrides=[*common, f"method={m}", *knobs])
                   for m, knobs in settings] for settings in settings_per_sweep]
    shard = None
    if args.shard:
        index, count = (int(x) for x in args.shard.split("/"))
        shard = Shard(index, count)
    t0 = time.time()
    for cfgs in sweeps:
        for outcome in run_sweep(cfgs, shard=shard, merge=args.merge):
            print(outcome.status, outcome.detail)
    print(f"{sum(map(len, sweeps))} settings, wall {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
