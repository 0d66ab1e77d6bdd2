"""The docs' "Use a method in your own code" example (docs/api.md) runs as written (extracted, not
copied)."""

import contextlib
import io
import re

from tests.conftest import PROJECT, STORIES, need_shared

SECTION = "## Use a method in your own code"


def readme_example() -> str:
    text = (PROJECT / "docs" / "api.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the section holds one python example"
    return blocks[0]


def test_readme_example_runs_as_written():
    need_shared(STORIES)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(readme_example(), "docs/api.md", "exec"), {"__name__": "readme"})
    lines = printed.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert 0 < float(lines[1]) < 1  # SnapKV held less than the full cache
    assert lines[2].startswith("[16.0, 16.0")  # H2O at its budget in every layer
