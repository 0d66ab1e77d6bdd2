"""What a task may ask of the engine it is given: `TaskEngine`, a closed interface.

A task reads a few facts (the tokenizer, `encode`, the model's `info`, the `method`, the stop
ids) and hands over its work as data (`Task.requests` -> `Work`): `GenerationRequest`s (greedy
continuations of independent prompts, a query split off where the task has one, the paired
fidelity it wants) and `ScoreStreamRequest`s (one token stream teacher-forced and scored). It
scores what comes back (`Task.score`, one `Answer` per request). Because the requests are data,
something other than the model's own engine can answer them: a sweep answers each request for
every setting at once (harness.sweep.execute), then scores each setting's answers with the
task's own code. `answer` is how one engine answers one request. Every engine
(harness.core.engine.Engine, harness.engines.vllm_engine.VllmEngine) writes out each member;
none forwards what it lacks.

A task that needs more (a request of its own, turn by turn: multi-turn's conversations, lm-eval's
rewound contexts) declares `Task.needs_live_engine`; it is then always given the setting's own
`harness.core.engine.Engine`, and a sweep evaluates it per setting (and says so).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from harness.core.progress import progress
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
    part of the prompt. `fidelity_tokens` K > 0: the answer carries each prompt's paired
    fidelity (`Answer.fidelity`), `golds[i]` the gold answer's first K tokens of prompt i (None:
    none); a sweep computes it in the answers' pass, while each prompt's forward is held
    (harness.sweep.execute). `label`: what the progress bar calls it."""

    prompts: list[list[int]]
    max_new_tokens: list[int] | int
    stop_ids: frozenset[int] | None = None
    min_new_tokens: int = 0
    queries: list[list[int]] | None = None
    fidelity_tokens: int = 0
    golds: list[list[int] | None] | None = None
    label: str = "generate"

    def __post_init__(self) -> None:
        # normalized, so that two requests for the same work compare equal
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
    fidelity: bool = False  # each scored token against a full-cache pass on the stream


Request = GenerationRequest | ScoreStreamRequest


@dataclass
class Answer:
    """One request's answer: a `GenerationRequest`'s new tokens per prompt (`outputs`), or a
    `ScoreStreamRequest`'s scores `(T - max(prompt_tokens, 1),)`; and the paired fidelity the
    request declared (harness.core.fidelity: one record per prompt, or the stream's record),
    None where it declared none."""

    outputs: list[list[int]] | None = None
    scores: torch.Tensor | None = None
    fidelity: list[dict] | dict | None = None


@dataclass
class Work:
    """A task's requests, built from its engine's facts alone (the same for every setting of a
    sweep), and what its `score` needs besides their answers (the samples they came from; the
    task's own)."""

    requests: list[Request]
    context: Any = None


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


def answer(engine: TaskEngine, request: Request) -> Answer:
    """`engine`'s answer to one request, the fidelity it declares included."""
    if isinstance(request, ScoreStreamRequest):
        scores = engine.score_stream(request)
        fidelity = (engine.stream_fidelity(request.ids, request.prompt_tokens)
                    if request.fidelity else None)
        return Answer(scores=scores, fidelity=fidelity)
    outputs = list(progress(engine.generate(request), request.label, "prompt",
                            total=len(request.prompts)))
    fidelity = (engine.fidelity_many(request.fidelity_items(), request.fidelity_tokens,
                                     request.stop_ids, request.min_new_tokens)
                if request.fidelity_tokens else None)
    return Answer(outputs=outputs, fidelity=fidelity)


def encode_with(tokenizer, text: str, add_special_tokens: bool | None = None) -> list[int]:
    """`TaskEngine.encode` over a tokenizer: its own default for special tokens unless told."""
    kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
    # verbose=False: whole texts are tokenized once and cut afterwards (no length warning)
    return tokenizer(text, verbose=False, **kwargs)["input_ids"]
