"""The `lm_eval` task: offline YAMLs (lm-eval's own prompts over ../shared/data), the papers'
5-shot request dumps, and runs through the runner."""

import json
import math
import re

import pytest
from hydra import compose, initialize_config_dir

from kvcore.errors import ConfigError
from harness.lm_eval.tasks import TASK_FILES, offline_task_dir
from harness.run import run
from tests.conftest import DATA, PROJECT, STORIES, need_shared
from tests.helpers.runs import refused

# lm-eval 0.4.13's `copa` puts a space in front of every choice (utils.doc_to_choice) and the
# default target_delimiter adds another: "...because  the patron was drunk." lm-eval 0.3, which
# wrote the papers' dumps, joined them with one space. This is the only difference we accept.
COPA_JUNCTIONS = (" because  ", " therefore  ")


def copa_v03(text: str) -> str:
    for junction in COPA_JUNCTIONS:
        text = text.replace(junction, junction[:-1])
    return text


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    need_shared(DATA)
    from lm_eval.tasks import TaskManager

    folder = offline_task_dir(DATA, cache_dir=tmp_path_factory.mktemp("lm_eval_tasks"))
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    loaded = manager.load(list(TASK_FILES))["tasks"]
    for task in loaded.values():
        task.set_fewshot_seed(1234)
    return loaded


def requests_of(task, doc, shots=0):
    """(context, continuation) pairs lm-eval builds for one document."""
    reqs = task.construct_requests(doc, task.fewshot_context(doc, shots))
    return [r.args for r in (reqs if isinstance(reqs, list) else [reqs])]


def dump_prompts(name: str) -> list[str]:
    path = DATA / name
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


# --- the InfiniGen / H2O 5-shot request dumps ----------------------------------------------------
def _shot_docs_copa(shots: list[str]) -> list[dict]:
    """COPA docs that render as the dump's few-shot lines (premise, connector, answer)."""
    docs = []
    for shot in shots:
        cut = min((shot.find(f" {w} "), w) for w in ("because", "therefore") if f" {w} " in shot)
        premise, answer = shot[: cut[0]], shot[cut[0] + len(cut[1]) + 2:]
        docs.append({"premise": premise + ".", "choice1": answer, "choice2": answer, "label": 0,
                     "question": "cause" if cut[1] == "because" else "effect", "idx": -1})
    return docs


def _shot_docs_obqa(shots: list[str]) -> list[dict]:
    """OpenBookQA docs that render as the dump's few-shot lines (stem + " " + answer)."""
    docs = []
    for shot in shots:
        stem, answer = shot.rsplit(" ", 1)
        docs.append({"id": "shot", "question_stem": stem, "answerKey": "A",
                     "choices": {"text": [answer, "-", "-", "-"], "label": ["A", "B", "C", "D"]}})
    return docs


@pytest.mark.parametrize("name, dump, shot_docs, normalize, n_requests", [
    ("copa", "copa/copa-5.jsonl", _shot_docs_copa, copa_v03, 200),
    ("openbookqa", "openbookqa/openbookqa-5.jsonl", _shot_docs_obqa, lambda t: t, 2000),
])
def test_five_shot_prompts_match_the_papers_dumps(tasks, name, dump, shot_docs, normalize,
                                                  n_requests):
    """Every request of the dump (InfiniGen/H2O `generate_task_data.py --num-fewshot 5`, lm-eval
    0.3) is `shot_1 \\n\\n ... shot_5 \\n\\n context+continuation`.

    What is compared: (1) the evaluated part of every dump request equals the context +
    continuation our task builds for one of its documents and choices, so every document and
    choice of the local copy is the papers'; (2) given the dump's own five shots as few-shot
    documents, our task renders the whole 5-shot prompt identically (template, target delimiter,
    few-shot delimiter, order). What cannot be compared: which shots. lm-eval draws them from the
    training split (0.3 and 0.4.13 alike, with different RNG code); no training split is available
    offline (the dumps' COPA shots are none of the 100 validation documents, checked below), so
    our shots come from the evaluated split, the evaluated document left out.
    COPA differs from the dumps by exactly one space at the answer junction (lm-eval 0.4.13's own
    `copa` prompt; see COPA_JUNCTIONS); OpenBookQA is byte-identical.
    """
    from lm_eval.api.samplers import FirstNSampler

    task = tasks[name]
    ours = {}
    for doc in task.eval_docs:
        for i, (ctx, cont) in enumerate(requests_of(task, doc)):
            ours[normalize(ctx + cont)] = (doc, i)
    prompts = dump_prompts(dump)
    assert len(prompts) == n_requests
    saved = task.sampler
    try:
        for prompt in prompts:
            *shots, evaluated = prompt.split("\n\n")
            assert len(shots) == 5
            doc, choice = ours[evaluated]  # (1)
            task.sampler = FirstNSampler(shot_docs(shots))
            ctx, cont = requests_of(task, doc, shots=5)[choice]
            assert normalize(ctx + cont) == prompt  # (2)
    finally:
        task.sampler = saved
    assert len(set(ours)) == n_requests
    if name == "copa":
        shot_lines = {s for p in prompts for s in p.split("\n\n")[:-1]}
        assert not shot_lines & set(ours)  # the papers' shots are training documents


def test_copa_double_space_is_lm_eval_0_4_13s_own_prompt(tasks):
    """Our COPA prompt is lm-eval's: choices from its super_glue/copa utils (leading space) after
    the default target delimiter. Fails if lm-eval (or our include) changes this."""
    ctx, cont = requests_of(tasks["copa"], tasks["copa"].eval_docs[0])[1]
    assert (ctx, cont) == ("The man turned on the faucet therefore",
                           "  water flowed from the spout.")


def test_few_shot_examples_never_include_the_evaluated_document(tasks):
    task = tasks["copa"]
    for doc in task.eval_docs:
        ctx = task.fewshot_context(doc, 5)
        shots = ctx.split("\n\n")[:-1]
        own = task.fewshot_context(doc, 0)
        assert len(shots) == 5 and not any(s.startswith(own + " ") for s in shots)


# --- local copies mapped back to the original datasets' fields -----------------------------------
def _jsonl(rel):
    return [json.loads(line) for line in (DATA / rel).read_text().splitlines() if line.strip()]


def test_copa_docs_match_local_copy(tasks):
    task, raw = tasks["copa"], _jsonl("copa/copa.jsonl")
    assert len(task.eval_docs) == len(raw) == 100
    for doc, item in zip(task.eval_docs, raw):
        (ctx, a), (_, b) = requests_of(task, doc)
        assert ctx + "," == item["query"].replace(", because", " because,").replace(
            ", therefore", " therefore,")
        assert [a, b] == ["  " + c for c in item["choices"]]
        assert task.doc_to_target(doc) == " " + item["choices"][item["gold"]]


def test_piqa_docs_are_the_original_file_with_labels(tasks):
    task, raw = tasks["piqa"], _jsonl("piqa/dev.jsonl")
    labels = [int(x) for x in (DATA / "piqa/dev-labels.lst").read_text().split()]
    assert len(task.eval_docs) == len(raw) == len(labels) == 1838
    for doc, item, label in zip(task.eval_docs, raw, labels):
        assert {k: doc[k] for k in item} == item and doc["label"] == label  # trailing spaces kept
    ctx, cont = requests_of(task, task.eval_docs[0])[0]
    assert ctx == f"Question: {raw[0]['goal']}\nAnswer:" and cont == " " + raw[0]["sol1"]


def test_openbookqa_docs_match_local_copy(tasks):
    task, raw = tasks["openbookqa"], _jsonl("openbookqa/openbook_qa.jsonl")
    assert len(task.eval_docs) == len(raw) == 500
    for doc, item in zip(task.eval_docs, raw):
        assert requests_of(task, doc) == [(item["query"], " " + c) for c in item["choices"]]
        assert task.doc_to_target(doc) == item["gold"]


def test_winogrande_requests_equal_local_partial_format(tasks):
    task, raw = tasks["winogrande"], _jsonl("winogrande/winogrande.jsonl")
    assert len(task.eval_docs) == len(raw) == 1267
    for doc, item in zip(task.eval_docs, raw):
        expected = [(c, " " + item["continuation"]) for c in item["context_options"]]
        assert requests_of(task, doc) == expected
        assert task.doc_to_text(doc) == item["gold"]  # lm-eval's gold index for winogrande
    first = task.eval_docs[0]
    assert (first["option1"], first["option2"]) == ("Sarah", "Maria")


def test_rte_labels_and_prompt(tasks):
    task, raw = tasks["rte"], _jsonl("rte/val.jsonl")
    assert len(task.eval_docs) == len(raw) == 277
    for doc, item in zip(task.eval_docs, raw):
        assert doc["label"] == (0 if item["label"] == "entailment" else 1)
        ctx, cont = requests_of(task, doc)[doc["label"]]
        assert ctx == f"{item['premise']}\nQuestion: {item['hypothesis']} True or False?\nAnswer:"
        assert cont == (" True" if item["label"] == "entailment" else " False")


def test_lambada_requests_equal_local_split(tasks):
    task, raw = tasks["lambada_openai"], _jsonl("lambada/lambada_openai.jsonl")
    assert len(task.eval_docs) == len(raw) == 5153
    for doc, item in zip(task.eval_docs, raw[:1000]):
        assert requests_of(task, doc) == [(item["context"], " " + item["continuation"])]


# --- through the runner --------------------------------------------------------------------------
def cfg_for(*overrides):
    with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_runner_runs_lm_eval_task(tmp_path, monkeypatch):
    need_shared(STORIES)
    need_shared(DATA)
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path / "cache"))
    out = run(cfg_for("task=lm_eval", "model=stories260k", "task.names=[copa,rte]",
                      "task.limit=4", "task.num_fewshot=2", f"runner.results_root={tmp_path}"))
    assert out.parent == tmp_path / "lm_eval" / "stories260k" / "full"
    metrics = json.loads((out / "metrics.json").read_text())
    acc = metrics["accuracy"]
    for name in ("copa", "rte"):
        assert 0.0 <= acc[f"{name}/acc"] <= 1.0 and acc[f"{name}/samples"] == 4
        assert acc[f"{name}/acc_stderr"] > 0
    assert acc["acc_mean"] == pytest.approx((acc["copa/acc"] + acc["rte/acc"]) / 2)
    proto = metrics["protocol"]
    assert proto["num_fewshot"] == {"copa": 2, "rte": 2} and proto["scoring"] == "stepwise"
    assert proto["fewshot_seed"] == 1234 and proto["lm_eval_version"] == "0.4.13"
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and {r["task"] for r in rows} == {"copa", "rte"}
    for r in rows:
        assert r["prediction"] in (0, 1) and len(r["loglikelihoods"]) == 2
        if r["task"] == "rte":  # target = the gold choice index
            assert r["acc"] == float(r["prediction"] == r["target"])
    assert metrics["speed"]["decode_steps"] > 0  # stepwise: answer tokens are decode steps
    assert metrics["kv"]["samples"] == 16  # one KV sample per request (4 docs x 2 choices x 2)


@pytest.mark.parametrize("overrides, message", [
    (["task.names=[hellaswag]"], "task.names: 'hellaswag' has no offline copy"),
    (["task.names=[]"], "task.names=[] must be a non-empty list"),
    (["task.scoring=sometimes"], "task.scoring='sometimes'; allowed: stepwise, chunked"),
    (["task.num_fewshot=-1"], "task.num_fewshot=-1 must be an integer >= 0"),
    (["task.data_dir=/nonexistent/data"], "task.data_dir=/nonexistent/data: no such folder"),
    (["task.seed=abc"], "task.seed='abc' must be an integer"),
])
def test_config_errors_before_weights(overrides, message, tmp_path, monkeypatch):
    from harness.core import models

    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the config error was found")
    monkeypatch.setattr(models, "load_model", refuse)
    need_shared(STORIES)
    with pytest.raises(ConfigError) as err:
        run(cfg_for("task=lm_eval", "model=stories260k", *overrides,
                    f"runner.results_root={tmp_path}"))
    assert message in str(err.value)
    assert not any(tmp_path.iterdir())


def test_missing_data_file_is_named(tmp_path, monkeypatch):
    from harness.core import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    need_shared(STORIES)
    (tmp_path / "data" / "copa").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"rte/val.jsonl is missing \(needed by lm-eval task "):
        run(cfg_for("task=lm_eval", "model=stories260k", "task.names=[rte]",
                    f"task.data_dir={tmp_path / 'data'}", f"runner.results_root={tmp_path / 'r'}"))


# --- your own task YAMLs (local data): every output type -----------------------------------------
GEN_DOCS = [{"question": "Tom has 3 apples and buys 2 more. How many?", "answer": "5"},
            {"question": "A box holds 4 pens. How many pens in 2 boxes?", "answer": "8"}]
ROLL_DOCS = [{"page": " = Valkyria Chronicles = \n\n Senjo no Valkyria 3 is a game . \n"},
             {"page": " Once upon a time there was a little girl named Lily . \n"}]


def write_custom_tasks(folder, data):
    """A generate_until task with two regex filters (gsm8k-shaped) and a loglikelihood_rolling
    task (wikitext-shaped), over jsonl files in `data`."""
    folder.mkdir(parents=True, exist_ok=True)
    data.mkdir(parents=True, exist_ok=True)
    for name, docs in (("gen", GEN_DOCS), ("roll", ROLL_DOCS)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "my_gen.yaml").write_text(f"""task: my_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: "{data / 'gen.jsonl'}"}}}}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["\\n\\n", "Question:"], do_sample: false, max_gen_toks: 8}}
metric_list: [{{metric: exact_match, aggregation: mean, higher_is_better: true}}]
filter_list:
  - name: strict-match
    filter: [{{function: regex, regex_pattern: "#### (\\\\d+)"}}, {{function: take_first}}]
  - name: flexible-extract
    filter: [{{function: regex, group_select: -1, regex_pattern: "(\\\\w+)"}},
             {{function: take_first}}]
""")
    (folder / "my_roll.yaml").write_text(f"""task: my_roll
dataset_path: json
dataset_kwargs: {{data_files: {{test: "{data / 'roll.jsonl'}"}}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{page}}}}"
metric_list: [{{metric: word_perplexity}}, {{metric: bits_per_byte}}]
""")
    return folder


def test_summarize_generate_until_filters_and_rolling(stories, tmp_path):
    """lm-eval's output for generate_until (strings, one sample per filter) and
    loglikelihood_rolling (one float) becomes metrics per filter and rows; it used to crash
    (float() of a string / indexing a float) and drop every metric not of the "none" filter."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from harness.lm_eval import KVHarnessLM
    from methods import build_method
    from tasks.lm_eval import summarize
    from tests.conftest import make_engine

    model, tok = stories
    folder = write_custom_tasks(tmp_path / "yaml", tmp_path / "data")
    names = ["my_gen", "my_roll"]
    lm = KVHarnessLM(make_engine(model, build_method("full"), tok))
    out = simple_evaluate(model=lm, tasks=names, log_samples=True, bootstrap_iters=0,
                          task_manager=TaskManager(include_path=str(folder),
                                                   include_defaults=False))
    metrics, rows = summarize(out, names)
    gen = [r for r in rows if r["task"] == "my_gen"]
    assert len(gen) == 4 and {r["filter"] for r in gen} == {"strict-match", "flexible-extract"}
    for filt in ("strict-match", "flexible-extract"):
        mine = [r for r in gen if r["filter"] == filt]
        assert all(isinstance(r["generation"], str) for r in mine)
        assert metrics[f"my_gen/exact_match,{filt}"] == pytest.approx(
            sum(r["prediction"] == r["target"] for r in mine) / 2)
    assert all(r["prediction"] == "[invalid]" for r in gen if r["filter"] == "strict-match")
    roll = [r for r in rows if r["task"] == "my_roll"]
    assert len(roll) == 2 and metrics["my_gen/samples"] == metrics["my_roll/samples"] == 2
    words = sum(len(re.split(r"\s+", d["page"])) for d in ROLL_DOCS)  # lm-eval's count_words
    assert metrics["my_roll/word_perplexity"] == pytest.approx(
        math.exp(-sum(r["loglikelihood"] for r in roll) / words), rel=1e-6)
    assert "acc_mean" not in metrics


def test_runner_runs_your_own_task_yamls(tmp_path, monkeypatch):
    """task.include_path: your own YAMLs over local jsonl (generate_until with filters,
    loglikelihood_rolling) next to an offline task, through the runner, metrics per filter."""
    need_shared(STORIES)
    need_shared(DATA)
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path / "cache"))
    folder = write_custom_tasks(tmp_path / "yaml", tmp_path / "data")
    out = run(cfg_for("task=lm_eval", "model=stories260k", "task.names=[my_gen,my_roll,copa]",
                      f"task.include_path={folder}", "task.limit=2", "task.num_fewshot=0",
                      f"runner.results_root={tmp_path / 'r'}"))
    metrics = json.loads((out / "metrics.json").read_text())
    acc = metrics["accuracy"]
    assert {"my_gen/exact_match,strict-match", "my_gen/exact_match,flexible-extract",
            "my_roll/word_perplexity", "copa/acc"} <= set(acc)
    assert acc["my_gen/samples"] == acc["my_roll/samples"] == acc["copa/samples"] == 2
    assert metrics["protocol"]["include_path"] == [str(folder.resolve())]
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["task"] for r in rows].count("my_gen") == 4  # 2 docs x 2 filters


@pytest.mark.parametrize("setup, message", [
    ("nofolder", "task.include_path={p}/nowhere: no such folder"),
    ("missing_data", "task.include_path: lm-eval could not load task 'my_gen' "
                     "(FileNotFoundError: Unable to find"),
    ("unknown", "task.names: 'other' has no offline copy and is not a task of "
                "task.include_path"),
    ("few_docs", "task.num_fewshot=5 but lm-eval task 'my_gen' has only 2 document(s) to draw "
                 "few-shot examples from"),  # the default 5 shots from a 2-document split
])
def test_include_path_errors_before_weights(setup, message, tmp_path, monkeypatch):
    from harness.core import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    need_shared(STORIES)
    folder = write_custom_tasks(tmp_path / "yaml", tmp_path / "data")
    names = "[other]" if setup == "unknown" else "[my_gen]"
    if setup == "missing_data":
        (tmp_path / "data" / "gen.jsonl").unlink()
    path = tmp_path / "nowhere" if setup == "nofolder" else folder
    with pytest.raises(ConfigError) as err:
        run(cfg_for("task=lm_eval", "model=stories260k", f"task.names={names}",
                    f"task.include_path={path}", f"runner.results_root={tmp_path / 'r'}"))
    assert message.format(p=tmp_path) in str(err.value)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


def test_a_tag_runs_its_tasks(tmp_path, monkeypatch):
    """An lm-eval tag (a set of tasks with no result of its own) is run as its tasks; the run
    used to end in KeyError after the whole evaluation."""
    need_shared(STORIES)
    monkeypatch.setenv("KVH_CACHE_DIR", str(tmp_path / "cache"))
    folder = write_custom_tasks(tmp_path / "yaml", tmp_path / "data")
    for name in ("my_gen", "my_roll"):
        path = folder / f"{name}.yaml"
        path.write_text(path.read_text() + "tag: my_tag\n")
    out = run(cfg_for("task=lm_eval", "model=stories260k", "task.names=[my_tag]",
                      f"task.include_path={folder}", "task.limit=1", "task.num_fewshot=0",
                      f"runner.results_root={tmp_path / 'r'}"))
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["accuracy"]["my_gen/samples"] == metrics["accuracy"]["my_roll/samples"] == 1
    assert metrics["protocol"]["tasks"] == ["my_gen", "my_roll"]


def test_a_bad_line_in_an_include_path_data_file_is_named(tmp_path, no_weight_loading, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    folder = write_custom_tasks(tmp_path / "yaml", tmp_path / "data")
    data = tmp_path / "data" / "gen.jsonl"
    lines = data.read_text().splitlines()
    data.write_text(lines[0] + "\n" + '{"question": "b", "answer": \n' + lines[1] + "\n")
    message = refused(tmp_path, "task=lm_eval", "model=stories260k", "task.names=[my_gen]",
                      f"task.include_path={folder}", "task.num_fewshot=0")
    assert f"{data} line 2: Expecting value" in message
