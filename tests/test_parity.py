"""`make parity` pieces that run without the peer venv: the comparer on planted results, the
peer's kept-position recovery, and our side's protocol switch (budget lifted after the context)."""

import importlib.util
import json

import pytest
import torch

from benchmarks import parity, parity_compare
from methods import build_method
from tests.conftest import PROJECT, make_engine

CASES = {c.name: c for c in parity.CASES}


def peer_module():
    spec = importlib.util.spec_from_file_location("kvpress_peer", PROJECT / "scripts" / "kvpress_peer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sample(kept, generated=(5, 2), top=((5, 9.0), (7, 8.0))):
    logits = [{"ids": [i for i, _ in top], "values": [v for _, v in top]} for _ in generated]
    return {"id": "s0", "kept": kept, "generated": list(generated), "logits": logits}


def write(folder, row, ours, peer, press="KnormPress"):
    spec = {"name": f"{row}@0.5", "row": row, "peer": {"press": press}}
    prompts = {"cases": [spec], "samples": [{}], "model": "m", "ruler": {}, "kept_ratios": [0.5]}
    versions = {"kvpress": "x", "transformers": "y", "torch": "z"}
    for name, obj in (("prompts", prompts), ("ours", {"ours": versions, "results": [
            {"case": spec["name"], "samples": [ours]}]}),
            ("peer", {"peer": versions, "results": [{"case": spec["name"], "samples": [peer]}]})):
        (folder / f"{name}.json").write_text(json.dumps(obj))


def test_same_sets_same_answers_within(tmp_path, capsys):
    kept = [[[0, 3, 4], [1, 2, 4]], [[0, 1, 2], [2, 3, 4]]]
    write(tmp_path, "knorm", sample(kept), sample(kept, top=((5, 9.0005), (7, 8.0))))
    assert parity_compare.compare_folder(tmp_path, CASES, 2e-3) == 0
    out = capsys.readouterr().out
    assert "| knorm | jaccard min 1.000" in out and "parity: 1/1 methods within tolerance" in out


def test_a_differing_position_is_named(tmp_path, capsys):
    ours = [[[0, 3, 4], [1, 2, 4]], [[0, 1, 2], [2, 3, 4]]]
    peer = [[[0, 3, 4], [1, 2, 4]], [[0, 1, 2], [1, 3, 4]]]
    write(tmp_path, "knorm", sample(ours), sample(peer))
    assert parity_compare.compare_folder(tmp_path, CASES, 2e-3) == 1
    out = capsys.readouterr().out
    assert ("MISMATCH knorm: knorm@0.5 s0: layer 1 head 1: jaccard 0.500 < 1.0 (kept 3 here, 3 in "
            "kvpress; first differing position 1, kvpress only)") in out
    assert "parity: 0/1 methods within tolerance" in out


def test_logits_and_answers_checked_when_sets_agree(tmp_path, capsys):
    kept = [[[0, 1]]]
    write(tmp_path, "knorm", sample(kept), sample(kept, top=((5, 9.01), (7, 8.0))))
    assert parity_compare.compare_folder(tmp_path, CASES, 2e-3) == 1
    assert "step 0: max |logit diff| 1.00e-02 > 0.002" in capsys.readouterr().out
    write(tmp_path, "knorm", sample(kept), sample(kept, generated=(5, 3)))
    assert parity_compare.compare_folder(tmp_path, CASES, 2e-3) == 1
    assert "answers differ at step 1 (ours [2], kvpress [3])" in capsys.readouterr().out


def test_containment_rows_accept_nested_sets_of_other_sizes(tmp_path, capsys):
    ours, peer = [[[0, 1, 2, 5]]], [[[0, 2, 5]]]
    write(tmp_path, "pyramidkv", sample(ours), sample(peer), press="PyramidKVPress")
    assert parity_compare.compare_folder(tmp_path, CASES, 2e-3) == 0
    assert "kept counts differ by up to 1" in capsys.readouterr().out
    write(tmp_path, "pyramidkv", sample(ours), sample([[[0, 3, 5]]]), press="PyramidKVPress")
    assert parity_compare.compare_folder(tmp_path, CASES, 2e-3) == 1


def test_peer_recovers_gathered_positions():
    keys = torch.randn(1, 2, 9, 4)
    index = torch.tensor([[[7, 1, 4]], [[0, 8, 2]]]).view(1, 2, 3)
    kept = keys.gather(2, index[..., None].expand(1, 2, 3, 4))
    assert peer_module().kept_positions(keys, kept) == [[1, 4, 7], [0, 2, 8]]
    with pytest.raises(RuntimeError, match="none of the keys"):
        peer_module().kept_positions(keys, kept + 1)


def test_peer_recovers_masked_positions():
    """A masking press (KVzipPress): kept = every context position but the masked (head, seq)."""
    from types import SimpleNamespace

    attn = [SimpleNamespace(layer_idx=0, masked_key_indices=(torch.tensor([0, 0, 0]),
                                                             torch.tensor([0, 1, 1]),
                                                             torch.tensor([2, 0, 4])))]
    model = SimpleNamespace(model=SimpleNamespace(layers=[SimpleNamespace(self_attn=a) for a in attn]),
                            config=SimpleNamespace(num_key_value_heads=2))
    assert peer_module().masked_kept(model, 5) == {0: [[0, 1, 3, 4], [1, 2, 3]]}


def test_cases_map_budgets_exactly(tmp_path):
    """kvpress keeps int(T x (1 - cr)), ours int(r x T): the same count at the suite's ratios."""
    for spec in parity.case_specs(tmp_path):
        if spec["peer"]["press"] is None:
            continue
        cr = spec["peer"]["kwargs"]["compression_ratio"]
        assert all(int(t * (1 - cr)) == int(spec["kept_ratio"] * t) for t in range(64, 4096))


def test_per_step_method_lifted_after_the_context(tiny_model):
    """kvpress's protocol on our side: TOVA compresses the context once, then the question and
    the answer append (its budget lifted), and the budget knob is restored afterwards."""
    method = build_method("tova", budget_ratio=0.5)
    engine = make_engine(tiny_model, method, chunk=4096)
    s = {"id": "x", "context_ids": list(range(3, 43)), "question_ids": [50, 51, 52],
         "max_new_tokens": 4}
    out = parity.run_sample(engine, method, s, lift=True)
    assert [len(h) for h in out["kept"][0]] == [20, 20] and len(out["generated"]) == 4
    assert out["final_kept_tokens"] == [26, 26]  # 20 kept + 3 question + 3 fed answer tokens
    assert method.budget_tokens is None


def test_a_tie_flip_at_the_cut_is_noise_a_far_move_is_a_disagreement(tmp_path, capsys):
    """Ties: position 3 kept here, 1 in kvpress, both near the cut on both sides -> within (and
    counted); the same swap with 1 far from kvpress's cut, or a kept position moved far from the
    cut (here: 0 for 4), still fails."""
    ours, peer = [[[0, 3, 4]]], [[[0, 1, 4]]]
    near = [[[1, 3]]]
    write(tmp_path, "knorm", {**sample(ours), "near_cut": near}, {**sample(peer), "near_cut": near})
    assert parity_compare.compare_folder(tmp_path, CASES, 2e-3) == 0
    out = capsys.readouterr().out
    assert "2 tie flip(s) at the cut" in out and "parity: 1/1" in out
    write(tmp_path, "knorm", {**sample(ours), "near_cut": near},
          {**sample(peer), "near_cut": [[[3]]]})
    assert parity_compare.compare_folder(tmp_path, CASES, 2e-3) == 1
    moved = [[[1, 3, 4]]]  # position 0 (far from the cut) moved to 1
    write(tmp_path, "knorm", {**sample(ours), "near_cut": near}, {**sample(moved), "near_cut": near})
    assert parity_compare.compare_folder(tmp_path, CASES, 2e-3) == 1
    assert "first differing position 0, ours only" in capsys.readouterr().out


def test_near_cut_is_the_band_around_the_kth_score_on_both_sides():
    """Our side's and the peer's rule are the same: positions within margin x max|score| of the
    kept_count-th largest score; +inf (protected) never near."""
    scores = torch.tensor([[[5.0, 1.0, 1.00001, float("inf"), 0.99999, 0.5]]])
    for near_cut in (parity.near_cut, peer_module().near_cut):
        assert near_cut(scores, 3, 1e-5) == [[1, 2, 4]]
        assert near_cut(scores, 3, 1e-8) == [[2]]
        assert near_cut(scores, 1, 1e-5) == [[]]


def test_our_side_records_the_scores_at_its_cut(tiny_model):
    """run_sample records, per layer and KV head, the positions near the context's cut; the
    kept sets hold exactly the top budget of those scores."""
    method = build_method("knorm", budget_ratio=0.5)
    engine = make_engine(tiny_model, method, chunk=4096)
    s = {"id": "x", "context_ids": list(range(3, 43)), "question_ids": [50, 51],
         "max_new_tokens": 2}
    out = parity.run_sample(engine, method, s, lift=False)
    assert len(out["near_cut"]) == len(out["kept"]) and all(
        len(layer) == 2 and all(len(head) >= 1 for head in layer) for layer in out["near_cut"])
    assert "make_layer" not in vars(method)
