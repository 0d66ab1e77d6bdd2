"""Collect runs into one table and draw the trade-off plots.

    python -m harness.report <results dir or glob> [<more> ...] [--out DIR]

Reads only `metrics.json` files (a run *is* its folder), each checked against the schema
(harness/schema.py): a corrupt or foreign file is skipped with a warning naming it, the rest are
reported. Hidden folders (staging of unfinished runs) are never read. Writes `report.md`,
`report.csv` and PNG plots into --out (default `<first dir>/_report`; a new folder, or one holding
only an earlier report):
  * accuracy_vs_kv_held.png   task metric vs KV held (bytes on every tier / full cache), per variant
  * accuracy_vs_attended.png  task metric vs attended fraction (sparse layers, decode steps)
  * decode_ms_vs_context.png  decode ms/token vs context length, per method
  * nll_curve.png             streaming NLL per block over tokens, per run
  * bytes_per_step.png        host->device bytes per decode step, per run
  * ruler_heatmap.png         RULER single-needle accuracy, depth x length (when present)
  * throughput_vs_batch.png   decode tokens/s (all sequences) vs runner.batch_size, per variant
  * capacity.png              sequences whose compute-device KV fits in 1 GiB vs context, per
                              variant (from the KV each sequence held: kv.bytes_device_total)
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import sys
from pathlib import Path
from typing import Any

from harness.results import check_writable, write_text_atomic
from harness.schema import SchemaError, load
from kvcore.errors import ConfigError

COLUMNS = ["run", "model", "method", "budget", "protocol", "batch", "task", "metric", "value",
           "active",
           "kv_held", "attended_fraction", "paper_relative_kv_size", "decode_tok_s", "decode_ms",
           "kv_bytes", "bytes_per_step"]
# The two axes, both defined once in harness.accounting and computed the same way for every run.
AXES = {"kv_held": ("accuracy_vs_kv_held.png",
                    "KV held (bytes on every tier / full cache in the model dtype)"),
        "attended_fraction": ("accuracy_vs_attended.png",
                              "attended fraction (sparse layers, decode steps)")}
# Main metric per task, and whether higher is better (the first scalar found is used otherwise).
MAIN_METRIC = {"perplexity": ("ppl", False), "longbench": ("average", True),
               "ruler": ("average", True), "xsum": ("rougeL", True),
               "multiturn": ("accuracy", True), "lm_eval": ("acc_mean", True)}


PLOT_NAMES = ("accuracy_vs_kv_held.png", "accuracy_vs_attended.png", "decode_ms_vs_context.png",
              "nll_curve.png", "bytes_per_step.png", "ruler_heatmap.png",
              "throughput_vs_batch.png", "capacity.png")
GIB = 2**30
REPORT_NAMES = frozenset({"report.md", "report.csv", *PLOT_NAMES})


def find_runs(patterns: list[str]) -> list[Path]:
    """metrics.json files under folders, globs or files; ConfigError when a path matches nothing.
    Folders whose name starts with "." (a run being written, kept aside) are left out."""
    files: set[Path] = set()
    for pattern in patterns:
        path = Path(pattern)
        if path.is_dir():
            candidates = [(path, f) for f in path.rglob("metrics.json")]
        else:
            matched = [Path(p) for p in glob.glob(pattern, recursive=True)]
            if not matched:
                raise ConfigError(f"{pattern}: no such file or folder")
            candidates = [(p if p.is_dir() else p.parent, p / "metrics.json" if p.is_dir() else p)
                          for p in matched]
        for root, f in candidates:
            inside = f.parent.relative_to(root).parts if f.parent != root else ()
            if f.name == "metrics.json" and f.is_file() and not any(
                    part.startswith(".") for part in inside):
                files.add(f)
    return sorted(files)


def _knobs(method: dict[str, Any], group: str) -> str:
    """The method's own declaration (metrics.json method.axis_keys / variant_keys) of which knobs
    move it along an axis and which name a variant: the report names no method's knobs."""
    hyper = method.get("hyperparameters", {})
    return " ".join(f"{k}={hyper[k]}" for k in method.get(group, []) if hyper.get(k) is not None)


def load_runs(files: list[Path], warn=None) -> list[tuple[Path, dict]]:
    """(path, metrics) of every file that follows the schema; the others are named in a warning."""
    warn = warn or (lambda text: print(text, file=sys.stderr))
    runs = []
    for f in files:
        try:
            runs.append((f, load(f)))
        except SchemaError as exc:
            warn(f"warning: skipped {exc}")
    return runs



def protocol_label(metrics: dict) -> str:
    proto = metrics.get("protocol", {})
    dense = proto.get("dense_layers")
    label = f"dense={dense if dense else '[]'} prefill={proto.get('prefill', '?')}"
    # A task's own protocol variant (RULER's query mode, perplexity after a prompt); RULER runs
    # written before `variant` existed carry only the query description ("query-aware: ...").
    variant = proto.get("variant") or (proto.get("query") or "").split(":")[0]
    return f"{label} {variant}" if variant else label


def series_label(metrics: dict) -> str:
    """One curve per method variant and protocol: points of different protocols never join."""
    method = metrics["method"]
    return f"{method['name']} {_knobs(method, 'variant_keys')} [{protocol_label(metrics)}]".replace(
        "  ", " ")


def main_metric(metrics: dict) -> tuple[str, float | None]:
    acc = metrics.get("accuracy", {})
    key, _ = MAIN_METRIC.get(metrics["task"]["name"], (None, True))
    if key in acc and isinstance(acc[key], (int, float)):
        return key, float(acc[key])
    for k, v in acc.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return k, float(v)
    return "", None


def kv_held(kv: dict) -> float | None:
    if kv.get("held_ratio") is not None:
        return kv["held_ratio"]
    return 1 / kv["compression_ratio"] if kv.get("compression_ratio") else None  # same definition


def model_label(metrics: dict) -> str:
    """The model's name, with its dtype unless float32: the name (folder + config hash) leaves the
    dtype out, and a bf16 run must never join an fp32 run's curve or row group."""
    model = metrics["model"]
    dtype = model.get("dtype") or "float32"
    return model["name"] if dtype == "float32" else f"{model['name']} ({dtype})"


def row(path: Path, metrics: dict, root: Path | None) -> dict[str, Any]:
    speed, kv, transfer = metrics.get("speed", {}), metrics.get("kv", {}), metrics.get("transfer", {})
    name, value = main_metric(metrics)
    return {
        "run": str(path.parent.relative_to(root)) if root and root in path.parents else str(path.parent),
        "model": model_label(metrics), "method": metrics["method"]["name"],
        "budget": " ".join(filter(None, (_knobs(metrics["method"], "axis_keys"),
                                         _knobs(metrics["method"], "variant_keys")))),
        "protocol": protocol_label(metrics), "series": series_label(metrics),
        "batch": metrics.get("protocol", {}).get("batch_size", 1),
        "task": metrics["task"]["name"], "metric": name, "value": value,
        "active": {True: "yes", False: "INACTIVE", None: "reference"}.get(kv.get("method_active")),
        "kv_held": kv_held(kv), "attended_fraction": kv.get("attended_fraction_sparse_layers"),
        "paper_relative_kv_size": kv.get("paper_relative_kv_size"),
        "decode_tok_s": speed.get("decode_tokens_per_s"),
        "decode_ms": speed.get("decode_ms_per_token_median"),
        "kv_bytes": kv.get("bytes_total"), "bytes_per_step": transfer.get("bytes_per_decode_step"),
        "_metrics": metrics,
    }


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def markdown(rows: list[dict]) -> str:
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(_fmt(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(out) + "\n"


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


def _accuracy_plot(plt, rows: list[dict], axis: str, out: Path) -> Path | None:
    """Task metric vs one named axis, one curve per method variant and protocol."""
    filename, xlabel = AXES[axis]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["value"] is not None and r[axis] is not None:
            groups.setdefault((r["task"], r["model"], r["metric"]), []).append(r)
    if not groups:
        return None
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    for ax, ((task, model, metric), rs) in zip(axes[0], sorted(groups.items())):
        for series in sorted({r["series"] for r in rs}):
            pts = sorted((r[axis], r["value"]) for r in rs if r["series"] == series)
            inactive = any(r["active"] == "INACTIVE" for r in rs if r["series"] == series)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if not inactive else "x:",
                    label=series + (" (INACTIVE runs)" if inactive else ""))
        ax.set(title=f"{task} on {model}", xlabel=xlabel, ylabel=metric)
        ax.legend(fontsize=7)
    _save(fig, out / filename)
    plt.close(fig)
    return out / filename


def plots(rows: list[dict], out: Path) -> list[Path]:
    """Every plot the rows allow; a plot a run's odd data breaks is skipped with a warning."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[Path] = []
    for draw in (_plot_accuracy, _plot_decode, _plot_nll, _plot_bytes, _plot_ruler,
                 _plot_throughput, _plot_capacity):
        try:
            made += draw(rows, out, plt)
        except Exception as exc:  # noqa: BLE001 - a bad field of one run must not lose the report
            plt.close("all")
            print(f"warning: plot {draw.__name__[6:]} skipped: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
    return made


def _plot_accuracy(rows: list[dict], out: Path, plt) -> list[Path]:
    return [path for axis in AXES if (path := _accuracy_plot(plt, rows, axis, out))]


def _plot_decode(rows: list[dict], out: Path, plt) -> list[Path]:
    made = []
    timed = [r for r in rows if r["decode_ms"] is not None]
    if timed:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for series in sorted({r["series"] for r in timed}):
            pts = sorted((r["_metrics"].get("kv", {}).get("seen_tokens_mean", 0), r["decode_ms"])
                         for r in timed if r["series"] == series)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", label=series)
        ax.set(title="Decode latency vs context", xlabel="context length (tokens)",
               ylabel="decode ms/token (median)")
        ax.legend(fontsize=8)
        _save(fig, out / "decode_ms_vs_context.png")
        plt.close(fig)
        made.append(out / "decode_ms_vs_context.png")
    return made


def _scatter_by_series(plt, points: dict[str, list[tuple]], out: Path, name: str, title: str,
                       xlabel: str, ylabel: str) -> list[Path]:
    """One line per series through its (x, y) points, sorted by x."""
    if not points:
        return []
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for series, pts in sorted(points.items()):
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=series)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.legend(fontsize=8)
    _save(fig, out / name)
    plt.close(fig)
    return [out / name]


def _plot_throughput(rows: list[dict], out: Path, plt) -> list[Path]:
    """Drawn when some variant ran at two or more batch sizes (FlexGen / InfiniGen Fig. 14)."""
    points: dict[str, list[tuple]] = {}
    for r in rows:
        if r["decode_tok_s"] is not None:
            points.setdefault(f"{r['series']} ({r['task']}, {r['model']})", []).append(
                (r["batch"], r["decode_tok_s"]))
    points = {k: v for k, v in points.items() if len({p[0] for p in v}) > 1}
    return _scatter_by_series(plt, points, out, "throughput_vs_batch.png",
                              "Decode throughput vs batch size", "runner.batch_size",
                              "decode tokens/s (all sequences)")


def _plot_capacity(rows: list[dict], out: Path, plt) -> list[Path]:
    points: dict[str, list[tuple]] = {}
    for r in rows:
        kv = r["_metrics"].get("kv", {})
        if kv.get("bytes_device_total") and kv.get("seen_tokens_mean"):
            points.setdefault(f"{r['series']} ({r['model']})", []).append(
                (kv["seen_tokens_mean"], GIB / kv["bytes_device_total"]))
    return _scatter_by_series(plt, points, out, "capacity.png",
                              "Sequences whose device KV fits in 1 GiB", "context (tokens seen)",
                              "sequences per GiB of device KV")


def _plot_nll(rows: list[dict], out: Path, plt) -> list[Path]:
    made = []
    curves = [r for r in rows if r["_metrics"].get("accuracy", {}).get("nll_per_block")]
    if curves:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in curves:
            acc = r["_metrics"]["accuracy"]
            block = acc.get("block_tokens", 256)
            nll = acc["nll_per_block"]
            ax.plot([(i + 1) * block for i in range(len(nll))], nll, ".-",
                    label=f"{r['method']} {r['budget']}".strip())
        ax.set(title="Streaming NLL per block", xlabel="tokens", ylabel="mean NLL (nats/token)")
        ax.legend(fontsize=7)
        _save(fig, out / "nll_curve.png")
        plt.close(fig)
        made.append(out / "nll_curve.png")
    return made


def _plot_bytes(rows: list[dict], out: Path, plt) -> list[Path]:
    made = []
    moved = [r for r in rows if r["bytes_per_step"]]
    if moved:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        labels = [f"{r['method']}\n{r['budget']}".strip() for r in moved]
        ax.bar(range(len(moved)), [r["bytes_per_step"] / 2**20 for r in moved])
        ax.set_xticks(range(len(moved)), labels, fontsize=7)
        ax.set(title="Host-to-device bytes per decode step", ylabel="MiB per step")
        _save(fig, out / "bytes_per_step.png")
        plt.close(fig)
        made.append(out / "bytes_per_step.png")
    return made


def _plot_ruler(rows: list[dict], out: Path, plt) -> list[Path]:
    made = []
    grids = [r for r in rows if r["_metrics"].get("accuracy", {}).get("niah_single_grid")]
    if grids:
        fig, axes = plt.subplots(1, len(grids), figsize=(5 * len(grids), 4), squeeze=False)
        for ax, r in zip(axes[0], grids):
            grid = r["_metrics"]["accuracy"]["niah_single_grid"]
            cells = [[float("nan") if v is None else v for v in line] for line in grid["accuracy"]]
            im = ax.imshow(cells, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")  # NaN: no sample
            ax.set_xticks(range(len(grid["lengths"])), grid["lengths"])
            ax.set_yticks(range(len(grid["depths"])), grid["depths"])
            ax.set(title=f"needle: {r['method']} {r['model']}", xlabel="context length (tokens)",
                   ylabel="needle depth (%)")
            fig.colorbar(im, ax=ax, label="accuracy (%)")
        _save(fig, out / "ruler_heatmap.png")
        plt.close(fig)
        made.append(out / "ruler_heatmap.png")
    return made


def check_out(out: Path) -> None:
    """--out must be a new folder or one holding only an earlier report (never a user's files)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; allowed: a new folder or an earlier report's")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir()
                         if p.name not in REPORT_NAMES and not p.name.startswith("."))
        if foreign:
            raise ConfigError(f"--out {out} holds files that are not a report "
                              f"({', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}); "
                              "choose a new or empty folder")
    check_writable(out, f"--out {out}")  # a read-only place: one line, before any work


def build_report(patterns: list[str], out: Path | None = None
                 ) -> tuple[list[dict], Path, list[Path]]:
    """Rows, the output folder and the plots made. ConfigError (bad paths, no valid run)."""
    first = Path(patterns[0]) if Path(patterns[0]).is_dir() else None
    out = out or (first / "_report" if first else Path("results") / "_report")
    check_out(out)
    files = find_runs(patterns)
    runs = load_runs(files)
    if not runs:
        found = f"{len(files)} metrics.json, none valid" if files else "no metrics.json"
        raise ConfigError(f"no runs to report under {' '.join(patterns)} ({found})")
    rows = [row(f, metrics, first) for f, metrics in runs]
    out.mkdir(parents=True, exist_ok=True)
    rows.sort(key=lambda r: (r["task"], r["model"], r["method"], r["budget"]))
    write_text_atomic(out / "report.md", markdown(rows))
    write_text_atomic(out / "report.csv", to_csv(rows))
    return rows, out, plots(rows, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.report", description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="results folders or globs of run folders")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        rows, out, made = build_report(args.paths, args.out)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the disk filled, or --out changed, while the report was written
        print(f"error: writing the report failed ({exc.strerror or exc}: {exc.filename})",
              file=sys.stderr)
        return 2
    sys.stdout.write(markdown(rows))
    print(f"\n{len(rows)} runs -> {out / 'report.md'}, {out / 'report.csv'}, "
          f"{len(made)} plots: {', '.join(p.name for p in made)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
