"""LongBench v1 per-dataset protocol data (Bai et al., 2023, arXiv 2308.14508).

Source: THUDM/LongBench at commit 2e00731, `LongBench/config/dataset2prompt.json` (templates,
verbatim, including the "asconcisely" typo of narrativeqa), `LongBench/config/dataset2maxlen.json`
(generation lengths), `LongBench/eval.py` (metric per dataset, first-line rule) and
`LongBench/pred.py` (no chat template for the few-shot and code datasets, newline stop for samsum).
The 16 English + code datasets are here; the 5 Chinese ones (multifieldqa_zh, dureader, vcsum,
lsht, passage_retrieval_zh) are left out: their metrics need the jieba word segmenter.
"""

from __future__ import annotations

from dataclasses import dataclass

_MULTI_DOC_QA = (
    "Answer the question based on the given passages. Only give me the answer and do not output "
    "any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based "
    "on the given passages. Only give me the answer and do not output any other words.\n\n"
    "Question: {input}\nAnswer:"
)
_QASPER_RULES = (
    "as concisely as you can, using a single phrase or sentence if possible. If the question "
    "cannot be answered based on the information in the article, write \"unanswerable\". If the "
    "question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide "
    "any explanation."
)
_NARRATIVE_RULES = ("asconcisely as you can, using a single phrase if possible. Do not provide "
                    "any explanation.")


@dataclass(frozen=True)
class DatasetSpec:
    prompt: str  # str.format template over the row's fields {context} and {input}
    max_new_tokens: int  # dataset2maxlen.json
    metric: str  # a key of harness.core.metrics.METRICS
    chat_template: bool  # pred.py wraps the prompt in the chat template (False: few-shot / code)
    first_line: bool = False  # eval.py scores only the first line of the prediction
    stop_at_newline: bool = False  # pred.py also stops at "\n" (and never emits it first)
    category: str = ""


DATASETS: dict[str, DatasetSpec] = {
    "narrativeqa": DatasetSpec(
        "You are given a story, which can be either a novel or a movie script, and a question. "
        f"Answer the question {_NARRATIVE_RULES}\n\nStory: {{context}}\n\nNow, answer the question "
        f"based on the story {_NARRATIVE_RULES}\n\nQuestion: {{input}}\n\nAnswer:",
        128, "qa_f1", True, category="single-doc QA"),
    "qasper": DatasetSpec(
        f"You are given a scientific article and a question. Answer the question {_QASPER_RULES}"
        f"\n\nArticle: {{context}}\n\n Answer the question based on the above article "
        f"{_QASPER_RULES}\n\nQuestion: {{input}}\n\nAnswer:",
        128, "qa_f1", True, category="single-doc QA"),
    "multifieldqa_en": DatasetSpec(
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following "
        "question based on the above text, only give me the answer and do not output any other "
        "words.\n\nQuestion: {input}\nAnswer:",
        64, "qa_f1", True, category="single-doc QA"),
    "hotpotqa": DatasetSpec(_MULTI_DOC_QA, 32, "qa_f1", True, category="multi-doc QA"),
    "2wikimqa": DatasetSpec(_MULTI_DOC_QA, 32, "qa_f1", True, category="multi-doc QA"),
    "musique": DatasetSpec(_MULTI_DOC_QA, 32, "qa_f1", True, category="multi-doc QA"),
    "gov_report": DatasetSpec(
        "You are given a report by a government agency. Write a one-page summary of the report."
        "\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
        512, "rouge_l", True, category="summarization"),
    "qmsum": DatasetSpec(
        "You are given a meeting transcript and a query containing a question or instruction. "
        "Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the "
        "query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}"
        "\nAnswer:",
        512, "rouge_l", True, category="summarization"),
    "multi_news": DatasetSpec(
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n"
        "{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",
        512, "rouge_l", True, category="summarization"),
    "trec": DatasetSpec(
        "Please determine the type of the question below. Here are some examples of questions."
        "\n\n{context}\n{input}",
        64, "classification", False, first_line=True, category="few-shot"),
    "triviaqa": DatasetSpec(
        "Answer the question based on the given passage. Only give me the answer and do not output "
        "any other words. The following are some examples.\n\n{context}\n\n{input}",
        32, "qa_f1", False, first_line=True, category="few-shot"),
    "samsum": DatasetSpec(
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n"
        "{context}\n\n{input}",
        128, "rouge_l", False, first_line=True, stop_at_newline=True, category="few-shot"),
    "passage_count": DatasetSpec(
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. "
        "Please carefully read these paragraphs and determine how many unique paragraphs there "
        "are after removing duplicates. In other words, how many non-repeating paragraphs are "
        "there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after "
        "removing duplicates. The output format should only contain the number, such as 1, 2, 3, "
        "and so on.\n\nThe final answer is: ",
        32, "count", True, category="synthetic"),
    "passage_retrieval_en": DatasetSpec(
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which "
        "paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}"
        "\n\nPlease enter the number of the paragraph that the abstract is from. The answer format "
        "must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: ",
        32, "retrieval", True, category="synthetic"),
    "lcc": DatasetSpec(
        "Please complete the code given below. \n{context}Next line of code:\n",
        64, "code_sim", False, category="code"),
    "repobench-p": DatasetSpec(
        "Please complete the code given below. \n{context}{input}Next line of code:\n",
        64, "code_sim", False, category="code"),
}

HUB_REPO = "THUDM/LongBench"  # dataset repo; its loading script reads data/<name>.jsonl in data.zip
HUB_ARCHIVE = "data.zip"
