"""Every method with a `prepare` declares what it makes (`KVMethod.artefact_names`): a sweep
hands exactly those to another setting of the same `prepare_key` (harness.session), so an
attribute `prepare` sets without declaring it would be missing there. Checked on a tiny Llama
at each method's defaults."""

import pytest

from harness.core import hf_adapter
from methods import available_methods, build_method, method_class
from tests.methods.contract.common import get_model

PREPARING = [name for name in available_methods() if build_method(name).needs_prepare()]


def test_declared_artefacts_only_with_a_prepare():
    for name in available_methods():
        if name not in PREPARING:
            assert not method_class(name).artefact_names, (
                f"{name} declares artefacts but has no prepare to make them")


@pytest.mark.parametrize("name", PREPARING)
def test_prepare_sets_only_declared_artefacts(name, request, monkeypatch, tmp_path):
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path))
    model = get_model("llama", request)
    method = build_method(name)
    before = dict(vars(method))
    hf_adapter.prepare(method, model, None)
    set_now = {k for k, v in vars(method).items() if k not in before or before[k] is not v}
    undeclared = sorted(set_now - set(method.artefact_names))
    assert not undeclared, (f"{name}.prepare sets {', '.join(undeclared)} without declaring it "
                            "in artefact_names: a sweep would not hand it to the settings "
                            "sharing its prepare")
    artefacts = method.artefacts()
    other = build_method(name)
    other.adopt_artefacts(artefacts)
    assert all(getattr(other, k) is v for k, v in artefacts.items())
    with pytest.raises(ValueError, match="declares no artefact"):
        other.adopt_artefacts({"not_an_artefact": 1})
