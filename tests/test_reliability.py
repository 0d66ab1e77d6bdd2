"""Reliability: every bad input gets one clear error naming the key or file (and nothing is
written), crashes and signals leave no partial result, no surprise network, bounded memory."""

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from harness import models
from kvcore.errors import ConfigError
from harness.run import run
from tests.conftest import DATA, PROJECT, STORIES, need_shared

pytestmark = pytest.mark.usefixtures("shared")


@pytest.fixture
def shared():
    need_shared(STORIES)
    need_shared(DATA)


def cfg(*overrides):
    with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
        return compose("config", list(overrides))


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
        run(cfg(*overrides))
    assert expected in str(err.value)
    assert not root.exists() or not any(p.name == "metrics.json" for p in root.rglob("*"))


def _cli(*args, **kw):
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=PROJECT, env=env,
                          capture_output=True, text=True, timeout=120, **kw)


@pytest.mark.parametrize("args, expect", [
    (["model=nosuch"], "Could not find 'model/nosuch'"),
    (["logger=nosuch"], "Could not find 'logger/nosuch'"),
    (["method=kivi", "method.k_bits=3"], "error: method.k_bits=3; allowed: 2, 4, 8"),
])
def test_cli_one_line_and_debug_traceback(args, expect, tmp_path):
    proc = _cli(*args, f"runner.results_root={tmp_path}")
    assert proc.returncode != 0 and expect in proc.stderr and "Traceback" not in proc.stderr
    if args[0].startswith("method="):
        debug = _cli(*args, "runner.debug=true", f"runner.results_root={tmp_path}")
        assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_disk_full_while_writing_keeps_the_previous_result(tmp_path, monkeypatch):
    out = tmp_path / "pinned"
    base = ["model=stories260k", "task.max_tokens=80", f"runner.output_dir={out}"]
    first = run(cfg(*base))
    before = (first / "metrics.json").read_bytes()

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(ConfigError, match="No space left on device.*nothing was written"):
        run(cfg(*base, "method=h2o", "runner.overwrite=true"))
    assert (out / "metrics.json").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["pinned"]  # no staging left behind


def test_crash_mid_run_leaves_previous_result(tmp_path, monkeypatch):
    from tasks.perplexity import Perplexity

    out = tmp_path / "pinned"
    base = ["model=stories260k", "task.max_tokens=80", f"runner.output_dir={out}"]
    run(cfg(*base))
    before = (out / "metrics.json").read_bytes()
    monkeypatch.setattr(Perplexity, "evaluate", lambda self, engine: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        run(cfg(*base, "runner.overwrite=true"))
    assert (out / "metrics.json").read_bytes() == before


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under `nohup ... &`: inherited by the child


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_run_leaves_no_partial_result(sig, tmp_path):
    """The child starts with SIGINT ignored whatever the parent's state (a background job's
    disposition): the CLI must install its own handler for Ctrl-C to unwind cleanly."""
    env = dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "harness", "task.max_tokens=1500",
                             f"runner.results_root={tmp_path}"], cwd=PROJECT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_ignore_sigint)
    deadline = time.time() + 120
    seen = ""
    while time.time() < deadline:  # wait until decoding has started
        line = proc.stdout.readline()
        seen += line
        if "streaming perplexity" in line or not line:
            break
    time.sleep(1.0)
    proc.send_signal(sig)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, seen + rest
    assert "interrupted: no result written" in rest
    assert not list(tmp_path.rglob("metrics.json"))
    assert not [p for p in tmp_path.rglob("*partial*")]


def test_default_path_opens_no_socket(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    out = run(cfg("model=stories260k", "method=h2o", "task.max_tokens=100",
                  f"runner.results_root={tmp_path}"))
    assert (out / "metrics.json").is_file()


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


def test_fifty_runs_with_flat_memory(tmp_path):
    """Caches, hooks and models are released between runs in one process."""
    rss = []
    for i in range(50):
        run(cfg("model=stories260k", "method=h2o" if i % 2 else "method=streaming_llm",
                "task.max_tokens=40", f"runner.results_root={tmp_path}"))
        rss.append(models_rss())
    growth_mib = (rss[-1] - rss[9]) / 2**20
    print(f"RSS after run 10: {rss[9] / 2**20:.1f} MiB, after run 50: {rss[-1] / 2**20:.1f} MiB, "
          f"growth {growth_mib:.1f} MiB")
    assert len(list(tmp_path.rglob("metrics.json"))) == 50
    assert growth_mib < 40


def models_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


# --- second pass -----------------------------------------------------------------------------

@pytest.fixture
def no_weights(monkeypatch):
    """Loading weights fails the test: the error must come before."""
    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the bad input was refused")

    monkeypatch.setattr(models, "load_model", refuse)


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


@pytest.mark.parametrize("index", range(17))
def test_refused_before_weights_load(index, tmp_path, no_weights):
    cases_ = early_cases(tmp_path)
    assert len(cases_) == 17
    overrides, expected = cases_[index]
    with pytest.raises(ConfigError) as err:
        run(cfg(*overrides, f"runner.results_root={tmp_path / 'results'}"))
    assert expected in str(err.value)
    assert not list(tmp_path.rglob("metrics.json"))
    assert (tmp_path / "a_file.txt").read_text() == "mine"


def test_output_dir_never_replaces_a_users_folder(tmp_path, no_weights):
    """A non-empty folder that is not a run of this harness (a user's folder, a results root)
    is refused before weights load, and nothing in it moves."""
    user = tmp_path / "mine"
    (user / "sub").mkdir(parents=True)
    (user / "keep").write_text("k")
    with pytest.raises(ConfigError, match="not a run of this harness.*nothing was changed"):
        run(cfg("model=stories260k", f"runner.output_dir={user}"))
    assert sorted(p.name for p in user.iterdir()) == ["keep", "sub"]
    assert (user / "keep").read_text() == "k"
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]  # nothing renamed or staged


def test_output_dir_replaces_only_a_previous_run_on_request(tmp_path):
    out = tmp_path / "pinned"
    base = ["model=stories260k", "task.max_tokens=40", f"runner.output_dir={out}"]
    first = json.loads((run(cfg(*base)) / "metrics.json").read_text())
    with pytest.raises(ConfigError, match="holds a previous run; pass runner.overwrite=true"):
        run(cfg(*base, "method=h2o"))
    assert json.loads((out / "metrics.json").read_text()) == first
    run(cfg(*base, "method=h2o", "runner.overwrite=true"))
    assert json.loads((out / "metrics.json").read_text())["method"]["name"] == "h2o"
    # a run folder a user added a file to is no longer only ours: never replaced
    (out / "notes.txt").write_text("my notes")
    with pytest.raises(ConfigError, match="not a run of this harness .*notes.txt"):
        run(cfg(*base, "runner.overwrite=true"))
    assert (out / "notes.txt").read_text() == "my notes"
    # a results root holding runs is not a run either
    root = tmp_path / "root"
    run(cfg("model=stories260k", "task.max_tokens=40", f"runner.results_root={root}"))
    with pytest.raises(ConfigError, match="not a run of this harness"):
        run(cfg(*base[:2], f"runner.output_dir={root}", "runner.overwrite=true"))
    assert len(list(root.rglob("metrics.json"))) == 1


def test_empty_output_dir_is_used(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert run(cfg("model=stories260k", "task.max_tokens=40", f"runner.output_dir={out}")) == out
    assert (out / "metrics.json").is_file()


def test_skip_existing_with_output_dir_reuses_only_that_path(tmp_path, capsys):
    base = ["model=stories260k", "task.max_tokens=40", "runner.skip_existing=true"]
    sibling = run(cfg(*base, f"runner.output_dir={tmp_path / 'a'}"))
    wanted = tmp_path / "b"
    assert run(cfg(*base, f"runner.output_dir={wanted}")) == wanted  # not the sibling
    assert (wanted / "metrics.json").is_file() and sibling != wanted
    stamp = (wanted / "metrics.json").stat().st_mtime_ns
    capsys.readouterr()
    assert run(cfg(*base, f"runner.output_dir={wanted}")) == wanted  # same config: reused
    assert "skipped: a complete result" in capsys.readouterr().out
    assert (wanted / "metrics.json").stat().st_mtime_ns == stamp


def test_results_get_the_users_umask(tmp_path):
    old = os.umask(0o002)
    try:
        out = run(cfg("model=stories260k", "task.max_tokens=40", f"runner.results_root={tmp_path}"))
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o775
    for name in ("metrics.json", "config.yaml", "samples.jsonl"):
        assert (out / name).stat().st_mode & 0o777 == 0o664, name


def test_metrics_follow_the_versioned_schema(tmp_path):
    from harness import schema

    out = run(cfg("model=stories260k", "task.max_tokens=40", f"runner.results_root={tmp_path}"))
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["schema_version"] == schema.SCHEMA_VERSION
    assert list(metrics)[0] == "schema_version" and schema.problems(metrics) == []
    del metrics["run"]["config_hash"]
    assert schema.problems(metrics) == ["run.config_hash: missing"]


@pytest.mark.parametrize("args, expect", [
    (["logger=nosuch"], "error: Could not find 'logger/nosuch'; allowed: none, wandb"),
    (["hardware=nosuch"], "error: Could not find 'hardware/nosuch'; allowed: h200_sxm"),
    (["experiment=nosuch"], "error: Could not find 'experiment/nosuch'; allowed: "),
    (["method.budget_ratio=["], "error: override 'method.budget_ratio=[' cannot be parsed"),
    (["runner.nosuch=1"], "error: runner.nosuch is not a key of runner=default; allowed: "),
    (["method=_shared"], "error: method='_shared' is not a method"),
    (["method=nosuch"], "error: Could not find 'method/nosuch'; allowed: "),  # any new method
])
def test_hydra_errors_are_one_line_exit_2(args, expect, tmp_path):
    proc = _cli(*args, f"runner.results_root={tmp_path}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert expect in proc.stderr and "_shared" not in proc.stderr.split("allowed:")[-1]
    assert not list(tmp_path.iterdir())


def test_help_offers_no_fragment(tmp_path):
    proc = _cli("--help")
    assert proc.returncode == 0
    assert "method (provenance: official code | paper | reconstruction | reference):" in proc.stdout
    assert "  full              reference" in proc.stdout and "  h2o               official" in proc.stdout
    assert "_shared" not in proc.stdout
