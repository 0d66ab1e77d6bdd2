"""Lines of own logic per method file (goal: scorer methods on the template <= 80 lines each).

    python benchmarks/method_lines.py

Counts the lines of `methods/<name>.py` that hold code: docstrings, comments, blank lines and
imports are not logic; every other physical line is (a wrapped expression counts each line).
The template's own files (base.py, eviction.py, scoring.py, _*.py) are listed apart.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL_LINES = 80


def logic_lines(path: Path) -> int:
    source = path.read_text()
    tree = ast.parse(source)
    skip: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            skip.update(range(body[0].lineno, body[0].end_lineno + 1))  # a docstring
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            skip.update(range(node.lineno, node.end_lineno + 1))
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                            tokenize.DEDENT, tokenize.ENDMARKER):
            code.update(range(tok.start[0], tok.end[0] + 1))
    return len(code - skip)


def on_eviction_template(name: str, base: type) -> bool:
    """Whether the method's layers are the scored-eviction template's (built on a small model
    shape, or, for a method that needs prepared artefacts first, from the classes its file
    defines)."""
    from methods import build_method, method_class
    from methods.model import ModelInfo

    info = ModelInfo(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, max_positions=512,
                     rope_theta=10000.0)
    try:
        return isinstance(build_method(name).make_layer(3, info), base)
    except Exception:  # noqa: BLE001 - needs prepare(): read the layer classes the file defines
        module = sys.modules[method_class(name).__module__]
        return any(isinstance(v, type) and issubclass(v, base) and v.__module__ == module.__name__
                   for v in vars(module).values())


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from methods import available_methods, method_class
    from methods.eviction import EvictionLayer

    rows, template = [], []
    for name in available_methods():
        cls = method_class(name)
        module = sys.modules[cls.__module__]
        path = Path(module.__file__)
        on_template = on_eviction_template(name, EvictionLayer)
        rows.append((name, path.name, logic_lines(path), on_template))
    for path in sorted((ROOT / "methods").glob("*.py")):
        if path.name in ("base.py", "eviction.py", "scoring.py", "__init__.py") or path.name.startswith("_"):
            template.append((path.name, logic_lines(path)))
    print(f"| method | file | lines of logic | on the scored-eviction template | <= {GOAL_LINES} |")
    print("|---|---|---|---|---|")
    for name, file, n, on in rows:
        print(f"| {name} | {file} | {n} | {'yes' if on else 'no'} | "
              f"{('yes' if n <= GOAL_LINES else 'NO') if on else '-'} |")
    print("\nshared files: " + ", ".join(f"{f} {n}" for f, n in template))


if __name__ == "__main__":
    main()
