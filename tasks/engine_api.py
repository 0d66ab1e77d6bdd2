"""What a task may ask of the engine it is given: `TaskEngine`, a closed interface.

A task reads a few facts (the tokenizer, `encode`, the model's `info`, the `method`, the stop
ids) and hands over its work as data: a `GenerationRequest` (greedy continuations of independent
prompts, a query split off where the task has one) or a `ScoreStreamRequest` (one token stream
teacher-forced and scored). Because the requests are data, an engine other than the model's own
can answer them: a sweep answers one task pass's requests for every setting at once
(harness.sweep.execute). Every implementation (harness.core.engine.Engine, the sweep's engines,
harness.engines.vllm_engine.VllmEngine) writes out each member; none forwards what it lacks.

A task that needs more (a request of its own, turn by turn: multi-turn's conversations, lm-eval's
rewound contexts) declares `Task.needs_live_engine`; it is then always given the setting's own
`harness.core.engine.Engine`, and a sweep evaluates it per setting (and says so).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from methods.base import KVMethod
from methods.model import ModelInfo

# Every member of TaskEngine (tests/tasks/test_engine_api.py holds each implementation to all).
MEMBERS = ("tokenizer", "info", "method", "encode", "stop_token_ids", "generate", "score_stream",
           "fidelity_many", "stream_fidelity")


@dataclass(frozen=True)
class FidelityItem:
    """One sample as paired fidelity needs it (`task.fidelity_tokens`, harness.core.fidelity)."""
    prompt: list[int]
    query: list[int] | None = None  # fed after the prompt is over (query-agnostic protocol)
    gold: list[int] | None = None  # the gold answer's first K tokens; None: no gold answer


@dataclass
class GenerationRequest:
    """Greedy continuations of independent prompts: one list of new token ids per prompt, in
    order. `max_new_tokens`: per prompt (an int is the same for every prompt). `stop_ids`: None
    takes the engine's `stop_token_ids()`. `queries[i]` (query-agnostic protocol): fed after
    prompt i is over and its method has compressed it, before generating; None: any question is
    part of the prompt. `fidelity_tokens` K > 0: the task will ask paired fidelity of these
    samples (`fidelity_many(request.fidelity_items(), ...)`), `golds[i]` the gold answer's
    first K tokens of prompt i (None: none); an engine answering many settings computes it in
    the same pass, while each prompt's forward is held (harness.sweep.execute)."""

    prompts: list[list[int]]
    max_new_tokens: list[int] | int
    stop_ids: frozenset[int] | None = None
    min_new_tokens: int = 0
    queries: list[list[int]] | None = None
    fidelity_tokens: int = 0
    golds: list[list[int] | None] | None = None

    def __post_init__(self) -> None:
        # normalized, so that two requests for the same work compare equal (a sweep checks it)
        self.prompts = [list(p) for p in self.prompts]
        limits = self.max_new_tokens
        self.max_new_tokens = (list(limits) if isinstance(limits, (list, tuple))
                               else [limits] * len(self.prompts))
        if self.stop_ids is not None:
            self.stop_ids = frozenset(self.stop_ids)
        if self.queries is not None:
            self.queries = [list(q) for q in self.queries]
        if self.golds is not None:
            self.golds = [None if g is None else list(g) for g in self.golds]
        if len(self.max_new_tokens) != len(self.prompts) or any(
                x is not None and len(x) != len(self.prompts) for x in (self.queries, self.golds)):
            raise ValueError(f"{len(self.prompts)} prompts, {len(self.max_new_tokens)} limits, "
                             f"{'no' if self.queries is None else len(self.queries)} queries, "
                             f"{'no' if self.golds is None else len(self.golds)} golds")

    def query(self, i: int) -> list[int] | None:
        return None if self.queries is None else self.queries[i]

    def fidelity_item(self, i: int) -> FidelityItem:
        return FidelityItem(self.prompts[i], self.query(i),
                            None if self.golds is None else self.golds[i])

    def fidelity_items(self) -> list[FidelityItem]:
        return [self.fidelity_item(i) for i in range(len(self.prompts))]


@dataclass
class ScoreStreamRequest:
    """One token stream `ids` `(T,)` teacher-forced (streaming perplexity): its first
    `prompt_tokens` tokens one prompt (prefilled; its end compresses), then one decode step per
    token. `score(logits (N, V), targets (N,)) -> (N,)` scores each next token from the logits
    before it; the answer is `(T - max(prompt_tokens, 1),)`."""

    ids: torch.Tensor  # (T,)
    prompt_tokens: int
    score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def same_stream(self, other: "ScoreStreamRequest") -> bool:
        return (self.prompt_tokens == other.prompt_tokens and self.ids.shape == other.ids.shape
                and bool(torch.equal(self.ids, other.ids)))


class TaskEngine(abc.ABC):
    """The engine a task is given. Facts: `tokenizer` (a transformers tokenizer, or an object
    answering the same calls; None for a model without one), `info` (the model), `method` (the
    setting's KV method). Work: `generate` and `score_stream`, requests as data."""

    tokenizer: Any
    info: ModelInfo
    method: KVMethod

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids, with the tokenizer's own default for special tokens unless told."""

    @abc.abstractmethod
    def stop_token_ids(self) -> set[int]:
        """The ids that end an answer (the tokenizer's and the generation config's EOS)."""

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> Iterator[list[int]]:
        """The request's answers, one per prompt, in order."""

    @abc.abstractmethod
    def score_stream(self, request: ScoreStreamRequest) -> torch.Tensor:
        """The stream's scores `(T - max(prompt_tokens, 1),)`."""

    @abc.abstractmethod
    def fidelity_many(self, items: list, tokens: int, stop_ids: set[int] | None = None,
                      min_new_tokens: int = 0) -> list[dict]:
        """Paired fidelity to the full cache (`task.fidelity_tokens`): one record per
        `FidelityItem` (a sample as it was answered, with its gold tokens), the
        full cache's first `tokens` answer tokens teacher-forced through the setting's cache."""

    @abc.abstractmethod
    def stream_fidelity(self, ids: torch.Tensor, prompt_tokens: int) -> dict:
        """A `ScoreStreamRequest`'s stream compared token by token with a full-cache pass."""


def encode_with(tokenizer, text: str, add_special_tokens: bool | None = None) -> list[int]:
    """`TaskEngine.encode` over a tokenizer: its own default for special tokens unless told."""
    kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
    # verbose=False: whole texts are tokenized once and cut afterwards (no length warning)
    return tokenizer(text, verbose=False, **kwargs)["input_ids"]
