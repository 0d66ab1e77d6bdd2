"""The methods and models every shared check runs over, and what each check starts from: the
session's model of a family, a refusal turned into a skip, a request's logits."""

import functools

import pytest
import torch

from harness.core import hf_adapter
from methods import available_methods
from tests.conftest import make_engine
from tests.models import FAMILIES, heads_model

METHODS = available_methods()
MODELS = ["stories", *FAMILIES]  # "llama" is the harness's reference tiny GQA Llama
# the tiny Llama whose heads attend differently by construction (tests/models.py), where a head
# or group bug changes a kept set: in the compressing contract (test_contract.py)
HEADS = "heads"


@functools.cache
def session_heads_model(layers: int):
    return heads_model(layers)


def get_model(which, request, layers=2):
    if which == "stories":
        return request.getfixturevalue("stories")[0]
    if which == "llama" and layers == 2:
        return request.getfixturevalue("tiny_model")
    if which == "heads":
        return session_heads_model(layers)
    return request.getfixturevalue("family_models")(which, layers)


def skip_if_refused(method, model):
    """A method refused for this architecture (by design, see test_refusals_follow_...) is not
    run on it; the skip carries the one-line refusal."""
    reasons = method.validate(hf_adapter.model_info(model.config), {"batch_size": 1})
    if reasons:
        pytest.skip(f"refused: {'; '.join(reasons)}")


def run_logits(model, method, ids, prefill_end, chunk):
    engine = make_engine(model, method, chunk=chunk)
    with engine.request(final_tokens=ids.shape[1]) as req:  # the final length: all of ids
        out = [req.prefill(ids[:, :prefill_end], all_logits=True)]
        out += [req.step(ids[:, i]) for i in range(prefill_end, ids.shape[1])]
    return torch.cat(out, 1), engine
