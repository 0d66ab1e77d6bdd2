"""harness.core.models, model=hf: weights that do not match the config are an error, a useless or
non-finite config.json is one line before the weights load, NaN weights are refused, GGUF files
are converted once (a user's folder never overwritten), and every model gets its own name (folder
or hub id + config hash, GGUF metadata)."""

import errno
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from harness.core import models
from harness.report import find_runs, row
from harness.run import run
from kvcore.errors import ConfigError
from tests.conftest import PROJECT, STORIES, need_shared
from tests.helpers.runs import ST, model_folder, refused


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


def test_converted_model_cache_is_validated(tmp_path):
    folder = tmp_path / "conv"
    folder.mkdir()
    weights = folder / "model.safetensors"
    weights.write_bytes(b"w" * 1000)
    meta = {"weights_bytes": 1000, "weights_sha256": models._sha256(weights)}
    (folder / models._CONVERTED_MARK).write_text(json.dumps(meta))
    assert models._converted_ok(folder)
    weights.write_bytes(b"w" * 999 + b"x")  # same size, corrupt content
    assert not models._converted_ok(folder)
    (folder / models._CONVERTED_MARK).unlink()
    assert not models._converted_ok(folder)


@pytest.mark.usefixtures("shared_folder")
@pytest.mark.parametrize("config, expect", [
    ({"max_position_embeddings": 0}, "max_position_embeddings=0 must be a positive integer"),
    ({"hidden_size": -32}, "hidden_size=-32 must be a positive integer"),
    ({"num_hidden_layers": 0}, "num_hidden_layers=0"),
    ({"num_attention_heads": 0}, "num_attention_heads=0"),
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of "
                                 "num_key_value_heads=3"),
    ({"max_position_embeddings": 1}, "leaves nothing to score"),
])
def test_a_config_that_cannot_describe_a_model_is_refused(config, expect, tmp_path,
                                                          no_weight_loading):
    folder = model_folder(tmp_path, "m", **config)
    assert expect in refused(tmp_path, "model=hf", f"model.name_or_path={folder}",
                             "model.dtype=float32")


@pytest.mark.usefixtures("shared_folder")
def test_tokenizer_larger_than_the_embedding_is_refused_before_the_run(tmp_path, no_weight_loading):
    folder = model_folder(tmp_path, "small_vocab", vocab_size=100)
    message = refused(tmp_path, "model=hf", f"model.name_or_path={folder}", "model.dtype=float32")
    assert "has 512 tokens but the model's embedding has 100 rows" in message


@pytest.mark.usefixtures("shared_folder")
def test_cache_dir_that_is_a_file_or_read_only(tmp_path, monkeypatch, no_weight_loading):
    from harness.store import results

    a_file = tmp_path / "cache"
    a_file.write_text("not a folder")
    monkeypatch.setenv("KVH_CACHE_DIR", str(a_file))
    with pytest.raises(ConfigError, match=f"KVH_CACHE_DIR={a_file}: .* is a file, not a folder"):
        models.resolve_model({"name": "smollm2_135m", "device": "cpu"})
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path / "ro"))

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(results.tempfile, "mkstemp", read_only)
    with pytest.raises(ConfigError, match="KVH_CACHE_DIR=.*Read-only file system"):
        models.resolve_model({"name": "smollm2_135m", "device": "cpu"})


@pytest.mark.usefixtures("shared_folder")
def test_a_users_folder_where_a_model_would_be_converted_is_left_alone(tmp_path):
    folder = tmp_path / "smollm2-135m-instruct-q4_1"
    folder.mkdir()
    (folder / "mine.txt").write_text("not a converted model")
    with pytest.raises(ConfigError, match="is not a model this harness converted"):
        models.ensure_gguf_converted(models.smollm2_gguf_path(), folder, "SmolLM2")
    assert (folder / "mine.txt").read_text() == "not a converted model"


@pytest.mark.usefixtures("shared_folder")
def test_mismatched_weights_are_one_line_without_transformers_table(tmp_path, capfd):
    folder = model_folder(tmp_path, "mismatch", vocab_size=600)  # weights hold 512 rows
    with pytest.raises(ConfigError) as err:
        run(cfg_for("model=hf", f"model.name_or_path={folder}", "model.dtype=float32",
                "task.max_tokens=40", f"runner.results_root={tmp_path / 'r'}"))
    message = str(err.value)
    assert "do not match its config.json" in message and "mismatched" in message
    assert "ignore_mismatched_sizes" not in message
    printed = capfd.readouterr()
    assert "LOAD REPORT" not in printed.out + printed.err


@pytest.mark.usefixtures("shared_folder")
def test_corrupt_bin_weights_message(tmp_path):
    folder = model_folder(tmp_path, "corrupt_bin")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"garbage, not a checkpoint" * 10)
    with pytest.raises(ConfigError) as err:
        run(cfg_for("model=hf", f"model.name_or_path={folder}", "model.dtype=float32",
                "task.max_tokens=40", f"runner.results_root={tmp_path / 'r'}"))
    assert "not a PyTorch checkpoint" in str(err.value) and "weights_only" not in str(err.value)


def _gguf(path: Path, **meta) -> Path:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        if isinstance(value, int):
            writer.add_uint32(f"general.{key}", value)
        else:
            writer.add_string(f"general.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("stem, meta, label", [
    ("model-fee85397", {"name": "Qwen2.5 Coder 0.5B Instruct", "file_type": 3},
     "Qwen2.5-Coder-0.5B-Instruct-Q4_1"),
    ("ggml-model-q4_0", {"basename": "qwen2.5-coder", "size_label": "0.5B",
                         "finetune": "instruct", "file_type": 2},
     "qwen2.5-coder-0.5B-instruct-Q4_0"),
    ("SmolLM2-135M-Instruct.Q4_1", {"name": "Smollm2 135M 8k"}, "SmolLM2-135M-Instruct.Q4_1"),
    ("model", {}, "model"),  # nothing better known: the stem
])
def test_gguf_models_are_named_from_their_metadata(stem, meta, label, tmp_path):
    path = _gguf(tmp_path / f"{stem}.gguf", **meta)
    spec = models.resolve_model({"name": "hf", "gguf_file": str(path),
                                 "cache_dir": str(tmp_path / "cache")})
    assert spec.extra["label"] == label
    assert not (tmp_path / "cache").exists()  # resolving converts (and creates) nothing


def test_parameters_count_tied_embeddings_once():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         tie_word_embeddings=False))
    untied = sum(p.numel() for p in model.parameters())
    assert models.parameter_count(model) == untied  # two different matrices
    with torch.no_grad():  # an output embedding stored as a copy of the input one (GGUF)
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    assert models.parameter_count(model) == untied - 64 * 16


def test_a_named_model_from_another_folder_is_refused(tmp_path, no_weight_loading):
    need_shared(STORIES)
    other = model_folder(tmp_path, "other")
    message = refused(tmp_path, *ST, f"model.path={other}")
    assert f"model=stories260k model.path={other} holds another model" in message
    assert f"model=hf model.name_or_path={other}" in message


def test_a_copy_of_the_named_model_keeps_its_name(tmp_path):
    import shutil

    from harness.core import models

    need_shared(STORIES)
    copy = tmp_path / "stories_copy"
    shutil.copytree(STORIES, copy)
    spec = models.resolve_model({"name": "stories260k", "path": str(copy), "device": "cpu"})
    assert models.identify(spec, models.load_config(spec)).name == "stories260k"


def test_a_nan_in_the_model_config_is_refused_before_the_weights(tmp_path, no_weight_loading):
    need_shared(STORIES)
    folder = model_folder(tmp_path, "nan_eps", rms_norm_eps=float("nan"))
    message = refused(tmp_path, "model=hf", f"model.name_or_path={folder}", "task.max_tokens=40")
    assert "rms_norm_eps=nan must be a finite number" in message


def test_nan_weights_are_refused_not_written_as_ppl_nan(tmp_path):
    from safetensors.torch import load_file, save_file

    from harness.run import run

    need_shared(STORIES)
    folder = model_folder(tmp_path, "nan_weights")
    weights = load_file(folder / "model.safetensors")
    name = next(k for k in weights if k.endswith("q_proj.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    root = tmp_path / "results"
    with pytest.raises(ConfigError, match=f"{name} holds 1 NaN or infinite value"):
        run(cfg_for("model=hf", f"model.name_or_path={folder}", "task.max_tokens=40",
                f"runner.results_root={root}"))
    assert not root.exists()


def test_an_unknown_rope_type_names_the_config_not_the_weights(tmp_path, no_weight_loading):
    need_shared(STORIES)
    folder = model_folder(tmp_path, "bogus_rope",
                          rope_parameters={"rope_theta": 10000.0, "rope_type": "bogus"})
    message = refused(tmp_path, "model=hf", f"model.name_or_path={folder}", "task.max_tokens=40")
    assert "rope_type='bogus' is not a RoPE type this transformers builds; allowed: default" \
        in message


def test_runs_started_together_convert_a_model_once(tmp_path, monkeypatch):
    """Two runs on an empty cache: one converts, the other waits and reuses its folder (without
    the lock each would convert and replace the folder the other was loading)."""
    folder = tmp_path / "cache" / "model-q4"
    calls = []

    def convert(gguf, into, description):
        calls.append(into)
        time.sleep(0.5)  # both runs are past their first check by now
        into.mkdir()
        weights = into / "model.safetensors"
        weights.write_bytes(b"w" * 100)
        meta = {"weights_bytes": 100, "weights_sha256": models._sha256(weights)}
        (into / models._CONVERTED_MARK).write_text(json.dumps(meta))
        return into

    monkeypatch.setattr(models, "_convert_gguf", convert)
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda _: models.ensure_gguf_converted(Path("m.gguf"), folder, "m"),
                             range(2)))
    assert done == [folder, folder] and calls == [folder]
