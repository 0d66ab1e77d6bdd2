"""Architectures a method cannot serve are refused by the runner before any weights load, with one
line naming the method and the architecture fact (ModelInfo from the config alone)."""


import pytest

from harness.run import run
from kvcore.errors import ConfigError
from tests.helpers.runs import cfg_for, cli_here
from tests.models import deepseek_v2_config, family_config, gemma3_text_config


def model_folder(tmp_path, config):
    """A model folder as the runner checks it: config.json + a weights file never read here."""
    folder = tmp_path / "model"
    config.save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def no_rope_config():
    from transformers import GPT2Config

    return GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, vocab_size=256)


def rope_variant(family, **rope):
    config = family_config(family)
    config.rope_parameters = {**config.rope_parameters, **rope}
    return config


REFUSED = [  # (config, method overrides, fragment of the one-line reason)
    (lambda: family_config("mistral"), ["method=h2o"], "method=h2o evicts or selects tokens, but "
                                                      "mistral has sliding-window attention"),
    (lambda: family_config("mistral"), ["method=streaming_llm"], "sliding-window attention"),
    (lambda: family_config("mistral"), ["method=oracle_topk"], "sliding-window attention"),
    (lambda: family_config("mistral"), ["method=infinigen"], "sliding-window attention"),
    (no_rope_config, ["method=streaming_llm"], "method=streaming_llm applies RoPE itself and "
                                               "needs a RoPE model; gpt2 has none"),
    (no_rope_config, ["method=infinigen"], "method=infinigen applies RoPE itself"),
    (lambda: rope_variant("phi3", partial_rotary_factor=0.5), ["method=streaming_llm"],
     "phi3 uses rope_type=default on 0.5 of each head"),
    (lambda: rope_variant("llama", rope_type="yarn", factor=4.0,
                          original_max_position_embeddings=128),
     ["method=infinigen"], "llama uses rope_type=yarn"),
    (gemma3_text_config, ["method=kvquant"],  # a RoPE model, but one inv_freq per layer type
     "method=kvquant applies plain RoPE over the whole head itself; gemma3_text uses "
     "rope_type=per layer type (full_attention: default theta 1000000.0, sliding_attention: "
     "default theta 10000.0)"),
    (deepseek_v2_config, ["method=full"], "caches a 'latent' format (multi-head latent attention)"),
    (deepseek_v2_config, ["method=kivi"], "method=kivi needs per-head K/V caches"),
    (deepseek_v2_config, ["method=h2o"], "method=h2o needs per-head K/V caches"),
]


@pytest.mark.parametrize("config, overrides, message", REFUSED)
def test_refused_before_weights_in_one_line(config, overrides, message, no_weight_loading,
                                            tmp_path):
    folder = model_folder(tmp_path, config())
    results = tmp_path / "results"
    with pytest.raises(ConfigError) as err:
        run(cfg_for("model=hf", f"model.name_or_path={folder}", *overrides,
                    f"runner.results_root={results}"))
    assert message in str(err.value)
    assert "\n" not in str(err.value)
    assert not results.exists()


@pytest.mark.parametrize("config, overrides", [
    (no_rope_config, ["method=streaming_llm", "method.rerotate=false"]),  # no re-rotation
    (no_rope_config, ["method=h2o"]),
    (lambda: family_config("mistral"), ["method=kivi"]),  # keeps every token: the mask holds
    (lambda: family_config("qwen2"), ["method=h2o"]),  # sliding_window set but unused (layer_types)
    (gemma3_text_config, ["method=kivi"]),  # no RoPE of its own: per-layer-type RoPE is fine
])
def test_servable_architectures_reach_weight_loading(config, overrides, no_weight_loading,
                                                     tmp_path):
    folder = model_folder(tmp_path, config())
    with pytest.raises(AssertionError, match="weights were loaded"):
        run(cfg_for("model=hf", f"model.name_or_path={folder}", *overrides,
                    f"runner.results_root={tmp_path / 'results'}"))


def test_cli_refusal_is_one_line_and_exits_nonzero(tmp_path, monkeypatch):
    folder = model_folder(tmp_path, family_config("mistral"))
    status, _, err = cli_here(monkeypatch, "model=hf", "method=h2o", f"model.name_or_path={folder}",
                              f"runner.results_root={tmp_path / 'r'}")
    assert status != 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "sliding-window attention" in lines[0], err
    assert not (tmp_path / "r").exists()


def test_soft_capped_attention_is_refused_for_every_method():
    """Gemma-2 soft-caps attention logits inside transformers' own eager function, which our
    seams replace: every method refuses it instead of serving a different model."""
    from transformers import Gemma2Config

    from harness.core.hf_adapter import model_info
    from methods import available_methods, build_method, method_class

    info = model_info(Gemma2Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   vocab_size=100))
    for name in available_methods():
        reasons = build_method(name, **method_class(name).lossless_hyperparameters(64)
                               ).architecture_reasons(info)
        assert reasons and "soft-capping (50.0)" in reasons[0], name
