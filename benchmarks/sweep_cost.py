"""What the sweep engine saves: the same settings x samples through the old path (one run per
setting, each loading the model, building the task and prefilling every prompt) and through the
sweep engine (harness.sweep.run: all of that once, each prompt's dense forward run once and
replayed into every setting's layers), alternated in one process, CPU-seconds per (setting,
sample) and their ratio. The `fidelity` arm adds paired fidelity (task.fidelity_tokens) to the
batched one: what it costs per (setting, sample).

    python benchmarks/sweep_cost.py [--model smollm2_135m] [--length 1024] [--limit 3]
        [--methods snapkv tova knorm] [--budgets 0.2 0.5] [--rounds 1] [--threads 1]
        [--decode-batch 6] [--arms old sweep batched]
    python benchmarks/sweep_cost.py --task perplexity --dataset wikitext2 --length 512 ...

`--task perplexity`: streaming perplexity over the first --length + 1 tokens of the text (one
stream, --length tokens scored); the sweep engine steps the settings in lockstep (`batched`:
--decode-batch settings a forward), and "equal" means every setting's per-token NLL within 1e-4
relative of the old path's (the batched matmuls reassociate).

The old path here runs in this process (`harness.run.run` per setting), so it does not pay a
new Python process and its imports per setting as `runner.sweep_engine=false` does: the ratio
is a lower bound of the saving. Both paths write real result folders (under a temporary root);
their predictions are compared (they must be equal). At the end: where the sweep's time goes
(model load and task, shared prefills, decode steps, the rest: compression at each prompt's end,
scoring each setting's answers, writing results).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def configs(args, root: Path, decode_batch: int = 1, fidelity_tokens: int = 0) -> list:
    from hydra import compose, initialize_config_dir

    task = (["task=ruler", f"task.lengths=[{args.length}]", "task.depths=[50]",
             f"task.limit={args.limit}"] if args.task == "ruler" else
            ["task=perplexity", f"task.dataset={args.dataset}", "task.mode=streaming",
             f"task.max_tokens={args.length + 1}"])
    common = [f"model={args.model}", *task, f"runner.threads={args.threads}",
              f"runner.results_root={root}"]
    if decode_batch > 1:
        common.append(f"runner.sweep_decode_batch={decode_batch}")
    if fidelity_tokens:
        common.append(f"task.fidelity_tokens={fidelity_tokens}")
    common += args.extra
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return [compose(config_name="config", overrides=[*common, f"method={m}", *knobs])
                for m, knobs in settings(args)]


def runnable(args) -> list[tuple[str, list[str]]]:
    """The settings this model and task accept (checked as a run checks them, before weights);
    each refused one is named once."""
    from harness import session
    from kvcore.errors import ConfigError

    with tempfile.TemporaryDirectory() as tmp:
        cfgs = configs(args, Path(tmp))
    kept = []
    for (method, knobs), cfg in zip(settings(args), cfgs):
        try:
            one = session.Session.of([cfg])
            one.validate(one.settings[0])
        except ConfigError as exc:
            print(f"refused, left out: method={method} {' '.join(knobs)}: {exc}")
            continue
        kept.append((method, knobs))
    return kept


def settings(args) -> list[tuple[str, list[str]]]:
    """(method, knob overrides): each method at its defaults (its operating point) and, where it
    has a `budget_ratio` knob, at every other budget of --budgets; `--methods all`: every
    method. Once `runnable` has run, the settings it kept."""
    from methods import available_methods, build_method, method_class

    if args.settings is not None:
        return args.settings
    names = available_methods() if args.methods == ["all"] else args.methods
    out = []
    for name in names:
        out.append((name, []))
        if "budget_ratio" in method_class(name).hyperparameter_names():
            default = build_method(name).budget_ratio
            out += [(name, [f"method.budget_ratio={b}"]) for b in args.budgets if b != default]
    return out


def old_path(cfgs) -> list[Path]:
    from harness.run import run

    return [run(cfg) for cfg in cfgs]


def sweep_path(cfgs) -> list[Path]:
    from harness.sweep.run import run_sweep

    outcomes = run_sweep(cfgs)
    bad = [o.detail for o in outcomes if o.status != "ok"]
    if bad:
        raise SystemExit(f"sweep member not ok: {bad[0]}")
    return [o.folder for o in outcomes]


def predictions(folders: list[Path]) -> list[list]:
    """Per setting, per sample: its prediction, or (perplexity) its per-token NLL."""
    rows = [[json.loads(line) for line in (f / "samples.jsonl").read_text().splitlines()]
            for f in folders]
    return [[r.get("prediction", r.get("token_nll")) for r in setting] for setting in rows]


def agree(a: list[list], b: list[list]) -> bool:
    """Equal predictions; per-token NLLs within 1e-4 relative (and absolute)."""
    import math

    def same(x, y):
        if isinstance(x, list) and x and isinstance(x[0], float):
            return len(x) == len(y) and all(math.isclose(u, v, rel_tol=1e-4, abs_tol=1e-4)
                                            for u, v in zip(x, y))
        return x == y
    return len(a) == len(b) and all(len(p) == len(q) and all(map(same, p, q))
                                    for p, q in zip(a, b))


def breakdown(folders: list[Path]) -> dict[str, float]:
    """Seconds of the sweep spent in shared prefills and in decode steps (from metrics.json)."""
    prefill = decode = 0.0
    for f in folders:
        m = json.loads((f / "metrics.json").read_text())
        sharing = 1 + m["run"]["sweep"]["prefill_shared_with"]
        prefill += m["speed"]["prefill_ms_total"] / sharing / 1e3  # each member reports it
        tps = m["speed"]["decode_tokens_per_s"]
        decode += m["speed"]["decode_tokens"] / tps if tps else 0.0
    return {"prefill_s": prefill, "decode_s": decode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--task", choices=["ruler", "perplexity"], default="ruler")
    ap.add_argument("--dataset", default="wikitext2", help="perplexity: the text")
    ap.add_argument("--length", type=int, default=1024, help="RULER length, or perplexity's "
                    "scored tokens")
    ap.add_argument("--limit", type=int, default=3, help="samples: RULER's sub-tasks in order "
                    "(niah_single at depth 50, niah_multikey, ...)")
    ap.add_argument("--methods", nargs="+", default=["snapkv", "tova", "knorm"],
                    help="methods (all: every method), each at its defaults and, with a "
                    "budget_ratio knob, at each other budget of --budgets")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.2, 0.5])
    ap.add_argument("--rounds", type=int, default=1, help="old/sweep pairs, alternated")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every setting, "
                    "e.g. runner.dense_layers=[0,1] task.max_new_tokens=16 (the family protocol)")
    ap.add_argument("--decode-batch", type=int, default=6, help="runner.sweep_decode_batch of "
                    "the `batched` arm (settings decoded together)")
    ap.add_argument("--old-every", type=int, default=1, help="the old path runs every K-th "
                    "setting only (all samples), its cost per (setting, sample) taken from "
                    "those: a family of settings whose old path alone would outlast the session")
    ap.add_argument("--arms", nargs="+", default=["old", "sweep", "batched"],
                    choices=["old", "sweep", "batched", "fidelity"], help="what runs, "
                    "alternated in this order each round: one run per setting, the sweep engine "
                    "decoding one setting at a time, --decode-batch at a time, and that with "
                    "paired fidelity (task.fidelity_tokens=--fidelity-tokens)")
    ap.add_argument("--fidelity-tokens", type=int, default=12, help="K of the fidelity arm")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    args.settings = None
    if args.task == "perplexity":
        args.limit = 1  # one stream
    args.settings = runnable(args)
    n_settings = len(args.settings)
    every = {"old": (old_path, 1, 0), "sweep": (sweep_path, 1, 0),
             "batched": (sweep_path, args.decode_batch, 0),
             "fidelity": (sweep_path, args.decode_batch, args.fidelity_tokens)}
    arms = [(name, *every[name]) for name in args.arms]
    cost = {path: [] for path, *_ in arms}
    last = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for path, fn, decode_batch, fidelity_tokens in arms:
                cfgs = configs(args, Path(tmp) / f"{path}{r}", decode_batch, fidelity_tokens)
                if path == "old":
                    cfgs = cfgs[::args.old_every]
                t0, c0 = time.perf_counter(), time.process_time()
                folders = fn(cfgs)
                cpu, wall = time.process_time() - c0, time.perf_counter() - t0
                cost[path].append((cpu, wall))
                last[path] = folders
                print(f"round {r} {path:7s}: {cpu:.1f} CPU-s, {wall:.1f} s wall", flush=True)
        def answers(path):  # the settings every arm ran
            return predictions(last[path][::args.old_every] if path != "old" else last[path])
        first = next(iter(last))
        same = all(agree(answers(first), answers(path)) for path in last)
        for path in last:  # where they differ: the setting and the sample
            for folder, p, q in zip(last[path][::args.old_every] if path != "old"
                                    else last[path], answers(first), answers(path)):
                for i, (x, y) in enumerate(zip(p, q)):
                    if not agree([[x]], [[y]]):
                        print(f"  differs: {path} vs {first}: {folder.parent.name} sample {i}: "
                              f"{str(y)[:60]!r} vs {str(x)[:60]!r}")
        # settings decoded together each report the batched step's time: no breakdown there
        swept = "sweep" if "sweep" in last else None
        parts = breakdown(last[swept]) if swept else None
    cells = {path: (len(range(0, n_settings, args.old_every)) if path == "old" else n_settings)
             * args.limit for path in cost}
    cpu = {path: statistics.median(c for c, _ in runs) / cells[path]
           for path, runs in cost.items()}
    subset = (f"; the old path on every {args.old_every}th setting, "
              f"{cells['old'] // args.limit} of them" if args.old_every > 1 and "old" in cost
              else "")
    what = (f"RULER {args.length}" if args.task == "ruler" else
            f"streaming perplexity, {args.dataset}, {args.length} scored tokens")
    print(f"\n{n_settings} settings x {args.limit} samples ({what}, {args.model}, "
          f"{args.threads} thread(s), {args.rounds} round(s){subset}; predictions of every arm "
          f"equal: {same})")
    labels = {"old": "old path", "sweep": "sweep engine",
              "batched": f"sweep engine, {args.decode_batch} settings decoded together",
              "fidelity": f"the same with fidelity (K = {args.fidelity_tokens})"}
    for path in cost:
        ratio = (f", {cpu['old'] / cpu[path]:.2f}x the old path"
                 if "old" in cpu and path != "old" else "")
        if path == "fidelity" and "batched" in cpu:
            ratio += f", +{cpu[path] - cpu['batched']:.2f} over the same without"
        print(f"  {labels[path]}: {cpu[path]:.2f} CPU-s per (setting, sample){ratio}")
    if parts:
        wall = statistics.median(w for _, w in cost[swept])
        rest = wall - parts["prefill_s"] - parts["decode_s"]
        print(f"  {labels[swept]}: wall {wall:.1f} s: prefills {parts['prefill_s']:.1f} s "
              f"(recorded forwards and replays), decode steps {parts['decode_s']:.1f} s, the "
              f"rest {rest:.1f} s (model load, samples, compression at each prompt's end, "
              "scoring, writing)")

if __name__ == "__main__":
    main()
