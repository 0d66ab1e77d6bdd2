"""LongBench v1 (Bai et al., 2023, "LongBench: A Bilingual, Multitask Benchmark for Long Context
Understanding", arXiv 2308.14508), following the official THUDM/LongBench `pred.py` + `eval.py`.

Per sample: the dataset's prompt template is filled from the row (`{context}`, `{input}`); the
tokenized prompt is cut in the middle to `task.max_length_tokens` (its first and last halves are
kept); the model's chat template wraps it except for the few-shot and code datasets (trec,
triviaqa, samsum, lcc, repobench-p); the engine decodes greedily up to the dataset's generation
length (samsum also stops at a newline, which may not be the first token); only the first line of
the prediction is scored for trec, triviaqa and samsum. The score of a sample is the max of the
dataset's metric over its reference answers; a dataset's score is the mean ×100 and `average` is
the mean over the datasets run. Prompts, lengths and metric choice: `tasks/_longbench_config.py`;
metrics: `harness/core/metrics.py`.

Differences from `pred.py`, all recorded in the protocol block:
* truncation is done on token ids (pred.py decodes both halves and re-tokenizes the text);
* `max_length_tokens` bounds the whole model input, chat wrapper included (pred.py bounds the
  prompt before wrapping it), so that prompt + generation fit the model's positions by default;
* the chat wrapper is the tokenizer's own chat template (pred.py hard-codes one per model family),
  split around the prompt and tokenized piecewise without special tokens.

Data: `<task.data_dir>/<dataset>.jsonl` in the official format (`input`, `context`, `answers`,
`all_classes`, `_id`, ...); without a local file and with the hub reachable, the official `data.zip`
of the `THUDM/LongBench` dataset repo (what its loading script reads). Only multi_news ships in
../shared/data/longbench.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvcore.errors import ConfigError
from harness.core.metrics import METRICS
from harness.core.models import CHAT_TEMPLATE_KWARGS, chat_text
from methods.base import KVMethod
from methods.model import ModelInfo
from tasks._longbench_config import DATASETS, HUB_ARCHIVE, HUB_REPO, DatasetSpec
from tasks.base import Task, TaskResult, content_id
from tasks.engine_api import Answer, GenerationRequest, TaskEngine, Work
from tasks.text_sources import data_root, jsonl_objects

CHAT_MODES = ("auto", "always", "never")
_SLOT = "KVH_LONGBENCH_PROMPT_SLOT"  # stands for the prompt when splitting the chat template
_REQUIRED = ("input", "context", "answers")
_PARAGRAPH = re.compile(r"Paragraph \d+")  # what retrieval_score reads from an answer


def middle_truncate(ids: list[int], max_tokens: int) -> list[int]:
    """LongBench's truncation: if too long, keep the first and the last `max_tokens // 2` ids."""
    if len(ids) <= max_tokens:
        return list(ids)
    half = max_tokens // 2
    return list(ids[:half]) + list(ids[len(ids) - half:])


def first_line(text: str) -> str:
    """eval.py's post-processing for trec/triviaqa/samsum/lsht: the first line after leading
    newlines."""
    return text.lstrip("\n").split("\n")[0]


@contextlib.contextmanager
def _hub_quiet():
    """huggingface_hub's per-retry warnings off during the download: a failure is said in one
    line (the ConfigError of `_load`), not a dozen retry lines before it."""
    log = logging.getLogger("huggingface_hub")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"


def parse_rows(raw: bytes, source: str, dataset: str) -> list[dict[str, Any]]:
    """Rows of an official LongBench jsonl; one ConfigError naming `source` (and line) per flaw."""
    rows = []
    for number, row in jsonl_objects(raw, source, "LongBench JSON object"):
        missing = [key for key in _REQUIRED if key not in row]
        if missing:
            raise ConfigError(f"{source}:{number}: missing field {missing[0]!r}; LongBench rows "
                              f"have {', '.join(_REQUIRED)}, all_classes, _id")
        if not isinstance(row["context"], str) or not isinstance(row["input"], str):
            raise ConfigError(f"{source}:{number}: 'context' and 'input' must be strings")
        answers = row["answers"]
        if (not isinstance(answers, list) or not answers
                or not all(isinstance(a, str) for a in answers)):
            raise ConfigError(f"{source}:{number}: 'answers' must be a non-empty list of strings")
        if DATASETS[dataset].metric == "classification":
            classes = row.get("all_classes")
            if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
                raise ConfigError(f"{source}:{number}: {dataset} is scored by classification and "
                                  "needs 'all_classes', a list of class names")
        if DATASETS[dataset].metric == "retrieval" and not all(_PARAGRAPH.search(a)
                                                              for a in answers):
            raise ConfigError(f"{source}:{number}: {dataset} answers must read 'Paragraph <n>'")
        rows.append(row)
    if not rows:
        raise ConfigError(f"{source}: no rows (an empty file)")
    return rows


def chat_pieces(engine) -> tuple[list[int], list[int]]:
    """Token ids of the chat template before and after the user message (no special tokens added:
    the template writes its own)."""
    text = chat_text(engine.tokenizer, [{"role": "user", "content": _SLOT}])
    if not isinstance(text, str) or text.count(_SLOT) != 1:
        raise ConfigError("task.chat_template: this tokenizer's chat template does not place the "
                          "user message verbatim once; use task.chat_template=never")
    before, after = text.split(_SLOT)
    return (engine.encode(before, add_special_tokens=False) if before else [],
            engine.encode(after, add_special_tokens=False) if after else [])


@dataclass(kw_only=True)
class LongBench(Task):
    name: ClassVar[str] = "longbench"
    fidelity: ClassVar[bool] = True
    main_metric: ClassVar[str] = "average"  # mean of the datasets' LongBench scores
    higher_is_better: ClassVar[bool] = True
    batches: ClassVar[bool] = True
    datasets: list[str] | str = field(default_factory=lambda: ["multi_news"])  # one name = a list of one
    data_dir: str | None = None  # folder of <dataset>.jsonl (default ../shared/data/longbench)
    max_length_tokens: int | None = None  # model input cap (None: max positions - generation)
    max_new_tokens: int | None = None  # generation length (None: LongBench's per-dataset value)
    chat_template: str = "auto"  # auto (official rule) | always | never

    def check_options(self) -> list[str]:
        reasons = []
        if isinstance(self.datasets, str):
            self.datasets = [self.datasets]
        if not isinstance(self.datasets, (list, tuple)) or not self.datasets:
            reasons.append(f"task.datasets={self.datasets!r} must be a non-empty list of names; "
                           f"allowed: {', '.join(DATASETS)}")
        else:
            self.datasets = list(self.datasets)
            unknown = [d for d in self.datasets if d not in DATASETS]
            if unknown:
                reasons.append(f"task.datasets: unknown dataset {unknown[0]!r}; allowed: "
                               f"{', '.join(DATASETS)} (the Chinese datasets are not supported)")
            elif len(set(self.datasets)) != len(self.datasets):
                reasons.append(f"task.datasets={self.datasets} names a dataset twice")
        if self.chat_template not in CHAT_MODES:
            reasons.append(f"task.chat_template={self.chat_template!r}; allowed: "
                           f"{', '.join(CHAT_MODES)}")
        for key, low in (("max_length_tokens", 2), ("max_new_tokens", 1)):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < low):
                reasons.append(f"task.{key}={value!r} must be an integer >= {low} or null")
        return reasons

    # --- lengths ---------------------------------------------------------------------------
    def _lengths(self, info: ModelInfo, method: KVMethod) -> tuple[dict, list[str]]:
        """Per dataset (model input cap, generation length), and the reasons they cannot run."""
        plan, reasons = {}, []
        positions = info.max_positions
        for dataset in self.datasets:
            gen = self.max_new_tokens or DATASETS[dataset].max_new_tokens
            source = "task.max_new_tokens" if self.max_new_tokens else "LongBench's dataset2maxlen"
            cap = self.max_length_tokens or positions - gen
            if self.max_length_tokens is None and cap < 2:
                reasons.append(
                    f"task.max_length_tokens=null leaves {cap} prompt tokens for {dataset}: the "
                    f"model has {positions} positions and {dataset} generates up to {gen} tokens "
                    f"({source}); set task.max_new_tokens (e.g. {positions // 4}) or "
                    "task.max_length_tokens, or use a longer-context model")
            elif cap + gen > positions and not method.bounds_positions():
                reasons.append(
                    f"task.max_length_tokens={cap} + {gen} generated tokens for {dataset} exceed "
                    f"the model's max positions ({positions}); lower task.max_length_tokens to "
                    f"{positions - gen} or set task.max_new_tokens")
            plan[dataset] = (cap, gen)
        return plan, reasons

    def validate(self, info: ModelInfo, method: KVMethod) -> list[str]:
        return self._lengths(info, method)[1]

    # --- data ------------------------------------------------------------------------------
    def data_folder(self) -> Path:
        return data_root(self.data_dir) if self.data_dir else data_root(None) / "longbench"

    def check_data(self) -> None:
        self._rows, self._sources = {}, {}
        for dataset in self.datasets:
            self._rows[dataset], self._sources[dataset] = self._load(dataset)

    def _load(self, dataset: str) -> tuple[list[dict], str]:
        folder = self.data_folder()
        path = folder / f"{dataset}.jsonl"
        if path.is_file():
            return parse_rows(path.read_bytes(), str(path), dataset), str(path)
        if _hub_offline():
            raise ConfigError(
                f"task.datasets: {dataset} has no local file {path} and the hub is offline "
                f"(HF_HUB_OFFLINE/HF_DATASETS_OFFLINE=1); put the official {dataset}.jsonl (from "
                f"{HUB_REPO} {HUB_ARCHIVE}) in that folder or point task.data_dir at one")
        source = f"hf://datasets/{HUB_REPO}/{HUB_ARCHIVE}:data/{dataset}.jsonl"
        try:
            from huggingface_hub import hf_hub_download

            with _hub_quiet():
                archive = hf_hub_download(HUB_REPO, HUB_ARCHIVE, repo_type="dataset")
            with zipfile.ZipFile(archive) as zipped:
                raw = zipped.read(f"data/{dataset}.jsonl")
        except Exception as exc:  # network, hub or archive error: say what was asked
            raise ConfigError(f"task.datasets: {dataset} has no local file {path} and the hub "
                              f"download of {source} failed ({type(exc).__name__}: {exc}); put "
                              "the official jsonl in task.data_dir") from None
        return parse_rows(raw, source, dataset), source

    # --- evaluation ------------------------------------------------------------------------
    def _uses_chat(self, spec: DatasetSpec, has_template: bool) -> bool:
        if self.chat_template == "never":
            return False
        if self.chat_template == "always":
            return True
        return spec.chat_template and has_template

    def requests(self, engine: TaskEngine) -> Work:
        """One request per dataset (its prompts truncated in the middle to the model input cap)."""
        plan, reasons = self._lengths(engine.info, engine.method)
        if reasons:
            raise ConfigError("; ".join(reasons))
        if not getattr(self, "_rows", None):
            self.check_data()
        has_template = bool(getattr(engine.tokenizer, "chat_template", None))
        if self.chat_template == "always" and not has_template:
            raise ConfigError("task.chat_template=always but this model's tokenizer has no chat "
                              "template; allowed here: auto, never")
        built = [self._dataset_request(engine, dataset, plan[dataset],
                                       self._uses_chat(DATASETS[dataset], has_template))
                 for dataset in self.datasets]
        return Work([b[0] for b in built], {"plan": plan, "has_template": has_template,
                                             "prompts": [b[1] for b in built]})

    def score(self, engine: TaskEngine, work: Work, answers: list[Answer]) -> TaskResult:
        plan, has_template = work.context["plan"], work.context["has_template"]
        samples, per_dataset = [], {}
        for dataset, prompts, answered in zip(self.datasets, work.context["prompts"], answers,
                                              strict=True):
            spec = DATASETS[dataset]
            scored = self._score_dataset(engine, dataset, spec, prompts, answered)
            samples.extend(scored)
            per_dataset[dataset] = {
                "score": round(100 * sum(s["score"] for s in scored) / len(scored), 4),
                "samples": len(scored),
                "truncated": sum(s["truncated"] for s in scored),
                "metric": spec.metric,
                "max_length_tokens": plan[dataset][0],
                "max_new_tokens": plan[dataset][1],
                "chat_template": prompts["use_chat"],
            }
        metrics: dict[str, Any] = {d: per_dataset[d]["score"] for d in self.datasets}
        metrics["average"] = round(sum(metrics[d] for d in self.datasets) / len(self.datasets), 4)
        metrics["samples"] = len(samples)
        metrics["truncated"] = sum(s["truncated"] for s in samples)
        metrics["per_dataset"] = per_dataset
        protocol = {
            "benchmark": "LongBench v1 (arXiv 2308.14508), THUDM/LongBench@2e00731 pred.py/eval.py",
            "datasets": list(self.datasets),
            "data": dict(self._sources),
            "decoding": "greedy",
            "truncation": "middle, on token ids: the first and last max_length_tokens // 2 tokens "
                          "of the model input (chat wrapper included) are kept",
            "chat_template": {"mode": self.chat_template, "tokenizer_has_template": has_template,
                              "kwargs": dict(CHAT_TEMPLATE_KWARGS),
                              "applied": {d: per_dataset[d]["chat_template"]
                                          for d in self.datasets}},
            "first_line_scored": [d for d in self.datasets if DATASETS[d].first_line],
            "stop_at_newline": [d for d in self.datasets if DATASETS[d].stop_at_newline],
            "metrics": {d: DATASETS[d].metric for d in self.datasets},
            "score": "max over reference answers, mean x100 per dataset; average over datasets",
        }
        return TaskResult(metrics=metrics, samples=samples, protocol=protocol)

    def _dataset_request(self, engine, dataset: str, lengths: tuple[int, int],
                         use_chat: bool) -> tuple[GenerationRequest, dict]:
        """One dataset's request, and its rows and prompts as `_score_dataset` reads them."""
        spec = DATASETS[dataset]
        cap, gen = lengths
        prefix, suffix = chat_pieces(engine) if use_chat else ([], [])
        budget = cap - len(prefix) - len(suffix)
        if budget < 2:
            raise ConfigError(f"task.max_length_tokens={cap} for {dataset}: the chat template "
                              f"alone takes {len(prefix) + len(suffix)} tokens; raise it or set "
                              "task.chat_template=never")
        stop_ids = set(engine.stop_token_ids())
        if spec.stop_at_newline:
            stop_ids.add(engine.encode("\n", add_special_tokens=False)[-1])
        rows = self._rows[dataset][: self.limit] if self.limit else self._rows[dataset]
        prompts = []  # (ids, untruncated tokens, truncated?)
        for row in rows:
            prompt = spec.prompt.format(context=row["context"], input=row["input"])
            # pred.py tokenizes with the tokenizer's default special tokens unless it wraps the
            # prompt; the wrapper (chat template) brings its own.
            body = (engine.encode(prompt, add_special_tokens=False) if use_chat
                    else engine.encode(prompt))
            kept = middle_truncate(body, budget)
            prompts.append((prefix + kept + suffix, len(prefix) + len(body) + len(suffix),
                            len(kept) < len(body)))
        # pred.py's samsum call sets min_length = prompt + 1, which masks its EOS ids (newline
        # included) at the first step: the first token is never a stop token there.
        # fidelity's gold answer: the first reference, as the prediction would continue the prompt
        request = GenerationRequest([p[0] for p in prompts], gen, stop_ids,
                                    min_new_tokens=1 if spec.stop_at_newline else 0,
                                    label=f"longbench {dataset}",
                                    **self.golds(engine, [(row["answers"] or [""])[0]
                                                          for row in rows]))
        return request, {"rows": rows, "prompts": prompts, "use_chat": use_chat}

    def _score_dataset(self, engine, dataset: str, spec: DatasetSpec, built: dict,
                       answered: Answer) -> list[dict]:
        metric = METRICS[spec.metric]
        rows, prompts, use_chat = built["rows"], built["prompts"], built["use_chat"]
        samples = []
        for index, (row, (ids, untruncated, truncated), new_ids) in enumerate(
                zip(rows, prompts, answered.outputs, strict=True)):
            prediction = engine.tokenizer.decode(new_ids, skip_special_tokens=True)
            scored_text = first_line(prediction) if spec.first_line else prediction
            score_one = (functools.partial(metric, all_classes=row["all_classes"])
                         if spec.metric == "classification" else metric)
            score = max(0.0, *(score_one(scored_text, answer) for answer in row["answers"]))
            sample = {"id": row.get("_id", f"{dataset}-{index}"),
                      "sample_id": content_id(ids, list(row["answers"])), "dataset": dataset,
                      "prediction": prediction, "references": list(row["answers"]),
                      "score": score, "prompt_tokens": len(ids),
                      "prompt_tokens_untruncated": untruncated,
                      "truncated": truncated, "new_tokens": len(new_ids),
                      "chat_template": use_chat}
            if spec.first_line:
                sample["scored_prediction"] = scored_text
            samples.append(sample)
        self.add_fidelity(samples, answered)
        return samples
