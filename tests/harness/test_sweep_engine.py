"""The sweep engine gives every setting what a single run of it gives (harness.sweep.execute):
predictions, scores and KV figures, for every method and both K/V layouts."""

import json
import re

import pytest

from harness.run import run
from harness.sweep.run import run_sweep
from kvcore.errors import ConfigError
from methods import available_methods, build_method, method_class
from tests.conftest import PROJECT, STORIES, need_shared
from tests.helpers.runs import cfg_for
from tests.helpers.sweeps import (TASK, assert_close, assert_equal_to_single_runs, folder_figures,
                                  sharded_folders, single_runs, sweep_folders)

PROMPT_TOKENS = 300  # RULER length 320 on stories260K: a niah prompt of about this many tokens


@pytest.fixture(autouse=True)
def cpu_dispatch(monkeypatch):
    """Kernels dispatch as in a CPU run of the CLI (tests/conftest.py sets TRITON_INTERPRET=1,
    which sends KIVI's decode through Triton's interpreter: seconds per step)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def knob_settings(name: str) -> list[list[str]]:
    """Two settings of the method: compressing at two budgets where it has a budget knob, else
    its compressing knobs twice (identical settings share a prefill too)."""
    cls = method_class(name)
    knobs = cls.compressing_hyperparameters(PROMPT_TOKENS)
    first = [f"method.{k}={v}" for k, v in knobs.items()]
    if "budget_tokens" in knobs:  # its other knobs kept (e.g. layers the model has)
        second = [f"method.{k}={v * 2 if k == 'budget_tokens' else v}" for k, v in knobs.items()]
    elif "budget_ratio" in knobs:
        second = ["method.budget_ratio=0.5"]
    else:
        second = first
    return [first, second]


# Paired fidelity over the full cache's first tokens in every run: the per-token KL to the full
# cache compares each step's whole distribution, so a sweep that changes a setting's logits
# without changing its greedy answer (8 tokens of a tiny model) still differs.
FIDELITY = ["task.fidelity_tokens=4"]


@pytest.fixture(scope="module")
def full_alone(tmp_path_factory):
    """The full cache's single run per layout, made once for every method's sweep."""
    made = {}

    def get(layout: str):
        if layout not in made:
            settings = [[*TASK, *FIDELITY, f"runner.kv_layout={layout}", "method=full"]]
            made[layout] = (settings[0], single_runs(settings, tmp_path_factory.mktemp(layout))[0])
        return made[layout]
    return get


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("name", available_methods())
def test_sweep_equals_single_runs(name, layout, tmp_path, full_alone):
    """Each method's two settings swept with the full cache equal their single runs. The
    settings' prefills are one recorded dense forward, replayed into each method's layers
    (harness.sweep.replay) unless its layers attend otherwise (the reason is then recorded)."""
    need_shared(STORIES)
    runner = [f"runner.kv_layout={layout}"]
    settings = [[*TASK, *FIDELITY, *runner, f"method={name}", *knobs]
                for knobs in knob_settings(name)]
    swept = assert_equal_to_single_runs(settings, tmp_path, given=[full_alone(layout)])
    for folder in swept[:len(settings)]:
        sweep = json.loads((folder / "metrics.json").read_text())["run"]["sweep"]
        own_pass = sweep["prompts_prefilled_once"] == 0
        assert sweep["prefill_shared_with"] == 2 or sweep["prefill_replay_refused"] or own_pass, \
            sweep  # one forward for the three settings, or refused by name, or its own pass
        # a state that cannot be copied is replayed into each setting's own request (the full
        # cache's settings are one prefill group with the reference: no forward to replay)
        assert (sweep["prefill_replayed"] or sweep["prefill_replay_refused"] or own_pass
                or name == "full"), sweep
        # the recording it replays is the one its declaration names (Capabilities.
        # eager_prompt_attention): declared wrongly, each prompt's first replay is wasted
        declared = build_method(name).capabilities.eager_prompt_attention  # (a scorer's too)
        assert not sweep["prefill_replayed"] or sweep["prefill_replayed_eager"] == declared, sweep
        assert not (declared and sweep["prefill_replay_refused"]), sweep


def test_settings_of_several_methods_in_one_sweep(tmp_path, capsys):
    """Prefill groups side by side: two budgets of SnapKV share one prompt state, H2O and the
    full cache have their own; all three replay one recorded forward of each prompt (H2O its
    eager recording, as it attends with probabilities); each equals its single run."""
    need_shared(STORIES)
    settings = [[*TASK, "method=snapkv", "method.budget_tokens=24"],
                [*TASK, "method=h2o", "method.budget_tokens=24"],
                [*TASK, "method=snapkv", "method.budget_tokens=48"], [*TASK, "method=full"]]
    swept = assert_equal_to_single_runs(settings, tmp_path)
    shared = [json.loads((f / "metrics.json").read_text())["run"]["sweep"] for f in swept]
    assert [s["prefill_shared_with"] for s in shared] == [3, 3, 3, 3]
    assert all(s["prefill_replayed"] and s["prompts_prefilled_once"] == 2 for s in shared)
    out = capsys.readouterr().out
    assert re.search(r"shared prefill   snapkv\(.*budget_tokens=24\), snapkv\(.*48\)", out), out
    assert re.search(r"replayed +h2o", out) and re.search(r"replayed +full", out), out
    assert ("one forward      2 prompt(s) recorded once (and 2 with eager attention, for 1 "
            "setting(s)), replayed into 3 group(s) (4 settings)") in out, out


EAGER = ["h2o", "scissorhands", "kvmerger"]  # each scores a held prompt by its probabilities


def test_groups_replaying_the_eager_recording_compute_each_layers_probabilities_once(
        tmp_path, monkeypatch):
    """Settings whose layers attend a held prompt with probabilities (`eager_prompt_attention`)
    replay the prompt's eager recording together, layer by layer, as it is recorded: each
    layer's probabilities are computed once, by the recording, for all of them
    (methods.scoring.shared_attention), not once per group; and each setting equals its single
    run (its probabilities are the ones it would compute)."""
    from methods import scoring

    need_shared(STORIES)
    settings = [[*TASK, f"method={name}", *knob_settings(name)[0]] for name in EAGER]
    assert all(method_class(n).capabilities.eager_prompt_attention for n in EAGER)
    alone = single_runs(settings, tmp_path)
    prompt_calls, compute = [], scoring._attention_with_probs

    def counted(query, *args):
        if query.shape[2] > 1:  # a prompt's forward, not a decode step
            prompt_calls.append(query.shape[2])
        return compute(query, *args)
    monkeypatch.setattr(scoring, "_attention_with_probs", counted)
    swept = sweep_folders(settings, tmp_path)
    for a, b in zip(alone, swept):
        assert folder_figures(b) == folder_figures(a)
    prompts, layers = 2, 5  # two needle depths; stories260K's layers
    assert len(prompt_calls) == prompts * layers, prompt_calls  # the recording's, shared


# a method for each way a layer is called while a prompt is fed: the model's attention or
# eager probabilities, window queries, token ids, lookahead, the attention block, head-wise
# rows, quantized and selected K/V
REPLAYED = ["full", "h2o", "snapkv", "fastgen", "kvzip", "infinigen", "squeezeattention",
            "duo_attention", "kivi", "quest", "streaming_llm"]


@pytest.mark.parametrize("dense", ["[]", "[0]"])
def test_one_forward_replayed_chunk_by_chunk_equals_single_runs(dense, tmp_path):
    """Prompts fed in chunks of 128 tokens (three per prompt): each method's layers are called
    chunk by chunk in the replay as in its own forward; every setting replays, and equals its
    single run. With a dense layer (the full cache's, attending with the model's attention),
    the methods attending with probabilities replay the eager recording, whose dense layers
    attend as the model does."""
    need_shared(STORIES)
    settings = [[*TASK, "runner.prefill_chunk_tokens=128", f"runner.dense_layers={dense}",
                 f"method={name}", *knob_settings(name)[0]] for name in REPLAYED]
    swept = assert_equal_to_single_runs(settings, tmp_path)
    shared = [json.loads((f / "metrics.json").read_text())["run"]["sweep"] for f in swept]
    # InfiniGen (a host-tier store) and SqueezeAttention hold state that cannot be copied: they
    # replay the forward into their own requests
    assert all(s["prefill_replayed"] and not s["prefill_replay_refused"]
               and s["prefill_shared_with"] == len(REPLAYED) - 1 for s in shared), shared


@pytest.mark.parametrize("order", ["evicting first", "keeping all first"])
def test_prompt_scores_made_once_for_a_group_equal_each_settings_own(order, tmp_path, capsys):
    """KVzip's reconstruction scores depend on no budget: a prefill group scores each prompt
    once (`KVLayer.score_prompt`) and hands them over with the prompt state. A setting whose
    budget holds the whole sequence reconstructs nothing alone, so it drops what a smaller
    budget of its group scored (its figures, the reconstruction's among them, are its own);
    one that must evict scores for itself when its group's first setting did not."""
    need_shared(STORIES)
    evicting = [*TASK, "method=kvzip", "method.budget_tokens=48"]
    keeping = [*TASK, "method=kvzip", "method.budget_tokens=4096"]
    settings = [evicting, keeping] if order == "evicting first" else [keeping, evicting]
    swept = assert_equal_to_single_runs(settings, tmp_path)
    facts = [json.loads((f / "metrics.json").read_text())["kv"]["method_facts"] for f in swept]
    by_budget = dict(zip(("evicting", "keeping") if order == "evicting first"
                         else ("keeping", "evicting"), facts))
    assert by_budget["evicting"].get("reconstruction_tokens", 0) > 0, facts
    assert not (by_budget["keeping"] or {}).get("reconstruction_tokens"), facts
    assert "shared prefill   kvzip" in capsys.readouterr().out


def test_settings_equal_in_prepare_knobs_are_prepared_once(tmp_path, monkeypatch):
    """Q-Filters' SVD of calibration queries reads no budget (`prepare_knobs`): two budgets
    of a sweep are prepared once, and each equals its single run; another calibration length
    is prepared again."""
    from methods.qfilters import QFilters

    need_shared(STORIES)
    calls, original = [], QFilters.prepare

    def counted(self, ctx):
        calls.append(self.calibration_tokens)
        return original(self, ctx)
    monkeypatch.setattr(QFilters, "prepare", counted)
    settings = [[*TASK, "method=qfilters", "method.budget_tokens=24"],
                [*TASK, "method=qfilters", "method.budget_tokens=48"],
                [*TASK, "method=qfilters", "method.budget_tokens=48",
                 "method.calibration_tokens=1024"]]
    assert_equal_to_single_runs(settings, tmp_path)
    assert calls == [2048, 2048, 1024] + [2048, 1024], calls  # the single runs, the sweep


def test_a_method_attending_otherwise_over_a_held_prompt_prefills_itself(tmp_path, monkeypatch,
                                                                         capsys):
    """A method whose layers change attention while the prompt is held (planted: Knorm's output
    scaled) would compute other hidden states than the recording: its replay is refused at the
    first layer, by name, it prefills itself from then on, and still equals its single run;
    the full cache goes on replaying."""
    from methods.knorm import KnormLayer

    need_shared(STORIES)
    attend = KnormLayer.attend

    def scaled(self, *args, **kwargs):
        out, weights = attend(self, *args, **kwargs)
        return (out * 1.001 if self.holding_prompt() else out), weights

    monkeypatch.setattr(KnormLayer, "attend", scaled)
    settings = [[*TASK, "method=knorm", "method.budget_tokens=24"], [*TASK, "method=full"]]
    swept = assert_equal_to_single_runs(settings, tmp_path)
    knorm, full = [json.loads((f / "metrics.json").read_text())["run"]["sweep"] for f in swept]
    assert not knorm["prefill_replayed"] and knorm["prefill_replay_refused"].startswith("layer 0")
    assert full["prefill_replayed"] and full["prompts_prefilled_once"] == 2
    assert "not replayed   layer 0" in capsys.readouterr().out


def test_a_prompt_state_mutated_by_one_setting_is_caught(tmp_path):
    """The planted bug: every setting continues from the one shared prompt state (no copy), so
    the first setting's compression and decode change what the next one starts from: the
    comparison above fails (a wrong answer, or a state that no longer fits the next layer)."""
    need_shared(STORIES)
    settings = [[*TASK, "method=h2o", f"method.budget_tokens={b}"] for b in (24, 48)]
    alone = [folder_figures(f) for f in single_runs(settings, tmp_path)]
    try:
        planted = [folder_figures(f) for f in sweep_folders(settings, tmp_path, False)]
    except RuntimeError:  # the shared K/V rows already compressed by the first setting
        planted = None
    assert planted != alone
    right = sweep_folders(settings, tmp_path / "right")
    assert [folder_figures(f) for f in right] == alone


def test_batched_settings_equal_their_single_runs_and_batch_one(tmp_path):
    """runner.batch_size>1: each such setting runs its own task pass (harness.core.batch); the batch
    size is a memory knob and changes no prediction or score."""
    need_shared(STORIES)
    settings = [[*TASK, "method=snapkv", f"method.budget_tokens={b}", f"runner.batch_size={n}"]
                for n in (2, 1) for b in (24, 48)]
    alone = [folder_figures(f)[1] for f in single_runs(settings[:2], tmp_path)]
    swept = [folder_figures(f)[1] for f in sweep_folders(settings, tmp_path)]
    assert swept[:2] == alone
    assert swept[2:] == swept[:2]


def test_a_killed_sweep_resumes_from_its_records(tmp_path, monkeypatch, capsys):
    """Killed after three (setting, sample) answers: the next start reuses those three (their
    accounting included) and computes the rest; every setting equals its single run."""
    from harness.sweep import records as sweep_records

    need_shared(STORIES)
    settings = [[*TASK, "method=tova", f"method.budget_tokens={b}"] for b in (24, 48)]
    alone = [folder_figures(f) for f in single_runs(settings, tmp_path)]
    append, written = sweep_records.Records.append, []

    def killed_after_three(self, *args, **kwargs):
        if len(written) == 3:
            raise KeyboardInterrupt
        written.append(args)
        append(self, *args, **kwargs)

    monkeypatch.setattr(sweep_records.Records, "append", killed_after_three)
    with pytest.raises(KeyboardInterrupt):
        sweep_folders(settings, tmp_path)
    assert not list((tmp_path / "sweep" / "ruler").rglob("metrics.json"))  # nothing half-written
    monkeypatch.setattr(sweep_records.Records, "append", append)
    resumed = sweep_folders(settings, tmp_path)
    assert "resuming, 3 (setting, sample) answers recorded before" in capsys.readouterr().out
    assert [folder_figures(f) for f in resumed] == alone
    assert not list((tmp_path / "sweep" / sweep_records.FOLDER).iterdir())  # done: removed


def test_a_resumed_sweep_takes_recorded_fidelity_instead_of_making_it_again(tmp_path,
                                                                           monkeypatch):
    """Killed once the first prompt's fidelity records are written (both settings'): the next
    start neither teacher-forces that prompt again nor computes its full-cache reference, and
    every setting still equals its single run, fidelity included."""
    from harness.core import fidelity
    from harness.sweep import records as sweep_records

    need_shared(STORIES)
    settings = [[*TASK, *FIDELITY, "method=tova", f"method.budget_tokens={b}"] for b in (24, 48)]
    alone = [folder_figures(f) for f in single_runs(settings, tmp_path)]
    append, written = sweep_records.Records.append_fidelity, []

    def killed_after_one_prompt(self, *args):
        if len(written) == len(settings):
            raise KeyboardInterrupt
        written.append(args)
        append(self, *args)

    monkeypatch.setattr(sweep_records.Records, "append_fidelity", killed_after_one_prompt)
    with pytest.raises(KeyboardInterrupt):
        sweep_folders(settings, tmp_path)
    monkeypatch.setattr(sweep_records.Records, "append_fidelity", append)
    references, made = [], fidelity.reference
    monkeypatch.setattr(fidelity, "reference",
                        lambda *a, **kw: references.append(1) or made(*a, **kw))
    resumed = sweep_folders(settings, tmp_path)
    assert len(references) == 1  # the second prompt's only
    assert [folder_figures(f) for f in resumed] == alone


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("name", ["snapkv", "h2o", "tova"])
def test_a_handed_over_prompt_state_decodes_to_the_same_logits(tiny_model, name, layout):
    """A prompt fed by one engine, its state restored in another engine's request (another
    budget), compressed and decoded there: every step's logits equal the receiving engine's own
    prefill's (fp32, same arithmetic: exactly)."""
    import dataclasses

    import torch

    from harness.core import hf_adapter
    from harness.core.engine import Engine, EngineSettings
    from methods import build_method

    info = hf_adapter.model_info(tiny_model.config)
    settings = dataclasses.replace(EngineSettings(prefill_chunk_tokens=64), kv_layout=layout)
    feeder = Engine(tiny_model, None, build_method(name, budget_tokens=12), info, settings)
    target = Engine(tiny_model, None, build_method(name, budget_tokens=20), info, settings)
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(1)).tolist()

    def decode(req, logits):
        out = [logits]
        for _ in range(6):
            out.append(req.step(int(out[-1][0, -1].argmax())))
        return torch.cat(out, dim=1)

    with target.request() as req:
        expected = decode(req, req.prefill(prompt))
    with feeder.request(account=False) as req:
        logits = req.feed_prompt(prompt)
        snapshot = req.snapshot()
    with target.request() as req:
        req.restore(snapshot)
        req.close_prompt()
        got = decode(req, logits.clone())
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert target.ledger.samples[0] == target.ledger.samples[1]  # what each request held


SHARDED = [*TASK[:4], "task.depths=[10,30,50,70,90]", *TASK[5:]]  # 5 samples: uneven halves
SHARD_SETTINGS = [[*SHARDED, "method=snapkv", "method.budget_tokens=24"],
                  [*SHARDED, "method=h2o", "method.budget_tokens=24"],
                  [*SHARDED, "method=snapkv", "method.budget_tokens=48"]]


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory):
    """The unsharded sweep of SHARD_SETTINGS (one per module: two tests compare with it)."""
    need_shared(STORIES)
    return sweep_folders(SHARD_SETTINGS, tmp_path_factory.mktemp("unsharded"))


def test_merged_shards_equal_the_unsharded_sweep(tmp_path, unsharded):
    """Two shards, each answering its samples for every setting, merged: every setting's
    predictions, scores and metrics (accuracy, KV figures) are the unsharded sweep's."""
    from harness.sweep.records import FOLDER

    whole = unsharded
    merged = sharded_folders(SHARD_SETTINGS, tmp_path / "sharded")
    for a, b in zip(whole, merged):
        (ma, sa), (mb, sb) = folder_figures(a), folder_figures(b)
        assert len(sb) == 5 and sb == sa
        assert mb == ma
        sweep = json.loads((b / "metrics.json").read_text())["run"]["sweep"]
        # every prompt's forward recorded once by the shard answering it, replayed into each
        assert sweep["shards"] == 2 and sweep["prompts_prefilled_once"] == 5
        assert sweep["prefill_replayed"] and sweep["prefill_shared_with"] == 2
    assert not list((tmp_path / "sharded" / FOLDER).iterdir())  # merged: records removed


@pytest.mark.parametrize("planted", ["dropped", "duplicated"])
def test_a_split_that_drops_or_duplicates_a_sample_fails_the_merge(planted, tmp_path,
                                                                    monkeypatch):
    """The planted bug: the split gives sample 0 to no shard, or to both; the merge stops with
    one line (never a result short of a sample, or counting one twice)."""
    from harness.sweep import shards as sweep_shards

    need_shared(STORIES)
    split = sweep_shards.owner
    monkeypatch.setattr(sweep_shards, "owner", lambda prompt, prompts, count: (
        split(prompt, prompts, count) if prompt else -1))
    if planted == "duplicated":
        owns = sweep_shards.Shard.owns
        monkeypatch.setattr(sweep_shards.Shard, "owns", lambda self, prompt, prompts: (
            prompt == 0 or owns(self, prompt, prompts)))
    # a sample recorded twice refuses the setting's merge before weights (a failed member, one
    # line); a sample recorded by none stops the merge where it is missed
    with pytest.raises((ConfigError, AssertionError), match="no record for|recorded by two shards"):
        sharded_folders(SHARD_SETTINGS[:1], tmp_path)
    assert not list(tmp_path.rglob("metrics.json"))


def test_a_setting_that_cannot_be_sharded_is_refused_by_name(tmp_path):
    need_shared(STORIES)
    from harness.sweep.shards import Shard

    cfgs = [cfg_for(*SHARD_SETTINGS[0], "runner.batch_size=2", "runner.shards=2",
                    f"runner.results_root={tmp_path}"),
            cfg_for("model=stories260k", "method=h2o", "runner.shards=2",
                    f"runner.results_root={tmp_path}")]  # perplexity: one stream
    batched, = run_sweep(cfgs[:1], shard=Shard(0, 2))
    assert batched.status == "failed" and "runner.shards=2 with runner.batch_size=2" in \
        batched.detail
    stream, = run_sweep(cfgs[1:], shard=Shard(0, 2))
    assert stream.status == "failed" and "task=perplexity feeds its samples" in stream.detail
    with pytest.raises(ConfigError, match=r"runner.shards=2 splits the samples of a multirun"):
        run(cfgs[1])  # a single run is one process


def test_a_sharded_multirun_runs_its_shards_as_local_processes(tmp_path, unsharded):
    """`python -m harness -m ... runner.shards=2` without SLURM: two shard processes, then the
    merge; each member's folder equals the unsharded sweep's."""
    import os
    import subprocess
    import sys

    members = ["method=snapkv,h2o", "method.budget_tokens=24"]  # SHARD_SETTINGS[:2]
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "-m", *SHARDED, *members, "runner.shards=2",
         f"runner.results_root={tmp_path}/cli", f"hydra.sweep.dir={tmp_path}/cli/_sweeps/s"],
        cwd=PROJECT, env={**os.environ, "PYTHONPATH": str(PROJECT)}, capture_output=True,
        text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = sorted((tmp_path / "cli/_sweeps/s/shards").rglob("shard-*.log"))
    assert len(logs) == 2 and all("one forward" in log.read_text() for log in logs)
    assert "merging the records of 2 shards (10 (setting, sample) answers)" in proc.stdout
    summary = json.loads((tmp_path / "cli/_sweeps/s/summary.json").read_text())
    folders = [m["detail"] for m in summary["members"]]
    assert len(folders) == 2
    for a, b in zip(unsharded[:2], folders):
        assert folder_figures(PROJECT / b) == folder_figures(a)


def test_a_sample_that_fits_the_budget_takes_the_full_caches_answer(tmp_path, monkeypatch):
    """Budgets above every sequence (prompt + new tokens): H2O and SnapKV equal the full cache
    by their rule, so each sample is answered once for them (the second takes the first's
    answer) and counted in identical_to_full; the answers are what each computes alone. A
    budget below the prompt is never counted; the full cache and quantizers have no rule."""
    from harness.core.engine import Request

    need_shared(STORIES)
    settings = [[*TASK, "method=full"], [*TASK, "method=h2o", "method.budget_tokens=400"],
                [*TASK, "method=snapkv", "method.budget_tokens=800"],
                [*TASK, "method=h2o", "method.budget_tokens=24"], [*TASK, "method=kivi"]]
    alone = [folder_figures(f) for f in single_runs(settings, tmp_path)]
    answered, real = [], Request.answer  # every decode, shared prefill or not, ends here
    monkeypatch.setattr(Request, "answer", lambda self, *a, **k: (
        answered.append(self.engine.method.name) or real(self, *a, **k)))
    swept = sweep_folders(settings, tmp_path)
    assert sorted(answered) == sorted(["full", "h2o", "h2o", "kivi"] * 2)  # snapkv: reused
    counts = [json.loads((f / "metrics.json").read_text())["run"]["sweep"]["identical_to_full"]
              for f in swept]
    assert counts == [None, 2, 2, 0, None]
    for (ma, sa), (mb, sb) in zip(alone, map(folder_figures, swept)):
        assert sb == sa and mb["accuracy"] == ma["accuracy"]
    # Shown in the report's leaderboard and per-run table, never folded into a score.
    from harness.report.collect import collect, markdown
    from harness.report.leaderboard import IDENTICAL, build

    rows = collect([str(swept[0].parents[2])])
    board = {(e["method"], (e["setting"].split() or [""])[-1]): e[IDENTICAL] for e in build(rows)}
    assert board == {("full", ""): None, ("h2o", "budget_tokens=400"): 2,
                     ("snapkv", "budget_tokens=800"): 2, ("h2o", "budget_tokens=24"): 0,
                     ("kivi", "v_bits=2"): None}
    assert "identical_to_full" in markdown(rows).splitlines()[0]


@pytest.mark.parametrize("name, knobs, budget", [
    ("h2o", {"budget_tokens": 400}, 400), ("snapkv", {"budget_tokens": 64}, 64),
    ("h2o", {"budget_ratio": 0.5}, None),  # a share of the sequence: never all of it
    ("h2o", {"budget_tokens": 400, "recent_ratio": 0.3}, None),  # off the checked configuration
    ("streaming_llm", {"budget_tokens": 50}, None),  # its window is not what bounds it then
    ("kivi", {}, None), ("full", {}, None)])
def test_the_rule_budget_is_the_configuration_the_contract_checks(name, knobs, budget):
    from harness.sweep.plan import rule_budget
    from methods import build_method

    assert rule_budget(build_method(name, **knobs)) == budget


# One method per mechanism a batched decode step must keep apart per row: scored eviction,
# head-wise ragged budgets, selection from the host tier with lookahead prefetch, quantized
# storage, token-id policies, attention-block hooks (decodes alone), model hooks (own pass),
# the reference. (Every method batched with itself: tests/methods/contract/test_contract.py.)
MIXED = {"contiguous": ["full", "h2o", "adakv", "infinigen", "kivi", "fastgen",
                        "squeezeattention", "duo_attention", "quest"],
         "paged": ["full", "h2o", "adakv", "quest", "snapkv"]}


@pytest.mark.parametrize("layout, sizes", [("contiguous", (3, 0)), ("paged", (0,))])
def test_settings_decoded_together_equal_decode_batch_one(layout, sizes, tmp_path):
    """runner.sweep_decode_batch: settings of different methods in one sweep, decoded together
    (rows of one batched forward, each its own method and cache), 3 at a time (the last batch
    partial) and all at once (0 here): each equals the same sweep decoding one setting at a
    time, which equals each setting's single run (test_sweep_equals_single_runs) — the batch
    is a memory knob. Settings that cannot share a forward decode alone."""
    need_shared(STORIES)
    names = MIXED[layout]
    settings = [[*TASK, f"runner.kv_layout={layout}", f"method={name}",
                 *knob_settings(name)[0]] for name in names]
    figures = [folder_figures(f) for f in sweep_folders(settings, tmp_path / "one")]
    for size in (n or len(settings) for n in sizes):
        swept = sweep_folders([[*s, f"runner.sweep_decode_batch={size}"] for s in settings],
                              tmp_path / f"batch{size}")
        for name, want, got in zip(names, figures, swept):
            assert folder_figures(got) == want, name
        batches = [json.loads((f / "metrics.json").read_text())["run"]["sweep"]["decode_batch"]
                   for f in swept]
        assert max(batches) == size and min(batches) >= 1


def test_a_decode_batch_outside_a_multirun_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="runner.sweep_decode_batch=4 decodes the settings of "
                                          "a multirun together"):
        run(cfg_for(*TASK, "method=full", "runner.sweep_decode_batch=4",
                    f"runner.output_dir={tmp_path}/one"))
    with pytest.raises(ConfigError, match=r"runner.sweep_decode_batch=0 must be a positive"):
        run(cfg_for(*TASK, "method=full", "runner.sweep_decode_batch=0",
                    f"runner.output_dir={tmp_path}/two"))


STREAM = ["model=stories260k", "task=perplexity", "task.dataset=essays", "task.max_tokens=160",
          "runner.threads=1"]
STREAMED = [["method=full"], ["method=h2o", "method.budget_tokens=40"],
            ["method=streaming_llm", "method.sink_tokens=4", "method.window_tokens=32"],
            ["method=quest", "method.budget_tokens=64"], ["method=kivi"]]


@pytest.mark.parametrize("prompt", [None, 48])
def test_settings_streamed_together_equal_their_single_runs(prompt, tmp_path):
    """Streaming perplexity in a sweep: the text is teacher-forced through every setting, 2 at
    a time in lockstep (one batched forward per token, the last batch partial), each row its
    own method and cache. Every setting's figures equal its single run's: KV, transfer and step
    counts exactly; each token's NLL, the perplexity and its interval within the reassociation
    of the batched matmuls (1e-4 relative; a wrong token, position or cache is off by far more)."""
    need_shared(STORIES)
    task = [*STREAM, *([f"task.prefill_tokens={prompt}"] if prompt else [])]
    extra = [["method=snapkv", "method.budget_tokens=24"]] if prompt else []
    settings = [[*task, *knobs] for knobs in [*STREAMED, *extra]]
    alone = single_runs(settings, tmp_path)
    swept = sweep_folders([[*s, "runner.sweep_decode_batch=2"] for s in settings], tmp_path)
    for knobs, a, b in zip(settings, alone, swept):
        (ma, sa), (mb, sb) = folder_figures(a), folder_figures(b)
        assert_close(sb, sa, 1e-4, knobs[-1])
        assert_close(mb, ma, 1e-4, knobs[-1])
        assert mb["kv"] == ma["kv"] and mb["speed"] == ma["speed"]
        sweep = json.loads((b / "metrics.json").read_text())["run"]["sweep"]
        assert sweep["decode_batch"] == 2, (knobs, sweep)


LIVE = {"multiturn": ["model=stories260k", "task=multiturn", "task.turns=2", "task.samples=2",
                      "task.context_tokens=192", "task.max_new_tokens=4", "runner.threads=1"],
        "perplexity": [*STREAM, "task.mode=chunked", "task.window_tokens=64",
                       "runner.prefill=chunked", "runner.prefill_chunk_tokens=16"]}
# a compressing method that acts on each task's tokens (chunked windows are prompts only)
LIVE_METHOD = {"multiturn": ["method=snapkv", "method.budget_tokens=48"],
               "perplexity": ["method=streaming_llm", "method.sink_tokens=4",
                              "method.window_tokens=24"]}


@pytest.mark.parametrize("task", sorted(LIVE))
def test_a_task_needing_a_live_engine_runs_per_setting_and_equals_single_runs(task, tmp_path,
                                                                             capsys):
    """Multi-turn's conversations and chunked perplexity's windows are requests of their own
    (`Task.needs_live_engine`): each setting is evaluated by its own task pass over its own
    engine, which the sweep prints and records (`run.sweep.own_task_pass`), and each equals its
    single run."""
    need_shared(STORIES)
    settings = [[*LIVE[task], "method=full"], [*LIVE[task], *LIVE_METHOD[task]]]
    swept = assert_equal_to_single_runs(settings, tmp_path)
    for folder in swept:
        sweep = json.loads((folder / "metrics.json").read_text())["run"]["sweep"]
        assert "Task.needs_live_engine" in sweep["own_task_pass"], sweep
        assert sweep["prefill_shared_with"] == 0 and sweep["prompts_prefilled_once"] == 0
    out = capsys.readouterr().out
    assert re.search(r"own task pass +full.*: task=\w+ asks its engine for requests", out), out
    assert re.search(r"own task pass +(snapkv|streaming_llm).*: task=\w+ asks its engine",
                     out), out
