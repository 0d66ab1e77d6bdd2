"""The path from `python -m harness -m` to where one (setting, prompt) of a sweep runs is the
one the execute step's docstring names, four hops: `SweepLauncher.launch` -> `run_group` ->
`run_sweep` -> `harness.sweep.execute.evaluate` -> `Decoder.add`. Each function on it calls the
next itself (read from the source), so the docstring cannot drift from the code unnoticed."""

import ast
import inspect
import textwrap

import pytest

from harness.sweep import execute, run
from harness.sweep.decode import Decoder
from hydra_plugins.kvh_sweep import sweep_launcher

PATH = [(sweep_launcher.SweepLauncher.launch, "run_group"), (sweep_launcher.run_group, "run_sweep"),
        (run.run_sweep, "evaluate"), (execute.evaluate, "add")]


def called_names(function) -> set[str]:
    """Names of the functions and methods `function`'s body calls."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            for node in ast.walk(tree) if isinstance(node, ast.Call)}


@pytest.mark.parametrize("function, callee", PATH, ids=lambda x: getattr(x, "__qualname__", x))
def test_each_hop_calls_the_next(function, callee):
    assert callee in called_names(function), f"{function.__qualname__} no longer calls {callee}"


def test_the_last_hop_is_the_decoder_and_the_docstring_names_the_path():
    assert "turn.decoder.add(" in inspect.getsource(execute.evaluate)
    assert hasattr(Decoder, "add")
    doc = " ".join(execute.__doc__.split())
    assert ("`SweepLauncher.launch` (hydra_plugins/kvh_sweep) -> `run_group` -> "
            "`harness.sweep.run.run_sweep` -> `evaluate` (here) -> `Decoder.add`") in doc
