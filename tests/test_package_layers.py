"""harness/ is a few packages that import downward only, so a newcomer can read it bottom-up:
`store` (files) <- `core` (the engine) <- `config` <- `stats` <- `report` <- the entry modules
(`session`, `run`, `api`, `__main__`) <- `sweep` (many runs) <- `engines`, `lm_eval`.
A package's modules may import each other; between packages only downward. The scan is the one
of test_import_cycles (imports inside functions count)."""

from pathlib import Path

from tests.helpers.imports import cycles, project_graph

HARNESS = Path(__file__).resolve().parents[1] / "harness"
# What each package may import of harness besides itself and `harness` (CONF_DIR).
BELOW = {
    "harness.store": set(),
    "harness.core": {"harness.store"},
    "harness.config": {"harness.core", "harness.store"},
    "harness.stats": {"harness.store"},
    "harness.report": {"harness.core", "harness.store", "harness.config", "harness.stats"},
    "harness.sweep": {"harness.core", "harness.store", "harness.config", "harness.stats",
                      "harness.report", "harness.session", "harness.run", "harness.__main__"},
}


def unit(module: str) -> str:
    """The package a harness module belongs to (a top-level module is its own unit)."""
    parts = module.split(".")
    if parts[0] != "harness" or len(parts) == 1:
        return parts[0] if parts[0] != "harness" else "harness"
    package = HARNESS / parts[1]
    return ".".join(parts[:2]) if package.is_dir() else module


def unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, imported in project_graph().items():
        if not module.startswith("harness"):
            continue
        mine = unit(module)
        graph.setdefault(mine, set()).update(
            unit(m) for m in imported if m.startswith("harness") and unit(m) not in (mine, "harness"))
    return graph


def test_packages_of_harness_import_each_other_without_a_cycle():
    found = cycles(unit_graph())
    assert not found, "packages importing each other: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_lower_packages_import_only_what_lies_below_them():
    graph = unit_graph()
    wrong = {package: sorted(graph.get(package, set()) - allowed)
             for package, allowed in BELOW.items() if graph.get(package, set()) - allowed}
    assert not wrong, f"imports above a package's layer: {wrong}"


def test_the_top_level_of_harness_is_small():
    entries = sorted(p.name for p in HARNESS.iterdir()
                     if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())))
    assert len(entries) <= 15, f"{len(entries)} modules and packages at harness/: {entries}"


def test_the_layer_check_sees_an_upward_import():
    assert unit("harness.core.engine") == "harness.core"
    assert unit("harness.run") == "harness.run"
    graph = {"harness.core": {"harness.sweep"}, "harness.sweep": {"harness.core"}}
    assert cycles(graph) == [["harness.core", "harness.sweep"]]
