"""XSum zero-shot summarization in H2O's setting (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle
for Efficient Generative Inference of Large Language Models", arXiv 2306.14048; FMInference/H2O
`h2o_hf/run_summarization.py` over `h2o_hf/data/summarization_data/xsum_0shot.jsonl`).

Each item's `article` is the ready prompt ("###\\nArticle: <document>\\n\\nSummarize the above
article in 1 sentence.\\n", HELM's XSum format); the engine decodes greedily for the item's
`max_tokens` (or `task.max_new_tokens`) or until EOS, and the prediction is cut at the first
occurrence of any of the item's `stop` strings. ROUGE-1/2/L F-measures come from `rouge-score`
(`RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)`), ×100, averaged over the scored
items.

Differences from run_summarization.py, recorded in the protocol block: greedy decoding instead of
sampling at the item's temperature (0.3); the tokenizer's default special tokens (BOS for Llama
tokenizers) instead of `add_special_tokens=False`; the prediction is cut at the earliest of all
stop strings (the H2O script cuts at `stop[0]` with `str.find`, which drops the last character
when the stop string is absent); ROUGE from `rouge-score` with stemming (the script uses the
`rouge` package).

Long prompts are never truncated: an item whose prompt tokens + generation length exceed the
model's max positions is skipped and counted (`skipped_too_long`); items are read in file order
until `limit` items have been scored, so the scored set depends on the model (its positions and
tokenizer) but never on the KV method.

Data: `task.path`, else `<task.data_dir>/xsum/xsum_0shot.jsonl` (default ../shared/data), else the
`EdinburghNLP/xsum` test split from the hub (formatted as above, 64 tokens, stop "###").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from kvcore.errors import ConfigError
from harness.core.metrics import rouge_scores
from tasks.base import Task, TaskResult, content_id
from tasks.engine_api import Answer, GenerationRequest, TaskEngine, Work
from tasks.text_sources import data_root, jsonl_objects

HUB_DATASET = "EdinburghNLP/xsum"
H2O_FILE = Path("xsum") / "xsum_0shot.jsonl"
HUB_MAX_TOKENS = 64  # what every item of H2O's file asks for
HUB_STOP = ["###"]
ROUGE_KEYS = ("rouge1", "rouge2", "rougeL")


def h2o_prompt(document: str) -> str:
    """H2O / HELM XSum prompt; whitespace in the document is collapsed to single spaces (the items
    of H2O's file hold no newlines)."""
    body = " ".join(document.split())
    return f"###\nArticle: {body}\n\nSummarize the above article in 1 sentence.\n"


def cut_at_stop(text: str, stops: list[str]) -> str:
    """`text` up to the earliest occurrence of any stop string (unchanged if none occurs)."""
    positions = [text.find(s) for s in stops if s]
    positions = [p for p in positions if p >= 0]
    return text[: min(positions)] if positions else text


def parse_items(raw: bytes, source: str) -> list[dict[str, Any]]:
    """Items of an H2O-format jsonl; one ConfigError naming `source` (and line) per flaw."""
    items = []
    for number, item in jsonl_objects(raw, source, "H2O XSum request"):
        for key in ("article", "summary_gt"):
            if not isinstance(item.get(key), str):
                raise ConfigError(f"{source}:{number}: field {key!r} must be a string; H2O items "
                                  "have article, summary_gt, max_tokens, stop")
        max_tokens = item.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ConfigError(f"{source}:{number}: 'max_tokens' must be a positive integer")
        stop = item.get("stop", [])
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ConfigError(f"{source}:{number}: 'stop' must be a list of strings")
        items.append({"id": item.get("id", number - 1), "article": item["article"],
                      "summary_gt": item["summary_gt"], "max_tokens": max_tokens, "stop": stop})
    if not items:
        raise ConfigError(f"{source}: no items (an empty file)")
    return items


@dataclass(kw_only=True)
class XSum(Task):
    name: ClassVar[str] = "xsum"
    fidelity: ClassVar[bool] = True
    main_metric: ClassVar[str] = "rougeL"  # ROUGE-L F x100
    higher_is_better: ClassVar[bool] = True
    batches: ClassVar[bool] = True
    limit: int | None = 20  # items scored (the prompts are long); null: all
    path: str | None = None  # an H2O-format jsonl (overrides data_dir)
    data_dir: str | None = None  # folder holding xsum/xsum_0shot.jsonl (default ../shared/data)
    max_new_tokens: int | None = None  # generation length (None: each item's max_tokens)

    def check_options(self) -> list[str]:
        value = self.max_new_tokens
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            return [f"task.max_new_tokens={value!r} must be a positive integer or null"]
        return []

    def check_data(self) -> None:
        self._items, self._source = self._load()

    def _load(self) -> tuple[list[dict], str]:
        if self.path:
            path = Path(self.path).expanduser()
            if not path.is_file():
                raise ConfigError(f"task.path={path}: no such file (an H2O-format XSum jsonl)")
            return parse_items(path.read_bytes(), str(path)), str(path)
        path = data_root(self.data_dir) / H2O_FILE
        if path.is_file():
            return parse_items(path.read_bytes(), str(path)), str(path)
        if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
            raise ConfigError(f"task.data_dir: no local XSum file {path} and the hub is offline; "
                              "pass task.path=<H2O xsum_0shot.jsonl> or task.data_dir=")
        try:
            from datasets import load_dataset

            rows = load_dataset(HUB_DATASET, split="test")
        except Exception as exc:  # network or hub error: say what was asked and how to provide it
            raise ConfigError(f"task.data_dir: no local XSum file {path} and loading {HUB_DATASET} "
                              f"from the hub failed ({type(exc).__name__}); pass "
                              "task.path=<H2O xsum_0shot.jsonl>") from None
        items = [{"id": row["id"], "article": h2o_prompt(row["document"]),
                  "summary_gt": row["summary"], "max_tokens": HUB_MAX_TOKENS, "stop": HUB_STOP}
                 for row in rows]
        return items, f"hf://datasets/{HUB_DATASET} (test)"

    def requests(self, engine: TaskEngine) -> Work:
        """One request: the items read that fit the model's positions with their generation
        length (the others are recorded as skipped)."""
        if not getattr(self, "_items", None):
            self.check_data()
        positions = engine.info.max_positions
        planned, fitting = [], 0  # items read, in order: (item, ids, gen, fits)
        for item in self._items:
            if self.limit is not None and fitting >= self.limit:
                break
            ids = engine.encode(item["article"])
            gen = self.max_new_tokens or item["max_tokens"]
            fits = len(ids) + gen <= positions
            planned.append((item, ids, gen, fits))
            fitting += fits
        todo = [p for p in planned if p[3]]
        if not todo:
            raise ConfigError(f"task=xsum: none of the {len(planned)} items read fits the "
                              f"model's {positions} positions with its generation length; use a "
                              "model with more positions or lower task.max_new_tokens")
        request = GenerationRequest([p[1] for p in todo], [p[2] for p in todo], label="xsum",
                                    **self.golds(engine, [p[0]["summary_gt"] for p in todo]))
        return Work([request], planned)

    def score(self, engine: TaskEngine, work: Work, answers: list[Answer]) -> TaskResult:
        planned = work.context
        skipped = sum(not p[3] for p in planned)
        outs = iter(answers[0].outputs)
        samples, scored = [], []
        for item, ids, gen, fits in planned:
            if not fits:
                samples.append({"id": item["id"], "sample_id": content_id(ids, item["summary_gt"]),
                                "skipped": True, "prompt_tokens": len(ids),
                                "max_new_tokens": gen})
                continue
            new_ids = next(outs)
            text = engine.tokenizer.decode(new_ids, skip_special_tokens=True)
            prediction = cut_at_stop(text, item["stop"])
            rouge = {k: 100 * v for k, v in rouge_scores(prediction, item["summary_gt"]).items()}
            scored.append(rouge)
            samples.append({"id": item["id"], "sample_id": content_id(ids, item["summary_gt"]),
                            "skipped": False, "prediction": prediction,
                            "reference": item["summary_gt"], **rouge, "prompt_tokens": len(ids),
                            "max_new_tokens": gen, "new_tokens": len(new_ids)})
        self.add_fidelity([s for s in samples if not s["skipped"]], answers[0])
        metrics: dict[str, Any] = {k: round(sum(s[k] for s in scored) / len(scored), 4)
                                   for k in ROUGE_KEYS}
        metrics.update(scored=len(scored), skipped_too_long=skipped, items_read=len(samples))
        protocol = {
            "benchmark": "XSum zero-shot, H2O (arXiv 2306.14048) run_summarization.py setting",
            "data": self._source,
            "decoding": "greedy (the items' temperature is not used)",
            "max_new_tokens": self.max_new_tokens or "per item (max_tokens)",
            "special_tokens": "tokenizer default",
            "stop": "prediction cut at the earliest stop string; generation stops at EOS",
            "rouge": "rouge-score RougeScorer(rouge1, rouge2, rougeL, use_stemmer=True), F x100",
            "too_long": "skipped and counted, never truncated",
        }
        return TaskResult(metrics=metrics, samples=samples, protocol=protocol)
