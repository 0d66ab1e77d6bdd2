"""One summary of scripts/gpu_check.sh's parts: gpu_summary.json and gpu_table.md.

    python scripts/gpu_summary.py PARTS_DIR OUT_DIR --expect throughput_8b:8192,32768:1,8 \\
        --expect throughput_1b:8192:1,8 --expect kernels:8192,32768:1,8 [--dry-run]

PARTS_DIR holds what the steps wrote: gpu_tests.xml (pytest junit), kernels.json
(benchmarks/kernel_bandwidth.py) and throughput_*.json (benchmarks/throughput.py, rewritten after
every cell, so a part killed by its timeout still counts what it measured). A part that is
absent (or unreadable) is recorded as null; every expected goal cell is listed, with a null value
and a note (missing / skipped / out of memory) when it was not measured. Both files are written
atomically (harness.store.results).

Goals (`goals`: name -> {value, min, met, note}):
  * `<part> <context> B=<b> infinigen/full_offload decode`: InfiniGen >= 2x full_offload decode
    tok/s at >= 8K context (same batch, same run);
  * `<part> <context> B=<b> kivi2/full decode`: KIVI-2 vs full decode tok/s (reported: no bound);
  * `kernels <kernel> B=<b> T=<t> share of peak`: achieved / nominal bandwidth >= 0.7 (sparse,
    kivi); KVQuant's fused kernel at B=1 is reported without a bound;
  * `gpu tests`: the CUDA-marked tests ran (none skipped) and passed.
`not_cuda` lists parts measured on anything but CUDA (a real run must have none; `--dry-run`
marks a CPU rehearsal, whose numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.store.results import write_json_atomic, write_text_atomic  # noqa: E402

THROUGHPUT_GOALS = (  # (method, baseline, label, minimum ratio or None: reported only)
    ("infinigen", "full_offload", "infinigen/full_offload decode", 2.0),
    ("kivi", "full", "kivi2/full decode", None),
)
KERNELS = ("sparse", "kivi", "ragged")
REPORTED_KERNELS = ("kvquant",)  # batch 1 only (one sequence per call); reported, no bound
KERNEL_GOAL = 0.7


def load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def load_tests(path: Path) -> dict | None:
    """Counts from a pytest junit xml (all its test suites), and the failing tests' names."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {k: sum(int(s.get(k, 0)) for s in suites)
              for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["failed_names"] = [f"{case.get('classname')}::{case.get('name')}"
                              for case in root.iter("testcase")
                              if case.find("failure") is not None or case.find("error") is not None]
    return counts


def parse_expect(items: list[str]) -> dict[str, tuple[list[int], list[int]]]:
    """`PART:CONTEXTS:BATCHES` (comma-separated) -> {part: (contexts, batches)}."""
    plan = {}
    for item in items:
        part, contexts, batches = item.split(":")
        plan[part] = ([int(x) for x in contexts.split(",")], [int(x) for x in batches.split(",")])
    return plan


def goal(value: float | None, minimum: float | None, note: str | None = None) -> dict:
    met = None if value is None or minimum is None else value >= minimum
    return {"value": None if value is None else round(value, 3), "min": minimum, "met": met,
            "note": note}


def why_missing(run: dict | None, ctx: int, b: int, methods: tuple[str, ...]) -> str:
    if run is None:
        return "part missing (step failed or timed out before its first cell)"
    for key, label in (("failed", "out of memory"), ("skipped", "skipped")):
        for m in methods:
            reason = ((run.get(key) or {}).get(str(ctx)) or {}).get(m, {}).get(str(b))
            if reason is not None:
                return f"{m}: {label} ({reason})" if key == "failed" else f"{m}: {label}"
    if not run.get("finished"):
        return "not reached (the step ended before this cell: timeout or crash)"
    return "not measured"


def throughput_goals(key: str, run: dict | None, planned: list[int], batches: list[int]) -> dict:
    goals = {}
    contexts = (run or {}).get("contexts") or {}
    cells_at = lambda ctx: (contexts.get(str(ctx)) or {}).get("cells", {})
    for ctx in planned:
        cells = cells_at(ctx)
        for b in batches:
            for method, base, label, minimum in THROUGHPUT_GOALS:
                got, ref = cells.get(method, {}).get(str(b)), cells.get(base, {}).get(str(b))
                name = f"{key} {ctx} B={b} {label}"
                if got and ref and ref["decode_tokens_per_s"]:
                    goals[name] = goal(got["decode_tokens_per_s"] / ref["decode_tokens_per_s"],
                                       minimum)
                else:
                    goals[name] = goal(None, minimum, why_missing(run, ctx, b, (method, base)))
    return goals


def kernel_goals(run: dict | None, contexts: list[int], batches: list[int]) -> dict:
    rows = {(r["kernel"], r["context"], r["batch"]): r for r in (run or {}).get("rows", [])}
    goals = {}
    for t in contexts:
        for b in batches:
            for kernel in KERNELS:
                row = rows.get((kernel, t, b))
                name = f"kernels {kernel} B={b} T={t} share of peak"
                note = None if row else ("part missing" if run is None else "not reached")
                goals[name] = goal(row["share_of_peak"] if row else None, KERNEL_GOAL, note)
        for kernel in REPORTED_KERNELS:
            row = rows.get((kernel, t, 1))
            note = None if row else ("part missing" if run is None else "not reached")
            goals[f"kernels {kernel} B=1 T={t} share of peak"] = goal(
                row["share_of_peak"] if row else None, None, note)
    return goals


def table_lines(summary: dict, parts: list[str]) -> list[str]:
    fmt = lambda v, spec=".2f": "-" if v is None else format(v, spec)
    lines = ["| model | context | batch | method | decode tok/s | x full_offload | x full | "
             "transfer ms/step | exposed ms/step |", "|" + "---|" * 9]
    for key in parts:
        run = summary.get(key)
        for ctx, part in ((run or {}).get("contexts") or {}).items():
            cells = part["cells"]
            for method, per_batch in cells.items():
                for b, c in per_batch.items():
                    tps = c["decode_tokens_per_s"]
                    off, full = cells.get("full_offload", {}).get(b), cells.get("full", {}).get(b)
                    x_off = tps / off["decode_tokens_per_s"] if off else None
                    x_full = tps / full["decode_tokens_per_s"] if full else None
                    lines.append(f"| {run['model']} | {ctx}{'' if part.get('complete') else '*'} "
                                 f"| {b} | {method} | {tps:.1f} | {fmt(x_off)} | {fmt(x_full)} | "
                                 f"{c['transfer_ms_per_step']:.2f} | "
                                 f"{c['exposed_ms_per_step']:.2f} |")
    return lines


def goal_lines(goals: dict) -> list[str]:
    lines = []
    for name, g in goals.items():
        bound = "" if g["min"] is None else f" (goal >= {g['min']:g}: " + (
            "met" if g["met"] else "NOT met" if g["met"] is False else "unknown") + ")"
        note = f" [{g['note']}]" if g["note"] else ""
        lines.append(f"goal {name}: {'null' if g['value'] is None else g['value']}{bound}{note}")
    return lines


def summarize(parts_dir: Path, plan: dict[str, tuple[list[int], list[int]]],
              dry_run: bool = False) -> dict:
    throughput_keys = [k for k in plan if k.startswith("throughput")]  # in --expect order
    summary: dict = {"dry_run": dry_run, "gpu_tests": load_tests(parts_dir / "gpu_tests.xml"),
                     "kernels": load_json(parts_dir / "kernels.json")}
    for key in throughput_keys:
        summary[key] = load_json(parts_dir / f"{key}.json")
    goals: dict = {}
    tests = summary["gpu_tests"]
    if tests is None:
        goals["gpu tests"] = goal(None, None, "no junit xml (pytest did not finish)")
    else:
        ok = tests["tests"] > 0 and tests["skipped"] == 0 and tests["passed"] == tests["tests"]
        goals["gpu tests"] = {"value": f"{tests['passed']}/{tests['tests']} passed, "
                                       f"{tests['skipped']} skipped", "min": None, "met": ok,
                              "note": None if ok else "failures, errors or skips (see gpu_log)"}
    for key in throughput_keys:
        goals.update(throughput_goals(key, summary[key], *plan[key]))
    if "kernels" in plan:
        goals.update(kernel_goals(summary["kernels"], *plan["kernels"]))
    summary["goals"] = goals
    summary["not_cuda"] = list(
        key for key in throughput_keys if summary[key] is not None
        and not str(summary[key].get("device", "")).startswith("cuda"))
    if summary["kernels"] is not None and summary["kernels"].get("dry_run", True):
        summary["not_cuda"].append("kernels")  # timed on the CPU (--dry-run), or unmarked
    return summary


def write(summary: dict, out_dir: Path) -> list[str]:
    parts = [k for k in summary if k.startswith("throughput")]
    lines = table_lines(summary, parts)
    text = lines + ["", "(* context not complete: the step ended before all its batch sizes)", ""]
    text += goal_lines(summary["goals"])
    if summary["dry_run"]:
        text.insert(0, "DRY RUN (CPU rehearsal, tiny model): these numbers mean nothing\n")
    elif summary["not_cuda"]:
        text.insert(0, f"NOT CUDA: {', '.join(summary['not_cuda'])} ran elsewhere\n")
    write_text_atomic(out_dir / "gpu_table.md", "\n".join(text) + "\n")
    write_json_atomic(out_dir / "gpu_summary.json", summary)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--expect", action="append", default=[], metavar="PART:CONTEXTS:BATCHES")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    summary = summarize(args.parts_dir, parse_expect(args.expect), args.dry_run)
    print("\n".join(write(summary, args.out_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
