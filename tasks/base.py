"""The task interface: options (a dataclass = conf/task/<name>.yaml), the requests a task hands
its engine as data (`requests`), and how it scores their answers (`score`); `evaluate(engine)`
is the two through one engine (a task needing a live engine writes its own)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvcore.errors import ConfigError
from methods.base import KVMethod
from methods.model import ModelInfo
from tasks.engine_api import Answer, TaskEngine, Work, answer


def content_id(prompt: Any, reference: Any) -> str:
    """A sample's identity from its content (the prompt's token ids or text, and what it is
    scored against): two runs on the same samples pair up by it, whatever their order."""
    blob = json.dumps([prompt, reference], sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class TaskResult:
    metrics: dict[str, Any]  # accuracy-side numbers (ppl, acc, f1, ...)
    # one per prompt: id, sample_id (content_id), prediction, score(s), ...
    samples: list[dict[str, Any]] = field(default_factory=list)
    protocol: dict[str, Any] = field(default_factory=dict)  # how it was scored (recorded verbatim)


@dataclass(kw_only=True)
class Task:
    name: ClassVar[str]
    # The number a leaderboard ranks this task by (a key of TaskResult.metrics) and its
    # direction; every task declares both (tests/tasks/test_task_contract.py), so a report never
    # falls back to "the first number" for a new task.
    main_metric: ClassVar[str]
    higher_is_better: ClassVar[bool]
    # Sends independent prompts through `engine.generate`, so runner.batch_size > 1 decodes
    # them together (harness.core.batch); False: one stream or a rewound context, batch 1 only.
    batches: ClassVar[bool] = False
    # Asks its engine for more than tasks.engine_api.TaskEngine (a request of its own, fed turn by
    # turn or rewound): it is always given the setting's own harness.core.engine.Engine, and a sweep
    # evaluates it per setting (harness.sweep.execute) instead of answering its requests at once.
    needs_live_engine: ClassVar[bool] = False
    # The option that makes part of the input a prompt where phases() has none (named in the
    # runner's refusal of a prompt-only method), or None.
    prompt_option: ClassVar[str | None] = None
    # Whether the task records paired fidelity per sample (`fidelity_tokens`, harness.core.fidelity).
    fidelity: ClassVar[bool] = False
    limit: int | None = None  # at most this many samples (None: all)
    # K > 0: per sample, the full cache's first K greedy tokens teacher-forced through the
    # setting (KL to the full cache, top-token agreement, gold log-probability); 0: off
    fidelity_tokens: int = 0

    def __post_init__(self) -> None:
        reasons = self.check_options()
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit <= 0):
            reasons.append(f"task.limit={self.limit!r} must be a positive integer or null")
        reasons += self.fidelity_reasons()
        if reasons:
            raise ConfigError(reasons[0])

    def fidelity_reasons(self) -> list[str]:
        value = self.fidelity_tokens
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return [f"task.fidelity_tokens={value!r} must be an integer >= 0 (0: off; K > 0: the "
                    "full cache's first K tokens teacher-forced through the setting per sample)"]
        reasons = []
        if value and not self.fidelity:
            reasons.append(f"task.fidelity_tokens={self.fidelity_tokens}: task={self.name} records "
                           "no paired fidelity (ruler, longbench, xsum and perplexity do); set "
                           "task.fidelity_tokens=0")
        return reasons

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def check_options(self) -> list[str]:
        """Reasons the options alone are invalid, each naming its key (`task.x`)."""
        return []

    def validate(self, info: ModelInfo, method: KVMethod) -> list[str]:
        """Reasons this task cannot run with this model/method (checked before weights load)."""
        return []

    def phases(self) -> frozenset[str]:
        """The engine phases this task's tokens go through ("prefill": prompts; "decode": one
        token at a time), so the runner refuses a method that would never act on it."""
        return frozenset({"prefill", "decode"})

    def longest_prompt_tokens(self) -> int | None:
        """For a task whose phases() are prefill only: the longest prompt it feeds, when its
        options fix it (after validate()); None when unknown. Under runner.prefill=chunked a
        prompt that fits one chunk is scored before any method compresses it: the runner refuses
        that."""
        return None

    def check_prompts(self, tokenizer, info: ModelInfo, method: KVMethod) -> list[str]:
        """Reasons the prompts cannot be built (too short for their parts, ...), found with the
        tokenizer alone, before weights load. The runner loads the tokenizer only for tasks
        that override this."""
        return []

    def check_data(self) -> None:
        """Check that data files exist and are readable (before weights load); raise ConfigError."""

    def evaluate(self, engine: TaskEngine) -> TaskResult:
        """The task's samples through `engine`, scored: its requests answered one by one. A task
        that `needs_live_engine` overrides this, and is given the setting's own Engine."""
        work = self.requests(engine)
        return self.score(engine, work, [answer(engine, r) for r in work.requests])

    def requests(self, engine: TaskEngine) -> Work:
        """What the task needs computed (tasks.engine_api), built from the engine's facts alone
        (tokenizer, `encode`, `info`, `stop_token_ids`): never from its method, so one `Work`
        serves every setting of a sweep. A task that needs a live engine has none."""
        raise NotImplementedError(f"task={self.name} builds no requests (it needs a live engine)")

    def score(self, engine: TaskEngine, work: Work, answers: list[Answer]) -> TaskResult:
        """The task's result from `answers` (one per `work.requests`, in order); `engine`: the
        setting's facts (its tokenizer decodes, its method is recorded)."""
        raise NotImplementedError(f"task={self.name} scores no answers (it needs a live engine)")

    def golds(self, engine, texts: list[str | None]) -> dict:
        """What a `GenerationRequest` takes for paired fidelity: `fidelity_tokens` and each
        prompt's gold answer tokens (`gold_tokens`); nothing when fidelity is off."""
        if not self.fidelity_tokens:
            return {}
        return {"fidelity_tokens": self.fidelity_tokens,
                "golds": [self.gold_tokens(engine, t) for t in texts]}

    @staticmethod
    def add_fidelity(rows: list[dict], answered: Answer) -> None:
        """Each row's `fidelity` record (harness.core.fidelity), one per prompt of the answered
        request, where the request declared fidelity."""
        if answered.fidelity is None:
            return
        for row, record in zip(rows, answered.fidelity, strict=True):
            row["fidelity"] = record

    def gold_tokens(self, engine, text: str | None) -> list[int] | None:
        """The first `fidelity_tokens` tokens of a gold answer's text (no special tokens)."""
        if not text:
            return None
        return engine.encode(text, add_special_tokens=False)[: self.fidelity_tokens] or None
