"""No import cycle inside the project: packages import downward only. Every import counts, the
ones inside functions too (a function-local import that dodges a cycle at load time is still a
cycle in the design: the two modules cannot be understood, tested or moved apart). An import
under `if TYPE_CHECKING:` does not count (it never runs). `from pkg import sub` imports the
submodule `pkg.sub`, not `pkg` (as Python resolves it: pkg/__init__ runs first either way)."""

from tests.helpers.imports import cycles, imports_of, project_graph

def test_the_project_has_no_import_cycle():
    found = cycles(project_graph())
    assert not found, "import cycles (each a set of modules importing each other): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_the_scan_sees_a_cycle_through_a_function_local_import():
    graph = {"a": {"b"}, "b": set(), "c": {"d"}, "d": {"e"}, "e": {"c"}}
    assert cycles(graph) == [["c", "d", "e"]]
    modules = {"harness.session", "harness.run"}
    local = "def f():\n    from harness.run import run\n"
    assert imports_of("harness.session", local, False, modules) == {"harness.run"}
    guarded = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from harness.run import run\n"
    assert imports_of("harness.session", guarded, False, modules) == set()
