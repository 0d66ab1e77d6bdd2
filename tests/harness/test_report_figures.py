"""The report at the scale of a method-family comparison (30 methods, several budgets, three
tasks), on synthetic metrics.json files: every PNG within 3000 px, one legend label per method,
stable styles, the Pareto frontier, the leaderboard and the newer metrics.json fields."""

import json
from pathlib import Path

import pytest
from PIL import Image

from harness import report
from harness.report import leaderboard, style
from harness.report.figures import MAX_SIDE_PX, pareto
from methods import available_methods

SHIPPED = [m for m in available_methods() if m != "full"]
METHODS = ["full", *SHIPPED, *[f"newmethod{i}" for i in range(30 - 1 - len(SHIPPED))]]


def write_run(root: Path, method: str, task: str, value: float, held: float, *, variant=None,
              extra_acc=None, protocol=None, method_extra=None, started="2026-12-01T10:00:00"):
    hyper = {"budget_ratio": None if method == "full" else held, **(variant or {})}
    metrics = {
        "schema_version": 1,
        "accuracy": {"ppl" if task == "perplexity" else "average": value, **(extra_acc or {})},
        "speed": {"decode_tokens_per_s": 100 * held + 5, "decode_ms_per_token_median": 3 + held},
        "kv": {"held_ratio": held, "attended_fraction_sparse_layers": held,
               "seen_tokens_mean": 400.0, "bytes_device_total": 1e5 * held,
               "method_active": None if method == "full" else True},
        "transfer": {"bytes_per_decode_step": 1000.0 * held if "offload" in method else 0.0},
        "memory": {}, "env": {}, "model": {"name": "smollm2_135m"},
        "method": {"name": method, "hyperparameters": hyper, "axis_keys": ["budget_ratio"],
                   "variant_keys": sorted(variant or {}), **(method_extra or {})},
        "task": {"name": task, "options": {"max_tokens": 400} if task == "perplexity" else {}},
        "protocol": {"dense_layers": [0, 1], "prefill": "dense", "batch_size": 1,
                     **(protocol or {})},
        "run": {"started": started, "config_hash": f"{method}{task}{held}{variant}{protocol}",
                "status": "ok"},
    }
    folder = root / task / method / f"{held}-{abs(hash(json.dumps(variant)))}-{started}"
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps(metrics))
    return folder


def grid_of(score: float) -> dict:
    return {"niah_single_grid": {"lengths": [1024, 2048, 4096], "depths": [0, 25, 50, 75, 100],
                                 "accuracy": [[score] * 3] * 5}}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("family")
    for k, method in enumerate(METHODS):
        budgets = [1.0] if method == "full" else [0.1, 0.5]
        for held in budgets:
            quality = held ** (0.05 + 0.01 * k)
            write_run(root, method, "perplexity", 14 / quality, held)
            write_run(root, method, "ruler", 100 * quality, held, extra_acc=grid_of(100 * quality))
            write_run(root, method, "longbench", 30 * quality, held)
    # one method with two variants, and the fields newer runners write
    write_run(root, "h2o", "perplexity", 15.0, 0.25, variant={"recent_ratio": 0.25})
    write_run(root, "snapkv", "ruler", 80.0, 0.3, protocol={"budget_basis": "seen",
                                                              "prefill": "chunked"},
              method_extra={"provenance": "official code", "operating_point": "paper Fig. 5"})
    out = root / "_report"
    rows, out, made = report.build_report([str(root)], out)
    return rows, out, made


def test_every_figure_fits_3000_px_and_is_drawn(family):
    _, out, made = family
    names = {p.name for p in made}
    assert {"accuracy_vs_kv_held.png", "accuracy_vs_attended.png", "ruler_grid.png"} <= names
    for p in made:
        width, height = Image.open(p).size
        assert width <= MAX_SIDE_PX and height <= MAX_SIDE_PX, (p.name, width, height)
        assert min(width, height) >= 150


def test_one_label_per_method_and_a_tag_only_for_variants(family):
    rows, _, _ = family
    labels = style.variant_tags(rows)
    assert len({v for v in labels.values()}) == len(METHODS) + 1  # h2o's two variants
    assert labels["h2o", "recent_ratio=0.25"] == "h2o recent_ratio=0.25"
    assert all(label == method for (method, variant), label in labels.items() if method != "h2o")


def test_styles_are_stable_and_distinct():
    pairs = {(style.method_style(m).colour, style.method_style(m).marker) for m in METHODS}
    assert len(pairs) == len(METHODS)
    assert style.method_style("h2o") == style.method_style("h2o")
    assert style.method_style("full").reference
    new = style.method_style("a_method_added_next_year")
    assert new == style.method_style("a_method_added_next_year")
    assert (new.colour, new.marker) not in {(style.method_style(m).colour,
                                             style.method_style(m).marker) for m in SHIPPED}


@pytest.mark.parametrize("higher, points, front", [
    (True, [(0.1, 50), (0.2, 40), (0.3, 70), (0.5, 60), (1.0, 80)],
     [(0.1, 50), (0.3, 70), (1.0, 80)]),
    (False, [(0.1, 30), (0.2, 35), (0.3, 20), (0.5, 25), (1.0, 14)],
     [(0.1, 30), (0.3, 20), (1.0, 14)]),
])
def test_pareto_frontier(higher, points, front):
    assert pareto(points, higher) == front


def test_leaderboard_rows_columns_and_new_fields(family):
    rows, out, _ = family
    board = leaderboard.build(rows)
    section = leaderboard.sections(board)["smollm2_135m", "dense=[0, 1] prefill=dense"]
    assert len(section) == 1 + 2 * (len(METHODS) - 1) + 1  # + h2o's second variant
    assert section[0]["method"] == "full"
    entry = next(e for e in section if e["method"] == "tova" and e["setting"] == "budget_ratio=0.5")
    assert set(entry["tasks"]) == {"perplexity ppl", "ruler average", "longbench average"}
    assert entry[leaderboard.MEAN] == pytest.approx(
        (entry["tasks"]["ruler average"] + entry["tasks"]["longbench average"]) / 2)
    odd = leaderboard.sections(board)["smollm2_135m", "dense=[0, 1] prefill=chunked basis=seen"]
    assert [(e["provenance"], e["operating_point"]) for e in odd] == [
        ("official code", "paper Fig. 5")]
    text = (out / "leaderboard.md").read_text()
    assert "prefill=chunked basis=seen" in text and "official code" in text
    assert "ppl ↓" in text and "ruler average ↑" in text
    html = (out / "report.html").read_text()
    assert "http://" not in html and "https://" not in html and "<script src" not in html


def test_runs_without_the_newer_fields_still_report(tmp_path):
    write_run(tmp_path, "full", "perplexity", 14.0, 1.0)
    write_run(tmp_path, "h2o", "perplexity", 16.0, 0.2)
    rows, out, _ = report.build_report([str(tmp_path)], tmp_path / "out")
    assert [r["provenance"] for r in rows] == ["", ""]
    assert "provenance" not in (out / "leaderboard.md").read_text()  # no empty column
