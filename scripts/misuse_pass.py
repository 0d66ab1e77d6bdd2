"""Misuse pass: bad inputs beyond those the tests already cover, each run as a subprocess in its
own temp folder, and how each ended.

    nice -n 10 .venv/bin/python scripts/misuse_pass.py [--json out.json] [-k SUBSTR] [--timeout S]

Every case says what it expects: `refuse` (bad input), `run` (odd but valid) or `sweep` (a
sweep with one bad member: by design (harness.config.multirun) that member fails with its one-line reason,
the others run and the sweep exits 1). Outcomes:

* clean      refused as bad input: exit 2, one `error:` line naming the key/file, no traceback,
             nothing written under the results root (`run`: exit 0 and a result; `sweep`:
             exit 1, a `[failed]` line naming the key, the good members' results written)
* traceback  a Python traceback on the way out
* accepted   exit 0 for something that should be refused
* unclear    refused, but the message does not name the key, spans several lines, exits with
             another code, or the refusal left files under the results root
* destroyed  a file that existed in the case's folder before the run changed or vanished
* timeout    still running after --timeout seconds (killed)

Most cases are refused before the weights load (a few seconds each, stories260K); the whole pass
takes a few minutes on one core. Lines that lm-eval logs (timestamped) and argparse's `usage:`
line are not counted as part of the message.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
ST = ["model=stories260k", "runner.threads=1"]  # every harness case: stories260K, one thread
PPL = [*ST, "task.max_tokens=40"]
NOISE = re.compile(r"^(\d{4}-\d\d-\d\d:\d\d:\d\d:\d\d (INFO|WARNING|DEBUG) |usage: |\s{2,}\S)")
CLASSES = ("clean", "traceback", "accepted", "unclear", "destroyed", "timeout")


@dataclass
class Case:
    """`args` may hold `{tmp}` (the case's folder) and `{root}` (its results root)."""

    name: str
    args: list[str]
    expect: str = "refuse"  # refuse | run | sweep (the bad member fails, the others run)
    names: tuple[str, ...] = ()  # one of these in the message (default: the last key's leaf)
    module: str = "harness"
    setup: str = ""  # a preparation of the case folder (SETUPS)
    root: str = "{root}"  # the results root to watch
    env: dict[str, str] = field(default_factory=dict)


def m(name: str, method: str, knob: str, value: str, **kw) -> Case:
    return Case(name, [*PPL, f"method={method}", f"method.{knob}={value}"], **kw)


def t(name: str, task: str, *opts: str, **kw) -> Case:
    return Case(name, [*ST, f"task={task}", *opts], **kw)


def p(name: str, *opts: str, **kw) -> Case:
    return Case(name, [*PPL, *opts], **kw)


LME = ["--model", "kvharness", "--device", "cpu", "--tasks", "copa", "--limit", "2",
       "--model_args"]

CASES: list[Case] = [
    # --- methods' knobs: zero, negative, huge, wrong type, out of range -------------------
    m("infinigen partial_ratio=0", "infinigen", "partial_ratio", "0"),
    m("infinigen partial_ratio=1.5", "infinigen", "partial_ratio", "1.5"),
    m("infinigen pool_capacity=-0.5", "infinigen", "pool_capacity", "-0.5"),
    m("infinigen eviction=random", "infinigen", "eviction", "random"),
    m("infinigen calibration_tokens=0", "infinigen", "calibration_tokens", "0"),
    m("infinigen dense_layers=[99]", "infinigen", "dense_layers", "[99]"),
    m("infinigen skewing=maybe", "infinigen", "skewing", "maybe"),
    m("infinigen column_score=k", "infinigen", "column_score", "k"),
    m("quest page_size=0", "quest", "page_size", "0"),
    m("quest budget_tokens=-5", "quest", "budget_tokens", "-5"),
    m("quest min_pages=abc", "quest", "min_pages", "abc"),
    m("quest select_per=layer", "quest", "select_per", "layer"),
    m("quest dense_layers=[0,7]", "quest", "dense_layers", "[0,7]"),
    m("snapkv kernel_tokens=0", "snapkv", "kernel_tokens", "0"),
    m("snapkv window_tokens=1e12", "snapkv", "window_tokens", "1e12"),
    m("snapkv pooling=median", "snapkv", "pooling", "median"),
    m("snapkv budget_ratio=1.5", "snapkv", "budget_ratio", "1.5"),
    m("snapkv budget_ratio=0", "snapkv", "budget_ratio", "0"),
    m("kivi v_bits=16", "kivi", "v_bits", "16"),
    m("kivi group_size=0", "kivi", "group_size", "0"),
    m("kivi residual_tokens=50 (not a multiple of G)", "kivi", "residual_tokens", "50"),
    m("kivi k_bits=2.5", "kivi", "k_bits", "2.5"),
    m("kvquant k_bits=5", "kvquant", "k_bits", "5"),
    m("kvquant outlier_ratio=-0.1", "kvquant", "outlier_ratio", "-0.1"),
    m("kvquant outlier_ratio=2", "kvquant", "outlier_ratio", "2.0"),
    m("kvquant calibration_samples=0", "kvquant", "calibration_samples", "0"),
    m("kvquant q_norm=maybe", "kvquant", "q_norm", "maybe"),
    m("kvquant calibration_path missing", "kvquant", "calibration_path", "{tmp}/nope.txt",
      names=("calibration_path", "nope.txt")),
    m("shadowkv chunk_size=0", "shadowkv", "chunk_size", "0"),
    m("shadowkv rank_ratio=2", "shadowkv", "rank_ratio", "2.0"),
    m("shadowkv local_chunks=-1", "shadowkv", "local_chunks", "-1"),
    m("shadowkv compress_above_tokens=-1", "shadowkv", "compress_above_tokens", "-1"),
    m("shadowkv rank=0", "shadowkv", "rank", "0"),
    m("tailorkv k_bits=3", "tailorkv", "k_bits", "3"),
    m("tailorkv quant_layers=[7]", "tailorkv", "quant_layers", "[7]"),
    m("tailorkv dense_threshold=1.5", "tailorkv", "dense_threshold", "1.5"),
    m("tailorkv probe_top_ratio=0", "tailorkv", "probe_top_ratio", "0"),
    m("tailorkv key_channels=0", "tailorkv", "key_channels", "0"),
    m("duo_attention retrieval_head_ratio=1.5", "duo_attention", "retrieval_head_ratio", "1.5"),
    m("duo_attention sink_tokens=-1", "duo_attention", "sink_tokens", "-1"),
    m("duo_attention pattern_path missing", "duo_attention", "pattern_path", "{tmp}/nope",
      names=("pattern_path", "nope")),
    m("duo_attention probe_repeats=0", "duo_attention", "probe_repeats", "0"),
    m("streaming_llm window_tokens=0", "streaming_llm", "window_tokens", "0"),
    m("streaming_llm sink_tokens=-4", "streaming_llm", "sink_tokens", "-4"),
    m("streaming_llm rerotate=2", "streaming_llm", "rerotate", "2"),
    m("streaming_llm budget_tokens=0", "streaming_llm", "budget_tokens", "0"),
    Case("method=nosuch", [*PPL, "method=nosuch"], names=("method",)),
    # --- tasks' options -------------------------------------------------------------------
    t("ruler lengths=[0]", "ruler", "task.lengths=[0]"),
    t("ruler lengths=[]", "ruler", "task.lengths=[]"),
    t("ruler lengths=[100000]", "ruler", "task.lengths=[100000]"),
    t("ruler depths=[150]", "ruler", "task.depths=[150]"),
    t("ruler subtasks=[nosuch]", "ruler", "task.subtasks=[nosuch]"),
    t("ruler samples_per_cell=0", "ruler", "task.samples_per_cell=0"),
    t("ruler query=maybe", "ruler", "task.query=maybe"),
    t("ruler chat_template=sometimes", "ruler", "task.chat_template=sometimes"),
    t("ruler haystack=novels", "ruler", "task.haystack=novels"),
    t("longbench datasets=[nosuch]", "longbench", "task.datasets=[nosuch]"),
    t("longbench datasets=[]", "longbench", "task.datasets=[]"),
    t("longbench max_length_tokens=0", "longbench", "task.max_length_tokens=0"),
    t("longbench limit=-1", "longbench", "task.limit=-1"),
    t("longbench data_dir missing", "longbench", "task.max_length_tokens=256",
      "task.max_new_tokens=16", "task.data_dir={tmp}/nope",
      names=("data_dir", "nope")),
    t("multiturn turns=0", "multiturn", "task.turns=0"),
    t("multiturn answers=drop", "multiturn", "task.answers=drop"),
    t("multiturn context_tokens=100000", "multiturn", "task.context_tokens=100000"),
    t("multiturn max_new_tokens=0", "multiturn", "task.max_new_tokens=0"),
    t("xsum path missing", "xsum", "task.path={tmp}/nope.jsonl", names=("path", "nope")),
    t("xsum limit=0", "xsum", "task.limit=0"),
    t("xsum max_new_tokens=-1", "xsum", "task.max_new_tokens=-1"),
    t("lm_eval names=[nosuch]", "lm_eval", "task.names=[nosuch]", names=("nosuch",)),
    t("lm_eval names=[]", "lm_eval", "task.names=[]"),
    t("lm_eval num_fewshot=-1", "lm_eval", "task.num_fewshot=-1"),
    t("lm_eval scoring=both", "lm_eval", "task.scoring=both"),
    t("lm_eval include_path missing", "lm_eval", "task.include_path={tmp}/nope",
      names=("include_path", "nope")),
    t("lm_eval limit=0", "lm_eval", "task.limit=0"),
    p("perplexity text_file without path", "task.dataset=text_file", names=("path",)),
    p("perplexity path is a folder", "task.dataset=text_file", "task.path={tmp}",
      names=("path",)),
    p("perplexity max_tokens=0", "task.max_tokens=0"),
    p("perplexity block_tokens=0", "task.block_tokens=0"),
    p("perplexity prefill_tokens=100000", "task.prefill_tokens=100000"),
    p("perplexity chunked window_tokens=1", "task.mode=chunked", "task.window_tokens=1"),
    p("perplexity pg19 from an empty data_dir", "task.dataset=pg19", "task.data_dir={tmp}/empty",
      setup="empty", names=("data_dir", "empty")),
    p("perplexity dataset=wikitext103", "task.dataset=wikitext103"),
    # --- runner options -------------------------------------------------------------------
    p("runner.prefill=sometimes", "runner.prefill=sometimes"),
    p("runner.budget_basis=initial", "runner.budget_basis=initial"),
    p("runner.dense_layers=[5] (5 layers)", "method=h2o", "runner.dense_layers=[5]"),
    p("runner.dense_layers=[-1]", "method=h2o", "runner.dense_layers=[-1]"),
    p("runner.dense_layers=0 (not a list)", "method=h2o", "runner.dense_layers=0"),
    p("runner.batch_size=0", "runner.batch_size=0"),
    p("runner.batch_size=-2", "runner.batch_size=-2"),
    p("runner.batch_size=1.5", "runner.batch_size=1.5"),
    p("runner.batch_size=true", "runner.batch_size=true"),
    p("runner.kv_offload=gpu", "runner.kv_offload=gpu"),
    p("runner.kv_layout=ring", "runner.kv_layout=ring"),
    p("paged kv_block_tokens=0", "runner.kv_layout=paged", "runner.kv_block_tokens=0"),
    p("runner.prefill_chunk_tokens=0", "runner.prefill_chunk_tokens=0"),
    p("runner.attn_impl=flash", "runner.attn_impl=flash"),
    p("runner.seed=abc", "runner.seed=abc"),
    p("runner.seed=-1", "runner.seed=-1"),
    p("runner.seed=2**32", "runner.seed=4294967296"),
    p("hardware=nosuch", "hardware=nosuch", names=("hardware",)),
    p("experiment=nosuch", "experiment=nosuch", names=("experiment",)),
    p("runner.prefill_chunk_tokens=10**20 (valid: one chunk)",
      "runner.prefill_chunk_tokens=100000000000000000000", expect="run"),
    p("runner.dense_layers=[0,0] (valid: layer 0)", "method=h2o", "method.budget_ratio=0.5",
      "runner.dense_layers=[0,0]", expect="run"),
    Case("runner.threads=0", ["model=stories260k", "task.max_tokens=40", "runner.threads=0"]),
    p("runner.kv_admission=greedy", "runner.kv_layout=paged", "runner.kv_admission=greedy"),
    p("paged kv_device_limit_mib=-1", "runner.kv_layout=paged", "runner.kv_device_limit_mib=-1"),
    p("runner.diagnostics=2", "runner.diagnostics=2"),
    p("runner.diagnostics_every_steps=0", "runner.diagnostics=true",
      "runner.diagnostics_every_steps=0"),
    # --- model paths ----------------------------------------------------------------------
    Case("stories path missing", [*PPL, "model.path={tmp}/nope"], names=("model.path", "nope")),
    Case("stories path is empty ''", [*PPL, "model.path=''"], names=("model.path",)),
    Case("stories path is a file", [*PPL, "model.path={tmp}/keep.txt"], names=("keep.txt",)),
    Case("stories path is an empty folder", [*PPL, "model.path={tmp}/empty"], setup="empty",
         names=("empty",)),
    Case("hf without name_or_path", ["model=hf", "runner.threads=1", "task.max_tokens=40"],
         names=("name_or_path",)),
    Case("hf name_or_path is an empty folder", ["model=hf", "model.name_or_path={tmp}/empty",
                                                "runner.threads=1", "task.max_tokens=40"],
         setup="empty", names=("empty",)),
    Case("hf name_or_path is a file", ["model=hf", "model.name_or_path={tmp}/keep.txt",
                                       "runner.threads=1", "task.max_tokens=40"],
         names=("keep.txt",)),
    Case("hf gguf_file missing", ["model=hf", "model.gguf_file={tmp}/nope.gguf",
                                  "runner.threads=1", "task.max_tokens=40"],
         names=("nope.gguf",)),
    Case("hf gguf_file is text", ["model=hf", "model.gguf_file={tmp}/fake.gguf",
                                  "model.cache_dir={tmp}/cache", "runner.threads=1",
                                  "task.max_tokens=40"], setup="fake_gguf",
         names=("fake.gguf",)),
    p("model.dtype=float8", "model.dtype=float8"),
    p("model.device=tpu", "model.device=tpu"),
    Case("smollm2 dtype=int8", ["model=smollm2_135m", "model.dtype=int8", "runner.threads=1",
                                "task.max_tokens=40"], names=("dtype",)),
    # --- results_root / output_dir --------------------------------------------------------
    Case("results_root is a file", [*PPL, "runner.results_root={tmp}/keep.txt"],
         root="", names=("results_root",)),
    Case("results_root is a symlink loop", [*PPL, "runner.results_root={tmp}/loop"],
         setup="loop", root="", names=("results_root",)),
    Case("results_root is a dangling link", [*PPL, "runner.results_root={tmp}/dangling"],
         setup="dangling", root="", names=("results_root",)),
    Case("results_root with spaces and unicode (valid)", [*PPL, "runner.results_root='{tmp}/"
                                                          "rés ults ☃'"],
         expect="run", root="{tmp}/rés ults ☃"),
    Case("output_dir is a user's non-empty folder", [*PPL, "runner.output_dir={tmp}/mine"],
         setup="mine", root="", names=("output_dir",)),
    Case("output_dir is a file", [*PPL, "runner.output_dir={tmp}/keep.txt"], root="",
         names=("output_dir",)),
    # --- report and check -----------------------------------------------------------------
    Case("report without paths", [], module="harness.report", root="", names=("paths",)),
    Case("report of a missing folder", ["{tmp}/nope"], module="harness.report", root="",
         names=("nope",)),
    Case("report of an empty folder", ["{tmp}/empty"], module="harness.report", setup="empty",
         root="", names=("empty",)),
    Case("report --out is a user's file", ["{tmp}/runs", "--out", "{tmp}/keep.txt"],
         module="harness.report", setup="runs", root="", names=("--out", "keep.txt")),
    Case("check without --against", ["{tmp}/runs"], module="harness.report.check", setup="runs",
         root="", names=("--against",)),
    Case("check --against missing", ["{tmp}/runs", "--against", "{tmp}/nope.yaml"],
         module="harness.report.check", setup="runs", root="", names=("nope.yaml",)),
    Case("check --against a folder", ["{tmp}/runs", "--against", "{tmp}/empty"],
         module="harness.report.check", setup="runs", root="", names=("--against", "is a folder")),
    Case("check --against an empty file", ["{tmp}/runs", "--against", "{tmp}/empty.yaml"],
         module="harness.report.check", setup="runs", root="", names=("empty.yaml",)),
    Case("check --against a YAML list", ["{tmp}/runs", "--against", "{tmp}/list.yaml"],
         module="harness.report.check", setup="runs", root="", names=("list.yaml",)),
    Case("check of a missing folder", ["{tmp}/nope", "--against", "{tmp}/gate.yaml"],
         module="harness.report.check", setup="runs", root="", names=("nope",)),
    Case("check of a garbage metrics.json", ["{tmp}/bad", "--against", "{tmp}/gate.yaml"],
         module="harness.report.check", setup="runs", root="", names=("metrics.json",)),
    # --- sweeps with one bad member -------------------------------------------------------
    Case("sweep method=full,nosuch", ["-m", *PPL, "method=full,nosuch",
                                      "runner.results_root={root}"], expect="sweep",
         names=("nosuch",)),
    Case("sweep window_tokens=32,0", ["-m", *PPL, "method=streaming_llm",
                                      "method.window_tokens=32,0", "runner.results_root={root}"],
         expect="sweep", names=("window_tokens",)),
    Case("sweep task.max_tokens=40,0", ["-m", *ST, "task.max_tokens=40,0",
                                        "runner.results_root={root}"], expect="sweep",
         names=("max_tokens",)),
    Case("sweep runner.batch_size=1,0", ["-m", *PPL, "runner.batch_size=1,0",
                                         "runner.results_root={root}"], expect="sweep",
         names=("batch_size",)),
    # --- side files a method reads ----------------------------------------------------------
    m("infinigen calibration_path binary", "infinigen", "calibration_path", "{tmp}/calib.bin",
      setup="sidefiles", names=("calibration_path", "calib.bin")),
    m("kvquant calibration_path binary", "kvquant", "calibration_path", "{tmp}/calib.bin",
      setup="sidefiles", names=("calibration_path", "calib.bin")),
    m("kvquant calibration_path latin-1 text", "kvquant", "calibration_path", "{tmp}/latin1.txt",
      setup="sidefiles", names=("latin1.txt",)),
    *[m(f"duo_attention pattern {what}", "duo_attention", "pattern_path", f"{{tmp}}/duo_{what}",
        setup="sidefiles", names=(f"duo_{what}",))
      for what in ("corrupt_config", "list_config", "nan_gate", "gate_3")],
    *[Case(f"headkv head_scores_path {what}", [*PPL, "task.prefill_tokens=16", "method=headkv",
                                               "method.budget_tokens=8",
                                               f"method.head_scores_path={{tmp}}/headkv_{what}.json"],
           setup="sidefiles", names=(f"headkv_{what}.json",))
      for what in ("nan", "inf", "negative", "huge")],
    Case("headkv head_scores_path=''", [*PPL, "task.prefill_tokens=16", "method=headkv",
                                        "method.budget_tokens=8", "method.head_scores_path=''"],
         names=("head_scores_path",)),
    Case("duo_attention pattern_path=''", [*PPL, "task.prefill_tokens=16",
                                           "method=duo_attention", "method.pattern_path=''"],
         names=("pattern_path",)),
    m("kvquant cache_dir=''", "kvquant", "cache_dir", "''", names=("cache_dir",)),
    # --- sizes estimated before they allocate -----------------------------------------------
    m("quest page_size=1e9", "quest", "page_size", "1000000000", names=("page_size",)),
    t("ruler samples_per_cell=1e9", "ruler", "task.samples_per_cell=1000000000"),
    Case("ruler lengths=[1e8] on a model claiming 1e12 positions",
         ["model=hf", "model.name_or_path={tmp}/huge", "runner.threads=1", "task=ruler",
          "task.lengths=[100000000]"], setup="huge_positions", names=("lengths",)),
    Case("multiturn context_tokens=1e8 on a model claiming 1e12 positions",
         ["model=hf", "model.name_or_path={tmp}/huge", "runner.threads=1", "task=multiturn",
          "task.context_tokens=100000000"], setup="huge_positions", names=("context_tokens",)),
    # --- a model named by what it is; non-finite models -------------------------------------
    Case("stories260k model.path=another model", [*PPL, "model.path={tmp}/huge"],
         setup="huge_positions", names=("model.path",)),
    Case("hf model with rms_norm_eps=NaN", ["model=hf", "model.name_or_path={tmp}/nan_eps",
                                            "runner.threads=1", "task.max_tokens=40"],
         setup="nan_eps", names=("rms_norm_eps",)),
    p("method.name overriding method=snapkv", "method=snapkv", "method.name=pyramidkv",
      names=("method.name",)),
    # --- impossible combinations and hints --------------------------------------------------
    Case("shadowkv threshold beyond 512 positions", [*PPL, "task.prefill_tokens=16",
                                                     "method=shadowkv", "method.budget_tokens=8"],
         names=("compress_above_tokens",)),
    m("shadowkv rank=64 > key width 32", "shadowkv", "rank", "64"),
    Case("shadowkv rank and rank_ratio", [*PPL, "method=shadowkv", "method.rank=8",
                                          "method.rank_ratio=0.5"], names=("rank_ratio",)),
    Case("scissorhands recent_tokens > budget_tokens",
         [*PPL, "method=scissorhands", "method.budget_tokens=8", "method.recent_tokens=20"],
         names=("recent_tokens",)),
    m("quest group_reduce=mean", "quest", "group_reduce", "mean"),
    m("quest group_reduce=null", "quest", "group_reduce", "null"),
    Case("check ratio_to_method no run has", ["{tmp}/runs", "--against", "{tmp}/ratio.yaml"],
         module="harness.report.check", setup="runs", root="", names=("ratio_to_method",)),
    Case("check a key twice in an entry", ["{tmp}/runs", "--against", "{tmp}/twice.yaml"],
         module="harness.report.check", setup="runs", root="", names=("twice",)),
    Case("check --against /dev/zero", ["{tmp}/runs", "--against", "/dev/zero"],
         module="harness.report.check", setup="runs", root="", names=("/dev/zero",)),
    # --- lm-eval entry point --------------------------------------------------------------
    Case("lm_eval model_args model=nosuch", [*LME, "model=nosuch"], module="harness.lm_eval",
         root="", names=("nosuch",)),
    Case("lm_eval model_args budget_ratio=2", [*LME, "model=stories260k,method=h2o,"
                                               "budget_ratio=2"], module="harness.lm_eval",
         root="", names=("budget_ratio",)),
    Case("lm_eval model_args batch_size=abc", [*LME, "model=stories260k,batch_size=abc"],
         module="harness.lm_eval", root="", names=("batch_size",)),
]


# Case folders prepared by a block of cases below: {Case.setup: prepare(tmp)}.
SETUPS: dict[str, Callable[[Path], None]] = {}


# --- statistics and gate inputs: report, plan, check, the gate's and parity's folders ----------
# Runs with samples (perplexity and RULER, a full-cache run and an h2o run on the same samples), a
# frozen reference and a paired gate, then one file made hostile: a FIFO, a device link, a sparse
# giant, a NaN / null / string / bool score, a row that is no object, another sample. Each must
# be refused in one line naming the file, before any bootstrap, with nothing written.

_SID = "5eed0000c0ffee01"  # the one perplexity sample's content id
_NLL = [round(2.0 + 0.37 * ((7 * t) % 11) / 11, 6) for t in range(64)]  # its token losses


def _stats_run(folder: Path, method: str, task: str, accuracy: dict, rows: list[dict]) -> None:
    """A run folder (metrics.json as _fake_run writes it, for `method` and `task`) with its
    samples.jsonl."""
    _fake_run(folder)
    metrics = json.loads((folder / "metrics.json").read_text())
    metrics["method"].update(name=method, hyperparameters={"budget_ratio": 0.2}
                             if method != "full" else {}, axis_keys=["budget_ratio"])
    metrics["task"]["name"] = task
    metrics["accuracy"] = accuracy
    (folder / "metrics.json").write_text(json.dumps(metrics))
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _stats_tree(tmp: Path) -> None:
    """tmp/runs (perplexity and RULER, full and h2o), tmp/ref.jsonl (full's perplexity samples)
    and tmp/gate.yaml (h2o paired with that reference)."""
    runs = tmp / "runs"
    for method, shift in (("full", 0.0), ("h2o", 0.25)):
        nll = [round(x + shift, 6) for x in _NLL]
        _stats_run(runs / "perplexity" / "stories260k" / method / "t0", method, "perplexity",
                   {"ppl": 9.0 + shift}, [{"sample_id": _SID, "token_nll": nll}])
        scores = [float((i * 7 + (3 if shift else 0)) % 10 < 7) for i in range(30)]
        _stats_run(runs / "ruler" / "stories260k" / method / "t0", method, "ruler",
                   {"average": 100 * sum(scores) / 30},
                   [{"sample_id": f"{i:016x}", "subtask": "niah_single", "length_tokens": 256,
                     "score": s} for i, s in enumerate(scores)])
    (tmp / "ref.jsonl").write_text(json.dumps({"sample_id": _SID, "token_nll": _NLL}) + "\n")
    (tmp / "gate.yaml").write_text(
        "thresholds:\n  - {model: stories260k, method: h2o, task: perplexity, "
        "metric: paired.difference, paired_reference: ref.jsonl, max: 50.0}\n")


_TARGETS = {  # the file a case makes hostile
    "ppl": "runs/perplexity/stories260k/h2o/t0/samples.jsonl",
    "ruler": "runs/ruler/stories260k/h2o/t0/samples.jsonl",
    "ref": "ref.jsonl", "gate": "gate.yaml",
}


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _link(target: str) -> Callable[[Path], None]:
    def plant(path: Path) -> None:
        path.unlink()
        os.symlink(target, path)
    return plant


def _link_chain(path: Path) -> None:  # a link to a link to /dev/zero
    path.unlink()
    os.symlink("/dev/zero", path.with_name("hop"))
    os.symlink(path.with_name("hop"), path)


def _loop(path: Path) -> None:
    path.unlink()
    os.symlink(path, path)


def _folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _sparse(size: int) -> Callable[[Path], None]:
    def plant(path: Path) -> None:  # claims `size` bytes, writes none
        with open(path, "ab") as f:
            f.truncate(size)
    return plant


def _text(text: str) -> Callable[[Path], None]:
    return lambda path: path.write_text(text)


def _nll(first: str) -> Callable[[Path], None]:
    def plant(path: Path) -> None:  # the first token loss of the first row, as raw text
        text = path.read_text()
        path.write_text(re.sub(r'"token_nll": \[[-0-9.e]+', f'"token_nll": [{first}', text,
                               count=1))
    return plant


def _edit(old: str, new: str) -> Callable[[Path], None]:
    def plant(path: Path) -> None:  # one field of the first row, as raw text
        text = path.read_text()
        assert old in text, (old, path)
        path.write_text(text.replace(old, new, 1))
    return plant


_FIRST_SCORE = '"score": 1.0'
_MIB = 2**20


def _inputs(name: str, module: str, args: list[str], target: str,
            plant: Callable[[Path], None] | None, names: tuple[str, ...], root: str = "",
            env: dict[str, str] | None = None, expect: str = "refuse") -> Case:
    """A case on the statistics tree with `target` (a _TARGETS key) made hostile by `plant`."""
    key = f"inputs/{len(SETUPS)}"

    def prepare(tmp: Path) -> None:
        _stats_tree(tmp)
        if plant is not None:
            plant(tmp / _TARGETS[target])
    SETUPS[key] = prepare
    return Case(f"inputs: {name}", args, expect=expect, names=names, module=module, setup=key,
                root=root, env=env or {})


_REPORT = ["{tmp}/runs", "--out", "{tmp}/out", "--resamples", "200"]


def _report(name: str, target: str, plant, names=("samples.jsonl",)) -> Case:
    return _inputs(f"report {name}", "harness.report", _REPORT, target, plant, names,
                   root="{tmp}/out")


def _plan(name: str, plant, *args: str, target: str = "ruler", names=("samples.jsonl",)) -> Case:
    return _inputs(f"plan {name}", "harness.report.plan", ["{tmp}/runs", *(args or (
        "--half-width", "5", "--resamples", "200"))], target, plant, names)


def _check(name: str, target: str, plant, names=("ref.jsonl",)) -> Case:
    return _inputs(f"check {name}", "harness.report.check", ["{tmp}/runs", "--against",
                                                      "{tmp}/gate.yaml"], target, plant, names)


def _gate_folder(tmp: Path, extra: Callable[[Path], None] | None) -> None:
    """tmp/ci_gate as an earlier gate leaves it (a run, a sweep folder with its mark), then
    `extra` planted in it."""
    gate = tmp / "ci_gate"
    _fake_run(gate / "perplexity" / "stories260k" / "full" / "t0")
    sweep = gate / "_sweeps" / "stories"
    sweep.mkdir(parents=True)
    (sweep / ".kvh-sweep.json").write_text('{"harness": "kv-harness", "pid": 1}')
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    if extra is not None:
        extra(gate)


def _gate(name: str, value: str, extra=None, variable: str = "GATE_DIR") -> Case:
    """harness.store.out_dirs on the folder `variable` names (make gate / make parity's first step)."""
    key = f"inputs/{len(SETUPS)}"
    SETUPS[key] = lambda tmp: _gate_folder(tmp, extra)
    return Case(f"inputs: out_dirs {name}", [variable], names=(variable,),
                module="harness.store.out_dirs", setup=key, root="", env={variable: value})


def _parity_files(gate: Path) -> None:
    """tmp/parity as make parity leaves it."""
    parity = gate.parent / "parity"
    parity.mkdir()
    for name in ("prompts.json", "ours.json", "peer.json", "qfilters.safetensors"):
        (parity / name).write_text("{}\n")


def _user_folder(gate: Path) -> None:
    mine = gate.parent / "mine"
    (mine / "photos").mkdir(parents=True)
    (mine / "photos" / "cat.jpg").write_bytes(b"\xff\xd8 a cat")
    (mine / "todo.txt").write_text("buy milk\n")


CASES += [
    # report: the run's samples made hostile (one line, exit 2, --out never created)
    _report("samples FIFO", "ppl", _fifo),
    _report("samples -> /dev/full", "ppl", _link("/dev/full")),
    _report("samples -> /dev/random", "ppl", _link("/dev/random")),
    _report("samples -> /dev/null", "ppl", _link("/dev/null")),
    _report("samples -> link -> /dev/zero", "ppl", _link_chain),
    _report("samples sparse 257 MiB", "ppl", _sparse(257 * _MIB)),
    _report("samples is a folder", "ppl", _folder),
    _report("samples broken link", "ppl", _link("/nonexistent/samples.jsonl")),
    _report("samples link loop", "ppl", _loop),
    _report("token_nll Infinity", "ppl", _nll('Infinity')),
    _report("token_nll -Infinity", "ppl", _nll('-Infinity')),
    _report("token_nll 1e999 (inf)", "ppl", _nll('1e999')),
    _report("token_nll true", "ppl", _nll('true')),
    _report("token_nll '2.0'", "ppl", _nll('"2.0"')),
    _report("token_nll -2", "ppl", _nll('-2')),
    _report("token_nll nested list", "ppl", _nll('[2.0]')),
    _report("token_nll a mapping", "ppl", _text(json.dumps({"sample_id": _SID,
                                                             "token_nll": {"0": 2.0}}))),
    _report("row a JSON string", "ppl", _text('"' + _SID + '"\n')),
    _report("row a number", "ppl", _text("3.25\n")),
    _report("row null", "ppl", _text("null\n")),
    _report("row truncated", "ppl", _text('{"sample_id": "' + _SID + '", "token_nll": [2.0,')),
    _report("row latin-1 bytes", "ppl", lambda p: p.write_bytes(b'{"sample_id": "caf\xe9"}\n')),
    _report("sample_id a number", "ppl", _edit(f'"{_SID}"', "12345")),
    _report("ruler score 1e400", "ruler", _edit(_FIRST_SCORE, '"score": 1e400')),
    _report("ruler score '1'", "ruler", _edit(_FIRST_SCORE, '"score": "1"')),
    _report("ruler score false", "ruler", _edit(_FIRST_SCORE, '"score": false')),
    _report("ruler score 2.0", "ruler", _edit(_FIRST_SCORE, '"score": 2.0')),
    _report("ruler score -0.25", "ruler", _edit(_FIRST_SCORE, '"score": -0.25')),
    _report("ruler score [1]", "ruler", _edit(_FIRST_SCORE, '"score": [1]')),
    _report("ruler length_tokens '256'", "ruler",
            _edit('"length_tokens": 256', '"length_tokens": "256"')),
    _report("ruler subtask 3", "ruler", _edit('"subtask": "niah_single"', '"subtask": 3')),
    Case("inputs: report metrics.json sparse 17 MiB, the only run", _REPORT,
         module="harness.report", setup="inputs/only-run:sparse", root="{tmp}/out",
         names=("metrics.json", "16 MiB")),
    Case("inputs: report metrics.json -> /dev/zero, the only run", _REPORT,
         module="harness.report", setup="inputs/only-run:zero", root="{tmp}/out",
         names=("metrics.json", "/dev/zero")),
    _inputs("report --resamples 1", "harness.report", [*_REPORT[:3], "--resamples", "1"],
            "ppl", None, ("--resamples",), root="{tmp}/out"),
    _inputs("report --resamples 50", "harness.report", [*_REPORT[:3], "--resamples", "50"],
            "ppl", None, ("--resamples",), root="{tmp}/out"),
    _inputs("report --resamples 3*10**8", "harness.report",
            [*_REPORT[:3], "--resamples", "300000000"], "ppl", None, ("--resamples",),
            root="{tmp}/out"),
    _inputs("report --resamples 10**15", "harness.report",
            [*_REPORT[:3], "--resamples", str(10**15)], "ppl", None, ("--resamples",),
            root="{tmp}/out"),
    _inputs("report --resamples 2**70", "harness.report",
            [*_REPORT[:3], "--resamples", str(2**70)], "ppl", None, ("--resamples",),
            root="{tmp}/out"),
    _inputs("report --resamples 1e9 (not an integer)", "harness.report",
            [*_REPORT[:3], "--resamples", "1e9"], "ppl", None, ("--resamples",),
            root="{tmp}/out"),
    _inputs("report of good samples (valid)", "harness.report", _REPORT, "ppl", None, (),
            root="{tmp}/out", expect="run"),
    # plan: its arguments before any file, then the pilot's samples
    _plan("--half-width 1e-100", None, "--half-width", "1e-100", names=("--half-width",)),
    _plan("--half-width 1e-308", None, "--half-width", "1e-308", names=("--half-width",)),
    _plan("--half-width 5e-324", None, "--half-width", "5e-324", names=("--half-width",)),
    _plan("--half-width 1e-7", None, "--half-width", "1e-7", names=("--half-width",)),
    _plan("--half-width -inf", None, "--half-width=-inf", names=("--half-width",)),
    _plan("--half-width 1e309 (inf)", None, "--half-width", "1e309", names=("--half-width",)),
    _plan("--resamples 1", None, "--half-width", "5", "--resamples", "1",
          names=("--resamples",)),
    _plan("--resamples 3*10**9", None, "--half-width", "5", "--resamples", "3000000000",
          names=("--resamples",)),
    _plan("--resamples 10**20", None, "--half-width", "5", "--resamples", str(10**20),
          names=("--resamples",)),
    _plan("samples FIFO", _fifo),
    _plan("samples -> /dev/random", _link("/dev/random")),
    _plan("samples sparse 257 MiB", _sparse(257 * _MIB)),
    _plan("ruler score NaN", _edit(_FIRST_SCORE, '"score": NaN')),
    _plan("ruler score '0'", _edit(_FIRST_SCORE, '"score": "0"')),
    _plan("ruler score true", _edit(_FIRST_SCORE, '"score": true')),
    _plan("ruler row a list", _text('[["0000000000000000", 1.0]]\n')),
    # check: the frozen reference, the run's samples and the thresholds file
    _check("reference FIFO", "ref", _fifo),
    _check("reference -> /dev/full", "ref", _link("/dev/full")),
    _check("reference -> /dev/null", "ref", _link("/dev/null")),
    _check("reference -> /dev/random", "ref", _link("/dev/random")),
    _check("reference sparse 257 MiB", "ref", _sparse(257 * _MIB)),
    _check("reference is a folder", "ref", _folder),
    _check("reference broken link", "ref", _link("/nonexistent/ref.jsonl")),
    _check("reference row a list", "ref", _text(json.dumps([_SID, _NLL]) + "\n")),
    _check("reference token_nll Infinity", "ref", _nll('Infinity')),
    _check("reference token_nll '2.0'", "ref", _nll('"2.0"')),
    _check("reference on other samples", "ref", _edit(_SID, "0123456789abcdef")),
    _check("reference on other tokens", "ref", _text(json.dumps(
        {"sample_id": _SID, "token_nll": _NLL[:10]}) + "\n")),
    _check("reference scores a sample twice", "ref", _text(2 * (json.dumps(
        {"sample_id": _SID, "token_nll": _NLL}) + "\n"))),
    _check("reference without token_nll", "ref", _text(json.dumps({"sample_id": _SID}) + "\n")),
    _check("reference empty", "ref", _text("")),
    _check("reference latin-1 bytes", "ref", lambda p: p.write_bytes(b"{\"id\": \"\xe9\"}\n")),
    _check("reference rows without sample_id", "ref", _text(json.dumps({"token_nll": _NLL}))),
    _check("run samples FIFO", "ppl", _fifo, names=("samples.jsonl",)),
    _check("run samples -> /dev/full", "ppl", _link("/dev/full"), names=("samples.jsonl",)),
    _check("run token_nll null", "ppl", _nll('null'),
           names=("samples.jsonl",)),
    _check("run row a list", "ppl", _text("[1.0, 2.0]\n"), names=("samples.jsonl",)),
    _check("run on other samples", "ppl", _edit(_SID, "fedcba9876543210"),
           names=("ref.jsonl",)),
    _check("thresholds sparse 17 MiB", "gate", _sparse(17 * _MIB), names=("gate.yaml",)),
    _check("thresholds FIFO", "gate", _fifo, names=("gate.yaml",)),
    _check("thresholds -> /dev/random", "gate", _link("/dev/random"), names=("gate.yaml",)),
    _check("thresholds latin-1 bytes", "gate", lambda p: p.write_bytes(b"thresholds: [\xe9]\n"),
           names=("gate.yaml",)),
    # the folders make gate / make parity empty (GATE_DIR, PARITY_DIR): refused unless all is
    # what that target writes
    _gate("GATE_DIR a user's folder", "{tmp}/mine", _user_folder),
    _gate("GATE_DIR a link to an earlier gate", "{tmp}/link",
          lambda g: os.symlink(g, g.parent / "link")),
    _gate("GATE_DIR a user's file", "{tmp}/keep.txt"),
    _gate("GATE_DIR a FIFO", "{tmp}/pipe", lambda g: os.mkfifo(g.parent / "pipe")),
    _gate("GATE_DIR empty", ""),
    _gate("GATE_DIR gate + a user file deep", "{tmp}/ci_gate",
          lambda g: (g / "perplexity" / "stories260k" / "notes.md").write_text("mine\n")),
    _gate("GATE_DIR gate + a link inside", "{tmp}/ci_gate",
          lambda g: os.symlink(g.parent / "keep.txt", g / "perplexity" / "keep.txt")),
    _gate("GATE_DIR gate + a file in a run folder", "{tmp}/ci_gate",
          lambda g: (g / "perplexity" / "stories260k" / "full" / "t0" / "mine.csv")
          .write_text("1,2\n")),
    _gate("GATE_DIR gate + a sweep folder without its mark", "{tmp}/ci_gate",
          lambda g: (g / "_sweeps" / "stories" / ".kvh-sweep.json").unlink()),
    _gate("PARITY_DIR a user's folder", "{tmp}/mine", _user_folder, "PARITY_DIR"),
    _gate("PARITY_DIR an earlier gate's folder", "{tmp}/ci_gate", None, "PARITY_DIR"),
    _gate("PARITY_DIR parity files + a user file", "{tmp}/parity", lambda g: (
        _parity_files(g), (g.parent / "parity" / "results.xlsx").write_text("mine")),
        "PARITY_DIR"),
    _gate("PARITY_DIR peer.json a link to a user file", "{tmp}/parity", lambda g: (
        _parity_files(g), (g.parent / "parity" / "peer.json").unlink(),
        os.symlink(g.parent / "keep.txt", g.parent / "parity" / "peer.json")), "PARITY_DIR"),
    _gate("PARITY_DIR a link to a parity folder", "{tmp}/plink", lambda g: (
        _parity_files(g), os.symlink(g.parent / "parity", g.parent / "plink")), "PARITY_DIR"),
]


def _only_run(tmp: Path, plant: Callable[[Path], None]) -> None:
    """One run whose metrics.json is made hostile: the report names it in its one line."""
    folder = tmp / "runs" / "perplexity" / "stories260k" / "full" / "t0"
    _fake_run(folder)
    plant(folder / "metrics.json")


SETUPS["inputs/only-run:sparse"] = lambda tmp: _only_run(tmp, _sparse(17 * _MIB))
SETUPS["inputs/only-run:zero"] = lambda tmp: _only_run(tmp, _link("/dev/zero"))


# The API's CLI neighbours, method knobs, kernel flags and side files: refused before work.
# Kernel build flags and cache folder (checked by the CLI before anything loads), the knob
# classes every method shares (seeds, position-counting knobs), KVzip's calibration context,
# Expected Attention's sinks, and side files that are FIFOs, devices, folders or sparse giants.
# The API's own refusals cannot go through the CLI: tests/harness/test_api.py holds them.

def _c2(name: str, method: str, *opts: str, **kw) -> Case:
    """A run of `method` on a 24-token prompt (so every method has one to act on)."""
    return Case(f"i47c2 {name}", [*PPL, "task.prefill_tokens=24", f"method={method}", *opts],
                **kw)


def _flags(name: str, flags: str, method: str = "kivi") -> Case:
    return _c2(f"KVH_KERNEL_FLAGS {name}", method, env={"KVH_KERNEL_FLAGS": flags},
               names=("KVH_KERNEL_FLAGS",))


def _kernel_cache(name: str, folder: str, setup: str = "") -> Case:
    return _c2(f"KVH_KERNEL_CACHE {name}", "kivi", env={"KVH_KERNEL_CACHE": folder},
               setup=setup, names=("KVH_KERNEL_CACHE",))


def _c2_fifo(tmp: Path) -> None:
    os.mkfifo(tmp / "side.fifo")
    (tmp / "duo_fifo").mkdir()
    os.mkfifo(tmp / "duo_fifo" / "full_attention_heads.tsv")
    (tmp / "texts").mkdir()  # a folder of calibration texts, one of them a FIFO
    (tmp / "texts" / "a.txt").write_text("Once upon a time. " * 200)
    os.mkfifo(tmp / "texts" / "b.txt")


def _c2_sparse(tmp: Path) -> None:
    # 300 MiB claimed, nothing written: above the side-file limit (256 MiB), small enough for
    # this script's own before/after hashing of the case folder
    with open(tmp / "giant.txt", "wb") as f:
        f.truncate(300 * 2 ** 20)


SETUPS["i47c2/fifo"] = _c2_fifo
SETUPS["i47c2/sparse"] = _c2_sparse
SETUPS["i47c2/short"] = lambda tmp: _model_copy(tmp / "short", max_position_embeddings=66)
SETUPS["i47c2/pos200"] = lambda tmp: _model_copy(tmp / "pos200", max_position_embeddings=200)

_SHORT = ["model=hf", "model.name_or_path={tmp}/short", "runner.threads=1", "task.max_tokens=40",
          "task.prefill_tokens=24"]
_POS200 = ["model=hf", "model.name_or_path={tmp}/pos200", "runner.threads=1",
           "task.max_tokens=40", "task.prefill_tokens=24"]

CASES += [
    # --- kernel build flags: only what a build needs; nothing naming a file or another tool ---
    _flags("-Wl,-o names a user file", "-Wl,-o,{tmp}/keep.txt"),
    _flags("-o then a user file", "-O2 -o {tmp}/keep.txt"),
    _flags("-Wl,--output=", "-Wl,--output={tmp}/out.so"),
    _flags("-Wa,-o assembler output", "-Wa,-o,{tmp}/keep.txt"),
    _flags("-Wp,-MD dependency file", "-Wp,-MD,{tmp}/keep.txt"),
    _flags("-MF dependency file", "-MD -MF {tmp}/deps.d"),
    _flags("-specs= file", "-specs={tmp}/specs"),
    _flags("@file of arguments", "@{tmp}/keep.txt"),
    _flags("-fprofile-generate= folder", "-fprofile-generate={tmp}/prof"),
    _flags("-fdump-tree-all writes dumps", "-fdump-tree-all"),
    _flags("-fplugin= loads code", "-fplugin={tmp}/plugin.so"),
    _flags("-fstack-usage writes .su files", "-O3 -fstack-usage"),
    _flags("-save-temps", "-save-temps=obj"),
    _flags("-B compiler search path", "-B{tmp}"),
    _flags("-include a file", "-include {tmp}/keep.txt"),
    _flags("-Xlinker", "-Xlinker --output"),
    _flags("-mllvm", "-mllvm -stats"),
    _flags("--sysroot=", "--sysroot={tmp}"),
    _flags("-D value with a path", "-DOUT=/tmp/x"),
    _flags("a bare source file", "{tmp}/keep.txt"),
    _flags("-fprofile-use= reads a profile path", "-fprofile-use={tmp}/prof"),
    _flags("-Wl,-rpath", "-O3 -Wl,-rpath,{tmp}"),
    _flags("-D value with a comma", "-DLIST=a,b"),
    _flags("-fopt-info writes a report", "-fopt-info-vec-all={tmp}/opt.txt"),
    _flags("with method=turboquant", "-mno-avx512f -Wl,-T,{tmp}/script", method="turboquant"),
    _kernel_cache("a user's folder", "{tmp}/mine", setup="mine"),
    _kernel_cache("a user's file", "{tmp}/keep.txt"),
    _kernel_cache("a dangling link", "{tmp}/dangling", setup="dangling"),
    _kernel_cache("a link loop", "{tmp}/loop", setup="loop"),
    _kernel_cache("empty", ""),
    # --- seeds: 0..2**63-1 for every method that draws -------------------------------------
    _c2("turboquant seed=2**63", "turboquant", "method.seed=9223372036854775808",
        names=("method.seed",)),
    _c2("turboquant seed=-7", "turboquant", "method.seed=-7", names=("method.seed",)),
    _c2("razor_attention probe_seed=2**64", "razor_attention",
        "method.probe_seed=18446744073709551616", names=("method.probe_seed",)),
    _c2("headkv probe_seed=-1", "headkv", "method.probe_seed=-1", names=("method.probe_seed",)),
    _c2("duo_attention probe_seed=10**30", "duo_attention",
        "method.probe_seed=1000000000000000000000000000000", names=("method.probe_seed",)),
    # --- knobs counting positions: within the model's (stories260K: 512) ---------------------
    _c2("expected_attention future_tokens=513", "expected_attention", "method.future_tokens=513",
        names=("method.future_tokens",)),
    _c2("expected_attention sink_tokens=100000", "expected_attention",
        "method.sink_tokens=100000", names=("method.sink_tokens",)),
    _c2("expected_attention sinks above budget_tokens", "expected_attention",
        "method.budget_tokens=10", "method.sink_tokens=20", names=("method.sink_tokens",)),
    _c2("streaming_llm window_tokens=100000", "streaming_llm", "method.window_tokens=100000",
        names=("method.window_tokens",)),
    _c2("snapkv window_tokens=4096 (int)", "snapkv", "method.window_tokens=4096",
        names=("method.window_tokens",)),
    _c2("pyramidkv kernel_tokens=1001", "pyramidkv", "method.kernel_tokens=1001",
        names=("method.kernel_tokens",)),
    _c2("adakv window_tokens=600", "adakv", "method.window_tokens=600",
        names=("method.window_tokens",)),
    _c2("scissorhands history_tokens=10**6", "scissorhands", "method.history_tokens=1000000",
        names=("method.history_tokens",)),
    _c2("kvzip sink_tokens=2048", "kvzip", "method.sink_tokens=2048",
        names=("method.sink_tokens",)),
    _c2("qfilters window_tokens=9999", "qfilters", "method.window_tokens=9999",
        names=("method.window_tokens",)),
    _c2("razor_attention sink_tokens=777", "razor_attention", "method.sink_tokens=777",
        names=("method.sink_tokens",)),
    _c2("tailorkv recent_tokens=100000", "tailorkv", "method.recent_tokens=100000",
        names=("method.recent_tokens",)),
    Case("i47c2 expected_attention future_tokens=300 on a 200-position model",
         [*_POS200, "method=expected_attention", "method.future_tokens=300"],
         setup="i47c2/pos200", names=("method.future_tokens",)),
    # --- KVzip head level: a calibration context it can evict from ---------------------------
    _c2("kvzip level=head calibration_tokens=0", "kvzip", "method.level=head",
        "method.calibration_tokens=0", names=("method.calibration_tokens",)),
    Case("i47c2 kvzip level=head on a 66-position model", [*_SHORT, "method=kvzip",
                                                          "method.level=head"],
         setup="i47c2/short", names=("method.level=head", "head_scores_path")),
    # --- side files: kind and size before a byte is read ---------------------------------------
    _c2("kvquant calibration_path=/dev/zero", "kvquant", "method.calibration_path=/dev/zero",
        names=("calibration_path",)),
    _c2("infinigen calibration_path=/dev/urandom", "infinigen",
        "method.calibration_path=/dev/urandom", names=("calibration_path",)),
    _c2("qfilters calibration_path a FIFO", "qfilters", "method.calibration_path={tmp}/side.fifo",
        setup="i47c2/fifo", names=("calibration_path",)),
    _c2("qfilters filters_path a FIFO", "qfilters", "method.filters_path={tmp}/side.fifo",
        setup="i47c2/fifo", names=("filters_path",)),
    _c2("qfilters filters_path=/dev/zero", "qfilters", "method.filters_path=/dev/zero",
        names=("filters_path",)),
    _c2("kvzip head_scores_path=/dev/zero", "kvzip", "method.level=head",
        "method.head_scores_path=/dev/zero", names=("head_scores_path",)),
    _c2("kvzip calibration_path a FIFO", "kvzip", "method.level=head",
        "method.calibration_path={tmp}/side.fifo", setup="i47c2/fifo",
        names=("calibration_path",)),
    _c2("headkv head_scores_path a FIFO", "headkv", "method.head_scores_path={tmp}/side.fifo",
        setup="i47c2/fifo", names=("head_scores_path",)),
    _c2("duo_attention pattern_path holding a FIFO", "duo_attention",
        "method.pattern_path={tmp}/duo_fifo", setup="i47c2/fifo", names=("pattern_path",)),
    _c2("kvquant calibration_path a sparse 300 MiB file", "kvquant",
        "method.calibration_path={tmp}/giant.txt", setup="i47c2/sparse",
        names=("calibration_path",)),
    _c2("infinigen calibration_path a sparse 300 MiB file", "infinigen",
        "method.calibration_path={tmp}/giant.txt", setup="i47c2/sparse",
        names=("calibration_path",)),
    _c2("tailorkv calibration_path=/dev/zero", "tailorkv", "method.calibration_path=/dev/zero",
        names=("calibration_path",)),
    _c2("infinigen calibration_path a folder", "infinigen", "method.calibration_path={tmp}",
        names=("calibration_path",)),
    _c2("tailorkv calibration_path a FIFO", "tailorkv", "method.calibration_path={tmp}/side.fifo",
        setup="i47c2/fifo", names=("calibration_path",)),
    _c2("qfilters calibration_path=/dev/urandom", "qfilters",
        "method.calibration_path=/dev/urandom", names=("calibration_path",)),
    _c2("kvquant calibration folder holding a FIFO", "kvquant",
        "method.calibration_path={tmp}/texts", setup="i47c2/fifo", names=("b.txt",)),
]


# --- case folders ---------------------------------------------------------------------------

# Sweep shards: bounded by a SLURM array's index limit (every launcher) and by this machine's CPUs
# (local shard processes), refused before any shard process starts.
_RULER = ["model=stories260k", "task=ruler", "task.lengths=[320]", "runner.threads=1"]
CASES += [
    Case("shards: 1001 (above a SLURM array)", [*_RULER, "runner.shards=1001",
                                                "runner.results_root={root}"],
         names=("runner.shards",)),
    Case("shards: 10**6", [*_RULER, "runner.shards=1000000", "runner.results_root={root}"],
         names=("runner.shards",)),
    Case("shards: -3", [*_RULER, "runner.shards=-3", "runner.results_root={root}"],
         names=("runner.shards",)),
    Case("shards: a string", [*_RULER, "runner.shards=many", "runner.results_root={root}"],
         names=("runner.shards",)),
    Case("shards: 1.5", [*_RULER, "runner.shards=1.5", "runner.results_root={root}"],
         names=("runner.shards",)),
]

def _fake_run(folder: Path) -> None:
    """A minimal run folder that harness.report / harness.report.check read."""
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps({
        "schema_version": 1,
        "accuracy": {"ppl": 50.0, "nll_per_block": [4.0, 3.9], "block_tokens": 100},
        "speed": {"decode_tokens_per_s": 100.0, "decode_ms_per_token_median": 10.0},
        "kv": {"compression_ratio": 1.0, "bytes_total": 1000.0, "bytes_device_total": 1000.0,
               "held_ratio": 1.0, "seen_tokens_mean": 300.0, "method_active": True},
        "protocol": {"dense_layers": [], "prefill": "dense", "batch_size": 1},
        "transfer": {}, "memory": {}, "env": {}, "model": {"name": "stories260k"},
        "method": {"name": "full", "hyperparameters": {}, "axis_keys": [], "variant_keys": []},
        "task": {"name": "perplexity", "options": {}},
        "run": {"started": "2026-11-29T10:00:00", "config_hash": "x", "status": "ok"}}))


def setup_case(tmp: Path, how: str) -> None:
    (tmp / "keep.txt").write_text("a user's file\n")  # every case: must survive
    if how in SETUPS:  # a block's own preparation
        SETUPS[how](tmp)
    elif how == "empty":
        (tmp / "empty").mkdir()
    elif how == "loop":
        os.symlink(tmp / "loop", tmp / "loop")
    elif how == "dangling":
        os.symlink(tmp / "gone" / "away", tmp / "dangling")
    elif how == "mine":
        (tmp / "mine").mkdir()
        (tmp / "mine" / "notes.txt").write_text("mine\n")
    elif how == "fake_gguf":
        (tmp / "fake.gguf").write_text("not a gguf file\n")
    elif how == "runs":
        _fake_run(tmp / "runs" / "perplexity" / "stories260k" / "full" / "t0")
        (tmp / "empty.yaml").write_text("")
        (tmp / "list.yaml").write_text("- 1\n- 2\n")
        (tmp / "gate.yaml").write_text("thresholds:\n  - {model: stories260k, method: full, "
                                       "task: perplexity, metric: accuracy.ppl, max: 60}\n")
        (tmp / "bad").mkdir()
        (tmp / "bad" / "metrics.json").write_text("{not json")
        (tmp / "empty").mkdir()
        (tmp / "ratio.yaml").write_text("thresholds:\n  - {model: stories260k, method: full, "
                                        "task: perplexity, metric: accuracy.ppl, "
                                        "ratio_to_method: snapkv, max: 1.2}\n")
        (tmp / "twice.yaml").write_text("thresholds:\n  - {model: stories260k, method: full, "
                                        "task: perplexity, metric: accuracy.ppl, max: 60, "
                                        "max: 40}\n")
    elif how == "sidefiles":
        _side_files(tmp)
    elif how == "huge_positions":
        _model_copy(tmp / "huge", max_position_embeddings=10**12)
    elif how == "nan_eps":
        _model_copy(tmp / "nan_eps", rms_norm_eps=float("nan"))


STORIES = Path(os.environ.get("KVH_SHARED_DIR", PROJECT.parent / "shared")) / "models" / "stories260K"


def _model_copy(folder: Path, **config) -> None:
    """stories260K's files (links) with its config.json edited: another model by its config."""
    folder.mkdir()
    for f in STORIES.iterdir():
        if f.name != "config.json":
            os.symlink(f, folder / f.name)
    raw = json.loads((STORIES / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, **config}))


def _side_files(tmp: Path) -> None:
    """Broken side files for stories260K (5 layers, 8 query / 4 KV heads)."""
    (tmp / "calib.bin").write_bytes(bytes(range(256)) * 8)
    (tmp / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 200)
    gates = [[0.5] * 4 for _ in range(5)]
    for what, config, bad in (("corrupt_config", "{not json", None),
                              ("list_config", "[64, 256]", None),
                              ("nan_gate", None, float("nan")), ("gate_3", None, 3.0)):
        folder = tmp / f"duo_{what}"
        folder.mkdir()
        rows = [list(r) for r in gates]
        if bad is not None:
            rows[1][2] = bad
        (folder / "full_attention_heads.tsv").write_text(
            "\n".join("\t".join(repr(g) for g in r) for r in rows) + "\n")
        if config is not None:
            (folder / "config.json").write_text(config)
    for what, score in (("nan", "NaN"), ("inf", "Infinity"), ("negative", "-0.5"),
                        ("huge", "1e308, 1e308")):
        table = ", ".join(f'"{layer}-{h}": [{score}]' for layer in range(5) for h in range(8))
        (tmp / f"headkv_{what}.json").write_text("{" + table + "}\n")


def snapshot(tmp: Path) -> dict[str, str]:
    out = {}
    for path in tmp.rglob("*"):
        if path.is_file() and not path.is_symlink():
            out[str(path.relative_to(tmp))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


# --- one case -------------------------------------------------------------------------------

def default_names(case: Case) -> tuple[str, ...]:
    for arg in reversed(case.args):
        key = arg.lstrip("+").split("=", 1)[0]
        if "=" in arg and "." in key:
            return (key.rsplit(".", 1)[1],)
    return ()


def message_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.strip() and not NOISE.match(ln)]


def classify(case: Case, rc: int | None, out: str, err: str, tmp: Path,
             before: dict[str, str]) -> tuple[str, str]:
    after = snapshot(tmp)
    lost = [p for p, digest in before.items() if after.get(p) != digest]
    if lost:
        return "destroyed", f"changed or removed: {', '.join(lost)}"
    if rc is None:
        return "timeout", "killed after the timeout"
    if "Traceback (most recent call last)" in out + err:
        tail = [ln for ln in err.splitlines() if ln.strip()]
        return "traceback", tail[-1][:160] if tail else "traceback"
    root = Path(case.root.format(tmp=tmp, root=tmp / "results")) if case.root else None
    wrote = root is not None and root.exists() and any(root.rglob("*"))
    lines = message_lines(err)
    if case.expect == "run":
        if rc == 0 and wrote:
            return "clean", "ran"
        return "unclear", f"exit {rc}, wrote {wrote}: {' | '.join(lines)[:160]}"
    if case.expect == "sweep":
        failed = [ln.strip() for ln in (out + err).splitlines()
                  if ln.strip().startswith("[failed]")]
        names = case.names or default_names(case)
        results = list(root.rglob("metrics.json")) if root is not None and root.exists() else []
        ok = (rc == 1 and len(failed) == 1 and any(n in failed[0] for n in names)
              and len(results) == 1)
        detail = f"exit {rc}, {len(failed)} failed, {len(results)} results: {' '.join(failed)}"
        return ("clean" if ok else "unclear"), detail[:200]
    if rc == 0:
        return "accepted", "exit 0"
    names = case.names or default_names(case)
    text = " ".join(lines)
    why = []
    if rc != 2:
        why.append(f"exit {rc}")
    if len(lines) != 1:
        why.append(f"{len(lines)} lines")
    if names and not any(n in text for n in names):
        why.append(f"names none of {list(names)}")
    if root is not None and root.exists():
        why.append("left files under the results root" if wrote else
                   "left an empty results root")
    if why:
        return "unclear", "; ".join(why) + f": {text[:160]}"
    return "clean", text[:160]


def run_case(case: Case, base: Path, index: int, timeout_s: float, project: Path) -> dict:
    tmp = base / f"case{index:03d}"
    tmp.mkdir()
    setup_case(tmp, case.setup)
    before = snapshot(tmp)
    root = tmp / "results"
    args = [a.format(tmp=tmp, root=root) for a in case.args]
    if case.module == "harness" and not any("results_root=" in a or "output_dir=" in a
                                            for a in args):
        args.append(f"runner.results_root={root}")
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "WANDB_MODE": "offline",
           "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "KVH_CACHE_DIR": os.environ.get("KVH_CACHE_DIR", str(Path.home() / ".cache" /
                                                               "kv-harness")),
           **{k: v.format(tmp=tmp, root=root) for k, v in case.env.items()}}
    start = time.monotonic()
    try:
        proc = subprocess.run([PYTHON, "-m", case.module, *args], cwd=project, env=env,
                              capture_output=True, text=True, timeout=timeout_s)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = None
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
            else exc.stdout or ""
        err = (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) \
            else exc.stderr or ""
    outcome, detail = classify(case, rc, out, err, tmp, before)
    return {"case": case.name, "expect": case.expect, "module": case.module,
            "args": args, "exit": rc, "outcome": outcome, "detail": detail,
            "seconds": round(time.monotonic() - start, 1)}


def write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, ensure_ascii=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="write the results here (atomic)")
    ap.add_argument("-k", action="append", default=[],
                    help="only cases whose name contains this (repeatable)")
    ap.add_argument("--project", type=Path, default=PROJECT,
                    help="the checkout whose code runs (default: this one)")
    ap.add_argument("--timeout", type=float, default=90.0, help="seconds per case")
    args = ap.parse_args(argv)
    cases = [c for c in CASES if not args.k or any(k in c.name for k in args.k)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvh-misuse-") as base:
        for i, case in enumerate(cases):
            row = run_case(case, Path(base), i, args.timeout, args.project)
            rows.append(row)
            print(f"{i + 1:3d} {row['outcome']:9s} {row['seconds']:5.1f}s  {case.name}: "
                  f"{row['detail']}", flush=True)
    totals = {c: sum(r["outcome"] == c for r in rows) for c in CLASSES}
    print("\ntotals: " + ", ".join(f"{n} {c}" for c, n in totals.items()) +
          f" (of {len(rows)} cases; {sum(r['expect'] == 'run' for r in rows)} expected to run)")
    if args.json:
        write_json_atomic(args.json, {"totals": totals, "cases": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
