"""benchmarks/family_table.py --previous: rows of an earlier table matched by method and budget."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from benchmarks.family_table import previous_rows, row_key  # noqa: E402

EARLIER = """Method family, smollm2_135m: ...

| method | needle 1K | needle all | KV held | ppl | ppl attended |
|---|---|---|---|---|---|
| full | 5/5 | 15/15 | 1.000 | 14.08 | 1.000 |
| h2o budget_ratio=0.2 budget_tokens=null | 0/5 | 0/15 | 0.253 | 35.09 | 0.201 |
| kivi k_bits=2 v_bits=2 | 3/5 | 3/15 | 0.187 | 21.50 | 1.000 |

| method | needle 1K | needle all | KV held | ppl | ppl attended |
|---|---|---|---|---|---|
| h2o budget_ratio=0.2 budget_tokens=null | 0/5 | 9/15 | 0.253 | 99.99 | 0.201 |
"""


def test_rows_match_by_method_and_budget_from_the_first_table_only(tmp_path):
    path = tmp_path / "tables.md"
    path.write_text(EARLIER)
    rows = previous_rows(path)
    # a knob added since (compress_above_tokens) or a head share does not break the match
    assert rows[row_key("h2o budget_ratio=0.2 budget_tokens=null retrieval_head_ratio=0.1")] == (
        "0/15", "35.09")
    assert rows[row_key("kivi k_bits=2 v_bits=2")] == ("3/15", "21.50")
    assert rows[row_key("full")] == ("15/15", "14.08")
    assert row_key("h2o budget_ratio=0.5") not in rows  # another budget is another row
    assert len(rows) == 3  # the second table (another protocol) is not read
    assert previous_rows(path, 2) == {row_key("h2o budget_ratio=0.2"): ("9/15", "99.99")}


def test_a_file_without_a_family_table_is_refused(tmp_path):
    path = tmp_path / "notes.md"
    path.write_text("| a | b |\n|---|---|\n| 1 | 2 |\n")
    with pytest.raises(SystemExit, match="not a family table"):
        previous_rows(path)
    path.write_text(EARLIER)
    with pytest.raises(SystemExit, match="table 3 is not"):
        previous_rows(path, 3)


def test_a_run_that_never_compressed_is_marked_idle():
    from benchmarks.family_table import cells

    def ppl_run(reason):
        return {"accuracy": {"ppl": 9.03}, "kv": {"inactive_reason": reason,
                                                   "attended_fraction_sparse_layers": 1.0}}

    row = cells(None, ppl_run("held the full cache ..."), "not measured", "", [1024], 5)
    assert row[-2] == "9.03 (idle)"
    assert cells(None, ppl_run(None), "not measured", "", [1024], 5)[-2] == "9.03"
