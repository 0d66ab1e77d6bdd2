"""model=hf: weights that do not match the config are an error, a useless config.json is one line,
GGUF files are converted once, and every model gets its own name (folder or hub id + config hash)."""

import json
import shutil
import time

import pytest
from hydra import compose, initialize_config_dir

from harness import models
from harness.report import find_runs, row
from harness.run import run
from kvcore.errors import ConfigError
from tests.conftest import PROJECT, STORIES, need_shared


def cfg_for(*overrides):
    with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def saved_tiny(folder, layers=2):
    """A tiny Llama saved as a model folder, with a word-level tokenizer built in code."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    models.tiny_llama(num_layers=layers).save_pretrained(folder)
    vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(255)}}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)
    return folder


def edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def load(folder):
    spec = models.resolve_model({"name": "hf", "name_or_path": str(folder), "dtype": "float32",
                                 "device": "cpu"})
    models.load_config(spec)
    return models.load_model(spec)


def test_config_with_more_layers_than_the_weights_is_an_error(tmp_path):
    folder = saved_tiny(tmp_path / "tiny")
    edit_config(folder, num_hidden_layers=4)
    with pytest.raises(ConfigError) as err:
        load(folder)
    message = str(err.value)
    assert "\n" not in message and str(folder) in message
    # layers 2 and 3: 9 tensors each (q, k, v, o, gate, up, down, two norms)
    assert "18 missing (model.layers.2.input_layernorm.weight, " in message and ", ...)" in message


def test_config_with_fewer_layers_than_the_weights_is_an_error(tmp_path):
    folder = saved_tiny(tmp_path / "tiny", layers=3)
    edit_config(folder, num_hidden_layers=2)
    with pytest.raises(ConfigError, match=r"9 unexpected \(model\.layers\.2\.") as err:
        load(folder)
    assert "\n" not in str(err.value)


def test_matching_weights_load_cleanly(tmp_path):
    model, _ = load(saved_tiny(tmp_path / "tiny"))
    assert model.config.num_hidden_layers == 2


def test_empty_config_json_is_one_line_before_weights(tmp_path):
    folder = saved_tiny(tmp_path / "tiny")
    (folder / "config.json").write_text("{}")
    spec = models.resolve_model({"name": "hf", "name_or_path": str(folder), "device": "cpu"})
    with pytest.raises(ConfigError) as err:
        models.load_config(spec)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"model folder {folder}: its config.json cannot be used")
    assert "model_type" in message


def test_identity_is_folder_name_plus_config_hash(tmp_path):
    a = saved_tiny(tmp_path / "a" / "same-name")
    b = saved_tiny(tmp_path / "b" / "same-name")
    edit_config(b, rms_norm_eps=1e-3)
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)

    def name(folder):
        spec = models.resolve_model({"name": "hf", "name_or_path": str(folder), "device": "cpu"})
        return models.identify(spec, models.load_config(spec)).name

    assert name(a).startswith("same-name-") and name(b).startswith("same-name-")
    assert name(a) != name(b)  # same folder name, different model
    assert name(copy).split("-")[-1] == name(a).split("-")[-1]  # same config, same hash


def test_hub_cache_snapshot_is_named_by_its_hub_id(tmp_path):
    """A folder of the hub cache is named as the hub id would be, never by its revision hash."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    folder = saved_tiny(tmp_path / "hub" / "models--acme--tiny-lm" / "snapshots" / revision)
    spec = models.resolve_model({"name": "hf", "name_or_path": str(folder), "device": "cpu"})
    named = models.identify(spec, models.load_config(spec))
    assert named.name == f"acme_tiny-lm-{named.extra['identity']['config_hash']}"
    assert named.source == str(folder)


def test_hf_results_are_named_by_model_identity(tmp_path):
    need_shared(STORIES)
    local = tmp_path / "my-stories"
    shutil.copytree(STORIES, local)
    args = ["model=hf", f"model.name_or_path={local}", "model.dtype=float32", "model.device=cpu",
            "task.max_tokens=40", "task.dataset=pg19", f"runner.results_root={tmp_path / 'r'}"]
    first = run(cfg_for(*args))
    edit_config(local, rms_norm_eps=1e-3)
    second = run(cfg_for(*args))
    names = [json.loads((p / "metrics.json").read_text())["model"] for p in (first, second)]
    assert names[0]["name"] != names[1]["name"]
    for out, model in zip((first, second), names):
        assert model["name"] == f"my-stories-{model['config_hash']}"
        assert out.parent.parent.name == model["name"]  # results/<task>/<model>/<method>/<stamp>
    rows = [row(p, json.loads(p.read_text()), None) for p in find_runs([str(tmp_path / "r")])]
    assert {r["model"] for r in rows} == {n["name"] for n in names}  # two curves, not one "hf"


def test_gguf_file_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="model.gguf_file=/nonexistent.gguf: no such file"):
        models.resolve_model({"name": "hf", "gguf_file": "/nonexistent.gguf"})
    (tmp_path / "x.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a .gguf file"):
        models.resolve_model({"name": "hf", "gguf_file": str(tmp_path / "x.bin")})
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf")
    spec = models.resolve_model({"name": "hf", "gguf_file": str(tmp_path / "broken.gguf"),
                                 "cache_dir": str(tmp_path / "cache")})
    with pytest.raises(ConfigError, match="transformers cannot read it") as err:
        models.load_config(spec)
    assert "\n" not in str(err.value)


@pytest.mark.slow  # converts SmolLM2's GGUF (20 s alone on 2 cores, minutes under load)
def test_gguf_file_is_converted_once_and_named_by_its_config(tmp_path):
    gguf = models.smollm2_gguf_path()
    cfg = {"name": "hf", "gguf_file": str(gguf), "cache_dir": str(tmp_path), "dtype": "float32",
           "device": "cpu"}
    spec = models.resolve_model(cfg)
    spec = models.identify(spec, models.load_config(spec))
    embedded = models.resolve_model({"name": "smollm2_135m", "device": "cpu"})
    embedded = models.identify(embedded, models.load_config(embedded))
    # The same GGUF through model=hf: named by its file and the same config hash.
    assert spec.name == f"{gguf.stem}-{embedded.extra['identity']['config_hash']}"
    model, tokenizer = models.load_model(spec)
    converted = list(tmp_path.glob("gguf-*"))
    assert len(converted) == 1 and (converted[0] / models._CONVERTED_MARK).is_file()
    stamp = (converted[0] / "model.safetensors").stat().st_mtime_ns
    started = time.time()
    models.load_model(models.resolve_model(cfg))  # reused, not converted again
    assert (converted[0] / "model.safetensors").stat().st_mtime_ns == stamp
    assert time.time() - started < 30
    assert model.config.num_hidden_layers == 30 and tokenizer("hello").input_ids
