"""Metric functions against values computed by hand from the official definitions (LongBench v1
metrics.py + the `rouge` package for ROUGE-L; rouge-score for XSum)."""

import pytest

from harness.core.metrics import (
    HIGHER_IS_BETTER,
    METRICS,
    classification_score,
    code_sim_score,
    count_score,
    first_code_line,
    normalize_answer,
    qa_f1_score,
    retrieval_score,
    rouge_l_score,
    rouge_scores,
    similarity_ratio,
)


def test_normalize_answer_lowercases_and_drops_punctuation_and_articles():
    assert normalize_answer("The Cat, sat!  on A mat.") == "cat sat on mat"
    assert normalize_answer("Anna and an apple") == "anna and apple"  # only whole-word articles


def test_qa_f1_by_hand():
    # "The cat sat" -> [cat, sat]; "a cat sat down" -> [cat, sat, down]: P = 1, R = 2/3 -> 0.8
    assert qa_f1_score("The cat sat", "a cat sat down") == pytest.approx(0.8)
    # overlap counts multiplicity: [cat, cat, dog] vs [cat]: 1 common, P = 1/3, R = 1 -> 0.5
    assert qa_f1_score("cat cat dog", "cat") == pytest.approx(0.5)
    assert qa_f1_score("dog", "cat") == 0.0
    assert qa_f1_score("", "cat") == 0.0
    assert qa_f1_score("The Eiffel Tower.", "eiffel tower") == pytest.approx(1.0)


def test_rouge_l_single_sentence_by_hand():
    # distinct words: ref {the, cat, was, on, mat} = 5, pred {the, cat, sat, on, mat} = 5;
    # LCS "the cat on the mat" -> distinct {the, cat, on, mat} = 4: R = P = 4/5
    assert rouge_l_score("the cat sat on the mat", "the cat was on the mat") == pytest.approx(
        0.8, abs=1e-7)


def test_rouge_l_is_summary_level_union_over_sentences():
    # sentences split at "."; ref "a c" / "b d", pred "a b" / "c d": the union of the pairwise
    # LCS words is {a, b, c, d} -> R = P = 1 (a plain LCS over the whole text would give 0.75)
    assert rouge_l_score("a b. c d", "a c. b d") == pytest.approx(1.0, abs=1e-7)


def test_rouge_l_tie_break_follows_the_rouge_package():
    # ref sentences "x y" and "y z", pred "y x". LCS("x y", "y x") has length 1; the package's
    # backtrack takes "y" (ties move along the prediction), so the union is {y}:
    # R = 1/3 (ref words x, y, z), P = 1/2 (pred words y, x) -> F = 0.4 (taking "x" would give 0.8)
    assert rouge_l_score("y x", "x y. y z") == pytest.approx(0.4, abs=1e-7)


def test_rouge_l_is_case_sensitive_and_empty_predictions_score_zero():
    assert rouge_l_score("The Cat", "the cat") == 0.0
    assert rouge_l_score("", "a b") == 0.0
    assert rouge_l_score("...", "a b") == 0.0


def test_classification_score_by_hand():
    classes = ["Human being", "Location", "Entity"]
    assert classification_score("Human being", "Human being", all_classes=classes) == 1.0
    assert classification_score("Location or Human being", "Human being",
                                all_classes=classes) == 0.5
    assert classification_score("Entity", "Human being", all_classes=classes) == 0.0


def test_classification_drops_substrings_of_the_answer_with_the_official_skip():
    classes = ["Ab", "Abc", "Abcd", "X"]
    # found [Ab, Abc, Abcd]; "Ab" (a substring of the answer) is removed, which makes the walk skip
    # "Abc" (also a substring): [Abc, Abcd] remain -> 1/2, as the official code scores it
    assert classification_score("Abcd", "Abcd", all_classes=classes) == 0.5
    # when the substring comes last it is removed and nothing is skipped: [Abcd] -> 1
    assert classification_score("Abcd", "Abcd", all_classes=["Abcd", "Ab"]) == 1.0


def test_retrieval_and_count_scores_by_hand():
    assert retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
    assert retrieval_score("Paragraph 3 or Paragraph 4", "Paragraph 3") == 0.5
    assert retrieval_score("Paragraph 13", "Paragraph 3") == 0.0  # digit runs, not substrings
    assert retrieval_score("none of them", "Paragraph 3") == 0.0
    assert count_score("There are 7 unique paragraphs", "7") == 1.0
    assert count_score("7 of 10", "7") == 0.5
    assert count_score("seven", "7") == 0.0
    with pytest.raises(ValueError, match="Paragraph"):
        retrieval_score("1", "the first one")


def test_code_similarity_first_line_and_ratio():
    text = "\n```python\n# a comment\n// another\nx = foo(1)\ny = 2"
    assert first_code_line(text) == "x = foo(1)"
    assert first_code_line("# only comments\n```") == ""
    assert code_sim_score("```\n# c\nx = foo(1)\n", "x = foo(1)") == 1.0
    # difflib: "abc" matches -> 2*3/8 = 0.75
    assert similarity_ratio("abcd", "abce") == 0.75
    # 2*5/16 = 0.625 -> 62.5 rounds half to even (fuzzywuzzy's int(round())) -> 0.62
    assert similarity_ratio("abcdefgh", "abcdeXYZ") == 0.62
    assert similarity_ratio("", "") == 1.0
    assert similarity_ratio("", "x") == 0.0
    assert code_sim_score("// nothing but a comment", "x = 1") == 0.0


def test_xsum_rouge_scores_by_hand():
    scores = rouge_scores("a b c", "a b d")
    assert scores["rouge1"] == pytest.approx(2 / 3)  # unigrams a, b of 3
    assert scores["rouge2"] == pytest.approx(1 / 2)  # bigram "a b" of 2
    assert scores["rougeL"] == pytest.approx(2 / 3)  # LCS "a b"
    # stemming and lowercasing: "The cats sat" == "the cat sat"
    assert rouge_scores("The cats sat", "the cat sat")["rouge1"] == pytest.approx(1.0)


def test_registry_is_complete():
    assert set(METRICS) == set(HIGHER_IS_BETTER)
    assert {"qa_f1", "rouge_l", "classification", "retrieval", "count", "code_sim"} <= set(METRICS)
    assert METRICS["rougeL_stemmed"]("a b c", "a b d") == pytest.approx(2 / 3)
