"""LongBench v1: official prompts, middle truncation, chat-template rule, first-line rule and
metrics per dataset, data errors before weights load, and a run through the runner."""

import json
import logging
import zipfile

import pytest
import torch
from hydra import compose, initialize_config_dir

from harness.core import hf_adapter
from harness.core import models
from harness.core.engine import Request
from kvcore.errors import ConfigError
from harness.core.metrics import rouge_l_score
from harness.run import run
from methods import build_method
from tasks import build_task
from tasks._longbench_config import DATASETS
from tasks.longbench import LongBench, first_line, middle_truncate
from tests.conftest import PROJECT, STORIES, make_engine, need_shared

TREC_CLASSES = ["Human being", "Location", "Entity", "Abbreviation"]
ROWS = {
    "trec": [
        {"input": "Question: Where is Aspen ?\nType:", "context":
         "Question: Who wrote Hamlet ?\nType: Human being\nQuestion: What is NASA ?\nType: "
         "Abbreviation", "answers": ["Location"], "all_classes": TREC_CLASSES, "_id": "t1"},
        {"input": "Question: Who built it ?\nType:", "context": "Question: Where is Rome ?\nType: "
         "Location", "answers": ["Location"], "all_classes": TREC_CLASSES, "_id": "t2"},
    ],
    "passage_count": [
        {"input": "", "context": "Paragraph 1: A cat.\n\nParagraph 2: A dog.\n\nParagraph 3: A "
         "cat.", "answers": ["2"], "all_classes": None, "_id": "c1"},
        {"input": "", "context": "Paragraph 1: Red.\n\nParagraph 2: Blue.", "answers": ["2"],
         "all_classes": None, "_id": "c2"},
    ],
    "lcc": [
        {"input": "", "context": "def foo(a):\n    return a + 1\n\n", "answers": ["x = foo(1)"],
         "all_classes": None, "_id": "l1"},
        {"input": "", "context": "import os\n", "answers": ["path = os.getcwd()"],
         "all_classes": None, "_id": "l2"},
    ],
    "samsum": [
        {"input": "Dialogue: Tom: Hi Ann! Ann: Hi Tom, the park? Tom: Yes.\nSummary: ",
         "context": "Dialogue: Bob: Lunch? Sue: Sure.\nSummary: Bob and Sue will have lunch.",
         "answers": ["Tom and Ann go to the park."], "all_classes": None, "_id": "s1"},
    ],
}


def write_jsonl(folder, dataset, rows):
    path = folder / f"{dataset}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def fake_generation(monkeypatch):
    """Record every prompt the engine is given and answer with queued texts (as token ids)."""
    calls, answers = [], []

    def generate(self, prompt, max_new_tokens, stop_ids=None, min_new_tokens=0, query=None):
        calls.append({"ids": [int(i) for i in prompt], "max_new_tokens": max_new_tokens,
                      "stop_ids": set(stop_ids or ())})
        return self.engine.encode(answers.pop(0), add_special_tokens=False)

    monkeypatch.setattr(Request, "generate", generate)
    return calls, answers


def test_middle_truncate_keeps_first_and_last_halves():
    ids = list(range(10))
    assert middle_truncate(ids, 4) == [0, 1, 8, 9]
    assert middle_truncate(ids, 5) == [0, 1, 8, 9]  # int(max_length / 2) per side, as pred.py
    assert middle_truncate(ids, 10) == ids
    assert first_line("\n\nLocation\nHuman being") == "Location"


def test_multi_news_end_to_end_on_stories(stories, data_dir, monkeypatch):
    model, tok = stories
    seen = []
    original = Request.generate

    def spy(self, prompt, max_new_tokens, stop_ids=None, min_new_tokens=0, query=None):
        seen.append([int(i) for i in prompt])
        return original(self, prompt, max_new_tokens, stop_ids, min_new_tokens, query)

    monkeypatch.setattr(Request, "generate", spy)
    task = build_task("longbench", limit=2, max_length_tokens=400, max_new_tokens=48,
                      data_dir=str(data_dir / "longbench"))
    task.check_data()
    res = task.evaluate(make_engine(model, build_method("full"), tok))

    rows = [json.loads(line) for line in
            (data_dir / "longbench" / "multi_news.jsonl").read_text().splitlines()[:2]]
    assert len(res.samples) == 2 and len(seen) == 2
    for row, ids, sample in zip(rows, seen, res.samples):
        full = tok(DATASETS["multi_news"].prompt.format(**row))["input_ids"]  # BOS included
        assert len(full) > 400
        assert ids == full[:200] + full[-200:]
        assert sample["id"] == row["_id"]
        assert sample["truncated"] is True and sample["chat_template"] is False
        assert sample["prompt_tokens"] == 400 and sample["prompt_tokens_untruncated"] == len(full)
        assert sample["prediction"].strip() and 1 <= sample["new_tokens"] <= 48
        assert sample["score"] == max(rouge_l_score(sample["prediction"], a)
                                      for a in row["answers"])
    m = res.metrics
    assert 0 <= m["multi_news"] <= 100 and m["average"] == m["multi_news"]
    assert m["multi_news"] == pytest.approx(50 * sum(s["score"] for s in res.samples), abs=1e-3)
    assert m["samples"] == 2 and m["truncated"] == 2
    assert m["per_dataset"]["multi_news"]["metric"] == "rouge_l"
    assert res.protocol["data"]["multi_news"].endswith("multi_news.jsonl")


def test_few_shot_count_and_code_paths(stories, tmp_path, fake_generation):
    model, tok = stories
    calls, answers = fake_generation
    for dataset in ("trec", "passage_count", "lcc"):
        write_jsonl(tmp_path, dataset, ROWS[dataset])
    answers += [
        "Location\nHuman being",  # trec: first line only -> 1 (the whole text would give 0.5)
        "\nHuman being\nLocation",  # leading newlines dropped, first line is wrong -> 0
        "2\n3",  # passage_count: no first-line rule, 2 numbers, 1 right -> 0.5
        "There are 2",  # -> 1
        "# the next line\nx = foo(1)\n",  # lcc: first non-comment line, exact -> 1
        "path = os.getcwd(",  # difflib ratio: 2*17/35 -> 97 -> 0.97
    ]
    task = build_task("longbench", datasets=["trec", "passage_count", "lcc"],
                      data_dir=str(tmp_path))
    task.check_data()
    res = task.evaluate(make_engine(model, build_method("full"), tok))

    order = [(d, row) for d in ("trec", "passage_count", "lcc") for row in ROWS[d]]
    for (dataset, row), call in zip(order, calls):
        spec = DATASETS[dataset]
        assert call["ids"] == tok(spec.prompt.format(**row))["input_ids"]  # no chat template
        assert call["max_new_tokens"] == spec.max_new_tokens  # 64, 32, 64
    newline = tok.encode("\n", add_special_tokens=False)[-1]
    assert all(newline not in c["stop_ids"] for c in calls)
    scores = [s["score"] for s in res.samples]
    assert scores == pytest.approx([1.0, 0.0, 0.5, 1.0, 1.0, 0.97])
    assert res.samples[0]["scored_prediction"] == "Location"
    assert "scored_prediction" not in res.samples[2]  # passage_count is scored whole
    m = res.metrics
    assert (m["trec"], m["passage_count"], m["lcc"]) == pytest.approx((50.0, 75.0, 98.5))
    assert m["average"] == pytest.approx((50 + 75 + 98.5) / 3, abs=1e-3)
    assert [m["per_dataset"][d]["metric"] for d in ("trec", "passage_count", "lcc")] == [
        "classification", "count", "code_sim"]


def test_samsum_stops_at_newline_on_stories(stories, tmp_path):
    model, tok = stories
    write_jsonl(tmp_path, "samsum", ROWS["samsum"])
    task = build_task("longbench", datasets=["samsum"], data_dir=str(tmp_path))
    res = task.evaluate(make_engine(model, build_method("full"), tok))
    sample = res.samples[0]
    # stories260K writes one line here and the newline ends generation well before 128 tokens
    assert sample["prediction"].endswith("\n") and "\n" not in sample["prediction"][:-1]
    assert 1 <= sample["new_tokens"] < 128
    assert sample["scored_prediction"] == first_line(sample["prediction"])
    reference = ROWS["samsum"][0]["answers"][0]
    assert sample["score"] == rouge_l_score(sample["scored_prediction"], reference)


def test_first_token_may_not_stop_samsum():
    """pred.py's min_length = prompt + 1: a stop token is masked at the first step only."""
    vocab, newline, eos, other = 10, 3, 2, 7

    class FakeRequest:
        answer = Request.answer  # the decoding loop under test, over the fake forwards

        def prefill(self, ids):
            logits = torch.zeros(1, 1, vocab)
            logits[0, 0, newline], logits[0, 0, eos], logits[0, 0, other] = 5.0, 4.0, 1.0
            return logits

        def step(self, token):
            logits = torch.zeros(1, 1, vocab)
            logits[0, 0, newline] = 5.0
            return logits

    out = Request.generate(FakeRequest(), [1, 2], 8, {newline, eos}, min_new_tokens=1)
    assert out == [other, newline]
    assert Request.generate(FakeRequest(), [1, 2], 8, {newline, eos}) == [newline]


def test_chat_template_rule_on_smollm2(smollm2, data_dir, tmp_path, fake_generation):
    model, tok = smollm2
    calls, answers = fake_generation
    engine = make_engine(model, build_method("full"), tok)
    templated = tok.apply_chat_template([{"role": "user", "content": "SLOT"}], tokenize=False,
                                        add_generation_prompt=True)
    before, after = templated.split("SLOT")
    prefix = tok(before, add_special_tokens=False)["input_ids"]
    suffix = tok(after, add_special_tokens=False)["input_ids"]
    row = json.loads((data_dir / "longbench" / "multi_news.jsonl").read_text().splitlines()[0])
    body = tok(DATASETS["multi_news"].prompt.format(**row), add_special_tokens=False)["input_ids"]

    answers.append("A summary.")
    task = build_task("longbench", limit=1, max_length_tokens=300,
                      data_dir=str(data_dir / "longbench"))
    res = task.evaluate(engine)  # auto: multi_news is wrapped
    half = (300 - len(prefix) - len(suffix)) // 2
    assert calls[0]["ids"] == prefix + body[:half] + body[-half:] + suffix
    assert res.samples[0]["chat_template"] is True and res.samples[0]["prompt_tokens"] <= 300

    answers.append("A summary.")
    build_task("longbench", limit=1, max_length_tokens=300, chat_template="never",
               data_dir=str(data_dir / "longbench")).evaluate(engine)
    assert calls[1]["ids"] == body[:150] + body[-150:]  # SmolLM2 adds no BOS

    write_jsonl(tmp_path, "trec", ROWS["trec"][:1])
    trec_ids = tok(DATASETS["trec"].prompt.format(**ROWS["trec"][0]))["input_ids"]
    answers.append("Location")
    build_task("longbench", datasets=["trec"], data_dir=str(tmp_path)).evaluate(engine)
    assert calls[2]["ids"] == trec_ids  # auto: few-shot datasets are not wrapped
    answers.append("Location")
    build_task("longbench", datasets=["trec"], data_dir=str(tmp_path),
               chat_template="always").evaluate(engine)
    trec_body = tok(DATASETS["trec"].prompt.format(**ROWS["trec"][0]),
                    add_special_tokens=False)["input_ids"]
    assert calls[3]["ids"] == prefix + trec_body + suffix


def test_always_needs_a_chat_template(stories, tmp_path):
    model, tok = stories
    write_jsonl(tmp_path, "trec", ROWS["trec"])
    task = build_task("longbench", datasets=["trec"], data_dir=str(tmp_path),
                      chat_template="always")
    with pytest.raises(ConfigError, match="task.chat_template=always but this model's tokenizer"):
        task.evaluate(make_engine(model, build_method("full"), tok))


@pytest.mark.parametrize("options, message", [
    ({"datasets": ["qasper", "nope"]},
     "task.datasets: unknown dataset 'nope'; allowed: narrativeqa"),
    ({"datasets": ["dureader"]}, "unknown dataset 'dureader'"),
    ({"datasets": []}, "task.datasets=[] must be a non-empty list"),
    ({"datasets": ["trec", "trec"]}, "names a dataset twice"),
    ({"chat_template": "sometimes"},
     "task.chat_template='sometimes'; allowed: auto, always, never"),
    ({"max_length_tokens": 1}, "task.max_length_tokens=1 must be an integer >= 2"),
    ({"max_new_tokens": 0}, "task.max_new_tokens=0 must be an integer >= 1"),
    ({"limit": 0}, "task.limit=0"),
])
def test_bad_options_name_the_key(options, message):
    with pytest.raises(ConfigError) as err:
        build_task("longbench", **options)
    assert message in str(err.value)


def test_a_single_name_is_a_list_of_one():
    assert build_task("longbench", datasets="trec").datasets == ["trec"]


def test_lengths_are_checked_against_the_model_positions(stories):
    info = hf_adapter.model_info(stories[0].config)
    full, streaming = build_method("full"), build_method("streaming_llm")
    reasons = build_task("longbench").validate(info, full)  # 512 positions - 512 generated
    assert len(reasons) == 1 and "leaves 0 prompt tokens for multi_news" in reasons[0]
    assert "task.max_new_tokens" in reasons[0]
    assert build_task("longbench", max_new_tokens=128).validate(info, full) == []
    too_long = build_task("longbench", max_length_tokens=400)
    assert "exceed the model's max positions (512)" in too_long.validate(info, full)[0]
    assert too_long.validate(info, streaming) == []  # attends at in-cache positions


def test_missing_file_offline_names_dataset_and_folder(tmp_path):
    task = build_task("longbench", datasets=["qasper"], data_dir=str(tmp_path))
    with pytest.raises(ConfigError) as err:
        task.check_data()
    assert "qasper" in str(err.value) and str(tmp_path / "qasper.jsonl") in str(err.value)
    assert "offline" in str(err.value)


@pytest.mark.parametrize("dataset, lines, message", [
    ("trec", [json.dumps(ROWS["trec"][0]), '{"input": "x", "context": '],
     "trec.jsonl:2: not valid JSON"),
    ("trec", ["", json.dumps({"input": "", "context": ""})],
     "trec.jsonl:2: missing field 'answers'"),
    ("trec", [json.dumps({**ROWS["trec"][0], "answers": []})],
     "'answers' must be a non-empty list"),
    ("trec", [json.dumps({**ROWS["trec"][0], "all_classes": None})], "needs 'all_classes'"),
    ("trec", ["[1, 2]"], "trec.jsonl:1: a JSON object is expected"),
    ("trec", ["", "  "], "no rows"),
    ("passage_retrieval_en", [json.dumps({**ROWS["lcc"][0], "answers": ["Paragraph"]})],
     "passage_retrieval_en.jsonl:1: passage_retrieval_en answers must read 'Paragraph <n>'"),
])
def test_malformed_data_names_file_and_line(tmp_path, dataset, lines, message):
    path = tmp_path / f"{dataset}.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    task = build_task("longbench", datasets=[dataset], data_dir=str(tmp_path))
    with pytest.raises(ConfigError) as err:
        task.check_data()
    assert message in str(err.value) and str(path) in str(err.value)


def test_hub_archive_when_online(tmp_path, monkeypatch):
    import huggingface_hub

    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        zipped.writestr("data/lcc.jsonl", "".join(json.dumps(r) + "\n" for r in ROWS["lcc"]))
    asked = []

    def download(repo_id, filename, repo_type=None, **kwargs):
        asked.append((repo_id, filename, repo_type))
        return str(archive)

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    task = build_task("longbench", datasets=["lcc"], data_dir=str(tmp_path / "empty"))
    task.check_data()
    assert asked == [("THUDM/LongBench", "data.zip", "dataset")]
    assert [r["_id"] for r in task._rows["lcc"]] == ["l1", "l2"]
    assert task._sources["lcc"] == "hf://datasets/THUDM/LongBench/data.zip:data/lcc.jsonl"

    missing = build_task("longbench", datasets=["qasper"], data_dir=str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="qasper has no local file .* hub download .* failed"):
        missing.check_data()  # the archive has no data/qasper.jsonl


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_runner_refuses_the_official_length_on_512_positions(tmp_path, monkeypatch, data_dir):
    need_shared(STORIES)
    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the config error was found")

    monkeypatch.setattr(models, "load_model", refuse)
    with pytest.raises(ConfigError, match="leaves 0 prompt tokens for multi_news"):
        run(_cfg("model=stories260k", "task=longbench", f"runner.results_root={tmp_path}"))
    with pytest.raises(ConfigError, match="no local file"):
        run(_cfg("model=stories260k", "task=longbench", "task.max_new_tokens=16",
                 "task.datasets=[qasper]", f"runner.results_root={tmp_path}"))
    assert not any(tmp_path.iterdir())


def test_runner_writes_longbench_results(tmp_path, data_dir):
    need_shared(STORIES)
    out = run(_cfg("model=stories260k", "task=longbench", "task.limit=1", "task.max_new_tokens=16",
                   f"runner.results_root={tmp_path}"))
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0 <= metrics["accuracy"]["multi_news"] <= 100
    assert metrics["accuracy"]["per_dataset"]["multi_news"]["max_length_tokens"] == 512 - 16
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 1 and samples[0]["prompt_tokens"] == 496 and samples[0]["truncated"]
    assert metrics["protocol"]["decoding"] == "greedy"


def test_data_dir_expands_the_home_folder(monkeypatch, tmp_path):
    """task.data_dir=~/... is the user's folder, as the lm-eval data folder already was."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert LongBench(data_dir="~/longbench").data_folder() == tmp_path / "longbench"


@pytest.mark.usefixtures("shared_folder")
def test_longbench_hub_fallback_offline_is_one_line(tmp_path, monkeypatch, caplog):
    """Without network, huggingface_hub logged a warning per retry (12 lines, half a minute)
    before the task's one ConfigError line."""
    import huggingface_hub

    from tasks import build_task

    def download(*a, **k):
        logging.getLogger("huggingface_hub.utils._http").warning(
            "'[Errno -2] Name or service not known' thrown while requesting HEAD ...")
        logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    task = build_task("longbench", datasets=["qasper"], data_dir=str(tmp_path / "nope"))
    level = logging.getLogger("huggingface_hub").level
    with caplog.at_level(logging.DEBUG), pytest.raises(ConfigError, match="hub download"):
        task.check_data()
    assert not [r for r in caplog.records if r.name.startswith("huggingface_hub")]
    assert logging.getLogger("huggingface_hub").level == level  # restored
