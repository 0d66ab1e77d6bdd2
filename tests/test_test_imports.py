"""Tests import their shared helpers from helper modules (tests/conftest.py, tests/models.py,
tests/helpers/, tests/methods/contract/, ...), never from another test file: a test file can then
be moved, renamed or deleted without breaking another, and pytest never imports a test module
twice under two names."""

import ast
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]


def imports_of_test_modules(source: str) -> list[tuple[int, str]]:
    """(line, imported name) of every import of a `test_*` module in `source`, at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            names = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        hits = [name for name in names if any(part.startswith("test_") for part in name.split("."))]
        if hits:
            found.append((node.lineno, hits[0]))
    return found


def test_no_test_file_imports_another_test_file():
    files = sorted((PROJECT / "tests").rglob("*.py"))
    assert PROJECT / "tests" / "conftest.py" in files and len(files) > 50  # the scan sees the tests
    offences = [f"{path.relative_to(PROJECT)}:{line}: imports {name}"
                for path in files
                for line, name in imports_of_test_modules(path.read_text(encoding="utf-8"))]
    assert not offences, ("move the shared helper into a helper module (tests/helpers/, "
                          "tests/conftest.py, ...) and import it from there:\n" + "\n".join(offences))


def test_planted_test_imports_are_found_and_helper_imports_are_not():
    planted = ["from tests.harness.test_run import cfg_for",
               "import tests.methods.test_kivi",
               "from tests.methods import test_kivi",
               "def f():\n    from tests.tasks.test_lm_eval import write_custom_tasks",
               "from .test_contract import get_model"]
    for source in planted:
        assert imports_of_test_modules(source), source
    allowed = ["from tests.conftest import make_engine", "from tests.helpers.runs import cfg_for",
               "from tests.methods.contract.common import get_model", "import pytest",
               "from tests.methods.kernels.kvquant_cases import random_cache",
               "from harness import models"]
    for source in allowed:
        assert not imports_of_test_modules(source), source
