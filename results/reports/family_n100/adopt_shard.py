"""Take one shard's records of a sweep as the whole of a smaller sweep over the same first
prompts: the records of `make_runs.py SRC R --shard i/n` (every setting, the noise floor too)
become those of `make_runs.py DST R --shard 0/1`, so that `make_runs.py DST R --merge 1` writes
every setting's folder. Nothing is recomputed or edited: each record names its prompt by the
hash of its tokens, and the merge stops with one line at the first sample whose prompt differs
or has no record. Used when a run is cut short: niah4k's shard 0 of 2 (its first 6 samples)
as niah4k_n6.

    python results/reports/family_n100/adopt_shard.py niah4k 0/2 niah4k_n6 R [--part family]
"""
import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_runs  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from harness.session import Session  # noqa: E402
from harness.sweep.records import record_path  # noqa: E402
from harness.sweep.shards import Shard  # noqa: E402


def identities(task: str, root: str, parts: list[str]) -> list[tuple[str, str, dict]]:
    """(label, identity, runner) of every setting of the task's sweeps (`parts`), in order."""
    settings = [*(make_runs.family_settings(task) if "family" in parts else []),
                *([make_runs.NOISE_FLOOR] if "floor" in parts else [])]
    with initialize_config_dir(config_dir=str(make_runs.PROJECT / "conf"), version_base="1.3"):
        cfgs = [compose(config_name="config", overrides=[*make_runs.common_overrides(task, root),
                                                         f"method={m}", *knobs])
                for m, knobs in settings]
    out = []
    for cfg in cfgs:
        one = Session.of([cfg]).settings[0]
        out.append((one.label, one.identity, one.runner))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("shard", help="i/n: the source shard")
    ap.add_argument("dst")
    ap.add_argument("root")
    ap.add_argument("--part", choices=["family", "floor"], action="append",
                    help="only these sweeps' records (default both, as make_runs.py)")
    args = ap.parse_args()
    parts = args.part or ["family", "floor"]
    index, count = (int(x) for x in args.shard.split("/"))
    src, dst = identities(args.src, args.root, parts), identities(args.dst, args.root, parts)
    if [label for label, _, _ in src] != [label for label, _, _ in dst]:
        raise SystemExit(f"{args.src} and {args.dst} differ in their settings")
    for (label, a, runner), (_, b, _) in zip(src, dst):
        source = record_path(runner, a, Shard(index, count))
        target = record_path(runner, b, Shard(0, 1))
        if target.exists():
            raise SystemExit(f"{target} exists: not overwritten")
        if not source.exists():
            raise SystemExit(f"{label}: no records at {source}")
        shutil.copyfile(source, target)
        print(f"{label}: {source.name} -> {target.name}")


if __name__ == "__main__":
    main()
