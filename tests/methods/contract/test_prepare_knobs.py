"""A method declaring `prepare_knobs` (the knobs its `prepare` reads) is prepared once for every
setting of a sweep equal in them, the others taking its artefacts (harness.session). That is
only right when every other knob changes nothing `prepare` makes: each is set to other valid
values on a tiny Llama, at the method's defaults (where the calibration runs), and the
artefacts `prepare` made (`KVMethod.artefacts`) and the facts it returned (but wall times) must
be equal."""

import pytest
import torch

from harness.core import hf_adapter
from kvcore.errors import ConfigError
from methods import available_methods, build_method, method_class
from tests.methods.contract.common import get_model
from tests.methods.contract.knobs import alternatives

DECLARING = [name for name in available_methods() if method_class(name).prepare_knobs is not None]
CASES = [pytest.param(name, knob, id=f"{name}.{knob}") for name in DECLARING
         for knob in method_class(name).hyperparameter_names()
         if knob not in method_class(name).prepare_knobs]


def prepared(model, method) -> tuple[dict, dict]:
    """(the artefacts `prepare` made, its facts without wall times)."""
    facts = hf_adapter.prepare(method, model, None)
    made = method.artefacts()  # what a sweep hands to settings of the same key
    return made, {k: v for k, v in facts.items() if not k.endswith(("_s", "_ms"))}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_prepare_knobs_are_knobs():
    for name in DECLARING:
        cls = method_class(name)
        unknown = set(cls.prepare_knobs) - set(cls.hyperparameter_names())
        assert not unknown, f"{name}.prepare_knobs names no knob: {sorted(unknown)}"
        assert cls.needs_prepare(build_method(name)), f"{name} declares prepare_knobs, no prepare"


@pytest.mark.parametrize("name, knob", CASES)
def test_a_knob_prepare_does_not_read_changes_nothing_it_makes(name, knob, request, monkeypatch,
                                                              tmp_path):
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))
    model = get_model("llama", request, layers=3)
    base = build_method(name)
    reference = prepared(model, base)
    tried = []
    value = getattr(base, knob)
    unset_size = {"_ratio": [0.2, 0.5], "_tokens": [64]}  # a budget left unset by default
    extra = next((v for end, v in unset_size.items() if value is None and knob.endswith(end)), [])
    for value in [*alternatives(name, knob, value, {}), *extra]:
        try:
            other = build_method(name, **{knob: value})
        except (ConfigError, TypeError, ValueError):
            continue
        tried.append(value)
        assert same(prepared(model, other), reference), (
            f"method.{knob}={value!r} changes what {name}'s prepare makes: a sweep would hand it "
            f"another setting's artefacts; declare it in {name}.prepare_knobs")
    if not tried:
        pytest.skip(f"method.{knob}: no other valid value to try at {name}'s defaults")
