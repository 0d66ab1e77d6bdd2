"""Multi-turn shared context: one request per conversation, the context prefilled once, turns in
order with answers kept in the cache, segments equal to the chat template's own rendering."""

import pytest

from kvcore.errors import ConfigError
from methods import build_method
from methods.model import ModelInfo
from tasks import build_task
from tasks.prompts import NEEDLE, PromptFormat, needle_depth_fractions
from tests.conftest import make_engine


def multiturn(**options):
    return build_task("multiturn", **options)


@pytest.mark.parametrize("model_fixture, options, depth_tolerance", [
    ("stories", dict(turns=2, context_tokens=300), 1.0),  # ~30 words: depth is one of 2 sentences
    ("smollm2", dict(turns=4, context_tokens=1024), 0.06),
    ("smollm2", dict(turns=3, context_tokens=2048, haystack="repeat"), 0.06),
])
def test_context_fills_its_budget_with_every_needle(request, model_fixture, options,
                                                    depth_tolerance):
    _, tok = request.getfixturevalue(model_fixture)
    task = multiturn(samples=2, **options)
    for d in task.dialogues(tok):
        budget = options["context_tokens"]
        slack = 40 if options.get("haystack") == "repeat" else 12  # one noise line / essay word
        assert budget - slack <= len(d.context_ids) <= budget
        assert d.context_ids == d.fmt.encode(d.context_text())
        needles = [NEEDLE.format(key=k, value=v) for k, v in zip(d.keys, d.values)]
        assert all(n in d.context_text() for n in needles)
        for got, want in zip(needle_depth_fractions(d.context, needles), d.depths_percent):
            assert abs(got - want / 100) <= depth_tolerance
        assert len(set(d.keys)) == len(set(d.values)) == options["turns"]


def test_seed_decides_the_conversations(stories):
    _, tok = stories
    a = multiturn(turns=2, context_tokens=300, seed=3).dialogues(tok)
    b = multiturn(turns=2, context_tokens=300, seed=3).dialogues(tok)
    c = multiturn(turns=2, context_tokens=300, seed=4).dialogues(tok)
    assert [d.context_ids for d in a] == [d.context_ids for d in b]
    assert all(x.values != y.values and x.keys != y.keys for x, y in zip(a, c))
    assert a[0].values != a[1].values  # conversations differ from each other


def test_chat_segments_are_the_templates_rendering(smollm2):
    """Context + turn segments + answers, concatenated, equal one rendering of the whole chat."""
    _, tok = smollm2
    (d,) = multiturn(turns=3, context_tokens=256, samples=1).dialogues(tok)
    answers = [": 1234567.", " is 42", ""]
    fed = d.context_text()
    messages = []
    for k in range(3):
        fed += d.turn_text(k, answers)
        q = f"What is the special magic number for {d.keys[k]} mentioned in the provided text?"
        prefix = f"The special magic number for {d.keys[k]} mentioned in the provided text is"
        if k == 0:
            q = ("Some special magic numbers are hidden within the following text. Make sure to "
                 "memorize it. I will quiz you about the numbers afterwards.\n"
                 f"{d.context}\n{q}")
        messages.append({"role": "user", "content": q})
        expected = tok.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=True) + prefix
        assert fed == expected
        if k > 0:  # token level too: the segment opens with the end-of-turn special token
            first = d.fmt.encode(d.turn_text(k, answers), first=False)[0]
            assert first == tok.convert_tokens_to_ids("<|im_end|>")
        fed += answers[k]
        messages.append({"role": "assistant", "content": (prefix + answers[k]).strip()})


def test_plain_segments_continue_the_text(stories):
    _, tok = stories
    (d,) = multiturn(turns=2, context_tokens=300, samples=1).dialogues(tok)
    assert not d.fmt.chat and d.context_ids[0] == tok.bos_token_id
    assert d.context_text().endswith(d.context + "\n")
    assert d.turn_text(0, []).startswith("What is the special magic number for " + d.keys[0])
    second = d.turn_text(1, ["x"])
    assert second.startswith("\nWhat is") and second.endswith("mentioned in the provided text is")
    assert d.fmt.encode(second, first=False)[0] != tok.bos_token_id


def check_run(engine, res, turns, max_new_tokens):
    """One request per conversation, the context prefilled once, answers kept in the cache."""
    rows = res.samples
    assert len(engine.ledger.samples) == len(rows)
    prompts = sum(r["context_tokens"] + sum(t["prompt_tokens"] for t in r["turns"]) for r in rows)
    assert engine.prefill_tokens == prompts  # context once + each question segment once
    for r, ledger in zip(rows, engine.ledger.samples):
        assert [t["turn"] for t in r["turns"]] == list(range(1, turns + 1))
        fed = r["context_tokens"] + sum(t["prompt_tokens"] + t["generated_tokens"] - 1
                                        for t in r["turns"])
        assert r["positions_fed"] == fed == ledger["seen_tokens"]  # every answer stayed
        for t in r["turns"]:
            assert 1 <= t["generated_tokens"] <= max_new_tokens
            assert t["correct"] in (0.0, 1.0)
    m = res.metrics
    assert [f"turn_{k}" for k in range(1, turns + 1)] == [k for k in m if k.startswith("turn_")]
    assert all(0.0 <= m[k] <= 100.0 for k in m if k.startswith("turn_") or k == "accuracy")
    assert m["conversations"] == len(rows)


def test_end_to_end_stories(stories):
    model, tok = stories
    engine = make_engine(model, build_method("full"), tok)
    task = multiturn(turns=2, samples=2, max_new_tokens=4)  # context: what the turns leave
    res = task.evaluate(engine)
    check_run(engine, res, turns=2, max_new_tokens=4)
    assert task.context_tokens == res.protocol["context_tokens"]
    assert task.context_tokens + task.turn_cost_tokens(PromptFormat(tok, "auto")) <= 512
    assert res.protocol["prompt_format"] == "plain" and res.protocol["answers"].startswith("append")


def test_end_to_end_smollm2_later_turns(smollm2):
    """Every turn, the later ones included, answers with a number hidden in the shared context.

    Measured with method=full, 16 new tokens, 2 conversations each: 3 turns at 512 context tokens
    12/12 right (seeds 0, 1), at 1024 6/6 (seed 1), at 2048 2/6 (seed 0); 2 turns at 512 3/4.
    SmolLM2-135M answers with the wrong needle's value at times, so accuracy is not asserted;
    a value from the context in every turn shows the later turns still read the cached context.
    """
    model, tok = smollm2
    engine = make_engine(model, build_method("full"), tok)
    res = multiturn(turns=3, samples=1, context_tokens=512, max_new_tokens=12).evaluate(engine)
    check_run(engine, res, turns=3, max_new_tokens=12)
    (row,) = res.samples
    values = [t["value"] for t in row["turns"]]
    for t in row["turns"]:
        assert any(v in t["prediction"] for v in values), row
    assert res.protocol["prompt_format"] == "chat"


@pytest.mark.parametrize("options, key", [
    ({"answers": "trim"}, "task.answers"),
    ({"turns": 0}, "task.turns"),
    ({"turns": 41}, "task.turns"),
    ({"samples": 0}, "task.samples"),
    ({"context_tokens": 8}, "task.context_tokens"),
    ({"max_new_tokens": 0}, "task.max_new_tokens"),
    ({"haystack": "novels"}, "task.haystack"),
    ({"chat_template": "on"}, "task.chat_template"),
])
def test_bad_options_name_the_key(options, key):
    with pytest.raises(ConfigError, match=key):
        multiturn(**options)


def test_positions_are_checked(stories):
    _, tok = stories
    info = ModelInfo(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, max_positions=512)
    reasons = multiturn(context_tokens=500, turns=4).validate(info, build_method("full"))
    assert reasons and "task.context_tokens=500" in reasons[0]
    with pytest.raises(ConfigError, match="task.turns=4 with task.max_new_tokens=32"):
        multiturn(turns=4).dialogues(tok, 512)  # the default context leaves no room for needles
    with pytest.raises(ConfigError, match="task.context_tokens=100 is too small"):
        multiturn(turns=3, context_tokens=100).dialogues(tok, 512)
