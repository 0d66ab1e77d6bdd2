"""One entry path: the model loads, a method prepares and an engine is built over them only in
harness.session (which validates every setting before the weights load). Code that writes the
load -> prepare -> Engine sequence out again skips those checks; this scan names it (file:line).
The allow-list gives each exception its reason."""

import ast
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
SCANNED = ("harness", "tasks", "benchmarks")

# file -> why it may call the sequence's steps itself
ALLOWED = {
    "harness/session.py": "the entry path itself",
    "harness/sweep_engine.py": "the sweep's shared-prefill and eager engines, over the model and "
                               "methods its Session loaded and prepared",
    "harness/api.py": "the user's own model, already loaded: the cache runs the runner's checks "
                      "(method.validate, protocol_reasons) before it prepares",
    "benchmarks/infinigen_official.py": "the authors' code reads the model, which may be one "
                                        "built in code (tiny_gqa7) that no model config names",
    "benchmarks/throughput.py": "random-weight Llama shapes built in code "
                                "(benchmarks.random_models), which no model config names",
    "benchmarks/offload_speed.py": "random-weight Llama shapes built in code "
                                   "(benchmarks.random_models), which no model config names",
    "benchmarks/parity.py": "the Q-Filters case reads a filters file exported from the loaded "
                            "model, so not every setting can be checked before the weights load",
}


def sequence_calls(source: str) -> list[tuple[int, str]]:
    """(line, call) of every `models.load_model(`, `hf_adapter.prepare(` and `Engine(` call."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        owner = getattr(func.value, "id", None) if isinstance(func, ast.Attribute) else None
        if name in ("Engine", "load_model") or (name == "prepare" and owner == "hf_adapter"):
            found.append((node.lineno, f"{owner}.{name}" if owner else name))
    return sorted(found)


def offences(files: list[Path]) -> tuple[list[str], set[str]]:
    """The calls outside the allow-list (file:line: call), and the allowed files that call."""
    out, used = [], set()
    for path in files:
        rel = path.relative_to(PROJECT).as_posix()
        calls = sequence_calls(path.read_text(encoding="utf-8"))
        if calls and rel in ALLOWED:
            used.add(rel)
        elif calls:
            out += [f"{rel}:{line}: {call}(" for line, call in calls]
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
    planted = ("from harness import hf_adapter, models\nfrom harness.engine import Engine\n"
               "model, tok = models.load_model(spec, 'sdpa')\n"
               "hf_adapter.prepare(method, model, tok, info)\n"
               "engine = Engine(model, tok, method, info)\n")
    assert sequence_calls(planted) == [(3, "models.load_model"), (4, "hf_adapter.prepare"),
                                       (5, "Engine")]
    clean = ("from harness.session import Session\n'''models.load_model(spec) in a docstring'''\n"
             "engines = Session(settings).ready()  # not Engine(...)\n")
    assert sequence_calls(clean) == []
