"""Whether a knob acts: the compressing case run at the knob's default and at other valid values
(test_every_knob_acts.py; the mutants' uniform-split check)."""

import math
import re

import torch

from harness.core import hf_adapter
from kvcore.errors import ConfigError
from methods import build_method, method_class
from tests.conftest import make_engine
from tests.methods.contract.step_checker import SEQ_TOKENS

PREFILL_TOKENS, CHUNK_TOKENS = 48, 16
SIZE_KNOBS = ("budget_ratio", "budget_tokens")


def behaviour(model, method) -> tuple[torch.Tensor, list]:
    """(logits of every step, kept positions and stats of every layer at the end)."""
    ids = torch.randint(3, 250, (1, SEQ_TOKENS), generator=torch.Generator().manual_seed(7))
    engine = make_engine(model, method, chunk=CHUNK_TOKENS)
    with engine.request() as req:
        logits = [req.prefill(ids[:, :PREFILL_TOKENS])[0, -1]]
        logits += [req.step(ids[:, i])[0, -1] for i in range(PREFILL_TOKENS, SEQ_TOKENS)]
        state = [(kv.kept_positions().tolist(), kv.stats()) for kv in req.cache.kv_layers]
    return torch.stack(logits), state


# Test values for knobs of methods written before `knob_test_values` (a new method declares
# its own, for a knob whose default is null or that takes no numeric perturbation)
LEGACY_KNOB_VALUES = {
    ("shadowkv", "rank"): [4],  # null: the official rank 160, clamped to the head size
    ("squeezeattention", "scorer_options"): [{"recent_ratio": 0.25}],  # its H2O scorer's knob
}
# knobs naming a file or a folder (null: the method's default artefacts): what they read is
# tested by the method's own tests and tests/methods/contract/test_prepare_knobs.py
FILE_KNOB_SUFFIXES = ("_path", "_dir")


def declared_values(name: str, knob: str) -> list | None:
    declared = getattr(method_class(name), "knob_test_values", {})
    if knob in declared:
        return list(declared[knob])
    return LEGACY_KNOB_VALUES.get((name, knob))


def alternatives(name: str, knob: str, value, settings: dict) -> list:
    """Other values of `knob` to try, most telling first: the method's declared test values
    (`knob_test_values`), else perturbations of the default (a list of layer indices: one
    fewer, each one layer later)."""
    declared = declared_values(name, knob)
    if declared is not None:
        return [v for v in declared if v != value]
    if isinstance(value, list) and value and all(isinstance(i, int) for i in value):
        return [v for v in (value[:-1], [i + 1 for i in value]) if v != value]
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        out = (value // 2, value * 2, value + 1, value - 1, value // 8, value // 32, value * 4)
        return list(dict.fromkeys(v for v in out if v != value))
    if isinstance(value, float):
        out = [value / 2, value * 1.5, value + 0.25, value - 0.25, value / 4, value * 3]
        return [v for v in out if math.isfinite(v) and v != value]
    if isinstance(value, str) or value is None:
        try:
            build_method(name, **{**settings, knob: "__not_a_choice__"})
        except (ConfigError, TypeError, ValueError) as refusal:
            found = re.search(r"allowed[^:]*: ([^;]+)", str(refusal))
            if found:
                return [c.strip() for c in found.group(1).split(",") if c.strip() != value]
            if value is None and "a boolean" in str(refusal):  # optional boolean: null = a rule
                return [True, False]
    return []


def has_alternatives(name: str, knob: str) -> bool:
    """Whether `alternatives` names any other value of `knob` (valid or not)."""
    settings = method_class(name).compressing_hyperparameters(SEQ_TOKENS)
    return bool(alternatives(name, knob, getattr(build_method(name, **settings), knob), settings))


def knob_acts(model, name: str, knob: str) -> bool | None:
    """True when another valid value of `knob` changes the behaviour in the compressing case,
    False when none does, None when no other valid value could be tried."""
    cls = method_class(name)
    settings = cls.compressing_hyperparameters(SEQ_TOKENS)
    base = build_method(name, **settings)
    info = hf_adapter.model_info(model.config)
    others = []  # the valid other values, found before anything runs (a file knob has none)
    for value in alternatives(name, knob, getattr(base, knob), settings):
        try:
            other = build_method(name, **{**settings, knob: value})
        except (ConfigError, TypeError, ValueError):
            continue
        if not other.validate(info, {"batch_size": 1}):
            others.append(other)
    if not others:
        return None
    ref_logits, ref_state = behaviour(model, base)
    for other in others:
        logits, state = behaviour(model, other)
        if not torch.equal(logits, ref_logits) or state != ref_state:
            return True
    return False


def knobs(name: str) -> list[str]:
    """A method's own knobs (the shared size knobs are the contract's compressing case)."""
    cls = method_class(name)
    fields = [k for k in cls.hyperparameter_names() if k not in SIZE_KNOBS]
    budget = [k for k in SIZE_KNOBS if k in cls.compressing_hyperparameters(SEQ_TOKENS)]
    return fields + budget
