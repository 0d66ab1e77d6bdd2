"""`kvharness`: an lm-eval `LM` whose every token goes through our Engine and the KV method.

lm-eval's own `hf` model scores with one cache-less forward, so a cache-side KV method never acts
there. This model owns the three request types instead:

* `loglikelihood` (`_loglikelihood_tokens`): each request is a fresh managed cache. The context is
  prefilled through the method (in `prefill_chunk_tokens` chunks); its last position's logits
  predict the first continuation token. The remaining continuation tokens are then scored against
  the managed cache (so the method has already compressed the context):
    - `scoring=chunked`: one prefill call over continuation[:-1] with logits for every position;
    - `scoring=stepwise`: one decode step per token, so per-step methods act between tokens.
  The inputs are HFLM's: (context + continuation)[-(max_length + 1):][:-1], continuation logits
  read from the last len(continuation) positions; with method=full this reproduces HFLM.
* `loglikelihood_rolling`: lm-eval's rolling windows (`get_rolling_token_windows`, prefix token
  = BOS, or EOS without BOS, as HFLM), each window streamed one token at a time through the method
  (the StreamingLLM perplexity protocol); returns the summed log-probability per document.
* `generate_until`: greedy decoding through the engine, stopping at EOS, at `max_gen_toks`, or as
  soon as a stop string appears; the text is cut at the first stop string.

Built either from an existing `Engine` (Python) or from lm-eval `--model_args` (CLI):
`model=smollm2_135m|stories260k|hf, name_or_path=..., method=h2o, budget_ratio=0.2, scoring=...`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, resolve_max_length
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from kvcore.errors import ConfigError
from harness.core.models import chat_text, parameter_count
from harness.core.progress import progress
from harness.session import OwnFeed

log = logging.getLogger(__name__)

SCORING = ("chunked", "stepwise")
DEFAULT_MAX_GEN_TOKS = 256  # as HFLM
# model_args consumed by the model group (the rest are LM options or method hyperparameters)
MODEL_KEYS = ("name_or_path", "path", "dtype", "cache_dir")
LM_KEYS = ("method", "scoring", "prefill_chunk_tokens", "attn_impl", "max_length", "max_gen_toks",
           "check_budget", "threads", "share_context", "batch_size", "max_batch_size", "device",
           "runner_dense_layers", "runner_prefill")


def parse_value(value: Any) -> Any:
    """A model_args value from a string: null/none, true/false, int, float, else the string."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    lower = text.lower()
    if lower in ("null", "none", "~"):
        return None
    if lower in ("true", "false"):
        return lower == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _positive_int(key: str, value: Any, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"kvharness {key}={value!r} must be a positive integer")
    return value


# (method, activity) of every evaluation whose model info lm-eval read (harness.lm_eval CLI)
ACTIVITY: list[tuple[str, dict[str, Any]]] = []
# lm-eval's own options it passes to every model, with its defaults (lm_eval EvaluatorConfig)
_CLI_DEFAULTS = {"batch_size": 1, "max_batch_size": None, "device": "cuda:0"}


def merge_cli_options(args: dict[str, Any], cli: dict[str, Any] | None) -> dict[str, Any]:
    """--model_args with lm-eval's --batch_size/--max_batch_size/--device: an option given in
    model_args (README: `--model_args ...,batch_size=2`) is taken from there; given both ways
    with two values it is refused (lm-eval itself would pass it twice: a TypeError)."""
    out = dict(args)
    for key, value in (cli or {}).items():
        if value is None:
            continue
        if key not in out:
            out[key] = value
        elif str(value) != str(_CLI_DEFAULTS.get(key)) and str(value) != str(out[key]):
            raise ConfigError(f"kvharness {key} is given twice, --{key} {value} and --model_args "
                              f"{key}={out[key]}; give it once")
    return out


def _check_batch(batch_size: Any, max_batch_size: Any) -> int:
    """lm-eval's batch_size: a positive integer (requests decoded together, harness.core.batch), or
    auto, which runs batch 1 (no memory probing: a KV method changes what fits)."""
    value = parse_value(batch_size) if batch_size is not None else 1
    if isinstance(value, str) and value.startswith("auto"):
        log.info("kvharness: batch_size=%s runs one sequence at a time (batch 1)", value)
        value = 1
    elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"kvharness batch_size={batch_size!r}: allowed: a positive integer "
                          "or auto")
    if max_batch_size is not None and parse_value(max_batch_size) is not None:
        log.info("kvharness: max_batch_size=%s ignored (batch_size=%s)", max_batch_size, value)
    return value


def _model_device(device: str | None) -> str:
    """lm-eval's --device (None, cpu, cuda, cuda:0) -> our model.device (auto, cpu, cuda).

    lm-eval's CLI passes cuda:0 unless told otherwise; like its `hf` model, an unavailable CUDA
    device falls back to the automatic choice (with a warning) instead of failing."""
    if device is None:
        return "auto"
    text = str(device)
    if text == "cpu":
        return "cpu"
    if text in ("cuda", "cuda:0"):
        if torch.cuda.is_available():
            return "cuda"
        log.warning("kvharness: device=%s but CUDA is not available; using the CPU", text)
        return "auto"
    raise ConfigError(f"kvharness device={device!r}; allowed: cpu, cuda, cuda:0 (or none: auto)")


def build_engine(model: str, method: str = "full", prefill_chunk_tokens: int = 512,
                 attn_impl: str = "sdpa", check_budget: bool = True, device: str | None = None,
                 threads: int | None = None, model_options: dict[str, Any] | None = None,
                 method_options: dict[str, Any] | None = None, dense_layers: Any = None,
                 prefill: str = "dense", batch_size: int = 1):
    """Load a model and a KV method into an Engine through the runner's entry path
    (harness.session: every check before the weights load).

    Returns (engine, the model's description)."""
    from harness.config.runner import ATTN_IMPLS
    from harness.session import Session, setting
    from methods import build_method

    if attn_impl not in ATTN_IMPLS:
        raise ConfigError(f"kvharness attn_impl={attn_impl!r}; allowed: {', '.join(ATTN_IMPLS)}")
    kv_method = build_method(str(method), **(method_options or {}))
    runner = {"batch_size": batch_size, "prefill_chunk_tokens": prefill_chunk_tokens, "seed": 0,
              "attn_impl": attn_impl, "check_budget": check_budget,
              "dense_layers": _layer_list(dense_layers), "prefill": prefill}
    session = Session([setting({"name": model, "device": _model_device(device),
                                **(model_options or {})}, runner, kv_method,
                               _LoglikelihoodTask())])
    if threads:
        torch.set_num_threads(int(threads))
    engine, = session.ready()
    return engine, session.spec.description


class _LoglikelihoodTask(OwnFeed):
    """lm-eval's requests prefill a context, then score or generate token by token
    (loglikelihood and generate_until batch; rolling streams one document)."""

    name = "lm_eval"


def _layer_list(value: Any) -> list[int]:
    """runner_dense_layers from model_args ("0;1": lm-eval splits model_args on commas)."""
    if value is None or value == "":
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, str):
        try:
            return [int(v) for v in value.replace(";", " ").split()]
        except ValueError:
            raise ConfigError(f"kvharness runner_dense_layers={value!r} must be layer indices "
                              "separated by ';' (e.g. runner_dense_layers=0;1)") from None
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ConfigError(f"kvharness runner_dense_layers={value!r} must be layer indices separated "
                      "by ';'")


@register_model("kvharness")
class KVHarnessLM(TemplateLM):
    """lm-eval model backed by the harness Engine and its KV method (greedy; batch_size
    requests decoded together for loglikelihood and generate_until)."""

    def __init__(self, engine=None, *, model: str | None = None, method: str | None = None,
                 scoring: str = "chunked", prefill_chunk_tokens: int = 512,
                 attn_impl: str = "sdpa", max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, check_budget: bool = True,
                 threads: int | None = None, share_context: bool = True,
                 batch_size: int | str | None = 1, max_batch_size: int | None = None,
                 device: str | None = None, runner_dense_layers: Any = None,
                 runner_prefill: str = "dense", **options: Any):
        """`engine`: an existing Engine (model, tokenizer and KV method fixed by it), or None to
        load one from `model` (+ name_or_path, path, dtype, cache_dir), `method` (default full)
        and the method's hyperparameters (any other keyword), as lm-eval's --model_args give
        them. `scoring`: chunked | stepwise (see the module docstring). `share_context`: one
        context prefill per group of requests with the same context (results are identical).
        `runner_dense_layers` ("0;1") and `runner_prefill` (dense | sparse) are the run protocol,
        as runner.dense_layers / runner.prefill of the runner."""
        super().__init__()
        batch = _check_batch(batch_size, max_batch_size)
        scoring = parse_value(scoring)
        if scoring not in SCORING:
            raise ConfigError(f"kvharness scoring={scoring!r}; allowed: {', '.join(SCORING)}")
        self.scoring = scoring
        self._description = None
        self.share_context = bool(parse_value(share_context))
        self._warned_unforkable = False
        options = {k: parse_value(v) for k, v in options.items()}
        if engine is None:
            if model is None:
                raise ConfigError("kvharness needs model=<smollm2_135m|stories260k|hf> in "
                                  "--model_args (or an engine from Python)")
            model_options = {k: options.pop(k) for k in MODEL_KEYS if k in options}
            method = parse_value(method) or "full"
            self._check_method_options(str(method), options)
            engine, self._description = build_engine(
                str(parse_value(model)), str(method),
                _positive_int("prefill_chunk_tokens", parse_value(prefill_chunk_tokens)),
                str(parse_value(attn_impl)), bool(parse_value(check_budget)), device,
                _positive_int("threads", parse_value(threads), allow_none=True),
                model_options, options, runner_dense_layers, str(parse_value(runner_prefill)),
                batch)
        elif model is not None or method is not None or options:
            extra = [k for k, v in (("model", model), ("method", method)) if v is not None]
            raise ConfigError(f"kvharness: {', '.join(extra + sorted(options))} given together "
                              "with an engine; the engine already fixes model and method")
        if engine.settings.batch_size != batch:
            engine.settings = dataclasses.replace(engine.settings, batch_size=batch)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        if self.tokenizer is None:
            raise ConfigError("kvharness needs an engine with a tokenizer")
        self._max_length = _positive_int("max_length", parse_value(max_length), allow_none=True)
        self._max_gen_toks = _positive_int("max_gen_toks", parse_value(max_gen_toks))
        self._device = engine.device
        self._stop_ids = engine.stop_token_ids()

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """lm-eval's CLI: `--model_args` plus its own --batch_size/--max_batch_size/--device."""
        from lm_eval.utils import simple_parse_args_string

        return cls(**merge_cli_options(simple_parse_args_string(arg_string), additional_config))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None):
        return cls(**merge_cli_options(dict(arg_dict), additional_config))

    def activity(self) -> dict[str, Any]:
        """Whether the KV method acted over the requests served so far (harness.core.accounting):
        kv.method_active / kv.inactive_reason, as the runner records them."""
        from harness.core.accounting import activity

        engine = self.engine
        kv = {**engine.ledger.summary(), **engine.attended.summary()}
        return activity(engine.method.capabilities.compresses, kv)

    @staticmethod
    def _check_method_options(method: str, options: dict[str, Any]) -> None:
        from methods import method_class

        allowed = method_class(method).hyperparameter_names()
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ConfigError(
                f"kvharness model_args {unknown[0]}={options[unknown[0]]!r} is neither an option "
                f"of the model ({', '.join(('model',) + MODEL_KEYS + LM_KEYS)}) nor a "
                f"hyperparameter of method={method} ({', '.join(allowed) or 'none'})")

    # --- what lm-eval reads ----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """Conditioning token for empty contexts and rolling windows: BOS, else EOS (as HFLM)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        if self._max_length:
            return self._max_length
        return resolve_max_length(self.engine.model.config, self.tokenizer)

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self.engine.settings.batch_size

    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        """Recorded by lm-eval in results["config"] once the evaluation is over: which model, KV
        method and protocol, and whether the method acted (also kept in ACTIVITY, which the CLI
        flags)."""
        engine = self.engine
        activity = self.activity()
        ACTIVITY.append((engine.method.name, activity))
        return {
            "kvharness_model": self._description or getattr(engine.model, "name_or_path",
                                                            type(engine.model).__name__),
            "kvharness_method": engine.method.name,
            "kvharness_hyperparameters": engine.method.hyperparameters(),
            "kvharness_scoring": self.scoring,
            "kvharness_prefill_chunk_tokens": engine.settings.prefill_chunk_tokens,
            "kvharness_max_length": self.max_length,
            "model_num_parameters": parameter_count(engine.model),
            "model_dtype": str(next(engine.model.parameters()).dtype),
            **{f"kvharness_{k}": v for k, v in activity.items()},
        }

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs) -> list[int]:
        """Token ids; `add_special_tokens=None` means the tokenizer's own default (mapping it to
        False would drop BOS and shift loglikelihoods), except for a string that already starts
        with the BOS text (no second BOS), as HFLM."""
        if add_special_tokens is None:
            bos_text = self.tokenizer.decode(self.prefix_token_id)
            if bos_text and string.startswith(bos_text):
                add_special_tokens = False
        ids = self.engine.encode(string, add_special_tokens=add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        return chat_text(self.tokenizer, chat_history, add_generation_prompt,
                         continue_final_message=not add_generation_prompt)

    # --- loglikelihood ---------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                              ) -> list[tuple[float, bool]]:
        """Requests sharing a (fitted) context share one context prefill: the managed cache is
        snapshotted after it and restored before each further continuation (see `_snapshot`)."""
        if self.batch_size > 1:
            return self._batched_loglikelihood(requests, disable_tqdm)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (_, context, continuation) in enumerate(requests):
            groups.setdefault(tuple(self._fit(context, continuation)), []).append(i)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        items = groups.items()
        if not disable_tqdm:
            items = progress(items, "kvharness loglikelihood", "ctx", total=len(groups))
        for context, members in items:
            continuations = [requests[i][2] for i in members]
            for i, logits in zip(members, self._group_logits(list(context), continuations)):
                answer = self._answer(logits, requests[i][2])
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                results[i] = answer
        return results  # type: ignore[return-value]

    def _batched_loglikelihood(self, requests, disable_tqdm: bool) -> list[tuple[float, bool]]:
        """`batch_size` requests at a time through `engine.batch` (no context sharing: each
        sequence prefills its own context, as `share_context=false` does at batch 1)."""
        size, results = self.batch_size, []
        starts = range(0, len(requests), size)
        if not disable_tqdm:
            starts = progress(starts, "kvharness loglikelihood", "batch")
        for start in starts:
            group = requests[start:start + size]
            contexts = [self._fit(context, continuation) for _, context, continuation in group]
            continuations = [continuation for _, _, continuation in group]
            for (key, _, continuation), logits in zip(
                    group, self._batch_logits(contexts, continuations)):
                answer = self._answer(logits, continuation)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
                results.append(answer)
        return results

    def _batch_logits(self, contexts: list[list[int]], continuations: list[list[int]]
                      ) -> list[torch.Tensor]:
        """`_fresh_logits` for several requests decoded together (same rows, same protocol)."""
        rests = [c[:-1] for c in continuations]
        with self.engine.batch(len(contexts)) as batch:
            first = batch.prefill(contexts)  # (B, V): each context's last position
            if self.scoring == "chunked":
                rows = batch.prefill(rests, all_logits=True)
            else:
                rows = [[] for _ in rests]
                for t in range(max(len(r) for r in rests)):
                    seqs = [s for s, r in enumerate(rests) if t < len(r)]
                    logits = batch.step(seqs, [rests[s][t] for s in seqs])
                    for s, row in zip(seqs, logits):
                        rows[s].append(row[None])
                rows = [torch.cat(r) if r else first.new_empty(0, first.shape[-1]) for r in rows]
        return [torch.cat([first[s:s + 1], rows[s]]) for s in range(len(contexts))]

    def _fit(self, context: list[int], continuation: list[int]) -> list[int]:
        """HFLM's window: the context left-truncated so context + continuation[:-1] fits."""
        if not continuation:
            raise ValueError("kvharness: empty continuation")
        if len(continuation) > self.max_length:
            raise ValueError(f"kvharness: continuation of {len(continuation)} tokens is longer "
                             f"than max_length={self.max_length}")
        kept = (context + continuation)[-(self.max_length + 1):]
        fitted = kept[: len(kept) - len(continuation)]
        if not fitted:
            raise ValueError("kvharness: empty context (lm-eval puts the prefix token there)")
        return fitted

    def _continue(self, req, continuation: list[int]) -> list[torch.Tensor]:
        """Score continuation[:-1] against the request's cache: logits rows predicting
        continuation[1:] (one prefill call, or one decode step per token)."""
        rest = continuation[:-1]
        if not rest:
            return []
        if self.scoring == "chunked":
            return [req.prefill(rest, all_logits=True)[0]]
        return [req.step(token)[0] for token in rest]

    def _group_logits(self, context: list[int], continuations: list[list[int]]
                      ) -> list[torch.Tensor]:
        """Per continuation, logits `(len(continuation), V)` fp32 predicting each of its tokens,
        with the (fitted) `context` prefilled through the method first. With `share_context`, the
        context is prefilled once and the cache restored from a snapshot for each continuation."""
        if len(continuations) == 1 or not self.share_context:
            return [self._fresh_logits(context, c) for c in continuations]
        engine = self.engine
        out = []
        with engine.request() as req:
            first = req.prefill(context)[0]  # (1, V): the last context position
            snapshot = self._snapshot(req)
            for j, continuation in enumerate(continuations if snapshot else continuations[:1]):
                if j > 0:  # account the finished continuation as its own sample, then rewind
                    engine.ledger.record(req.cache.kv_layers, engine.settings.check_budget)
                    req.restore(snapshot, consume=j == len(continuations) - 1)
                out.append(torch.cat([first] + self._continue(req, continuation)))
        if snapshot is None:  # the method's state cannot be snapshotted: prefill again
            out += [self._fresh_logits(context, c) for c in continuations[1:]]
        return out

    def _fresh_logits(self, context: list[int], continuation: list[int]) -> torch.Tensor:
        with self.engine.request() as req:
            rows = [req.prefill(context)[0]] + self._continue(req, continuation)
        return torch.cat(rows)

    def continuation_logits(self, context: list[int], continuation: list[int]) -> torch.Tensor:
        """Logits `(len(continuation), V)` fp32 predicting each continuation token: the context
        (HFLM-fitted) prefilled through the method, the continuation scored against its cache."""
        return self._fresh_logits(self._fit(context, continuation), continuation)

    def _snapshot(self, req):
        """The request's state for rewinding (`Request.snapshot`), or None (then re-prefill)."""
        snapshot = req.snapshot()
        if snapshot is None and not self._warned_unforkable:
            log.info("kvharness: the state of method=%s cannot be snapshotted; each "
                     "continuation prefills its context again", self.engine.method.name)
            self._warned_unforkable = True
        return snapshot

    def _answer(self, logits: torch.Tensor, continuation: list[int]) -> tuple[float, bool]:
        """(sum of continuation log-probs, whether greedy decoding would produce it)."""
        target = torch.tensor(continuation, device=logits.device)
        logprobs = F.log_softmax(logits, dim=-1).gather(-1, target[:, None]).squeeze(-1)
        greedy = bool((logits.argmax(dim=-1) == target).all())
        return float(logprobs.sum()), greedy

    def score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """One request: (sum of continuation log-probs, is greedy)."""
        return self._answer(self.continuation_logits(context, continuation), continuation)

    # --- loglikelihood_rolling ---------------------------------------------------------------
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        results = []
        items = requests if disable_tqdm else progress(requests, "kvharness rolling", "doc")
        for request in items:
            (string,) = request.args
            total = 0.0
            windows = get_rolling_token_windows(token_list=self.tok_encode(string),
                                                prefix_token=self.prefix_token_id,
                                                max_seq_len=self.max_length, context_len=1)
            for context, predicted in map(make_disjoint_window, windows):
                total += self._stream_logprob(context, predicted)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            results.append(total)
        return results

    def _stream_logprob(self, context: list[int], predicted: list[int]) -> float:
        """Feed context + predicted[:-1] one token at a time; sum log p(predicted)."""
        tokens = context + predicted[:-1]
        first_scored = len(context) - 1  # logits after this token predict predicted[0]
        total = 0.0
        with self.engine.request(final_tokens=len(tokens)) as req:  # the stream's length
            for i, token in enumerate(tokens):
                logits = req.step(token)[0, -1]
                if i >= first_scored:
                    total += float(F.log_softmax(logits, dim=-1)[predicted[i - first_scored]])
        return total

    # --- generate_until ----------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        jobs = []  # (prompt ids, max new tokens, stop strings)
        for request in requests:
            context, gen_kwargs = request.args[0], request.args[1]
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ConfigError(f"kvharness decodes greedily; this request asks for sampling "
                                  f"({gen_kwargs!r}); set do_sample=false / temperature=0")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_new = int(kwargs.pop("max_gen_toks"))
            if max_new >= self.max_length:
                raise ValueError(f"kvharness: max_gen_toks={max_new} must be less than "
                                 f"max_length={self.max_length}")
            prompt = self.tok_encode(context, left_truncate_len=self.max_length - max_new)
            jobs.append((prompt, max_new, [s for s in until if s]))
        size, results = self.batch_size, []
        starts = range(0, len(jobs), size)
        if not disable_tqdm:
            starts = progress(starts, "kvharness generate", "batch" if size > 1 else "req")
        for start in starts:
            group = jobs[start:start + size]
            texts = ([self._greedy(*group[0])] if size == 1 else self._greedy_batch(group))
            for request, text in zip(requests[start:start + size], texts):
                self.cache_hook.add_partial("generate_until", tuple(request.args[:2]), text)
                results.append(text)
        return results

    def _greedy_batch(self, jobs: list[tuple[list[int], int, list[str]]]) -> list[str]:
        """`_greedy` for several requests decoded together: a sequence leaves the batch at a
        stop token (not kept), at its max_gen_toks or when one of its stop strings appears."""
        def finished(s: int, new: list[int]) -> bool:
            return any(stop in self.tok_decode(new) for stop in jobs[s][2])

        with self.engine.batch(len(jobs)) as batch:
            outs = batch.generate([j[0] for j in jobs], [j[1] for j in jobs], self._stop_ids,
                                  finished=finished)
        texts = []
        for new, (_, _, stops) in zip(outs, jobs):
            if new and new[-1] in self._stop_ids:
                new = new[:-1]
            texts.append(cut_at_stop(self.tok_decode(new), stops))
        return texts

    def _greedy(self, prompt: list[int], max_new_tokens: int, stops: list[str]) -> str:
        """Greedy decoding through the engine; the text cut at the first stop string."""
        new: list[int] = []
        with self.engine.request() as req:
            logits = req.prefill(prompt)
            while True:
                token = int(logits[0, -1].argmax())
                if token in self._stop_ids:
                    break
                new.append(token)
                text = self.tok_decode(new)
                if len(new) >= max_new_tokens or any(s in text for s in stops):
                    break
                logits = req.step(token)
        return cut_at_stop(self.tok_decode(new), stops)


def cut_at_stop(text: str, stops: list[str]) -> str:
    """`text` up to the earliest occurrence of any stop string."""
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=len(text))
    return text[:cut]
