"""No `__getattr__` in harness/: an object answers what it defines and nothing else. A
`__getattr__` that forwards what it lacks to another object makes which calls reach which object
depend on what happens to be defined (a sweep's engine once ran a task's live requests on one
setting's engine this way, silently). Module-level ones count too (a lazy module attribute):
import explicitly instead."""

import ast
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]


def getattr_definitions(source: str) -> list[int]:
    """Lines of every `def __getattr__` (a module's or a class's, at any depth)."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name == "__getattr__"]


def test_harness_defines_no_getattr():
    files = sorted((PROJECT / "harness").rglob("*.py"))
    assert len(files) > 30  # the scan sees the package
    found = [f"{path.relative_to(PROJECT)}:{line}" for path in files
             for line in getattr_definitions(path.read_text(encoding="utf-8"))]
    assert not found, "define each member explicitly instead of forwarding: " + ", ".join(found)


def test_the_scan_finds_a_planted_getattr():
    planted = ("def __getattr__(name):\n    return 1\n\n"
               "class Proxy:\n    def other(self):\n        pass\n\n"
               "    def __getattr__(self, name):\n        return getattr(self.inner, name)\n")
    assert getattr_definitions(planted) == [1, 8]
    assert getattr_definitions("class Plain:\n    def get(self):\n        pass\n") == []
