"""The closed interface between a task and its engine (tasks.engine_api): every engine a task
can be given writes out each member of `TaskEngine`, and a task asks only for those members
unless it declares `needs_live_engine`."""

import ast
import inspect
import textwrap
from pathlib import Path

import pytest
import torch

from harness.core.engine import Engine
from harness.engines.vllm_engine import VllmEngine
from tasks import available_tasks, build_task, task_class
from tasks.engine_api import MEMBERS, GenerationRequest, ScoreStreamRequest, TaskEngine

PROJECT = Path(__file__).resolve().parents[2]
IMPLEMENTATIONS = (Engine, VllmEngine)


def written_members(cls: type) -> set[str]:
    """The members `cls` writes out itself: methods and properties of its own class body, and
    the attributes its `__init__` assigns on `self`."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    found = {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    init = next((n for n in body if isinstance(n, ast.FunctionDef) and n.name == "__init__"),
                None)
    for node in ast.walk(init) if init else ():
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"):
            found.add(node.attr)
    return found


def test_the_interface_lists_every_member():
    abstract = set(TaskEngine.__abstractmethods__)
    facts = set(TaskEngine.__annotations__)
    assert abstract | facts == set(MEMBERS)


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_every_engine_writes_out_every_member(cls):
    assert issubclass(cls, TaskEngine)
    assert not cls.__abstractmethods__
    missing = set(MEMBERS) - written_members(cls)
    assert not missing, f"{cls.__name__} does not write out {sorted(missing)}"


def test_the_member_scan_sees_what_a_class_lacks():
    class Partial(TaskEngine):
        def __init__(self, tokenizer):
            self.tokenizer, self.info = tokenizer, None

        def encode(self, text, add_special_tokens=None):
            return []

    assert set(MEMBERS) - written_members(Partial) == {
        "method", "stop_token_ids", "generate", "score_stream", "fidelity_many", "stream_fidelity"}
    with pytest.raises(TypeError, match="abstract"):
        Partial(None)


def engine_attributes(path: Path) -> dict[str, list[int]]:
    """attribute -> lines of every `engine.<attribute>` in a task module."""
    found: dict[str, list[int]] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "engine"):
            found.setdefault(node.attr, []).append(node.lineno)
    return found


def may_need_live_engine(name: str) -> bool:
    """Whether the task declares a live engine (a class attribute, or a property deciding it
    from its options)."""
    declared = inspect.getattr_static(task_class(name), "needs_live_engine")
    return isinstance(declared, property) or declared is True


def test_tasks_ask_their_engine_only_for_the_interface():
    offences = []
    for name in available_tasks():
        if may_need_live_engine(name):
            continue
        path = PROJECT / "tasks" / f"{name}.py"
        for attribute, lines in engine_attributes(path).items():
            if attribute not in MEMBERS:
                offences.append(f"tasks/{name}.py:{lines[0]}: engine.{attribute}")
    assert not offences, ("a task asks its engine for more than tasks.engine_api.TaskEngine; "
                          "declare Task.needs_live_engine or send a request: "
                          + ", ".join(offences))
    assert {"multiturn", "lm_eval", "perplexity"} <= {n for n in available_tasks()
                                                     if may_need_live_engine(n)}


def test_the_task_scan_sees_an_engine_attribute(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def evaluate(self, engine):\n    return engine.model, engine.encode('a')\n")
    assert engine_attributes(planted) == {"model": [2], "encode": [2]}


def test_perplexity_needs_a_live_engine_in_chunked_mode_only():
    assert build_task("perplexity", mode="chunked").needs_live_engine
    assert not build_task("perplexity", mode="streaming").needs_live_engine
    assert task_class("multiturn").needs_live_engine and task_class("lm_eval").needs_live_engine
    assert not task_class("ruler").needs_live_engine


def test_a_generation_request_is_normalized_so_equal_work_compares_equal():
    a = GenerationRequest([(1, 2), [3]], 4, {7}, queries=[[5], (6,)])
    b = GenerationRequest([[1, 2], [3]], [4, 4], frozenset({7}), queries=[[5], [6]])
    assert a == b and a.max_new_tokens == [4, 4] and a.query(1) == [6]
    assert a != GenerationRequest([[1, 2], [3]], [4, 5], {7}, queries=[[5], [6]])
    assert GenerationRequest([[1]], 2).query(0) is None
    with pytest.raises(ValueError, match="2 prompts, 1 limits"):
        GenerationRequest([[1], [2]], [3])
    with pytest.raises(ValueError, match="1 queries"):
        GenerationRequest([[1], [2]], 3, queries=[[4]])
