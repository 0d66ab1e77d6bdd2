"""Every registered method: composes from its YAML, runs prefill + decode on eager and sdpa with
chunked prefill, leaves the model pristine, and equals the full cache when its budget covers the
sequence (one parametrized test over all methods; a new method is covered by adding its files)."""


import pytest
import torch

from harness import hf_adapter
from methods import available_methods, build_method, method_class
from tests.conftest import PROJECT, make_engine

METHODS = available_methods()


def run_logits(model, method, ids, prefill_end, chunk):
    engine = make_engine(model, method, chunk=chunk)
    with engine.request() as req:
        out = [req.prefill(ids[:, :prefill_end], all_logits=True)]
        out += [req.step(ids[:, i]) for i in range(prefill_end, ids.shape[1])]
    return torch.cat(out, 1), engine


def test_every_method_has_yaml_and_test():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from methods import SHARED_KNOBS

    for name in METHODS:
        with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
            conf = OmegaConf.to_container(compose("config", [f"method={name}"]).method)
        assert conf.pop("name") == name
        fields = method_class(name).hyperparameter_names()
        assert set(fields) <= set(conf) <= set(fields) | set(SHARED_KNOBS), name
        assert (PROJECT / "tests" / "methods" / f"test_{name}.py").is_file(), name
        build_method(name, **conf)  # the defaults are valid


def test_declared_capabilities_match_the_code():
    """Capabilities are read by the runner, so they must be true: a method with its own
    `prepare` declares needs_prepare (the runner skips prepare otherwise), one that keeps the
    full cache as a reference declares compresses=False, every prefill mode is a known one."""
    from methods.base import PREFILL_MODES, KVMethod

    for name in METHODS:
        cls = method_class(name)
        caps = cls.capabilities
        assert (cls.prepare is not KVMethod.prepare) == caps.needs_prepare, name
        assert set(caps.prefill_modes) <= set(PREFILL_MODES) and caps.prefill_modes, name
        if caps.needs_prefill:
            assert not caps.acts_during_decode, name
        fields = set(cls.hyperparameter_names())
        assert set(cls.axis_keys) | set(cls.variant_keys) <= fields | {"budget_ratio",
                                                                       "budget_tokens"}, name


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("which", ["tiny", "stories"])
@pytest.mark.parametrize("name", METHODS)
def test_budget_covering_the_sequence_equals_full(name, which, attn, request):
    model = request.getfixturevalue("tiny_model" if which == "tiny" else "stories")
    model = model if which == "tiny" else model[0]
    torch.manual_seed(3)
    ids = torch.randint(3, 250, (1, 72))
    hf_adapter.set_attention(model, attn)
    try:
        full, _ = run_logits(model, build_method("full"), ids, 56, chunk=24)
        cls = method_class(name)
        got, engine = run_logits(model, build_method(name, **cls.lossless_hyperparameters(72)),
                                 ids, 56, chunk=24)
    finally:
        hf_adapter.set_attention(model, "sdpa")
    assert (got - full).abs().max().item() <= 2e-5, name
    assert not any(hasattr(m, "_kvh_layer") for m in hf_adapter.attention_modules(model))
    assert engine.ledger.samples[-1]["tokens_per_layer"][0] > 0
