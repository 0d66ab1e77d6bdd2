"""One entry path: the model loads, a method prepares and an engine is built over them only in
harness.session (which validates every setting before the weights load). Code that writes the
load -> prepare -> Engine sequence out again skips those checks; this scan names it (file:line).
The allow-list gives each exception (a file, or one function of a file: `file::function`) its
reason."""

import ast
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
SCANNED = ("harness", "tasks", "benchmarks")

# file -> why it may call the sequence's steps itself
ALLOWED = {
    "harness/session.py": "the entry path itself",
    "harness/sweep/plan.py": "the sweep's shared-prefill and eager engines, over the model and "
                               "methods its Session loaded and prepared",
    "harness/api.py": "the user's own model, already loaded: the cache runs the runner's checks "
                      "(method.validate, protocol_reasons) before it prepares",
    "benchmarks/infinigen_official.py": "the authors' code reads the model, which may be one "
                                        "built in code (tiny_gqa7) that no model config names",
    "benchmarks/throughput.py": "random-weight Llama shapes built in code "
                                "(benchmarks.random_models), which no model config names",
    "benchmarks/offload_speed.py::random_engine": "random-weight Llama shapes built in code "
                                                  "(benchmarks.random_models), which no model "
                                                  "config names",
    "benchmarks/serving_vs_vllm.py": "the full cache only (nothing to prepare or refuse), one "
                                     "loaded model serving engines of every batch size and "
                                     "layout in turn, timed against vLLM on the same prompts",
    "benchmarks/parity.py": "the Q-Filters case reads a filters file exported from the loaded "
                            "model, so not every setting can be checked before the weights load",
}


def sequence_calls(source: str) -> list[tuple[int, str, str | None]]:
    """(line, call, the innermost function around it) of every `models.load_model(`,
    `hf_adapter.prepare(` and `Engine(` call."""
    found = []

    def visit(node, function):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            owner = getattr(func.value, "id", None) if isinstance(func, ast.Attribute) else None
            if name in ("Engine", "load_model") or (name == "prepare" and owner == "hf_adapter"):
                found.append((node.lineno, f"{owner}.{name}" if owner else name, function))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source), None)
    return sorted(found)


def offences(files: list[Path]) -> tuple[list[str], set[str]]:
    """The calls outside the allow-list (file:line: call), and the allow-list entries used."""
    out, used = [], set()
    for path in files:
        rel = path.relative_to(PROJECT).as_posix()
        for line, call, function in sequence_calls(path.read_text(encoding="utf-8")):
            entry = next((e for e in (rel, f"{rel}::{function}") if e in ALLOWED), None)
            if entry is None:
                out.append(f"{rel}:{line}: {call}(")
            else:
                used.add(entry)
    return out, used


def test_only_the_session_loads_prepares_and_builds_engines():
    files = sorted(p for d in SCANNED for p in (PROJECT / d).rglob("*.py"))
    assert PROJECT / "harness" / "session.py" in files and len(files) > 50  # the scan sees them
    found, used = offences(files)
    assert not found, ("build settings with harness.session (Session, setting, compose) and get "
                       "engines from Session.engine / Session.ready, which validate before the "
                       "weights load:\n" + "\n".join(found))
    assert used == set(ALLOWED), f"allow-list entries with nothing to allow: {set(ALLOWED) - used}"


def test_a_planted_sequence_is_found(tmp_path):
    planted = ("from harness import hf_adapter, models\nfrom harness.core.engine import Engine\n"
               "model, tok = models.load_model(spec, 'sdpa')\n"
               "hf_adapter.prepare(method, model, tok, info)\n"
               "engine = Engine(model, tok, method, info)\n")
    assert sequence_calls(planted) == [(3, "models.load_model", None),
                                       (4, "hf_adapter.prepare", None), (5, "Engine", None)]
    inside = "def random_engine():\n    def make():\n        return Engine(m, t, x, i)\n"
    assert sequence_calls(inside) == [(3, "Engine", "make")]  # the innermost function
    clean = ("from harness.session import Session\n'''models.load_model(spec) in a docstring'''\n"
             "engines = Session(settings).ready()  # not Engine(...)\n")
    assert sequence_calls(clean) == []
