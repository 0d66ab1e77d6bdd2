"""XSum in H2O's setting: H2O's items, stop strings, ROUGE from rouge-score, over-long prompts
skipped and counted (never truncated), data errors named by file and line."""

import json

import pytest
from hydra import compose, initialize_config_dir

from harness.core.engine import Request
from kvcore.errors import ConfigError
from harness.core.metrics import rouge_scores
from harness.run import run
from methods import build_method
from tasks import build_task
from tasks.xsum import cut_at_stop, h2o_prompt
from tests.conftest import PROJECT, STORIES, make_engine, need_shared

SUFFIX = "\n\nSummarize the above article in 1 sentence.\n"
ITEMS = [
    {"article": h2o_prompt("A man was seen near the river on Sunday."),
     "summary_gt": "A man was seen.", "max_tokens": 16, "temperature": 0.3, "stop": ["###"]},
    {"article": h2o_prompt("The council met. It voted on the budget."),
     "summary_gt": "The council voted on the budget.", "max_tokens": 32, "temperature": 0.3,
     "stop": ["###", "\n"]},
]


def write_items(path, items):
    path.write_text("".join(json.dumps(i) + "\n" for i in items), encoding="utf-8")
    return path


@pytest.fixture
def fake_generation(monkeypatch):
    """Record every prompt the engine is given and answer with queued texts (as token ids)."""
    calls, answers = [], []

    def generate(self, prompt, max_new_tokens, stop_ids=None, min_new_tokens=0, query=None):
        calls.append({"ids": [int(i) for i in prompt], "max_new_tokens": max_new_tokens})
        return self.engine.encode(answers.pop(0), add_special_tokens=False)

    monkeypatch.setattr(Request, "generate", generate)
    return calls, answers


def test_cut_at_stop_takes_the_earliest_stop_string():
    assert cut_at_stop("a summary.###\nArticle", ["###"]) == "a summary."
    assert cut_at_stop("one\ntwo ### three", ["###", "\n"]) == "one"
    assert cut_at_stop("no stop here", ["###"]) == "no stop here"
    assert cut_at_stop("x###", []) == "x###"


def test_hub_prompt_reproduces_h2o_items(data_dir):
    line = (data_dir / "xsum" / "xsum_0shot.jsonl").read_text(encoding="utf-8").splitlines()[0]
    article = json.loads(line)["article"]
    body = article[len("###\nArticle: "):-len(SUFFIX)]
    assert h2o_prompt(body) == article
    assert h2o_prompt("Doc  one\nmore") == "###\nArticle: Doc one more" + SUFFIX


def test_stories_skips_what_does_not_fit_and_scores_two(stories, data_dir):
    model, tok = stories
    task = build_task("xsum", limit=2)
    task.check_data()
    res = task.evaluate(make_engine(model, build_method("full"), tok))

    lines = (data_dir / "xsum" / "xsum_0shot.jsonl").read_text(encoding="utf-8").splitlines()
    fits = [len(tok(json.loads(x)["article"])["input_ids"]) + 64 <= 512 for x in lines[:50]]
    first_two = [i for i, ok in enumerate(fits) if ok][:2]
    m = res.metrics
    assert m["scored"] == 2 and m["skipped_too_long"] == first_two[1] - 1
    assert m["items_read"] == first_two[1] + 1
    scored = [s for s in res.samples if not s["skipped"]]
    assert [s["id"] for s in scored] == first_two
    for s in res.samples:
        assert (s["prompt_tokens"] + s["max_new_tokens"] <= 512) == (not s["skipped"])
    for s in scored:
        assert "###" not in s["prediction"] and 1 <= s["new_tokens"] <= 64
        expected = rouge_scores(s["prediction"], s["reference"])
        for key in ("rouge1", "rouge2", "rougeL"):
            assert s[key] == pytest.approx(100 * expected[key])
    for key in ("rouge1", "rouge2", "rougeL"):
        assert 0 <= m[key] <= 100
        assert m[key] == pytest.approx(sum(s[key] for s in scored) / 2, abs=1e-3)
    assert res.protocol["too_long"] == "skipped and counted, never truncated"


def test_stop_strings_generation_length_and_rouge(stories, tmp_path, fake_generation):
    model, tok = stories
    calls, answers = fake_generation
    path = write_items(tmp_path / "items.jsonl", ITEMS)
    engine = make_engine(model, build_method("full"), tok)
    answers += ["A man was seen.### Article: more", "The council voted.\nIt did ###"]
    res = build_task("xsum", path=str(path)).evaluate(engine)
    assert [c["max_new_tokens"] for c in calls] == [16, 32]  # each item's max_tokens
    assert calls[0]["ids"] == tok(ITEMS[0]["article"])["input_ids"]  # tokenizer default: BOS
    first, second = res.samples
    assert first["prediction"] == "A man was seen." and first["rouge1"] == pytest.approx(100.0)
    assert second["prediction"] == "The council voted."
    # "the council voted" vs "the council voted on the budget": P = 1, R = 1/2 -> F = 2/3
    assert second["rouge1"] == pytest.approx(200 / 3)
    assert res.metrics["rouge1"] == pytest.approx((100 + 200 / 3) / 2, abs=1e-3)

    answers += ["x", "y"]
    build_task("xsum", path=str(path), max_new_tokens=7).evaluate(engine)
    assert [c["max_new_tokens"] for c in calls[2:]] == [7, 7]


def test_nothing_that_fits_is_an_error(stories, tmp_path):
    model, tok = stories
    long_item = {**ITEMS[0], "article": h2o_prompt("word " * 2000)}
    task = build_task("xsum", path=str(write_items(tmp_path / "long.jsonl", [long_item])))
    with pytest.raises(ConfigError, match="none of the 1 items read fits the model's 512"):
        task.evaluate(make_engine(model, build_method("full"), tok))


@pytest.mark.parametrize("lines, message", [
    ([json.dumps(ITEMS[0]), '{"article": "x",'], "items.jsonl:2: not valid JSON"),
    ([json.dumps({**ITEMS[0], "max_tokens": 0})], "items.jsonl:1: 'max_tokens' must be a positive"),
    ([json.dumps({"article": "x"})], "items.jsonl:1: field 'summary_gt' must be a string"),
    ([json.dumps({**ITEMS[0], "stop": "###"})], "'stop' must be a list of strings"),
    (["", ""], "no items"),
])
def test_malformed_items_name_file_and_line(tmp_path, lines, message):
    path = tmp_path / "items.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        build_task("xsum", path=str(path)).check_data()
    assert message in str(err.value) and str(path) in str(err.value)


def test_missing_files_and_bad_options(tmp_path):
    with pytest.raises(ConfigError, match="task.path=.*missing.jsonl: no such file"):
        build_task("xsum", path=str(tmp_path / "missing.jsonl")).check_data()
    with pytest.raises(ConfigError, match="no local XSum file .*xsum_0shot.jsonl and the hub is "
                                          "offline"):
        build_task("xsum", data_dir=str(tmp_path)).check_data()
    with pytest.raises(ConfigError, match="task.max_new_tokens=0 must be a positive integer"):
        build_task("xsum", max_new_tokens=0)
    with pytest.raises(ConfigError, match="task.limit=-2"):
        build_task("xsum", limit=-2)
    assert build_task("xsum").limit == 20  # the prompts are long: a small default


def test_hub_items_when_online(tmp_path, monkeypatch):
    import datasets

    rows = [{"id": "38264402", "document": "Doc  one\nmore", "summary": "S one."}]
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: rows
                        if (name, split) == ("EdinburghNLP/xsum", "test") else None)
    task = build_task("xsum", data_dir=str(tmp_path))
    task.check_data()
    assert task._items == [{"id": "38264402", "article": "###\nArticle: Doc one more" + SUFFIX,
                            "summary_gt": "S one.", "max_tokens": 64, "stop": ["###"]}]


def test_smollm2_two_items(smollm2):
    model, tok = smollm2
    res = build_task("xsum", limit=2, max_new_tokens=32).evaluate(
        make_engine(model, build_method("full"), tok))
    m = res.metrics
    assert m["scored"] == 2 and m["skipped_too_long"] == 0  # 8192 positions: nothing skipped
    assert all(0 <= m[k] <= 100 for k in ("rouge1", "rouge2", "rougeL"))
    assert m["rouge1"] > 10  # an instruct model's summaries overlap the references (21.2 here)


def test_runner_writes_xsum_results(tmp_path, data_dir):
    need_shared(STORIES)
    with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "model=stories260k", "task=xsum", "task.limit=1", f"runner.results_root={tmp_path}"])
    out = run(cfg)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["accuracy"]["scored"] == 1 and 0 <= metrics["accuracy"]["rougeL"] <= 100
    assert metrics["task"]["options"]["limit"] == 1
