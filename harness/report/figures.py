"""The report's figures: small multiples, one style per method, the protocol in each title.

Each figure answers one question (`FIGURES`: file stem -> question, shown as its caption in
report.html and on W&B). Panels split what must never share an axis (task, model, protocol);
inside a panel one method is one colour and marker (style.py), its variants differ by line style,
and the legend names methods, not knob lists. A figure with more panels than fit 3000 px is
continued in `<name>_2.png`, ...; every PNG is at most MAX_SIDE_PX on each side.
"""

from __future__ import annotations

import math
import sys
import textwrap
from pathlib import Path

from harness.report.collect import AXES, REFERENCE
from harness.report.leaderboard import task_columns
from harness.report.style import linestyle, method_style, variant_tags

DPI = 100
MAX_SIDE_PX = 3000
PANEL_IN = (4.4, 3.4)  # one panel, inches (440 x 340 px at DPI)
NCOLS = 3
MAX_ROWS = 6  # panels per figure: NCOLS x MAX_ROWS, then the next page
FONT = {"font.size": 9, "axes.titlesize": 9, "axes.labelsize": 9, "legend.fontsize": 8,
        "xtick.labelsize": 8, "ytick.labelsize": 8, "figure.titlesize": 11}
GIB = 2**30
FRONTIER = "Pareto frontier"
FRONTIER_NAMES = 6  # frontier points named in the panel, at most (more would overlap)

FIGURES = {
    "accuracy_vs_kv_held": "Which method keeps the most accuracy for the memory it holds? "
                           "(task metric vs KV held, bars: 95 % intervals; the grey band is the "
                           "Pareto frontier)",
    "accuracy_vs_attended": "Which method keeps the most accuracy for the tokens it attends? "
                            "(task metric vs attended fraction, bars: 95 % intervals; grey band: "
                            "Pareto frontier)",
    "ruler_grid": "Where in the context does retrieval fail? (RULER single needle, accuracy per "
                  "context length x needle depth, one row per method and budget)",
    "decode_ms_vs_context": "How does decode latency grow with the context? (median ms per "
                            "token; the full cache in black)",
    "throughput_vs_batch": "How does decode throughput scale with the batch? (tokens/s over all "
                           "sequences; the full cache in black)",
    "capacity": "How many sequences fit in 1 GiB of device KV? (from the KV each sequence held)",
    "nll_curve": "Does a method's loss drift as the stream grows? (streaming NLL per block)",
    "bytes_per_step": "How much does each method move host-to-device per decode step?",
}



def wrapped(*lines: str, width: int = 52) -> str:
    """A panel title on as many lines as it needs: long task and protocol labels otherwise run
    into the neighbouring panel's title."""
    return "\n".join(part for line in lines for part in textwrap.wrap(line, width))


def question(path: Path) -> str:
    """The question a figure file answers (`accuracy_vs_kv_held_2.png`: its figure's)."""
    stem = path.stem if path.stem in FIGURES else path.stem.rsplit("_", 1)[0]
    return FIGURES.get(stem, "")


def draw_all(rows: list[dict], out: Path) -> list[Path]:
    """Every figure the rows allow; a figure one run's odd data breaks is skipped with a warning
    (the rest of the report is still written)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[Path] = []
    draws = [lambda: accuracy(plt, rows, "kv_held", out),
             lambda: accuracy(plt, rows, "attended_fraction", out),
             lambda: ruler_grid(plt, rows, out), lambda: decode(plt, rows, out),
             lambda: throughput(plt, rows, out), lambda: capacity(plt, rows, out),
             lambda: nll(plt, rows, out), lambda: bytes_moved(plt, rows, out)]
    with plt.rc_context(FONT):
        for name, draw in zip(FIGURES, draws):
            try:
                made += draw()
            except Exception as exc:  # noqa: BLE001 - a bad field of one run must not lose the report
                plt.close("all")
                print(f"warning: figure {name} skipped: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
    return made


# ---------------------------------------------------------------------------------------------
# Shared pieces.

def save(fig, path: Path) -> Path:
    """Write atomically at DPI, lowered only if the figure would exceed MAX_SIDE_PX."""
    width_in, height_in = fig.get_size_inches()
    dpi = min(DPI, MAX_SIDE_PX / max(width_in, height_in))
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=dpi)
    _palette(tmp)
    tmp.replace(path)
    return path


def _palette(png: Path, worst: int = 24) -> None:
    """Re-encode as a 256-colour PNG (a third of the bytes: report.html embeds every figure)
    unless some pixel would move by more than `worst` in a channel (a method's colour lost)."""
    from PIL import Image, ImageChops

    rgb = Image.open(png).convert("RGB")
    small = rgb.quantize(colors=256, method=Image.Quantize.MAXCOVERAGE, dither=Image.Dither.NONE)
    error = max(high for _, high in ImageChops.difference(rgb, small.convert("RGB")).getextrema())
    if error <= worst:
        small.save(png, "PNG", optimize=True)


def pages(items: list, per_page: int) -> list[list]:
    return [items[i:i + per_page] for i in range(0, len(items), per_page)] or [[]]


def page_name(stem: str, index: int) -> str:
    return f"{stem}.png" if index == 0 else f"{stem}_{index + 1}.png"


def grid(plt, n_panels: int, legend_entries: int, title: str):
    """A constrained-layout figure of n panels (NCOLS per row) with room for a legend below."""
    ncols = min(NCOLS, n_panels)
    nrows = math.ceil(n_panels / ncols)
    legend_rows = math.ceil(legend_entries / legend_columns(ncols)) if legend_entries else 0
    size = (max(ncols * PANEL_IN[0], 6.0), nrows * PANEL_IN[1] + 0.6 + 0.24 * legend_rows)
    fig = plt.figure(figsize=size, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, axes[:n_panels]


def legend_columns(ncols: int) -> int:
    return 2 * ncols + 1 if ncols > 1 else 3


def legend(fig, handles: dict, ncols: int) -> None:
    """One legend for the figure, below the panels: one entry per method (variant), the
    frontier and the reference first, then the methods by name."""
    if handles:
        first = [k for k in (FRONTIER, REFERENCE) if k in handles]
        order = first + sorted(k for k in handles if k not in first)
        fig.legend([handles[k] for k in order], order, loc="outside lower center",
                   ncols=legend_columns(ncols), frameon=False, handlelength=2.6)


def handle(labels: dict, rows: list[dict], r: dict):
    """(legend label, style kwargs with line style) of the row's method variant."""
    style = method_style(r["method"], REFERENCE)
    kwargs = dict(style.kwargs(), linestyle=linestyle(rows, r["method"], r["variant"]))
    return labels[r["method"], r["variant"]], kwargs


def _remember(handles: dict, label: str, line) -> None:
    if label not in handles:
        handles[label] = line


def _group(rows: list[dict], key) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(key(r), []).append(r)
    return dict(sorted(out.items(), key=lambda kv: tuple(str(k) for k in kv[0])))


def pareto(points: list[tuple[float, float]], higher: bool) -> list[tuple[float, float]]:
    """The points no other point beats on both axes: less x (memory, attention) and better y."""
    best, front = None, []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1] if higher else p[1])):
        if best is None or (y > best if higher else y < best):
            front.append((x, y))
            best = y
    return front


# ---------------------------------------------------------------------------------------------
# Accuracy vs an axis.

def accuracy(plt, rows: list[dict], axis: str, out: Path) -> list[Path]:
    """Main metric vs `axis`, one panel per (task, metric, model, protocol), Pareto frontier."""
    pts = [r for r in rows if r["value"] is not None and r[axis] is not None]
    if not pts:
        return []
    labels, column = variant_tags(rows), task_columns(rows)
    # One panel per leaderboard column (task, metric and the task options that differ), model
    # and protocol: points of different texts, lengths or protocols never share a line.
    groups = list(_group(pts, lambda r: (column[id(r)], r["model"], r["protocol"])).items())
    stem = "accuracy_vs_kv_held" if axis == "kv_held" else "accuracy_vs_attended"
    short, definition = AXES[axis]
    made = []
    for i, page in enumerate(pages(groups, NCOLS * MAX_ROWS)):
        methods = {labels[r["method"], r["variant"]] for _, rs in page for r in rs}
        fig, axes = grid(plt, len(page), len(methods) + 1,
                         f"Task metric vs {short} ({definition})")
        handles: dict = {}
        for ax, ((task, model, protocol), rs) in zip(axes, page):
            _accuracy_panel(ax, rows, rs, axis, labels, handles)
            higher = rs[0]["higher_is_better"]
            ax.set_title(wrapped(f"{task} · {model}", protocol), fontsize=9)
            ax.set_xlabel(short)
            ax.set_ylabel(f"{rs[0]['metric']} ({'higher' if higher else 'lower'} is better)")
            ax.set_xlim(0, max(1.05, 1.05 * max(r[axis] for r in rs)))  # offloading holds > 1
            ax.grid(alpha=0.3)
        legend(fig, handles, min(NCOLS, len(page)))
        made.append(save(fig, out / page_name(stem, i)))
        plt.close(fig)
    return made


def _accuracy_panel(ax, rows, rs, axis, labels, handles) -> None:
    higher = rs[0]["higher_is_better"]
    front = pareto([(r[axis], r["value"]) for r in rs if r["active"] != "INACTIVE"], higher)
    if len(front) > 1:
        line, = ax.step([p[0] for p in front], [p[1] for p in front], where="post",
                        color="0.6", linewidth=7, alpha=0.35, zorder=1, solid_capstyle="round")
        _remember(handles, FRONTIER, line)
        _name_frontier(ax, rs, axis, front, labels)
    for (method, variant), series in _group(rs, lambda r: (r["method"], r["variant"])).items():
        series.sort(key=lambda r: r[axis])
        label, kwargs = handle(labels, rows, series[0])
        line, = ax.plot([r[axis] for r in series], [r["value"] for r in series], **kwargs)
        _remember(handles, label, line)
        _error_bars(ax, [r for r in series if r.get("ci95_low") is not None], axis,
                    line.get_color())
        dead = [r for r in series if r["active"] == "INACTIVE"]
        if dead:  # the method did not act: drawn, but crossed out
            ax.plot([r[axis] for r in dead], [r["value"] for r in dead], "x", color="red",
                    markersize=10, zorder=6)
        if method == REFERENCE:
            ax.axhline(series[0]["value"], color="black", linewidth=0.8, linestyle=":", zorder=2)


def _error_bars(ax, rs: list[dict], axis: str, color) -> None:
    """Each point's 95 % interval (harness.report.compare.attach) as a vertical bar."""
    if rs:
        ax.errorbar([r[axis] for r in rs], [r["value"] for r in rs],
                    yerr=[[max(0.0, r["value"] - r["ci95_low"]) for r in rs],
                          [max(0.0, r["ci95_high"] - r["value"]) for r in rs]],
                    fmt="none", ecolor=color, elinewidth=1, capsize=2.5, alpha=0.7, zorder=3)


def _name_frontier(ax, rs, axis, front, labels) -> None:
    """Name the methods on the frontier next to their points (not the reference: it is the
    star), so the panel says who wins where without matching colours to the legend."""
    on_front = [r for r in rs if (r[axis], r["value"]) in set(front) and r["method"] != REFERENCE]
    named: set[tuple] = set()
    for r in sorted(on_front, key=lambda r: r[axis])[:FRONTIER_NAMES]:
        if (r[axis], r["value"]) in named:
            continue
        named.add((r[axis], r["value"]))
        ax.annotate(labels[r["method"], r["variant"]], (r[axis], r["value"]),
                    textcoords="offset points", xytext=(5, 4), fontsize=7, color="0.25",
                    zorder=7)


# ---------------------------------------------------------------------------------------------
# RULER: methods x (length, depth) cells.

RULER_ROWS = 90  # method rows per panel (0.26 in each): a taller group continues below


def ruler_grid(plt, rows: list[dict], out: Path) -> list[Path]:
    """One heatmap per (model, protocol), rows = method x budget, columns = length x depth;
    panels go to ruler_grid.png, ruler_grid_2.png, ... so that no page is taller than fits."""
    runs = [r for r in rows if r["_metrics"].get("accuracy", {}).get("niah_single_grid")]
    if not runs:
        return []
    labels = variant_tags(rows)
    panels = []
    for (model, protocol), rs in _group(runs, lambda r: (r["model"], r["protocol"])).items():
        cols, cells, names = _ruler_matrix(rs, labels)
        for start in range(0, len(names), RULER_ROWS):
            panels.append((f"{model} · {protocol}", cols, cells[start:start + RULER_ROWS],
                           names[start:start + RULER_ROWS]))
    pages_, page, height = [], [], 0.0
    for panel in panels:
        h = 0.26 * len(panel[3]) + 1.3
        if page and height + h > 27:
            pages_.append(page)
            page, height = [], 0.0
        page.append(panel)
        height += h
    pages_.append(page)
    made = []
    for i, page in enumerate(pages_):
        made.append(_ruler_page(plt, page, out / page_name("ruler_grid", i)))
    return made


def _ruler_page(plt, page: list, path: Path) -> Path:
    heights = [0.26 * len(names) + 1.3 for *_, names in page]
    width = max(9.0, 3.2 + 0.42 * max(len(cols) for _, cols, _, _ in page))
    fig = plt.figure(figsize=(min(29.0, width), sum(heights) + 0.8), layout="constrained")
    axes = fig.subplots(len(page), 1, squeeze=False, height_ratios=heights).ravel()
    fig.suptitle("RULER niah_single accuracy (%) per context length and needle depth")
    image = None
    for ax, (title, cols, cells, names) in zip(axes, page):
        image = ax.imshow(cells, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(cols)), [f"{length}\n{depth}%" for length, depth in cols])
        ax.set_yticks(range(len(names)), names)
        for k in range(1, len(cols)):
            if cols[k][0] != cols[k - 1][0]:  # a new context length
                ax.axvline(k - 0.5, color="white", linewidth=3)
        for y, line in enumerate(cells):
            for x, v in enumerate(line):
                if v == v:  # not NaN (no sample in that cell)
                    ax.text(x, y, f"{v:.0f}", ha="center", va="center", fontsize=7)
        ax.set_title(title, loc="left")
        ax.set_xlabel("context length (tokens) / needle depth")
    fig.colorbar(image, ax=list(axes), label="accuracy (%)", shrink=0.6)
    save(fig, path)
    plt.close(fig)
    return path


def _ruler_columns(rs: list[dict]) -> list[tuple[int, float]]:
    """(length, depth) of every cell any run of the group has, by length then depth."""
    return sorted({(length, depth) for r in rs
                   for g in [r["_metrics"]["accuracy"]["niah_single_grid"]]
                   for length in g["lengths"] for depth in g["depths"]})


def _ruler_matrix(rs: list[dict], labels: dict):
    cols = _ruler_columns(rs)
    rs = sorted(rs, key=lambda r: (r["method"] != REFERENCE, r["method"], r["variant"],
                                   r["setting"], r["batch"], r["run"]))
    cells, names = [], []
    for r in rs:
        g = r["_metrics"]["accuracy"]["niah_single_grid"]
        value = {(length, depth): g["accuracy"][i][j]
                 for i, depth in enumerate(g["depths"]) for j, length in enumerate(g["lengths"])}
        cells.append([float("nan") if value.get(c) is None else value[c] for c in cols])
        batch = f" batch={r['batch']}" if r["batch"] != 1 else ""
        names.append(f"{labels[r['method'], r['variant']]} {r['setting']}{batch}".strip())
    return cols, cells, names


# ---------------------------------------------------------------------------------------------
# Lines over a measured x: decode latency, throughput, capacity, NLL.

def _lines(plt, rows: list[dict], points: list[tuple[dict, float, float]], panel_key, stem: str,
           title: str, xlabel: str, ylabel: str, min_points: int = 1, logx: bool = False,
           out: Path | None = None) -> list[Path]:
    """One line per (method, variant, setting) through its (x, y) points, per panel."""
    if not points:
        return []
    labels = variant_tags(rows)
    series: dict = {}
    for r, x, y in points:
        key = (panel_key(r), r["method"], r["variant"], r["setting"], r["protocol"])
        series.setdefault(key, []).append((x, y, r))
    series = {k: v for k, v in series.items() if len({p[0] for p in v}) >= min_points}
    if not series:
        return []
    panels = sorted({k[0] for k in series}, key=str)
    made = []
    for i, page in enumerate(pages(panels, NCOLS * MAX_ROWS)):
        methods = {labels[k[1], k[2]] for k in series if k[0] in page}
        fig, axes = grid(plt, len(page), len(methods), title)
        handles: dict = {}
        for ax, panel in zip(axes, page):
            for key, pts in sorted(series.items(), key=lambda kv: str(kv[0])):
                if key[0] != panel:
                    continue
                pts.sort(key=lambda p: p[0])
                label, kwargs = handle(labels, rows, pts[0][2])
                line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], **kwargs)
                _remember(handles, label, line)
            ax.set_title(" · ".join(str(p) for p in panel) if isinstance(panel, tuple) else panel)
            ax.set(xlabel=xlabel, ylabel=ylabel)
            if logx:  # batch sizes: powers of two, labelled as the numbers they are
                ax.set_xscale("log", base=2)
                xs = sorted({p[0] for key, pts in series.items() if key[0] == panel
                             for p in pts})
                ax.set_xticks(xs, [f"{x:g}" for x in xs])
                ax.minorticks_off()
            ax.grid(alpha=0.3)
        legend(fig, handles, min(NCOLS, len(page)))
        made.append(save(fig, out / page_name(stem, i)))
        plt.close(fig)
    return made


def decode(plt, rows: list[dict], out: Path) -> list[Path]:
    pts = [(r, r["context_tokens"], r["decode_ms"]) for r in rows
           if r["decode_ms"] is not None and r["context_tokens"]]
    return _lines(plt, rows, pts, lambda r: (r["model"], r["task"], f"batch {r['batch']}"),
                  "decode_ms_vs_context", "Decode latency vs context (median ms per token)",
                  "context (tokens seen, mean)", "decode ms/token", min_points=2, out=out)


def throughput(plt, rows: list[dict], out: Path) -> list[Path]:
    pts = [(r, r["batch"], r["decode_tok_s"]) for r in rows if r["decode_tok_s"] is not None]
    return _lines(plt, rows, pts, lambda r: (r["model"], r["task"]), "throughput_vs_batch",
                  "Decode throughput vs batch size (tokens/s, all sequences)",
                  "runner.batch_size", "decode tokens/s", min_points=2, logx=True, out=out)


def capacity(plt, rows: list[dict], out: Path) -> list[Path]:
    pts = []
    for r in rows:
        kv = r["_metrics"].get("kv", {})
        if kv.get("bytes_device_total") and kv.get("seen_tokens_mean"):
            pts.append((r, kv["seen_tokens_mean"], GIB / kv["bytes_device_total"]))
    return _lines(plt, rows, pts, lambda r: (r["model"], r["protocol"]), "capacity",
                  "Sequences whose device KV fits in 1 GiB", "context (tokens seen, mean)",
                  "sequences per GiB", out=out)


def nll(plt, rows: list[dict], out: Path) -> list[Path]:
    column = task_columns(rows)  # one panel per text and length, as the leaderboard's columns
    pts = []
    for r in rows:
        acc = r["_metrics"].get("accuracy", {})
        block = acc.get("block_tokens", 256)
        for i, value in enumerate(acc.get("nll_per_block") or []):
            pts.append((dict(r, setting=f"{r['setting']} {r['run']}", column=column[id(r)]),
                        (i + 1) * block, value))
    return _lines(plt, rows, pts, lambda r: (r["column"], r["model"], r["protocol"]), "nll_curve",
                  "Streaming NLL per block", "tokens", "mean NLL (nats/token)", out=out)


def bytes_moved(plt, rows: list[dict], out: Path, most: int = 80) -> list[Path]:
    moved = sorted((r for r in rows if r["bytes_per_step"]), key=lambda r: -r["bytes_per_step"])
    if not moved:
        return []
    shown = moved[:most]
    labels = variant_tags(rows)
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.22 * len(shown)), layout="constrained")
    names = [f"{labels[r['method'], r['variant']]} {r['setting']} · {r['task']} · {r['model']}"
             for r in shown]
    colours = [method_style(r["method"], REFERENCE).kwargs()["color"] for r in shown]
    ax.barh(range(len(shown)), [r["bytes_per_step"] / 2**20 for r in shown], color=colours)
    ax.set_yticks(range(len(shown)), names)
    ax.invert_yaxis()
    ax.set_xlabel("MiB host-to-device per decode step")
    ax.set_title("Host-to-device bytes per decode step"
                 + (f" (the {most} largest of {len(moved)})" if len(moved) > most else ""))
    ax.grid(axis="x", alpha=0.3)
    made = [save(fig, out / "bytes_per_step.png")]
    plt.close(fig)
    return made
