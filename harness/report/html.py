"""report.html: one self-contained page (no network at view time) a person opens.

The leaderboard (sortable by any column, filterable), the figures as embedded PNGs with the
question each answers, and every run in a folded table. Static figures on purpose: plotly's
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

from harness.report import leaderboard
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
td.text,th.text{text-align:left} td.text:last-child{white-space:normal;min-width:22em}
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
    table.querySelectorAll('th').forEach(function(th,col){
      th.addEventListener('click',function(){
        var asc=!th.classList.contains('sorted-asc');
        table.querySelectorAll('th').forEach(function(h){h.classList.remove('sorted-asc','sorted-desc');});
        th.classList.add(asc?'sorted-asc':'sorted-desc');
        var body=table.tBodies[0], rows=Array.prototype.slice.call(body.rows);
        rows.sort(function(a,b){var x=key(a.cells[col]),y=key(b.cells[col]);
          if(x===y)return 0; if(x===null)return 1; if(y===null)return -1;
          return (x<y?-1:1)*(asc?1:-1);});
        rows.forEach(function(r){body.appendChild(r);});
      });
    });
  });
  var box=document.getElementById('filter');
  if(box){box.addEventListener('input',function(){var q=box.value.toLowerCase();
    document.querySelectorAll('table.sortable tbody tr').forEach(function(r){
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


def _best(entries: list[dict], column: str) -> float | None:
    values = [(e["tasks"][column], e["higher"][column]) for e in entries if column in e["tasks"]]
    if len(values) < 2:
        return None
    higher = values[0][1]
    return max(v for v, _ in values) if higher else min(v for v, _ in values)


def board_html(board: list[dict]) -> str:
    out = []
    for (model, protocol), entries in leaderboard.sections(board).items():
        own, rest = leaderboard.header(entries)
        out.append(f"<h3>{_e(model)} · <code>{_e(protocol)}</code></h3>")
        text = set(leaderboard.TEXT)
        heads = [f'<th class="{"text" if c in text else ""}" title="{_e(c)}">'
                 f'{_e(c + leaderboard.arrow(entries, c))}</th>' for c in own + rest]
        out.append('<table class="sortable board"><thead><tr>' + "".join(heads)
                   + "</tr></thead><tbody>")
        best = {c: _best(entries, c) for c in rest}
        for e in entries:
            cls = ("reference" if e["method"] == "full" else
                   "inactive" if e["active"] == "INACTIVE" else "")
            cells = [_td(leaderboard.cell(e, c), c in text,
                         best.get(c) is not None and leaderboard.cell(e, c) == best[c]
                         and e["method"] != "full", leaderboard.shown(e, c))
                     for c in own + rest]
            out.append(f'<tr class="{cls}" title="{_e(" ".join(e["runs"]))}">'
                       + "".join(cells) + "</tr>")
        out.append("</tbody></table>")
    return "\n".join(out)


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
    """The comparisons' markdown (a table, list items, paragraphs) as HTML."""
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
        if line.startswith("- "):
            out.append(f"<li>{_e(line[2:])}</li>")
        elif line.strip():
            out.append(f"<p>{_e(line)}</p>")
    close()
    return "\n".join(out)


def page(rows: list[dict], board: list[dict], made: list[Path], sources: list[str],
         generated: str, paired: str = "") -> str:
    protocols = sorted({r["protocol"] for r in rows})
    models = sorted({r["model"] for r in rows})
    methods = sorted({r["method"] for r in rows})
    questions = "".join(f'<li><a href="#{_e(p.stem)}">{_e(p.name)}</a>: '
                        f"{_e(figures.question(p))}</li>" for p in made)
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
<h2>Leaderboard</h2>
<p>One row per method setting (budget knobs, variant, provenance / operating point); each task
column is the task's main metric (↑ higher / ↓ lower is better; the best non-reference value is
shaded); the full cache is the bold row. KV held = bytes on every tier / full cache; attended =
tokens attended / seen at decode steps (sparse layers); decode ms = median per token; bytes =
host-to-device per decode step. A task cell reads value [95 % interval] n=units #rank interval
(bootstrap ranks in its section); a verdict against the full cache follows where there is one.
Click a column to sort (by value).
<input id="filter" type="search" placeholder="filter rows (method, knob, …)"></p>
{board_html(board)}
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
