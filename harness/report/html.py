"""report.html: one self-contained page (no network at view time) a person opens.

First the answer (harness.report.budgets): per budget level, the best setting, those that cannot
be told from it after correction and the full cache, with what each costs. Then the leaderboard:
one table per section and task column, grouped by budget level, best first inside a level, with
the compact letter display; each row one line (provenance, operating point, variant and runs in
the method cell's tooltip); speed figures from a shared lockstep step marked as shared. Then
the figures as embedded PNGs with the question each answers, and every run in a folded table.
No absolute path of the machine that made it: sources and runs are named relative to the
report's folder. Static figures on purpose: plotly's
self-contained HTML embeds ~4.6 MB of JavaScript per page and Vega-Lite (altair) needs the
vl-convert native wheel to inline its JavaScript offline; neither is a dependency of the
harness, and a PNG reads the same in a browser, on W&B and in a markdown note. The page's own
script (sorting, filtering) is a few lines of plain JavaScript; it marks `<body data-ready>`
when done, which tests/harness/test_report_browser.py checks in headless Chromium.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

from harness.report import budgets, leaderboard
from harness.report.collect import COLUMNS, fmt
from harness.report import figures

STYLE = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:1.5em auto;
max-width:1500px;padding:0 1em;color:#222}
h1{font-size:1.5em;margin:.2em 0} h2{margin-top:1.6em;border-bottom:1px solid #ddd}
h3{font-size:1.05em;margin:1.2em 0 .3em} .meta{color:#555} code{background:#f3f3f3;padding:0 3px}
table{border-collapse:collapse;font-size:12.5px;margin:.3em 0 1em;display:block;overflow-x:auto}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:right;white-space:nowrap}
th{background:#f5f5f5;cursor:pointer;position:sticky;top:0}
th.sorted-asc::after{content:" \\25B2"} th.sorted-desc::after{content:" \\25BC"}
td.text,th.text{text-align:left} tr.level th{background:#eef3fb;text-align:left;cursor:default}
td.letters{font-family:ui-monospace,monospace;text-align:left;color:#1a4d8f}
td.info{cursor:help;text-decoration:underline dotted #999}
.shared{color:#8a5a00} table.answer td{white-space:normal;vertical-align:top}
table.answer td:first-child{min-width:11em} table.answer td:nth-child(2){min-width:18em}
table.answer th{cursor:default}
tr.reference td{font-weight:600;background:#fafafa}
tr.inactive td{color:#a00} td.best{background:#e6f4e6}
figure{margin:1.2em 0} figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{color:#444;margin-bottom:.3em;font-weight:600}
#filter{font-size:14px;padding:3px 6px;width:24em}
"""

SCRIPT = """
(function(){
  function key(td){var v=td.getAttribute('data-v');
    return v===null||v===''?null:(isNaN(+v)?v.toLowerCase():+v);}
  document.querySelectorAll('table.sortable').forEach(function(table){
    table.tHead.querySelectorAll('th').forEach(function(th,col){
      th.addEventListener('click',function(){
        var asc=!th.classList.contains('sorted-asc');
        table.tHead.querySelectorAll('th').forEach(function(h){h.classList.remove('sorted-asc','sorted-desc');});
        th.classList.add(asc?'sorted-asc':'sorted-desc');
        Array.prototype.forEach.call(table.tBodies,function(body){
          var rows=Array.prototype.filter.call(body.rows,function(r){
            return !r.classList.contains('level');});
          rows.sort(function(a,b){var x=key(a.cells[col]),y=key(b.cells[col]);
            if(x===y)return 0; if(x===null)return 1; if(y===null)return -1;
            return (x<y?-1:1)*(asc?1:-1);});
          rows.forEach(function(r){body.appendChild(r);});});
      });
    });
  });
  var box=document.getElementById('filter');
  if(box){box.addEventListener('input',function(){var q=box.value.toLowerCase();
    document.querySelectorAll('table.sortable tbody tr:not(.level)').forEach(function(r){
      r.style.display=r.textContent.toLowerCase().indexOf(q)<0?'none':'';});});}
  document.body.setAttribute('data-ready','1');
})();
"""


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _td(value, text_column: bool = False, best: bool = False, shown: str | None = None) -> str:
    cls = " ".join(filter(None, ("text" if text_column else "", "best" if best else "")))
    data = "" if value is None else (repr(float(value)) if isinstance(value, (int, float))
                                     and not isinstance(value, bool) else str(value))
    return (f'<td{f" class={chr(34)}{cls}{chr(34)}" if cls else ""} data-v="{_e(data)}">'
            f"{_e(fmt(value) if shown is None else shown)}</td>")


BOARD_HEAD = ("letters", "method", "setting", "value [95 %]", "n", "rank", "vs full",
              "kv_held", "attended", "decode ms", "MiB/step", "active")


def _info(e: dict) -> str:
    """The method cell's tooltip: what would make the row tall (provenance, operating point,
    variant knobs, the runs behind it)."""
    parts = [f"{k}: {e[k]}" for k in ("variant", "provenance", "operating_point") if e.get(k)]
    return "\n".join(parts + [f"runs: {' '.join(e['runs'])}"])


def _value_text(e: dict, column: str) -> str:
    ci = e.get("ci", {}).get(column)
    return fmt(e["tasks"][column]) + (f" [{fmt(ci[0])}, {fmt(ci[1])}]" if ci else "")


def _rank_text(e: dict, column: str) -> str:
    rank = e.get("ranks", {}).get(column)
    return "" if not rank else f"#{rank[0]}" + (f"-{rank[1]}" if rank[1] != rank[0] else "")


def _decode_td(e: dict) -> str:
    if e.get("speed_shared"):
        return (f'<td class="shared" data-v="{_e(e["decode_ms"])}" title="one batched step of '
                f'{e["speed_shared"]} settings in lockstep: shared, not this setting\'s own">'
                f'{_e(fmt(e["decode_ms"]))} shared</td>')
    return _td(e.get("decode_ms"))


def _fidelity_tds(e: dict, fid: list[str]) -> list[str]:
    """The row's fidelity cells (value [95 %]; empty where its run recorded none)."""
    out = []
    for name in fid:
        value = e.get("fidelity", {}).get(name)
        out.append(_td(None if value is None else value[0],
                       shown=None if value is None else leaderboard.shown(e, name)))
    return out


def board_row(e: dict, column: str, fid: list[str] = ()) -> str:
    cls = ("reference" if e["method"] == leaderboard.REFERENCE else
           "inactive" if e["active"] == "INACTIVE" else "")
    verdict = e.get("verdicts", {}).get(column, "")
    moved = e.get("bytes_per_step")
    cells = [f'<td class="letters text">{_e(e.get("letters", {}).get(column, ""))}</td>',
             f'<td class="text info" title="{_e(_info(e))}" data-v="{_e(e["method"])}">'
             f'{_e(e["method"])}</td>',
             _td(e["setting"], True),
             _td(e["tasks"][column], shown=_value_text(e, column)),
             _td(e["n"].get(column)),
             _td((e.get("ranks", {}).get(column) or (None,))[0], shown=_rank_text(e, column)),
             _td(verdict, True), *_fidelity_tds(e, fid),
             _td(e.get("kv_held")), _td(e.get("attended_fraction")), _decode_td(e),
             _td(None if moved is None else moved / 2**20), _td(e["active"], True)]
    return f'<tr class="setting {cls}">' + "".join(cells) + "</tr>"


def _level_body(label: str, members: list[dict], column: str, note: str,
                fid: list[str] = ()) -> str:
    head = (f'<tr class="level"><th colspan="{len(BOARD_HEAD) + len(fid)}">{_e(label)} '
            f'<span class="meta">· {len(members)} setting{"s" if len(members) != 1 else ""}'
            f'{_e(note)}</span></th></tr>')
    return "<tbody>" + head + "".join(board_row(e, column, fid) for e in members) + "</tbody>"


def _board_head(fid: list[str]) -> tuple[str, ...]:
    """BOARD_HEAD with the column's fidelity labels (task.fidelity_tokens) after "vs full"."""
    at = BOARD_HEAD.index("vs full") + 1
    labels = [name.rsplit(" · ", 1)[1] + leaderboard.arrow([], name) for name in fid]
    return (*BOARD_HEAD[:at], *labels, *BOARD_HEAD[at:])


def board_html(board: list[dict], answers: list[dict]) -> str:
    """One table per section and task column: the full cache, then each budget level."""
    out = []
    by_key: dict[tuple, list[dict]] = {}
    for a in answers:
        by_key.setdefault((a["model"], a["protocol"], a["column"]), []).append(a)
    for (model, protocol), entries in leaderboard.sections(board).items():
        for column in sorted({c for e in entries for c in e["tasks"]}):
            out.append(f"<h3>{_e(model)} · <code>{_e(protocol)}</code> · "
                       f"{_e(column + leaderboard.arrow(entries, column))}</h3>")
            fid = [name for name in leaderboard.fidelity_columns(entries)
                   if name.startswith(column + " · ")]
            heads = "".join(f'<th class="{"text" if h in ("letters", "method", "setting", "vs full", "active") else ""}">'
                            f"{_e(h)}</th>" for h in _board_head(fid))
            out.append(f'<table class="sortable board"><thead><tr>{heads}</tr></thead>')
            full = [e for e in entries if e["method"] == leaderboard.REFERENCE
                    and column in e["tasks"]]
            if full:
                out.append(_level_body("full cache (reference)", full, column, "", fid))
            for a in by_key.get((model, protocol, column), []):
                out.append(_level_body(a["level"], a["members"], column,
                                       f" · {a['apart']} of {a['pairs']} pairs told apart", fid))
            out.append("</table>")
    return "\n".join(out)


def _cost_short(e: dict) -> str:
    """KV held, decode ms (* when a shared batched step timed it), bytes moved per step."""
    parts = [f"KV held {fmt(e['kv_held'])}" if e.get("kv_held") is not None else ""]
    if e.get("decode_ms") is not None:
        parts.append(f"{fmt(e['decode_ms'])} ms" + ("*" if e.get("speed_shared") else ""))
    if e.get("bytes_per_step"):
        parts.append(f"{fmt(e['bytes_per_step'] / 2**20)} MiB/step")
    return " · ".join(p for p in parts if p)


def _answer_row(a: dict, top: int) -> str:
    column, best, same = a["column"], a["members"][0], a["with_best"][1:]
    listed = "; ".join(f"{budgets.name(e)} {fmt(e['tasks'][column])} ({_cost_short(e)})"
                       for e in same[:top])
    more = f"; and {len(same) - top} more (letter a below)" if len(same) > top else ""
    rest = listed + more if same else budgets.alone(a, "").lstrip("; ")
    return (f'<tr><td class="text"><b>{_e(a["level"])}</b><br><span class="meta">'
            f'{len(a["members"])} setting{"s" if len(a["members"]) != 1 else ""}, '
            f'{a["apart"]} of {a["pairs"]} pairs told apart</span></td>'
            f'<td class="text"><b>{_e(budgets.name(best))}</b> '
            f'{_e(_value_text(best, column))}<br><span class="meta">{_e(_cost_short(best))}'
            f'</span></td><td class="text">{_e(rest)}</td></tr>')


def answer_html(answers: list[dict], top: int = 8) -> str:
    """The page's first section: per section and column, one row per budget level: the best
    setting, those that cannot be told from it (with what each costs), the full cache first."""
    by_key: dict[tuple, list[dict]] = {}
    for a in answers:
        by_key.setdefault((a["model"], a["protocol"], a["column"]), []).append(a)
    out = []
    for (model, protocol, column), levels in by_key.items():
        members = [e for a in levels for e in a["members"]]
        out.append(f"<h3>{_e(model)} · <code>{_e(protocol)}</code> · "
                   f"{_e(column + leaderboard.arrow(members, column))}</h3>")
        out.append('<table class="answer"><thead><tr><th class="text">budget level</th>'
                   '<th class="text">best setting</th><th class="text">cannot be told from '
                   "the best after correction (letter a)</th></tr></thead><tbody>")
        full = levels[0]["full"]
        if full:
            out.append(f'<tr class="reference"><td class="text">full cache</td>'
                       f'<td class="text">{_e(_value_text(full, column))}<br>'
                       f'<span class="meta">{_e(_cost_short(full))}</span></td>'
                       f'<td class="text">the reference</td></tr>')
        out += [_answer_row(a, top) for a in levels]
        out.append("</tbody></table>")
        shared = sorted({e["speed_shared"] for e in members + ([full] if full else [])
                         if e.get("speed_shared")})
        if shared:
            out.append(f'<p class="meta shared">* decode ms of one batched step shared by '
                       f'{"/".join(map(str, shared))} settings in lockstep: the same for all of '
                       "them, not the setting's own speed.</p>")
    return "\n".join(out) or "<p>No budget level has a setting with a value.</p>"


def runs_html(rows: list[dict]) -> str:
    text = {"run", "model", "method", "variant", "budget", "provenance", "operating_point",
            "protocol", "task", "metric", "active"}
    heads = "".join(f'<th class="{"text" if c in text else ""}">{_e(c)}</th>' for c in COLUMNS)
    body = "".join("<tr>" + "".join(_td(r[c], c in text) for c in COLUMNS) + "</tr>"
                   for r in rows)
    return (f'<table class="sortable runs"><thead><tr>{heads}</tr></thead>'
            f"<tbody>{body}</tbody></table>")


def figures_html(made: list[Path]) -> str:
    out = []
    for path in made:
        question = figures.question(path)
        data = base64.b64encode(path.read_bytes()).decode()
        out.append(f'<figure id="{_e(path.stem)}"><figcaption>{_e(question)} '
                   f'<span class="meta">({_e(path.name)})</span></figcaption>'
                   f'<img class="figure" alt="{_e(path.stem)}" '
                   f'src="data:image/png;base64,{data}"></figure>')
    return "\n".join(out)


def markdown_html(text: str) -> str:
    """The comparisons' markdown (a table, "## " headings, list items, paragraphs) as HTML."""
    out, table = [], []

    def close() -> None:
        if table:
            head, body = table[0], [r for r in table[2:]]
            out.append('<table class="sortable paired"><thead><tr>'
                       + "".join(f'<th class="text">{_e(c)}</th>' for c in head)
                       + "</tr></thead><tbody>" + "".join(
                           "<tr>" + "".join(f'<td class="text" data-v="{_e(c)}">{_e(c)}</td>'
                                            for c in r) + "</tr>" for r in body)
                       + "</tbody></table>")
            table.clear()

    for line in text.splitlines():
        if line.startswith("|"):
            table.append([c.strip().replace("\\|", "|")
                          for c in line.strip("|").split(" | ")])
            continue
        close()
        if line.startswith("## "):
            out.append(f"<h3>{_e(line[3:])}</h3>")
        elif line.startswith("- "):
            out.append(f"<li>{_e(line[2:])}</li>")
        elif line.strip():
            out.append(f"<p>{_e(line)}</p>")
    close()
    return "\n".join(out)


def page(rows: list[dict], board: list[dict], made: list[Path], sources: list[str],
         generated: str, paired: str = "", answers: list[dict] | None = None) -> str:
    """The whole page; `sources` as the reader should see them (relative, never absolute)."""
    protocols = sorted({r["protocol"] for r in rows})
    models = sorted({r["model"] for r in rows})
    methods = sorted({r["method"] for r in rows})
    questions = "".join(f'<li><a href="#{_e(p.stem)}">{_e(p.name)}</a>: '
                        f"{_e(figures.question(p))}</li>" for p in made)
    answers = answers or []
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>kv-harness report: {len(methods)} methods, {len(rows)} runs</title>
<style>{STYLE}</style></head>
<body>
<h1>kv-harness report</h1>
<p class="meta">{len(rows)} runs of {len(methods)} methods ({_e(", ".join(methods))}) on
{_e(", ".join(models))}; generated {_e(generated)} from {_e(" ".join(sources))}.<br>
Protocols: {"; ".join(f"<code>{_e(p)}</code>" for p in protocols)}.</p>
<h2 id="answer">Which setting at this budget</h2>
<p>Per budget level (a setting's <code>budget_ratio</code>; a method at its own defaults by the
band of KV held it measured), the best setting by the task's metric and the settings that
cannot be told from it: paired comparisons of every two settings of the level on the same
samples, Benjamini-Hochberg over the level's pairs (FDR {budgets.FDR:.0%}), a difference inside
the noise floor never counts. KV held = bytes on every tier / full cache; decode ms = median per
token, <span class="shared">shared</span> where one batched step timed N settings together in
lockstep (no setting's own speed).</p>
<div class="answer">{answer_html(answers)}</div>
<h2>Leaderboard</h2>
<p>One table per task column, grouped by budget level, best first inside a level (click a
column to sort inside the levels). Settings that share a letter cannot be told apart after
correction (compact letter display; "a" holds the level's best). A value reads value [95 %
interval]; rank = bootstrap rank interval in the section; vs full = the paired comparison with
the full cache after Benjamini-Hochberg over the report. Hover a method for its provenance,
operating point, variant and runs.
<input id="filter" type="search" placeholder="filter rows (method, knob, …)"></p>
{board_html(board, answers)}
<h2>Paired comparison with the full cache</h2>
{markdown_html(paired)}
<h2>Figures</h2>
<ul>{questions}</ul>
{figures_html(made)}
<h2>Every run</h2>
<details><summary>{len(rows)} runs (one row each)</summary>
{runs_html(rows)}
</details>
<script>{SCRIPT}</script>
</body></html>
"""
