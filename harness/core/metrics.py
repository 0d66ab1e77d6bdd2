"""Pure scoring functions `(prediction, ground_truth) -> float` in [0, 1], one per metric name.

LongBench v1 (Bai et al., 2023, arXiv 2308.14508; THUDM/LongBench `LongBench/metrics.py`)
metrics are re-implemented here from their definitions, including the official code's quirks where
they change scores (each is named in the function's docstring). A task takes the max over a
sample's reference answers and reports ×100 averages; these functions score one (prediction,
reference) pair.

XSum ROUGE (H2O, Zhang et al., 2023, arXiv 2306.14048, scored the HELM way) uses the `rouge-score`
package with the Porter stemmer: `rouge1_stemmed`, `rouge2_stemmed`, `rougeL_stemmed`.

`METRICS` maps a metric name to its function and `HIGHER_IS_BETTER` says which way is better.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from functools import lru_cache
from typing import Callable

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"\d+")
_PARAGRAPH = re.compile(r"Paragraph (\d+)")


# --- QA F1 (narrativeqa, qasper, multifieldqa_en, hotpotqa, 2wikimqa, musique, triviaqa) -------

def normalize_answer(text: str) -> str:
    """SQuAD-style English normalization: lowercase, drop ASCII punctuation, drop the articles
    a/an/the, collapse whitespace (in that order, as LongBench does)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def token_f1(prediction_tokens: list[str], reference_tokens: list[str]) -> float:
    """Bag-of-tokens F1: overlap counted with multiplicity; 0 when nothing overlaps."""
    overlap = sum((Counter(prediction_tokens) & Counter(reference_tokens)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(prediction_tokens)
    recall = overlap / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str) -> float:
    """LongBench `qa_f1_score`: token F1 of the normalized prediction and answer."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


# --- ROUGE-L as LongBench computes it (gov_report, qmsum, multi_news, samsum) ------------------

def _rouge_sentences(text: str) -> list[str]:
    """Sentences as the `rouge` package (pltrdy, 1.0.1) cuts them: split on every ".", drop empty
    pieces, squeeze whitespace inside each piece (a blank piece becomes the empty sentence)."""
    return [" ".join(piece.split()) for piece in text.split(".") if len(piece) > 0]


def _sentence_words(sentence: str) -> list[str]:
    return sentence.split(" ")  # "".split(" ") == [""]: the empty sentence is one empty word


def _lcs_words(reference: list[str], candidate: list[str]) -> set[str]:
    """Distinct words of one longest common subsequence of `reference` and `candidate`.

    The backtrack starts at the end and, on a tie, moves along the candidate (left) rather than the
    reference (up), which fixes which LCS is taken when several exist (the `rouge` package's rule;
    it matters because the union below is a set of words, not of positions).
    """
    n, m = len(reference), len(candidate)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        row, above, word = table[i], table[i - 1], reference[i - 1]
        for j in range(1, m + 1):
            if word == candidate[j - 1]:
                row[j] = above[j - 1] + 1
            else:
                row[j] = above[j] if above[j] > row[j - 1] else row[j - 1]
    words: set[str] = set()
    i, j = n, m
    while i > 0 and j > 0:
        if reference[i - 1] == candidate[j - 1]:
            words.add(reference[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def rouge_l_score(prediction: str, ground_truth: str) -> float:
    """LongBench `rouge_score`: the F of summary-level ROUGE-L as the `rouge` package (pltrdy/rouge
    1.0.1, `Rouge().get_scores(..)["rouge-l"]["f"]`) computes it on whitespace words.

    Both texts are cut into sentences at every "."; the union LCS is the set of distinct words
    found in an LCS of any (reference sentence, prediction sentence) pair; recall and precision
    divide its size by the number of distinct words of the reference and of the prediction, and
    F = 2PR / (P + R + 1e-8). Words are case-sensitive and keep their punctuation (no
    normalization, no stemming). An empty prediction (or one made only of ".") scores 0, as the
    official code turns the package's exception into 0. Not reproduced: the package reconstructs
    the LCS recursively, so a sentence pair of more than ~1000 words in total raises
    RecursionError there (scored 0 by the official code); here it is scored normally.
    """
    candidate, reference = _rouge_sentences(prediction), _rouge_sentences(ground_truth)
    if not candidate or not reference:
        return 0.0
    candidate_words = [_sentence_words(s) for s in candidate]
    reference_words = [_sentence_words(s) for s in reference]
    union: set[str] = set()
    for ref in reference_words:
        for cand in candidate_words:
            union |= _lcs_words(ref, cand)
    recall = len(union) / len({w for s in reference_words for w in s})
    precision = len(union) / len({w for s in candidate_words for w in s})
    return 2.0 * precision * recall / (precision + recall + 1e-8)


# --- classification (trec), retrieval (passage_retrieval_en), count (passage_count) ----------

def classification_score(prediction: str, ground_truth: str, *, all_classes: list[str]) -> float:
    """LongBench `classification_score`: 1 / (number of class names found in the prediction) when
    the answer's class is among them, else 0.

    Class names that are substrings of the answer (but not the answer) are dropped from the found
    list first. Official quirk, reproduced: that drop walks the list while removing from it, so the
    entry right after a dropped one is never examined (it stays in the list).
    """
    found = [name for name in all_classes if name in prediction]
    i = 0
    while i < len(found):
        if found[i] in ground_truth and found[i] != ground_truth:
            found.remove(found[i])  # the next entry shifts into slot i and is then skipped
        i += 1
    return 1.0 / len(found) if ground_truth in found else 0.0


def _fraction_equal(numbers: list[str], target: str) -> float:
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def retrieval_score(prediction: str, ground_truth: str) -> float:
    """LongBench `retrieval_score`: the answer is "Paragraph N"; score = the share of all digit
    runs in the prediction that equal N ("Paragraph 3" → 1, "3 or 4" → 0.5, no digits → 0)."""
    match = _PARAGRAPH.search(ground_truth)
    if match is None:
        raise ValueError(f"retrieval answer {ground_truth!r} has no 'Paragraph <n>'")
    return _fraction_equal(_NUMBER.findall(prediction), match.group(1))


def count_score(prediction: str, ground_truth: str) -> float:
    """LongBench `count_score`: the share of digit runs in the prediction equal to the answer."""
    return _fraction_equal(_NUMBER.findall(prediction), str(ground_truth))


# --- code similarity (lcc, repobench-p) -------------------------------------------------------

def first_code_line(prediction: str) -> str:
    """The first line (after leading newlines) containing none of "`", "#", "//"; "" if none."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def similarity_ratio(a: str, b: str) -> float:
    """fuzzywuzzy `fuzz.ratio(a, b) / 100` without python-Levenshtein (LongBench's requirements
    install fuzzywuzzy alone, so it falls back to difflib): the stdlib
    `difflib.SequenceMatcher(None, a, b).ratio()` (Ratcliff/Obershelp, 2·matches / total length,
    autojunk on), ×100 rounded half-to-even to an integer. Equal strings give 1 (even both empty);
    otherwise an empty side gives 0."""
    if a == b:
        return 1.0
    if not a or not b:
        return 0.0
    return round(100 * difflib.SequenceMatcher(None, a, b).ratio()) / 100


def code_sim_score(prediction: str, ground_truth: str) -> float:
    """LongBench `code_sim_score`: similarity of the first non-comment, non-fence line of the
    prediction to the reference line."""
    return similarity_ratio(first_code_line(prediction), ground_truth)


# --- XSum ROUGE (rouge-score package, Porter stemmer) -----------------------------------------

@lru_cache(maxsize=1)
def _rouge_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)


def rouge_scores(prediction: str, reference: str) -> dict[str, float]:
    """F-measures of ROUGE-1/2/L from `rouge_score.RougeScorer(use_stemmer=True)` (its default
    tokenizer: lowercase, non-alphanumerics to spaces), keys rouge1/rouge2/rougeL, in [0, 1]."""
    scores = _rouge_scorer().score(reference, prediction)  # (target, prediction)
    return {key: float(value.fmeasure) for key, value in scores.items()}


def rouge1_stemmed(prediction: str, ground_truth: str) -> float:
    return rouge_scores(prediction, ground_truth)["rouge1"]


def rouge2_stemmed(prediction: str, ground_truth: str) -> float:
    return rouge_scores(prediction, ground_truth)["rouge2"]


def rougeL_stemmed(prediction: str, ground_truth: str) -> float:  # noqa: N802 (the package's name)
    return rouge_scores(prediction, ground_truth)["rougeL"]


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1_score,
    "rouge_l": rouge_l_score,
    "classification": classification_score,  # needs all_classes=
    "retrieval": retrieval_score,
    "count": count_score,
    "code_sim": code_sim_score,
    "rouge1_stemmed": rouge1_stemmed,
    "rouge2_stemmed": rouge2_stemmed,
    "rougeL_stemmed": rougeL_stemmed,
}

HIGHER_IS_BETTER: dict[str, bool] = {name: True for name in METRICS}
