"""The runner end to end: results on disk, and clear errors before any weights load."""

import json
import shutil
import socket
from pathlib import Path

import pytest

from kvcore.errors import ConfigError
from harness.run import run
from tests.conftest import STORIES, need_shared
from tests.helpers.reports import fake_run
from tests.helpers.runs import ST, cfg_for, cli_here, refused


def test_stories_run_writes_complete_results(tmp_path):
    need_shared(STORIES)
    out = run(cfg_for("model=stories260k", "task.max_tokens=300", "task.dataset=pg19",
                      f"runner.results_root={tmp_path}"))
    assert out.parent == tmp_path / "perplexity" / "stories260k" / "full"
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("accuracy", "speed", "memory", "kv", "model", "method", "task", "env", "protocol"):
        assert key in metrics
    assert metrics["accuracy"]["tokens_scored"] == 299
    assert metrics["kv"]["tokens_per_layer"] == [299.0] * 5
    assert metrics["speed"]["decode_steps"] == 299
    assert metrics["env"]["versions"]["transformers"] == "5.24.0"
    assert metrics["env"]["git"]["commit"] is None or len(metrics["env"]["git"]["commit"]) == 40
    assert (out / "config.yaml").is_file() and (out / "samples.jsonl").is_file()
    assert not [p for p in tmp_path.rglob(".*partial*")]


@pytest.mark.parametrize("overrides, message", [
    (["runner.prefill_chunk_tokens=0"], "runner.prefill_chunk_tokens=0 must be a positive integer"),
    (["runner.batch_size=2"], "runner.batch_size=2"),
    (["runner.attn_impl=flash"], "runner.attn_impl='flash'; allowed: sdpa, eager"),
    (["task.mode=sliding"], "task.mode='sliding'; allowed: chunked, streaming"),
    (["task.dataset=wikitext103"], "task.dataset='wikitext103'"),
    (["model.dtype=float8"], "model.dtype='float8'; allowed"),
    (["model.device=tpu"], "model.device='tpu'; allowed: auto, cpu, cuda"),
    (["model=hf"], "model=hf needs model.name_or_path"),
    (["model=hf", "model.name_or_path=/nonexistent/model"], "no such folder"),
    (["model=stories260k", "task.max_tokens=600"], "longer than the model's max positions (512)"),
    (["model=stories260k", "task.mode=chunked", "task.window_tokens=1024"],
     "task.window_tokens=1024 is longer than the model's max positions"),
    (["model=stories260k", "task.dataset=text_file"], "task.dataset=text_file needs task.path"),
])
def test_config_errors_name_the_key_before_weights(overrides, message, no_weight_loading, tmp_path):
    if any("stories260k" in o for o in overrides):
        need_shared(STORIES)
    with pytest.raises(ConfigError) as err:
        run(cfg_for(*overrides, f"runner.results_root={tmp_path}"))
    assert message in str(err.value)
    assert not any(tmp_path.iterdir())


def test_cuda_requested_without_cuda(no_weight_loading):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        run(cfg_for("model.device=cuda"))


@pytest.mark.parametrize("args, expect", [
    (["method=nosuch"], "Could not find 'method/nosuch'"),
    (["task=nosuch"], "Could not find 'task/nosuch'"),
    (["method.budgte_ratio=0.2"], "budgte_ratio"),
    (["runner.prefill_chunk_tokens=-5"], "error: runner.prefill_chunk_tokens=-5 must be a positive"),
])
def test_cli_errors_exit_nonzero_with_one_message(args, expect, tmp_path, monkeypatch):
    status, _, err = cli_here(monkeypatch, *args, f"runner.results_root={tmp_path}")
    assert status != 0
    assert expect in err
    assert "Traceback" not in err
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Local model folders: a tiny Llama with head_dim 48 (no tokenizer), broken variants."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("models")
    odd = root / "head_dim_48"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=96, intermediate_size=96,
                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=256)).save_pretrained(odd)
    (root / "empty").mkdir()
    (root / "readme_only").mkdir()
    (root / "readme_only" / "README.md").write_text("not a model")
    (root / "no_weights").mkdir()
    shutil.copy(STORIES / "config.json", root / "no_weights" / "config.json")
    corrupt = root / "corrupt"
    shutil.copytree(STORIES, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage, not safetensors")
    texts = root / "texts"
    texts.mkdir()
    (texts / "empty.txt").write_text("\n \n")
    (texts / "latin1.txt").write_bytes("na\xefve caf\xe9".encode("latin-1"))
    lb = root / "longbench"
    lb.mkdir()
    good = {"input": "q", "context": "c", "answers": ["a"], "length": 1, "dataset": "trec",
            "language": "en", "all_classes": ["a"], "_id": "1"}
    (lb / "trec.jsonl").write_text(json.dumps(good) + "\n" + '{"input": "broken\n')
    return root


HF = "model=hf"


def cases(f: Path):
    """(overrides, text the message must contain): at least 30 distinct bad inputs."""
    st = "model=stories260k"
    return [
        (["method=h2o", "method.budget_ratio=0"], "method.budget_ratio=0"),
        (["method=h2o", "method.budget_ratio=-0.5"], "method.budget_ratio=-0.5"),
        (["method=h2o", "method.budget_ratio=1.5"], "method.budget_ratio=1.5 must be in (0, 1]"),
        (["method=h2o", "method.budget_tokens=0"], "method.budget_tokens=0 must be a positive"),
        (["method=oracle_topk", "method.budget_ratio=2"], "method.budget_ratio=2"),
        (["method=kivi", "method.k_bits=3"], "method.k_bits=3; allowed: 2, 4, 8"),
        (["method=kivi", "method.v_bits=1"], "method.v_bits=1; allowed: 2, 4, 8"),
        (["method=infinigen", "method.alpha=0"], "method.alpha=0 must be > 0"),
        (["method=infinigen", "method.alpha=-2"], "method.alpha=-2"),
        (["method=infinigen", "method.partial_ratio=0"], "method.partial_ratio=0 must be in (0, 1]"),
        (["method=infinigen", "method.partial_ratio=1.2"], "method.partial_ratio=1.2"),
        (["method=infinigen", "method.mode=fast"], "method.mode='fast'; allowed: system, simulate"),
        (["method=infinigen", "method.eviction=random"], "method.eviction='random'"),
        (["method=infinigen", st, "method.dense_layers=[0,99]"], "method.dense_layers=[0, 99]"),
        (["method=infinigen", "method.calibration_path=/nonexistent.txt"],
         "method.calibration_path=/nonexistent.txt: no such file"),
        (["method=streaming_llm", "method.sink_tokens=600", "method.window_tokens=100"],
         "method.sink_tokens=600 is larger than method.window_tokens=100"),
        (["method=streaming_llm", "method.window_tokens=0"], "method.window_tokens=0"),
        (["method=full", "method.budget_ratio=0.2"], "method=full does not take method.budget_ratio"),
        (["++method.budgte_ratio=0.2"], "method.budgte_ratio is not a hyperparameter of method=full"),
        (["runner.prefill_chunk_tokens=0"], "runner.prefill_chunk_tokens=0"),
        (["runner.kv_offload=gpu"], "runner.kv_offload='gpu'; allowed: none, cpu"),
        (["runner.kv_offload=cpu", "method=streaming_llm"], "runner.kv_offload=cpu but method="),
        (["method=kivi", HF, f"model.name_or_path={f / 'head_dim_48'}"], "head_dim"),
        ([HF, "model.name_or_path=/nonexistent/model"], "/nonexistent/model: no such folder"),
        ([HF, f"model.name_or_path={f / 'empty'}"], "not a folder, or empty"),
        ([HF, f"model.name_or_path={f / 'readme_only'}"], "not a model folder (no config.json)"),
        ([HF, f"model.name_or_path={f / 'no_weights'}"], "no weights"),
        ([HF, f"model.name_or_path={f / 'corrupt'}", "model.dtype=float32"],
         "could not be read"),
        ([HF, f"model.name_or_path={f / 'head_dim_48'}", "model.dtype=float32"], "tokenizer"),
        ([HF, "model.name_or_path=meta-llama/Llama-3.2-1B"], "offline (HF_HUB_OFFLINE=1)"),
        ([st, "task.dataset=text_file", "task.path=/nonexistent.txt"], "task.path=/nonexistent.txt: no such file"),
        ([st, "task.dataset=text_file", f"task.path={f / 'texts' / 'empty.txt'}"], "the file is empty"),
        ([st, "task.dataset=text_file", f"task.path={f / 'texts' / 'latin1.txt'}"], "not UTF-8"),
        ([st, "task=longbench", "task.datasets=[trec]", f"task.data_dir={f / 'longbench'}",
          "task.max_new_tokens=16"], "trec.jsonl:2: not valid JSON"),
        ([st, "task=longbench", "task.datasets=[nosuch]"], "nosuch"),
        ([st, "task.max_tokens=600"], "task.max_tokens=600 is longer than the model's max positions"),
        ([st, "task.limit=0"], "task.limit=0"),
        (["model.device=cuda"], "CUDA is not available"),
        ([st, f"runner.results_root={f / 'texts' / 'empty.txt'}/sub"], "cannot write under"),
    ]


def test_at_least_30_cases():
    assert len(cases(Path("/x"))) >= 30


@pytest.mark.usefixtures("shared_folder")
@pytest.mark.parametrize("index", range(len(cases(Path("/x")))))
def test_bad_input_names_the_key_and_writes_nothing(index, folders, tmp_path, monkeypatch):
    import torch

    overrides, expected = cases(folders)[index]
    if "model.device=cuda" in overrides and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root = tmp_path / "results"
    if not any(o.startswith("runner.results_root") for o in overrides):
        overrides = [*overrides, f"runner.results_root={root}"]
    with pytest.raises(ConfigError) as err:
        run(cfg_for(*overrides))
    assert expected in str(err.value)
    assert not root.exists() or not any(p.name == "metrics.json" for p in root.rglob("*"))


@pytest.mark.usefixtures("shared_folder")
def test_default_path_opens_no_socket(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    out = run(cfg_for("model=stories260k", "method=h2o", "task.max_tokens=100",
                  f"runner.results_root={tmp_path}"))
    assert (out / "metrics.json").is_file()


@pytest.mark.usefixtures("shared_folder")
def test_runs_release_their_caches_hooks_and_models(tmp_path):
    """Caches, hooks and models are released between runs in one process: once both methods
    have run (lazy imports, compiled kernels and bounded memo caches warmed), every later run
    leaves no cache layer alive, the same modules with the same hooks, the same tensor bytes
    (a leaked KV cache of this run is ~50 KiB) and a flat RSS."""
    snapshots, rss = [], []
    for i in range(RELEASE_RUNS):
        run(cfg_for("model=stories260k", "method=h2o" if i % 2 else "method=streaming_llm",
                    "task.max_tokens=40", f"runner.results_root={tmp_path}"))
        if i in (1, RELEASE_RUNS - 1):
            snapshots.append(live_objects())
            rss.append(models_rss())
    assert len(list(tmp_path.rglob("metrics.json"))) == RELEASE_RUNS
    (layers, modules, hooks, tensor_bytes), later = snapshots[0], snapshots[1]
    assert later[0] == layers == 0, f"cache layers alive after a run: {later[0]}"
    assert later[1:3] == (modules, hooks), f"modules, hooks: {modules, hooks} -> {later[1:3]}"
    assert later[3] - tensor_bytes < 8 * 2**10, f"tensor bytes {tensor_bytes} -> {later[3]}"
    assert (rss[1] - rss[0]) / 2**20 < 24, f"RSS {rss[0] / 2**20:.1f} -> {rss[1] / 2**20:.1f} MiB"


RELEASE_RUNS = 4


def live_objects() -> tuple[int, int, int, int]:
    """(KV cache layers, torch modules, hooks on them, bytes of live tensors' storages)."""
    import gc

    import torch

    from methods.layer import KVLayer

    gc.collect()
    objects = gc.get_objects()
    modules = [o for o in objects if isinstance(o, torch.nn.Module)]
    hooks = sum(len(getattr(m, name)) for m in modules for name in vars(m)
                if name.endswith("_hooks") and isinstance(getattr(m, name), dict))
    storages = {}
    for o in objects:
        if torch.is_tensor(o) and o.device.type != "meta":
            storage = o.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return (sum(isinstance(o, KVLayer) for o in objects), len(modules), hooks,
            sum(storages.values()))


def models_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def early_cases(tmp: Path):
    """(overrides, text the message must contain): refused before any weights load."""
    st = "model=stories260k"
    a_file = tmp / "a_file.txt"
    a_file.write_text("mine")
    return [
        (["method=h2o", "method.budget_tokens=64", "method.budget_ratio=abc"],
         "method.budget_ratio='abc' must be a number or null"),
        (["method=infinigen", "method.skewing=maybe"], "method.skewing='maybe' must be a boolean"),
        (["method=streaming_llm", "method.sink_tokens=true"], "method.sink_tokens=True must be an integer"),
        (["method=streaming_llm", "method.budget_ratio=0.5", "method.sink_tokens=500",
          "method.window_tokens=abc"], "method.window_tokens='abc' must be an integer or null"),
        (["method=infinigen", "method.dense_layers=5"], "method.dense_layers=5 must be a list of integers"),
        (["method=kivi", "method.group_size=abc"], "method.group_size='abc' must be an integer"),
        (["method=kivi", "method.residual_tokens=128.0"], "method.residual_tokens=128.0 must be an integer"),
        (["method=full_offload", "method.prefetch=1"], "method.prefetch=1 must be a boolean"),
        ([st, "task.max_tokens=12.5"], "task.max_tokens=12.5 must be an integer or null"),
        ([st, "task=ruler", "task.lengths=512"], "task.lengths=512 must be a list of integers"),
        ([st, "task.dataset=7"], "task.dataset=7 must be a string"),
        ([st, "runner.overwrite=maybe"], "runner.overwrite='maybe' must be a boolean"),
        ([st, f"runner.output_dir={a_file}"], "is a file (or a link), not a folder"),
        ([st, f"runner.output_dir={tmp}/sub/.."], "must name the run folder itself"),
        ([st, "task=ruler", "task.lengths=[480]", "task.subtasks=[vt]", "task.max_new_tokens=8"],
         "task.lengths: 480 tokens is too short for sub-task vt"),
        ([st, "task=multiturn", "task.turns=3", "task.context_tokens=100"],
         "task.context_tokens=100 is too small for 3 needles"),
        ([st, "task=multiturn", "task.turns=4"], "task.turns=4 with task.max_new_tokens=32"),
    ]


@pytest.mark.usefixtures("shared_folder")
@pytest.mark.parametrize("index", range(17))
def test_refused_before_weights_load(index, tmp_path, no_weight_loading):
    cases_ = early_cases(tmp_path)
    assert len(cases_) == 17
    overrides, expected = cases_[index]
    with pytest.raises(ConfigError) as err:
        run(cfg_for(*overrides, f"runner.results_root={tmp_path / 'results'}"))
    assert expected in str(err.value)
    assert not list(tmp_path.rglob("metrics.json"))
    assert (tmp_path / "a_file.txt").read_text() == "mine"


@pytest.mark.usefixtures("shared_folder")
def test_metrics_follow_the_versioned_schema(tmp_path):
    from harness.store import schema

    out = run(cfg_for("model=stories260k", "task.max_tokens=40", f"runner.results_root={tmp_path}"))
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["schema_version"] == schema.SCHEMA_VERSION
    assert list(metrics)[0] == "schema_version" and schema.problems(metrics) == []
    del metrics["run"]["config_hash"]
    assert schema.problems(metrics) == ["run.config_hash: missing"]


@pytest.mark.usefixtures("shared_folder")
@pytest.mark.parametrize("overrides, expect", [
    (["task.mode=chunked", "task.block_tokens=128"], "task.block_tokens=128 applies to "
                                                     "task.mode=streaming only"),
    (["task.window_tokens=128"], "task.window_tokens=128 applies to task.mode=chunked only"),
    (["task.limit=3"], "task.limit=3 applies to task.mode=chunked only"),
    (["runner.kv_block_tokens=32"], "runner.kv_block_tokens=32 applies to runner.kv_layout=paged"),
    (["task.dataset=wikitext2", f"task.path={STORIES / 'config.json'}"],
     "use it with task.dataset=text_file"),
    (["task.dataset=essays", "task.data_dir=/tmp"], "task.data_dir=/tmp: no essays at"),
    (["task=ruler", "task.data_dir=/tmp"], "task.data_dir=/tmp: no essays at"),
    (["task=ruler", "task.haystack=repeat", "task.data_dir=/tmp"], "is not read with "
                                                                   "task.haystack=repeat"),
    (["runner.output_dir=''"], "runner.output_dir='' is empty"),
    (["runner.results_root=''"], "runner.results_root='' is empty"),
    (["model.path=''"], "model.path='' is empty"),
    (["runner.overwrite=true"], "runner.overwrite=true applies to runner.output_dir only"),
    (["runner.diagnostics_every_steps=4"], "applies with runner.diagnostics=true only"),
])
def test_options_that_do_not_apply_are_refused(overrides, expect, tmp_path, no_weight_loading):
    base = ST if "task=ruler" not in overrides else ["model=stories260k"]
    assert expect in refused(tmp_path, *base, *overrides)


@pytest.mark.usefixtures("shared_folder")
def test_a_method_that_acts_after_the_only_chunk_is_refused(tmp_path, no_weight_loading):
    """Chunked perplexity windows that fit one prefill chunk are scored before H2O compresses
    them (runner.prefill=chunked): its ppl equals full's, yet it held less (reported active).
    Under dense prefill (one compression at the prompt's end) it never acts at all."""
    base = ["model=stories260k", "method=h2o", "task.mode=chunked", "task.window_tokens=256",
            "task.max_tokens=512"]
    message = refused(tmp_path, *base, "runner.prefill=chunked")
    assert "every scored logit comes before the method acts" in message
    assert "would never act" in refused(tmp_path, *base)


@pytest.mark.usefixtures("shared_folder")
def test_huge_thread_count_is_one_line(tmp_path, no_weight_loading):
    assert "runner.threads=100000000000 is more than this machine's" in refused(
        tmp_path, *ST, "runner.threads=100000000000")


@pytest.mark.usefixtures("shared_folder")
@pytest.mark.parametrize("seed", ["-1", "4294967296", "99999999999999999999"])
def test_a_seed_numpy_cannot_take_is_one_line(seed, tmp_path, no_weight_loading):
    """numpy's legacy seeding raised ValueError after the weights loaded."""
    assert "must be an integer in [0, 2**32 - 1]" in refused(tmp_path, *ST, f"runner.seed={seed}")


def test_a_non_finite_result_is_flagged_in_the_summary_and_never_passes_a_gate(tmp_path):
    from harness.report import check
    from harness.run import summary

    folder = fake_run(tmp_path / "r", "full", float("nan"), 100.0)
    metrics = json.loads((folder / "metrics.json").read_text())
    metrics["kv"], metrics["transfer"] = {}, {}
    metrics["memory"] = {"kind": "cpu", "peak_bytes": 0}
    metrics["speed"].update(prefill_ms_total=1.0, prefill_tokens=1, decode_ms_per_token_p90=1.0)
    assert "NOT FINITE  ppl=nan" in summary(metrics, folder)
    (result,) = check.check([metrics], [{"model": "stories260k", "method": "full",
                                         "task": "perplexity", "metric": "accuracy.ppl",
                                         "max": 60}])
    assert not result["ok"] and "not a finite number" in result["why"]
