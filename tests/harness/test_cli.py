"""`python -m harness` (harness/__main__.py): one line per error (exit 2), tracebacks only on
request, Hydra's errors and hints, `--help`, and SIGINT/SIGTERM leaving no partial result.
Refusals run the CLI's entry in this process (`cli_here`); one test, the signals and the real
runs keep a process of their own."""

import os
import signal
import subprocess
import sys
import time

import pytest
from hydra.errors import ConfigCompositionException

from kvcore.errors import ConfigError
from tests.conftest import PROJECT
from tests.helpers.runs import ST, cfg_for, cli, cli_here


@pytest.mark.usefixtures("shared_folder")
def test_the_process_prints_one_line_and_exits_2(tmp_path):
    """The real process: what the tests below check in this process holds for `python -m
    harness` itself (its exit status and stderr)."""
    proc = cli("logger=nosuch", f"runner.results_root={tmp_path}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "error: Could not find 'logger/nosuch'; allowed: none, wandb\n"
    assert not list(tmp_path.iterdir())


@pytest.mark.usefixtures("shared_folder")
@pytest.mark.parametrize("args, expect", [
    (["model=nosuch"], "Could not find 'model/nosuch'"),
    (["method=kivi", "method.k_bits=3"], "error: method.k_bits=3; allowed: 2, 4, 8"),
])
def test_cli_one_line_and_debug_traceback(args, expect, tmp_path, monkeypatch):
    status, _, err = cli_here(monkeypatch, *args, f"runner.results_root={tmp_path}")
    assert status != 0 and expect in err and "Traceback" not in err
    if args[0].startswith("method="):
        with pytest.raises(ConfigError, match="method.k_bits=3"):
            cli_here(monkeypatch, *args, "runner.debug=true", f"runner.results_root={tmp_path}")


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under `nohup ... &`: inherited by the child


@pytest.mark.usefixtures("shared_folder")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_run_leaves_no_partial_result(sig, tmp_path):
    """The child starts with SIGINT ignored whatever the parent's state (a background job's
    disposition): the CLI must install its own handler for Ctrl-C to unwind cleanly."""
    env = dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONUNBUFFERED="1")
    # stories260K: decoding starts within seconds; its 512 positions under H2O (a decode step
    # of milliseconds) outlast the signal sent 0.2 s after decoding started
    proc = subprocess.Popen([sys.executable, "-m", "harness", "model=stories260k", "method=h2o",
                             "task.max_tokens=512", f"runner.results_root={tmp_path}"],
                            cwd=PROJECT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=_ignore_sigint)
    deadline = time.time() + 120
    seen = b""
    # raw reads, not readline: the progress bar's first frame ends in no newline (the next
    # frame's "\r" or the close ends it), so a line-wise read sees it only once decoding is over
    while time.time() < deadline and b"streaming perplexity" not in seen:
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            break
        seen += chunk
    time.sleep(0.2)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    seen, rest = seen.decode(errors="replace"), out.decode(errors="replace")
    assert proc.returncode == 130, seen + rest
    assert "interrupted: no result written" in rest
    assert not list(tmp_path.rglob("metrics.json"))
    assert not [p for p in tmp_path.rglob("*partial*")]


@pytest.mark.usefixtures("shared_folder")
@pytest.mark.parametrize("args, expect", [
    (["logger=nosuch"], "error: Could not find 'logger/nosuch'; allowed: none, wandb"),
    (["hardware=nosuch"], "error: Could not find 'hardware/nosuch'; allowed: h200_sxm"),
    (["experiment=nosuch"], "error: Could not find 'experiment/nosuch'; allowed: "),
    (["method.budget_ratio=["], "error: override 'method.budget_ratio=[' cannot be parsed"),
    (["runner.nosuch=1"], "error: runner.nosuch is not a key of runner=default; allowed: "),
    (["method=_shared"], "error: method='_shared' is not a method"),
    (["method=nosuch"], "error: Could not find 'method/nosuch'; allowed: "),  # any new method
])
def test_hydra_errors_are_one_line_exit_2(args, expect, tmp_path, monkeypatch):
    status, _, err = cli_here(monkeypatch, *args, f"runner.results_root={tmp_path}")
    assert status == 2, err
    assert err.strip().splitlines() == [err.strip()], err
    assert expect in err and "_shared" not in err.split("allowed:")[-1]
    assert not list(tmp_path.iterdir())


@pytest.mark.usefixtures("shared_folder")
def test_help_offers_no_fragment(tmp_path, monkeypatch):
    status, out, _ = cli_here(monkeypatch, "--help")
    assert status == 0
    assert "method (provenance: official code | paper | reconstruction | reference):" in out
    assert "  full              reference" in out and "  h2o               official" in out
    assert "_shared" not in out


@pytest.mark.usefixtures("shared_folder")
def test_hydra_full_error_and_debug_show_tracebacks(tmp_path, monkeypatch):
    """Asked for, an error propagates (the interpreter prints its traceback) instead of the one
    line."""
    root = f"runner.results_root={tmp_path}"
    with pytest.raises(ConfigError, match="method.k_bits=3"):
        cli_here(monkeypatch, *ST, "method=kivi", "method.k_bits=3", root,
                 env={"HYDRA_FULL_ERROR": "1"})
    with pytest.raises(ConfigCompositionException, match="runner.batchsize"):
        cli_here(monkeypatch, *ST, "runner.batchsize=2", "runner.debug=True", root)


def test_unquoted_tilde_gets_a_hint_to_quote_it():
    from harness.__main__ import one_line

    with pytest.raises(Exception) as err:
        cfg_for("task.path=~/x")
    assert "(quote the value: task.path='~/x')" in one_line(err.value)


@pytest.mark.usefixtures("shared_folder")
def test_sigterm_during_a_long_prefill_leaves_nothing(tmp_path):
    # SmolLM2 fed one token per forward: a 512-token window takes many seconds on CPU, so the
    # signal lands inside the prefill, after the weights are loaded
    env = dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "harness", "model=smollm2_135m",
                             "method=full", "task.mode=chunked", "task.window_tokens=512",
                             "task.max_tokens=512", "runner.prefill_chunk_tokens=1",
                             f"runner.results_root={tmp_path}"], cwd=PROJECT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, seen = time.time() + 120, ""
    while time.time() < deadline:  # until the weights are loaded: the prefill is running
        line = proc.stdout.readline()
        seen += line
        if ("Loading weights" in line and "100%" in line) or not line:
            break
    time.sleep(2.0)
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, seen + rest
    assert not list(tmp_path.rglob("*")), "an interrupted run left files or folders"


def test_overriding_method_name_is_refused(tmp_path, monkeypatch):
    status, _, err = cli_here(monkeypatch, *ST, "method=snapkv", "method.name=pyramidkv",
                              f"runner.results_root={tmp_path / 'r'}")
    assert status == 2, err[-2000:]
    assert ("method.name=pyramidkv overrides method=snapkv (whose settings were composed); "
            "choose it as method=pyramidkv") in err
    assert not (tmp_path / "r").exists()


def test_a_refused_command_imports_no_statistics_library():
    """A configuration error is reported before anything slow: the run path imports scipy (about
    a second) only when it computes an interval (harness.stats.intervals)."""
    code = ("import sys, harness.run, harness.sweep.run; "
            "print(sorted(m for m in ('scipy', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=PROJECT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout
