"""Shared-context multi-turn retrieval: a long context prefilled once, then one question per turn.

The idea is SCBench's (Li et al., "SCBench: A KV Cache-Centric Analysis of Long-Context Methods",
arXiv 2412.10319): a context is shared by several queries that arrive one after another, so a KV
method that compresses after prefill is also judged on the later queries, which its compression
could not anticipate. The questions are RULER's needle retrieval (Hsieh et al., arXiv
2404.06654; see `tasks/ruler.py`):

* **Context**: a haystack (`task.haystack`: essays | ruler | repeat) filled to `task.context_tokens`
  with `task.turns` needles "One of the special magic numbers for {key} is: {value}." (distinct
  adjective-noun keys, 7-digit values, depths drawn from RULER's 40-point grid, all from
  `task.seed`). The context segment is everything before the first question: chat header (if
  any), RULER's instruction and the haystack.
* **One request per conversation**: the context is prefilled once; then, for turn k, the question
  segment (end of the previous turn, question k, the assistant header and RULER's answer prefix)
  is prefilled on top of the same managed cache and the answer is decoded greedily.
* **Answers stay in the cache** (`task.answers=append`, the only mode): each generated answer is
  part of the conversation, as in a real chat (SCBench's multi-turn mode). Removing it again
  (`trim`) is not offered: once a method has evicted, merged or quantized entries while the
  answer was decoded, the cache cannot be rolled back to its state before the answer.
* **Chat format** (`task.chat_template=auto`): the first user message is instruction + context +
  question 1, later user messages are questions only; segments are cut from the chat template's
  own rendering, so the tokens fed equal a normal rendering of the conversation. `plain` joins
  the turns with newlines (RULER's base template).
* **Scoring**: string match of the asked needle's value in the turn's answer (RULER's
  `string_match_all` with one reference), accuracy (percent) per turn index and overall.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from kvcore.errors import ConfigError
from kvcore.guards import PROMPT_HOST_BYTES_PER_TOKEN, size_reason
from harness.core.models import CHAT_TEMPLATE_KWARGS
from harness.core.progress import progress
from methods.base import KVMethod
from methods.model import ModelInfo
from tasks.base import Task, TaskResult, content_id
from tasks.prompts import (CHAT_OPTIONS, HAYSTACKS, KEY_WORDS, NEEDLE, RULER_DEPTHS, PromptFormat,
                           clean_prediction, haystack_with_needles, is_int, largest_fitting,
                           load_haystack_words, magic_number, string_match_all)

if TYPE_CHECKING:
    from harness.core.engine import Engine

ANSWER_MODES = ("append",)
DEFAULT_CONTEXT_TOKENS = 1024
INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize "
         "it. I will quiz you about the numbers afterwards.")


def question(key: str) -> tuple[str, str]:
    """RULER's single-needle question and answer prefix for `key`."""
    return (f"What is the special magic number for {key} mentioned in the provided text?",
            f" The special magic number for {key} mentioned in the provided text is")


@dataclass
class Dialogue:
    """One conversation: the shared context and its questions, rendered into token segments."""

    fmt: PromptFormat
    context: str  # the haystack with the needles
    keys: list[str]  # turn k asks keys[k]
    values: list[str]
    depths_percent: list[float]
    haystack_units: int = 0
    context_ids: list[int] = field(default_factory=list)

    def _first_user(self) -> str:
        return f"{INTRO}\n{self.context}\n{question(self.keys[0])[0]}"

    def _split_first(self) -> tuple[str, str]:
        """(context segment, turn-1 segment) text."""
        q, prefix = question(self.keys[0])
        if not self.fmt.chat:
            return f"{INTRO}\n{self.context}\n", q + prefix
        full = self.fmt.render(self._first_user(), prefix)
        cut = full.index(self.context) + len(self.context)
        return full[:cut], full[cut:]

    def context_text(self) -> str:
        return self._split_first()[0]

    def turn_text(self, k: int, answers: list[str]) -> str:
        """Text of turn k's segment, given the decoded answers of turns 0..k-1 (already cached)."""
        if k == 0:
            return self._split_first()[1]
        q, prefix = question(self.keys[k])
        if not self.fmt.chat:
            return "\n" + q + prefix
        messages = [{"role": "user", "content": self._first_user()}]
        last = ""
        for j in range(k):
            last = (question(self.keys[j])[1].lstrip() + answers[j]).strip()
            messages.append({"role": "assistant", "content": last})
            messages.append({"role": "user", "content": question(self.keys[j + 1])[0]})
        full = self.fmt.render_messages(messages, True) + prefix.lstrip()
        end = full.rfind(last)
        if end < 0:
            raise ConfigError("task.chat_template: this chat template rewrites assistant messages, "
                              "so turns cannot be cut from its rendering; use "
                              "task.chat_template=plain")
        return full[end + len(last):]


@dataclass(kw_only=True)
class MultiTurn(Task):
    """Shared context, several retrieval questions in one request (SCBench, arXiv 2412.10319)."""

    name: ClassVar[str] = "multiturn"
    main_metric: ClassVar[str] = "accuracy"  # needles retrieved over every turn, %
    higher_is_better: ClassVar[bool] = True
    # one request per conversation, fed turn by turn (Engine.request)
    needs_live_engine: ClassVar[bool] = True
    context_tokens: int | None = None  # tokens of the shared context; None: min(1024, what fits)
    turns: int = 4  # needles = questions per conversation
    samples: int = 2  # conversations (contexts)
    haystack: str = "essays"  # essays | ruler | repeat
    data_dir: str | None = None  # holds ruler/PaulGrahamEssays.json (default ../shared/data)
    chat_template: str = "auto"  # auto | chat | plain
    answers: str = "append"  # answers stay in the cache (the only mode; see the docstring)
    max_new_tokens: int = 32  # per turn
    seed: int = 0

    def check_options(self) -> list[str]:
        reasons = []
        if self.context_tokens is not None and (not is_int(self.context_tokens)
                                                or self.context_tokens < 16):
            reasons.append(f"task.context_tokens={self.context_tokens!r} must be an integer >= 16 "
                           "or null")
        for key, low in (("turns", 1), ("samples", 1), ("max_new_tokens", 1)):
            value = getattr(self, key)
            if not is_int(value) or value < low:
                reasons.append(f"task.{key}={value!r} must be an integer >= {low}")
        if is_int(self.turns) and self.turns > len(RULER_DEPTHS):
            reasons.append(f"task.turns={self.turns} must be <= {len(RULER_DEPTHS)} (one needle "
                           "per depth of RULER's 40-point grid)")
        if self.haystack not in HAYSTACKS:
            reasons.append(f"task.haystack={self.haystack!r}; allowed: {', '.join(HAYSTACKS)}")
        elif self.haystack == "repeat" and self.data_dir:
            reasons.append(f"task.data_dir={self.data_dir} is not read with task.haystack=repeat "
                           "(the haystack is generated); drop it, or choose "
                           "task.haystack=essays|ruler")
        if self.chat_template not in CHAT_OPTIONS:
            reasons.append(f"task.chat_template={self.chat_template!r}; allowed: "
                           f"{', '.join(CHAT_OPTIONS)}")
        if self.answers not in ANSWER_MODES:
            reasons.append(f"task.answers={self.answers!r}; allowed: append (answers stay in the "
                           "cache; a compressed cache cannot be rolled back to drop them)")
        if not is_int(self.seed):
            reasons.append(f"task.seed={self.seed!r} must be an integer")
        return reasons

    def validate(self, info: ModelInfo, method: KVMethod) -> list[str]:
        if self.context_tokens is None:
            return []
        need = self.context_tokens + self.turns * (self.max_new_tokens + 1)
        size = size_reason(f"task.context_tokens={self.context_tokens}", need * (
            info.kv_bytes_per_token() + PROMPT_HOST_BYTES_PER_TOKEN),
            "the conversation's KV cache and its text")
        if size:
            return [size]
        if not info.max_positions or method.bounds_positions():
            return []
        if need > info.max_positions:
            return [f"task.context_tokens={self.context_tokens} + task.turns={self.turns} x "
                    f"(task.max_new_tokens={self.max_new_tokens} + 1) = {need} tokens, more than "
                    f"the model's {info.max_positions} max positions; lower them"]
        return []

    def check_prompts(self, tokenizer, info: ModelInfo, method: KVMethod) -> list[str]:
        """The context and turns fit (the failure would otherwise come after weights load):
        the same checks as `evaluate`, on the smallest haystack of each conversation."""
        fmt = PromptFormat(tokenizer, self.chat_template)
        saved = self.context_tokens, getattr(self, "_context_defaulted", False)
        try:
            context = self.resolve_context_tokens(fmt, info.max_positions)
            count = min(self.samples, self.limit) if self.limit else self.samples
            for index in range(count):
                need = len(self._make(fmt, index, 0).context_ids)
                if need > context:
                    return [self._context_too_small(context, need)]
            planned = context + self.turn_cost_tokens(fmt)
            limit = info.max_positions
            if limit and planned > limit and not method.bounds_positions():
                return [self._too_long(context, planned, info.max_positions)]
        except ConfigError as exc:
            return [str(exc)]
        finally:
            self.context_tokens, self._context_defaulted = saved
        return []

    def check_data(self) -> None:
        self._words = load_haystack_words(self.haystack, self.data_dir)

    # -- conversations (tokenizer only; no model) --

    def _draw(self, index: int) -> tuple[list[str], list[str], list[float]]:
        """Keys (turn k asks keys[k]), values and needle depths of conversation `index`, drawn turn
        by turn so that fewer turns keep the same first needles."""
        rng = random.Random(f"multiturn:{self.seed}:{index}")
        keys: list[str] = []
        values: list[str] = []
        depths: list[float] = []
        for _ in range(self.turns):
            keys.append(_fresh(lambda: rng.choice(KEY_WORDS), keys))
            values.append(_fresh(lambda: magic_number(rng), values))
            depths.append(_fresh(lambda: float(rng.choice(RULER_DEPTHS)), depths))
        return keys, values, depths

    def dialogue(self, fmt: PromptFormat, index: int, context_tokens: int) -> Dialogue:
        """Conversation `index` with the largest haystack whose context segment fits."""
        words = getattr(self, "_words", None)
        if words is None:
            words = self._words = load_haystack_words(self.haystack, self.data_dir)
        memo: dict[int, Dialogue] = {}

        def tokens(units: int) -> int:
            if units not in memo:
                memo[units] = self._make(fmt, index, units, words)
            return len(memo[units].context_ids)

        units = largest_fitting(tokens, context_tokens, 0)
        if units is None:
            raise ConfigError(self._context_too_small(context_tokens, len(memo[0].context_ids)))
        return memo[units]

    def _make(self, fmt: PromptFormat, index: int, units: int, words=None) -> Dialogue:
        """Conversation `index` with `units` haystack units, its context tokenized."""
        if words is None:
            words = getattr(self, "_words", None) or load_haystack_words(self.haystack,
                                                                         self.data_dir)
        keys, values, depths = self._draw(index)
        needles = [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)]
        d = Dialogue(fmt, haystack_with_needles(words, units, needles, depths), keys, values,
                     depths, units)
        d.context_ids = fmt.encode(d.context_text())
        return d

    def _context_too_small(self, context_tokens: int, need: int) -> str:
        if getattr(self, "_context_defaulted", False):
            return (f"task.turns={self.turns} with task.max_new_tokens={self.max_new_tokens} "
                    f"leave {context_tokens} tokens for the context, but its {self.turns} needles "
                    f"and instruction alone take {need} tokens with this tokenizer; lower them")
        return (f"task.context_tokens={context_tokens} is too small for {self.turns} needles "
                f"with this tokenizer: the needles and instruction alone take {need} tokens")

    def _too_long(self, context_tokens: int, planned: int, limit: int) -> str:
        return (f"task.context_tokens={context_tokens} plus {self.turns} turns (about "
                f"{planned - context_tokens} tokens with task.max_new_tokens="
                f"{self.max_new_tokens}) exceed the model's {limit} max positions; lower "
                "task.context_tokens or task.turns")

    def turn_cost_tokens(self, fmt: PromptFormat) -> int:
        """Upper estimate of the tokens the turns add after the context (questions + answers)."""
        d = Dialogue(fmt, "", *self._draw(0))
        empty = [""] * self.turns
        return sum(len(fmt.encode(d.turn_text(k, empty), first=False)) + 1 + self.max_new_tokens
                   for k in range(self.turns))

    def resolve_context_tokens(self, fmt: PromptFormat, max_positions: int | None) -> int:
        if self.context_tokens is not None and not getattr(self, "_context_defaulted", False):
            return self.context_tokens
        self._context_defaulted = True
        room = (max_positions or 10**9) - self.turn_cost_tokens(fmt) - 8  # 8: tokenizer slack
        if room < 16:
            raise ConfigError(f"task.turns={self.turns} with task.max_new_tokens="
                              f"{self.max_new_tokens} leave no room for a context in the model's "
                              f"{max_positions} max positions; lower them")
        return min(DEFAULT_CONTEXT_TOKENS, room)

    def dialogues(self, tokenizer, max_positions: int | None = None) -> list[Dialogue]:
        fmt = PromptFormat(tokenizer, self.chat_template)
        self.context_tokens = self.resolve_context_tokens(fmt, max_positions)
        count = min(self.samples, self.limit) if self.limit else self.samples
        return [self.dialogue(fmt, i, self.context_tokens)
                for i in progress(range(count), "multiturn: building contexts", "context")]

    # -- evaluation --

    def evaluate(self, engine: "Engine") -> TaskResult:
        tok, limit = engine.tokenizer, engine.info.max_positions
        bounded = engine.method.bounds_positions()
        stop_ids = engine.stop_token_ids()
        dialogues = self.dialogues(tok, limit)
        planned = self.context_tokens + self.turn_cost_tokens(dialogues[0].fmt)
        if limit and planned > limit and not bounded:
            raise ConfigError(self._too_long(self.context_tokens, planned, limit))
        rows = []
        for i, d in enumerate(progress(dialogues, "multiturn", "conversation")):
            turns: list[dict[str, Any]] = []
            answers: list[str] = []
            with engine.request() as req:
                req.prefill(d.context_ids)
                pending = None  # the last generated token, not yet fed to the cache
                for k in range(self.turns):
                    segment = d.fmt.encode(d.turn_text(k, answers), first=False)
                    if pending is not None and pending not in stop_ids:
                        segment = [pending] + segment  # a cut-off answer: its last token stays too
                    out = req.generate(segment, self.max_new_tokens, stop_ids)
                    pending = out[-1]
                    text = tok.decode([t for t in out if t not in stop_ids],
                                      skip_special_tokens=True)
                    answers.append(text)
                    prediction = clean_prediction(text)
                    turns.append({"turn": k + 1, "key": d.keys[k], "value": d.values[k],
                                  "depth_percent": d.depths_percent[k],
                                  "prompt_tokens": len(segment), "generated_tokens": len(out),
                                  "prediction": prediction,
                                  "correct": string_match_all(prediction, [d.values[k]])})
                positions = req.pos
            rows.append({"id": i, "sample_id": content_id(list(d.context_ids), d.values),
                         "context_tokens": len(d.context_ids),
                         "haystack_units": d.haystack_units, "positions_fed": positions,
                         "turns": turns})
        metrics = aggregate(rows, self.turns)
        fmt = dialogues[0].fmt
        protocol = {
            "benchmark": "shared-context multi-turn (SCBench, arXiv 2412.10319) with RULER "
                         "needles (arXiv 2404.06654); independent implementation",
            "prompt_format": fmt.name, "chat_template_option": self.chat_template,
            "chat_template_kwargs": dict(CHAT_TEMPLATE_KWARGS) if fmt.chat else None,
            "bos": fmt.bos(), "haystack": self.haystack, "context_tokens": self.context_tokens,
            "requests": "one per conversation: context prefilled once, then turns in order",
            "answers": "append: generated answers stay in the cache (no rollback)",
            "max_new_tokens": self.max_new_tokens,
            "decoding": "greedy, stops at the tokenizer/generation-config EOS ids",
            "metric": "value string match per turn (string_match_all, one reference), percent",
            "needle_depths": "random from RULER's 40-point grid, distinct per conversation",
            "task_seed": self.seed,  # needle placement (runner.seed is "seed")
        }
        return TaskResult(metrics=metrics, samples=rows, protocol=protocol)


def _fresh(draw, taken: list):
    """Draw until the item is not in `taken` (keys, values and depths differ within a context)."""
    while True:
        item = draw()
        if item not in taken:
            return item


def aggregate(rows: list[dict], turns: int) -> dict[str, Any]:
    """Accuracy (percent) per turn index and overall, and the share of fully answered contexts."""
    metrics: dict[str, Any] = {}
    for k in range(turns):
        hits = [r["turns"][k]["correct"] for r in rows]
        metrics[f"turn_{k + 1}"] = round(100 * sum(hits) / len(hits), 2) if hits else None
    every = [t["correct"] for r in rows for t in r["turns"]]
    metrics["accuracy"] = round(100 * sum(every) / len(every), 2) if every else None
    metrics["all_turns_correct"] = (round(100 * sum(all(t["correct"] == 1 for t in r["turns"])
                                                    for r in rows) / len(rows), 2)
                                    if rows else None)
    metrics["conversations"] = len(rows)
    metrics["context_tokens_mean"] = (round(sum(r["context_tokens"] for r in rows) / len(rows), 1)
                                      if rows else None)
    return metrics
