"""Every hyperparameter of every method changes what the method does (no ignored knob).

For each method and each of its knobs, the compressing case (a chunked prompt, then decode
steps on a tiny GQA Llama) runs at the knob's default and at another valid value: the logits or
the kept positions must differ. A knob that by design changes nothing in this case says so in
`KVMethod.inert_knobs` with its reason (e.g. InfiniGen's `mode`: `system` and `simulate` give
the same outputs by construction), and the test checks that claim too. String knobs take the
alternatives the method's own refusal names ("allowed: ..."); a knob with no such list is
perturbed only if it is numeric, boolean or a list of layer indices; a knob with none of these
(a null default) takes the values its method declares in `knob_test_values`, or the test fails.

This is also how a newcomer's "uniform split" (PyramidKV's pyramid silently flat) is caught: its
`beta` then changes nothing (tests/methods/contract/test_contract_mutants.py). A knob that changes
nothing on the random tiny Llama (whose flat attention can hide a threshold) is tried on stories260K.
"""

import pytest

from harness.core import hf_adapter
from methods import available_methods, build_method, method_class
from tests.methods.contract.common import get_model
from tests.methods.contract.knobs import FILE_KNOB_SUFFIXES, has_alternatives, knob_acts, knobs
from tests.methods.contract.step_checker import SEQ_TOKENS


CASES = [pytest.param(name, knob, id=f"{name}.{knob}")
         for name in available_methods() for knob in knobs(name)]


@pytest.mark.parametrize("name, knob", CASES)
def test_every_knob_acts(name, knob, request, monkeypatch, tmp_path):
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    inert = method_class(name).inert_knobs
    acts = knob_acts(get_model("llama", request, layers=3), name, knob)
    if not acts:  # a random tiny model's flat attention can hide a knob: ask a trained one
        stories = get_model("stories", request)
        settings = method_class(name).compressing_hyperparameters(SEQ_TOKENS)
        if not build_method(name, **settings).validate(
                hf_adapter.model_info(stories.config), {"batch_size": 1}):
            acts = knob_acts(stories, name, knob) or acts
    if knob in inert:
        assert acts is not True, f"method.{knob} is declared inert ({inert[knob]}) but acts"
        return
    if acts is None and knob.endswith(FILE_KNOB_SUFFIXES):
        pytest.skip(f"method.{knob} names a file or folder (its contents: the method's own tests)")
    if acts is None and has_alternatives(name, knob):
        pytest.skip(f"method.{knob}: every other value is refused in the compressing case")
    assert acts is not None, (
        f"method={name}: method.{knob}: no other valid value to try (a null default, no numeric "
        "perturbation, no 'allowed:' list in its refusal): declare one in the method's "
        "knob_test_values (no knob untested)")
    assert acts, (f"method={name}: method.{knob} changes nothing in the compressing case: an "
                  "ignored knob (or declare it in inert_knobs with the reason)")
