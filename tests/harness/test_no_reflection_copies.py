"""The harness moves state through declared interfaces (KVLayer.fork / adopt,
KVMethod.artefacts / adopt_artefacts, dataclass fields), never by copying or reading an object's
attribute dictionary: a new attribute must be declared to travel, not picked up by accident."""

import ast
from pathlib import Path

HARNESS = Path(__file__).resolve().parents[2] / "harness"


def reflective_reads(source: str) -> list[int]:
    """Lines reading `x.__dict__` or calling `vars(...)`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "__dict__":
            lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "vars"):
            lines.append(node.lineno)
    return lines


def test_the_checker_sees_both_forms():
    assert reflective_reads("a = b.__dict__\nc = vars(d)\nvars = 1\n") == [1, 2]


def test_harness_never_copies_through_dict_or_vars():
    found = [f"{path.relative_to(HARNESS.parent)}:{line}"
             for path in sorted(HARNESS.rglob("*.py"))
             for line in reflective_reads(path.read_text())]
    assert not found, ("harness/ reads attribute dictionaries (use the declared interfaces: "
                       "KVLayer.fork/adopt, KVMethod.artefacts, dataclasses.fields): "
                       + ", ".join(found))
