"""The project's import graph, read from the source (imports inside functions count; an
import under `if TYPE_CHECKING:` does not), and its cycles."""

import ast
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[2]
PACKAGES = ("harness", "kvcore", "methods", "tasks", "hydra_plugins")


def module_files() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (PROJECT / package).rglob("*.py"):
            parts = path.relative_to(PROJECT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module a relative `from . import x` names, from the importing module's name."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, source: str, is_package: bool, modules: set[str]) -> set[str]:
    """The project modules `module` (its `source`) imports, at any depth of its code but
    TYPE_CHECKING blocks."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                named = _absolute(module, is_package, child)
                subs = {f"{named}.{alias.name}" for alias in child.names} & modules
                found.update(subs)
                if len(subs) < len(child.names):  # names defined in `named` itself
                    found.add(named)
            visit(child)

    visit(ast.parse(source))
    return {m for m in found if m in modules and m != module}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def project_graph() -> dict[str, set[str]]:
    files = module_files()
    return {m: imports_of(m, p.read_text(), p.name == "__init__.py", set(files))
            for m, p in files.items()}
