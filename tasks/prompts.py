"""Prompt helpers shared by the needle tasks (ruler, multiturn, and any passkey-like task).

RULER (Hsieh et al., arXiv 2404.06654; NVIDIA/RULER `scripts/data/synthetic/`, `scripts/eval/`):
its needle and noise sentences, the 40-point depth grid, essay/noise haystacks with needles at
character depths, the plain/chat prompt format, fitting a prompt to a token budget, and RULER's
scoring (postprocess, string_match_all / string_match_part). A task imports these from here, not
from another task; tasks/ruler.py keeps only what is RULER's own (sub-task builders, aggregation).
"""

from __future__ import annotations

import bisect
import json
import random
import re
from typing import Any, Callable

from harness.core.models import chat_text
from kvcore.errors import ConfigError
from tasks.text_sources import data_root, load_essays, read_text_file

# ----------------------------------------------------------------------------------------------
# RULER's protocol constants shared by the needle tasks (scripts/data/synthetic/constants.py).

NOISE_SENTENCE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
                  "There and back again.")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
RULER_DEPTHS = tuple(round(i * 100 / 39) for i in range(40))  # numpy.linspace(0, 100, 40), rounded
HAYSTACKS = ("essays", "ruler", "repeat")
CHAT_OPTIONS = ("auto", "chat", "plain")

# ----------------------------------------------------------------------------------------------
# Vocabulary (written for this harness): keys are "adjective-noun", CWE draws single words.

ADJECTIVES = (
    "able", "agile", "ancient", "angry", "bitter", "blue", "bold", "brave", "bright", "broad",
    "busy", "calm", "cheap", "clean", "clever", "cold", "cosy", "crisp", "curly", "damp", "dark",
    "deep", "dense", "dry", "dusty", "eager", "early", "empty", "even", "faint", "fancy", "fast",
    "fierce", "firm", "flat", "fresh", "frozen", "funny", "gentle", "giant", "glad", "golden",
    "grand", "green", "grey", "happy", "hard", "heavy", "hidden", "hollow", "humble", "hungry",
    "icy", "idle", "jolly", "keen", "kind", "large", "late", "lazy", "light", "little", "lively",
    "lonely", "loud", "lucky", "mellow", "mild", "misty", "modern", "narrow", "neat", "noble",
    "odd", "old", "orange", "pale", "plain", "polite", "proud", "purple", "quick", "quiet",
    "rapid", "rare", "red", "rich", "rough", "round", "royal", "rusty", "sandy", "sharp", "shiny",
    "short", "silent", "silver", "simple", "sleepy", "slow", "small", "smooth", "soft", "solid",
    "sour", "spicy", "steep", "sticky", "stormy", "strange", "strong", "sunny", "sweet", "swift",
    "tall", "tame", "tender", "thick", "thin", "tidy", "tiny", "vast", "warm", "wide", "wild",
    "windy", "wise", "wooden", "young", "zesty",
)
NOUNS = (
    "anchor", "apple", "arrow", "badge", "bakery", "banana", "basket", "beacon", "bicycle",
    "blanket", "bottle", "bridge", "bucket", "butter", "button", "cabin", "camera", "candle",
    "canyon", "carpet", "castle", "cellar", "chair", "cherry", "chimney", "circle", "cloud",
    "compass", "cookie", "copper", "cotton", "crayon", "dolphin", "dragon", "drum", "eagle",
    "engine", "falcon", "feather", "fence", "forest", "fountain", "garden", "giraffe", "glacier",
    "guitar", "hammer", "harbor", "helmet", "island", "jacket", "jungle", "kettle", "kitten",
    "ladder", "lantern", "lemon", "library", "lizard", "magnet", "mango", "marble", "meadow",
    "mirror", "monkey", "mountain", "napkin", "needle", "ocean", "orchard", "otter", "oven",
    "paddle", "palace", "parrot", "pebble", "pencil", "pepper", "piano", "pillow", "planet",
    "pocket", "pumpkin", "puzzle", "rabbit", "rainbow", "river", "rocket", "saddle", "salmon",
    "sandal", "scarf", "shadow", "shelf", "signal", "spoon", "squirrel", "statue", "sunset",
    "teapot", "temple", "ticket", "tiger", "tomato", "tower", "tractor", "trumpet", "tunnel",
    "turtle", "umbrella", "valley", "velvet", "violin", "wagon", "wallet", "walnut", "window",
    "winter", "wizard", "zebra",
)
VERBS = (
    "admire", "arrive", "bake", "balance", "bounce", "borrow", "build", "carry", "chase", "climb",
    "collect", "cook", "dance", "deliver", "discover", "drift", "explore", "fetch", "float",
    "fold", "gather", "glide", "grow", "guard", "hover", "hurry", "imagine", "invent", "juggle",
    "knit", "launch", "listen", "march", "measure", "melt", "mend", "observe", "paint", "plant",
    "polish", "pour", "prepare", "question", "remember", "repair", "rescue", "sail", "scatter",
    "shiver", "sketch", "sneeze", "sparkle", "stretch", "swim", "travel", "tumble", "unfold",
    "visit", "wander", "whisper",
)
KEY_WORDS = tuple(f"{a}-{n}" for a in ADJECTIVES for n in NOUNS)
CWE_WORDS = tuple(sorted(set(ADJECTIVES + NOUNS + VERBS)))

# ----------------------------------------------------------------------------------------------
# Scoring (RULER scripts/eval: postprocess_pred, string_match_all / string_match_part).

def clean_prediction(text: str) -> str:
    """Strip, and turn control characters into newlines, as RULER's postprocess does."""
    return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    """Fraction of references found in the prediction (case-insensitive substrings), in [0, 1]."""
    low = prediction.lower()
    return sum(ref.lower() in low for ref in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1.0 when any reference is found in the prediction (RULER's QA metric), else 0.0."""
    low = prediction.lower()
    return float(any(ref.lower() in low for ref in references))


# ----------------------------------------------------------------------------------------------
# Haystacks.

def load_haystack_words(haystack: str, data_dir: str | None = None) -> list[str]:
    """The essay text cut into words at whitespace (RULER's essay haystack); [] for `repeat`."""
    if haystack == "repeat":
        return []
    base = data_root(data_dir)
    if haystack == "essays":
        text = load_essays(data_dir)
    elif haystack == "ruler":
        path = base / "ruler" / "PaulGrahamEssays.json"
        try:
            text = json.loads(read_text_file(path, "task.haystack=ruler"))["text"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(f"task.haystack=ruler: {path} is not RULER's "
                              '{"text": ...} essay file') from None
    else:
        raise ConfigError(f"task.haystack={haystack!r}; allowed: {', '.join(HAYSTACKS)}")
    return text.split()


_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*$")


def split_sentences(words: list[str]) -> list[str]:
    """Sentences from whitespace words: one ends at a word ending in . ! or ? (quotes allowed)."""
    sentences, current = [], []
    for word in words:
        current.append(word)
        if _SENTENCE_END.search(word):
            sentences.append(" ".join(current))
            current = []
    if current:
        sentences.append(" ".join(current))
    return sentences


def haystack_with_needles(words: list[str], n_units: int, needles: list[str],
                          depths: list[float]) -> str:
    """`n_units` haystack units with `needles[i]` inserted at `depths[i]` percent.

    Essays (`words` non-empty): the first `n_units` words (cycled if the text is shorter), needles
    between sentences. Noise (`words` empty): `n_units` noise sentences, one per line. A needle
    goes to the sentence boundary whose character offset is closest to `depth` percent of the
    haystack (RULER uses `int(sentences * depth / 100)`, which drifts with sentence lengths).
    """
    if words:
        reps = -(-n_units // len(words)) if n_units > len(words) else 1
        pieces, sep = split_sentences((words * reps)[:n_units]), " "
    else:
        pieces, sep = [NOISE_SENTENCE] * n_units, "\n"
    starts = [0]  # character offset of each boundary (before piece k; the last one is the end)
    for piece in pieces:
        starts.append(starts[-1] + len(piece) + len(sep))
    total = max(1, starts[-1] - len(sep))
    starts[-1] = total

    def boundary(depth: float) -> int:
        k = bisect.bisect_left(starts, total * depth / 100)
        near = [j for j in (k - 1, k) if 0 <= j < len(starts)]
        return min(near, key=lambda j: abs(starts[j] - total * depth / 100))

    at = sorted((boundary(d), d, i) for i, d in enumerate(depths))
    out, start = [], 0
    for cut, _, i in at:
        out.extend(pieces[start:cut])
        out.append(needles[i])
        start = cut
    out.extend(pieces[start:])
    return sep.join(out)


def needle_depth_fractions(context: str, needles: list[str]) -> list[float]:
    """For each needle (in the given order), the haystack characters before it divided by all
    haystack characters, i.e. the depth it was inserted at; the needles' own characters and
    their separators are not counted. A needle missing from `context` raises ValueError."""
    found = sorted((context.index(n), n) for n in needles)
    hay = max(1, len(context) - sum(len(n) + 1 for n in needles))
    before, depth = 0, {}
    for offset, n in found:
        depth[n] = min(1.0, max(0.0, (offset - before) / hay))
        before += len(n) + 1
    return [depth[n] for n in needles]


# Prompt formats and fitting to a token budget.

class PromptFormat:
    """A user message + answer prefix -> text -> token ids, plain (RULER `base`) or chat."""

    def __init__(self, tokenizer, option: str, key: str = "task.chat_template"):
        if option not in CHAT_OPTIONS:
            raise ConfigError(f"{key}={option!r}; allowed: {', '.join(CHAT_OPTIONS)}")
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if option == "chat" and not has_template:
            raise ConfigError(f"{key}=chat but this tokenizer has no chat template; "
                              "allowed here: auto, plain")
        self.tokenizer = tokenizer
        self.chat = has_template if option == "auto" else option == "chat"
        self.name = "chat" if self.chat else "plain"

    def render_messages(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return chat_text(self.tokenizer, messages, generation_prompt)

    def render(self, user_text: str, answer_prefix: str) -> str:
        """The whole prompt text; in chat mode the answer prefix opens the assistant turn."""
        if not self.chat:
            return user_text + answer_prefix
        return (self.render_messages([{"role": "user", "content": user_text}], True)
                + answer_prefix.lstrip())

    def encode(self, text: str, first: bool = True) -> list[int]:
        """Token ids. Chat text carries its own special tokens; plain text gets the tokenizer's
        defaults (e.g. BOS) at the start of a request only (`first`)."""
        kwargs = {} if (first and not self.chat) else {"add_special_tokens": False}
        return list(self.tokenizer(text, verbose=False, **kwargs)["input_ids"])

    def bos(self) -> bool | None:
        """Plain format: whether the tokenizer adds BOS by default; None in chat format (the chat
        template's text decides its own special tokens)."""
        if self.chat:
            return None
        bos = getattr(self.tokenizer, "bos_token_id", None)
        ids = self.encode("x")
        return bos is not None and bool(ids) and ids[0] == bos


def largest_fitting(count: Callable[[int], int], budget: int, lowest: int,
                    highest: int | None = None) -> int | None:
    """Largest n in [lowest, highest] with count(n) <= budget, for count non-decreasing in n.

    None when even `lowest` does not fit. Brackets by doubling steps, then bisects.
    """
    if count(lowest) > budget:
        return None
    if highest is not None and count(highest) <= budget:
        return highest
    lo, step = lowest, max(1, lowest)
    while (highest is None or lo + step < highest) and count(lo + step) <= budget:
        lo, step = lo + step, step * 2
    hi = lo + step if highest is None else min(lo + step, highest)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def distinct(draw: Callable[[], str], n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        item = draw()
        if item not in out:
            out.append(item)
    return out


def magic_number(rng: random.Random) -> str:
    return str(rng.randint(10**6, 10**7 - 1))


def join_keys(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


# ----------------------------------------------------------------------------------------------
# Option checks.

def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
