"""Map our local data copies (../shared/data) back to the fields lm-eval's own task YAMLs read.

Each YAML beside this file `include`s lm-eval's own task definition (so `doc_to_text`,
`doc_to_choice`, `doc_to_target` and the metrics are lm-eval's, unchanged) and only swaps the data
source: `dataset_path: json` over a local file plus `process_docs: !function utils.<task>_docs`,
which rebuilds the original dataset's fields from the local copy's format. lm-eval loads this module
by file path from the generated task folder (`harness.lm_eval.tasks.offline_task_dir`), where a
`kvh_paths.json` beside it names the data folder (PIQA keeps its labels in a separate file).

Formats (../shared/data/SOURCES.md):
  copa/copa.jsonl             {query: "<premise without its last char>, because|therefore",
                               choices: [2, first letter lower-cased], gold}
  piqa/dev.jsonl + dev-labels.lst   original {id, goal, sol1, sol2} + one 0/1 label per line
  openbookqa/openbook_qa.jsonl     {query: question_stem, choices: [4], gold}
  winogrande/winogrande.jsonl {context_options: [sentence[:blank] + option1, ... + option2],
                               continuation: sentence[blank + 1:].strip(), gold}
  rte/val.jsonl               SuperGLUE {premise, hypothesis, label: entailment|not_entailment, idx}
  lambada/lambada_openai.jsonl     {context, continuation}: the text split before its last word
"""

from __future__ import annotations

import json
from pathlib import Path

PATHS_FILE = "kvh_paths.json"  # written by offline_task_dir next to the copy of this module
COPA_CONNECTORS = {", because": "cause", ", therefore": "effect"}
OBQA_LABELS = ("A", "B", "C", "D")
RTE_LABELS = {"entailment": 0, "not_entailment": 1}  # GLUE RTE: 0 = entailment ("True")


def data_dir() -> Path:
    """The data folder recorded by offline_task_dir beside this module."""
    paths = Path(__file__).with_name(PATHS_FILE)
    return Path(json.loads(paths.read_text())["data_dir"])


def copa_doc(doc: dict, idx: int) -> dict:
    """llm-foundry COPA record -> SuperGLUE fields (premise, question, choice1/2, label, idx).

    lm-eval's `doc_to_text` drops the premise's last character (its period) and appends the
    connector; the local `query` already dropped it and added ", because"/", therefore". We put a
    period back so lm-eval's own function yields exactly the original text.
    """
    query = doc["query"]
    for connector, question in COPA_CONNECTORS.items():
        if query.endswith(connector):
            premise = query[: -len(connector)] + "."
            break
    else:
        raise ValueError(f"copa record {idx}: query {query!r} does not end with "
                         f"{' or '.join(map(repr, COPA_CONNECTORS))}")
    choice1, choice2 = doc["choices"]
    return {"premise": premise, "question": question, "choice1": choice1, "choice2": choice2,
            "label": int(doc["gold"]), "idx": idx}


def copa_docs(dataset):
    return dataset.map(copa_doc, with_indices=True, remove_columns=dataset.column_names)


def piqa_docs(dataset):
    """Original PIQA fields plus `label` from dev-labels.lst (same order, one per line)."""
    path = data_dir() / "piqa" / "dev-labels.lst"
    labels = [int(line) for line in path.read_text().split()]
    if len(labels) != len(dataset):
        raise ValueError(f"{path}: {len(labels)} labels for {len(dataset)} PIQA records")
    return dataset.map(lambda doc, i: {"label": labels[i]}, with_indices=True)


def obqa_doc(doc: dict, idx: int) -> dict:
    """{query, choices, gold} -> OpenBookQA "main" (id, question_stem, choices, answerKey)."""
    if len(doc["choices"]) != len(OBQA_LABELS):
        raise ValueError(f"openbookqa record {idx}: {len(doc['choices'])} choices, expected 4")
    return {"id": str(idx), "question_stem": doc["query"],
            "choices": {"text": list(doc["choices"]), "label": list(OBQA_LABELS)},
            "answerKey": OBQA_LABELS[int(doc["gold"])]}


def obqa_docs(dataset):
    return dataset.map(obqa_doc, with_indices=True, remove_columns=dataset.column_names)


def winogrande_doc(doc: dict) -> dict:
    """Partial-evaluation record -> WinoGrande fields {sentence, option1, option2, answer}.

    lm-eval builds the contexts as `sentence[:blank] + option` and the target as
    `sentence[blank + 1:].strip()`. The shared prefix of the two local contexts is
    `sentence[:blank]` (cut back to a word start, so that options sharing leading letters stay
    whole); the rebuilt sentence puts "_ " before the continuation, which lm-eval strips again.
    """
    first, second = doc["context_options"]
    shared = 0
    while shared < min(len(first), len(second)) and first[shared] == second[shared]:
        shared += 1
    shared = first.rfind(" ", 0, shared) + 1  # back to the start of the word (0 if none)
    prefix = first[:shared]
    if "_" in prefix:
        raise ValueError(f"winogrande record: the text before the blank contains '_': {prefix!r}")
    return {"sentence": f"{prefix}_ {doc['continuation']}", "option1": first[shared:],
            "option2": second[shared:], "answer": str(int(doc["gold"]) + 1)}


def winogrande_docs(dataset):
    return dataset.map(winogrande_doc, remove_columns=dataset.column_names)


def rte_doc(doc: dict) -> dict:
    """SuperGLUE RTE record -> GLUE RTE fields {sentence1, sentence2, label, idx}."""
    if doc["label"] not in RTE_LABELS:
        raise ValueError(f"rte record {doc.get('idx')}: label {doc['label']!r}; "
                         f"expected one of {sorted(RTE_LABELS)}")
    return {"sentence1": doc["premise"], "sentence2": doc["hypothesis"],
            "label": RTE_LABELS[doc["label"]], "idx": int(doc["idx"])}


def rte_docs(dataset):
    return dataset.map(rte_doc, remove_columns=dataset.column_names)


def lambada_doc(doc: dict) -> dict:
    """{context, continuation} -> {text}: lm-eval splits `text` again at its last space."""
    if " " in doc["continuation"]:
        raise ValueError(f"lambada record: continuation {doc['continuation']!r} is not one word")
    return {"text": f"{doc['context']} {doc['continuation']}"}


def lambada_docs(dataset):
    return dataset.map(lambada_doc, remove_columns=dataset.column_names)
