"""Peer parity with kvpress (`make parity`): the same prompts through our methods and through
kvpress's presses, on the embedded SmolLM2, compared position by position.

    python benchmarks/parity.py ours DIR        # prompts.json + ours.json (the harness side)
    .venv-peer/bin/python scripts/kvpress_peer.py --prompts DIR/prompts.json --out DIR/peer.json
    python benchmarks/parity.py compare DIR     # the table; exit 1 when a row is out of tolerance

The harness side is driven through its own API (an engine request per sample, the method built by
`build_method` as the runner does); the peer side is a standalone script run by the peer venv
(scripts/kvpress_peer.py: kvpress + its pinned transformers, no harness code); the comparer here
reads both JSON files. The cases (method knobs on our side, press and keyword arguments on
kvpress's, the tolerance of each row) are defined once, below, and handed to the peer through
prompts.json.

Protocol: kvpress's query-agnostic one (our `task.query=agnostic`): the RULER context is prefilled
and compressed, then the question and a greedy answer are fed on the compressed cache with the
original positions. kvpress compresses only at prefill. Under our default protocol
(`runner.prefill=dense`) every method compresses the context once, when it ends, as kvpress does;
our prompt compressors (snapkv, pyramidkv, knorm) then append, but our per-step methods
(streaming_llm, tova, keydiff, h2o) go on evicting while the question and answer are fed, so for
the comparison their budget is lifted once the context is compressed (kvpress's protocol), and
the row says so. The context is one forward (as kvpress's prefill, so the sums run in the same
shape), every layer compressed (`runner.dense_layers=[]`, as kvpress), fp32 on the CPU; the budget
basis is the context's length (our default `runner.budget_basis=final`). Budgets: kvpress's `compression_ratio` is the fraction removed, ours
`budget_ratio` the fraction kept; kept ratios 0.5 and 0.25 are exact in binary, so our int(r x T)
and kvpress's int(T x (1 - cr)) keep the same count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

KEPT_RATIOS = (0.5, 0.25)
LIFTED_BUDGET_TOKENS = 1 << 30  # "no more eviction" for a per-step method after the context
TOP_LOGITS = 20  # logits recorded per answer step (the comparer matches ids present on both sides)
SAMPLES = {"subtasks": ["niah_single"], "lengths": [1024, 2048], "depths": [25, 75],
           "max_new_tokens": 12, "query": "agnostic"}  # RULER options (tasks/ruler.py)
# fp32 on one CPU, two transformers versions and two attention call paths: sums in another order.
LOGIT_ABS = 2e-3
SNAP = {"window_tokens": 32, "kernel_tokens": 7}  # ours (SnapKV paper configs); kvpress: 64 / 5
# A top-k cut at a near-tie flips with fp noise (another CPU, another summation order): a
# position may be kept on one side only when, on both sides, its score lies within this margin
# of the score at the cut (the budget-th largest), relative to the head's largest |score|. fp32
# sums of a few thousand terms in another order differ by ~1e-6 relative; 1e-4 leaves room for
# the two transformers versions and attention paths and is still far below a real disagreement
# (a kept position moved far from the cut).
TIE_MARGIN_REL = 1e-4
QFILTERS_FILE = "qfilters.safetensors"  # the filters both sides load (written by the ours step)


@dataclass(frozen=True)
class Case:
    """One method of the suite: our method and knobs, kvpress's press and arguments, a tolerance."""

    name: str  # the row
    method: str  # ours (methods/<method>.py)
    press: str | None  # kvpress's class (None: no press)
    ours: dict = field(default_factory=dict)  # knobs besides the budget
    peer: dict = field(default_factory=dict)  # press kwargs besides compression_ratio
    peer_attn: str = "sdpa"
    # kept sets: "jaccard" (the same sets expected) or "containment" (budgets differ by design:
    # the smaller set must lie in the larger, both being top-k of the same scores)
    kept: str = "jaccard"
    kept_min: float = 1.0  # per (sample, layer, KV head)
    counted: bool = True  # False: the control, or a pair that differs by design (shown, not counted)
    answers: bool = True  # False: kvpress cannot answer here; kept positions only
    note: str = ""


CASES = [
    Case("full (control)", "full", None, counted=False,
         note="no compression on either side: the noise floor of the logits"),
    Case("streaming_llm", "streaming_llm", "StreamingLLMPress",
         ours={"sink_tokens": 4, "rerotate": False}, peer={"n_sink": 4},
         note="4 sinks; keys at text positions (rerotate=false = kvpress without "
              "KeyRerotationPress); ours evicts per step by design: budget lifted after the context"),
    Case("snapkv", "snapkv", "SnapKVPress", ours={**SNAP, "pooling": "avg"},
         peer={"window_size": 32, "kernel_size": 7},
         note="window 32, kernel 7 on both sides (kvpress defaults 64 / 5); avg pooling (kvpress "
              "has no max)"),
    Case("pyramidkv", "pyramidkv", "PyramidKVPress", ours={**SNAP, "pooling": "avg", "beta": 20},
         peer={"window_size": 32, "kernel_size": 7, "beta": 20}, kept="containment", answers=False,
         note="per-layer budgets differ by design: ours = KVCache-Factory's (window + the prefix "
              "schedule), kvpress puts the window inside its schedule so the mean stays "
              "T x (1 - cr), and falls back to SnapKV's uniform budget when its top layer would "
              "keep less than the window (KVCache-Factory has no such fallback: here at 25 %); "
              "means within 5 % (KVCache-Factory's floor divisions) and the same votes, so kept "
              "sets nest. Kept sets only: kvpress cannot "
              "feed a multi-token question over per-layer lengths with sdpa or eager on CPU (the "
              "mask is sized for layer 0; transformers#35168: FA2 only)"),
    Case("tova", "tova", "TOVAPress",
         note="last context query, heads averaged, one set per layer; kvpress always keeps the "
              "last token (official TOVA does not, nor do we); ours evicts per step by design: "
              "budget lifted after the context"),
    Case("keydiff", "keydiff", "KeyDiffPress",
         note="one-shot KeyDiffPress (not BlockPress); ours evicts per step by design: budget "
              "lifted after the context"),
    Case("knorm", "knorm", "KnormPress", note="lowest key L2 norms, no window on either side"),
    Case("expected_attention", "expected_attention", "ExpectedAttentionPress",
         peer={"n_future_positions": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True},
         note="kvpress's defaults on both sides (512 future positions, 4 sinks, covariance, "
              "value norms)"),
    Case("qfilters", "qfilters", "QFilterPress",
         note="the same filters on both sides (ours from the SVD at prepare, saved to "
              f"{QFILTERS_FILE} and loaded by path on both: kvpress would fetch published ones "
              "from the hub); no window; ours evicts per step by design: budget lifted after "
              "the context"),
    Case("kvzip", "kvzip", "KVzipPress",
         ours={"level": "pair", "chunk_tokens": 2048, "system_prompt": "sinks"},
         peer={"layerwise": True, "n_sink": 4, "chunk_size": 2048}, kept="containment",
         note="per-layer budgets split over heads (kvpress layerwise=True); kept counts per "
              "layer differ by rounding (kvpress: H*T - int(H*T*cr), ours H*int(r*T)), so the "
              "sets nest; the "
              "chat template's system prompt treated as kvpress does (system_prompt=sinks; "
              "ours defaults to the official: kept whole)"),
    Case("h2o ~ observed_attention", "h2o", "ObservedAttentionPress", ours={"recent_ratio": 0.0},
         peer_attn="eager", kept="jaccard", kept_min=0.0, counted=False,
         note="differs by design: kvpress divides each token's summed attention by the number of "
              "queries that saw it (T - j), H2O sums it (paper); ours with recent_ratio=0"),
]


def build_samples(tokenizer) -> list[dict]:
    """Fixed RULER needle samples (the harness's own task code), split where the question starts."""
    from tasks import build_task
    from tasks.ruler import PromptFormat, query_start

    task = build_task("ruler", **SAMPLES)
    task.check_data()
    fmt = PromptFormat(tokenizer, task.chat_template)
    out = []
    for s in task.build_samples(tokenizer):
        cut = query_start(s, fmt)
        out.append({"id": s.id, "context_ids": s.input_ids[:cut], "question_ids": s.input_ids[cut:],
                    "max_new_tokens": s.max_new_tokens, "answers": s.answers})
    return out


def case_specs(folder: Path) -> list[dict]:
    """Every (case, kept ratio) as prompts.json hands it to the peer (press name and kwargs)."""
    specs = []
    for case in CASES:
        for ratio in (KEPT_RATIOS if case.press is not None else (1.0,)):
            kwargs, ours = dict(case.peer), dict(case.ours)
            if case.method == "qfilters":  # one filters file for both sides
                kwargs["q_filters_file"] = ours["filters_path"] = str(folder / QFILTERS_FILE)
            if case.press is not None:
                kwargs["compression_ratio"] = 1.0 - ratio
            specs.append({"name": f"{case.name}@{ratio:g}", "row": case.name, "kept_ratio": ratio,
                          "method": case.method, "ours": ours,
                          "peer": {"press": case.press, "kwargs": kwargs, "answers": case.answers,
                                   "attn_implementation": case.peer_attn}})
    return specs


def top_logits(logits, k: int) -> dict:
    values, ids = logits.float().topk(k)
    return {"ids": ids.tolist(), "values": [round(v, 6) for v in values.tolist()]}


def head_sets(positions, num_kv_heads: int) -> list[list[int]]:
    """Sorted text positions per KV head from `kept_positions()`: `(B, H_kv, T)` (ragged heads
    padded with -1), or `(T,)` for a layer that keeps everything."""
    rows = positions[0] if positions.dim() == 3 else positions.expand(num_kv_heads, -1)
    return [sorted(p for p in h if p >= 0) for h in rows.tolist()]  # ragged heads: -1 padding


def near_cut(scores, kept_count: int, margin_rel: float) -> list[list[int]]:
    """Positions whose score lies within `margin_rel` x the head's largest |score| of the score
    at the cut (the `kept_count`-th largest), per KV head; `scores (1, H, T)` indexed by text
    position. Protected positions (+inf) are never near a cut."""
    out = []
    for row in scores[0].float():
        finite = row[row.isfinite()]
        if finite.numel() == 0 or not 0 < kept_count <= row.numel():
            out.append([])
            continue
        cut = row.topk(kept_count).values[-1]
        if not cut.isfinite():
            out.append([])
            continue
        band = margin_rel * float(finite.abs().max())
        out.append(sorted(((row - cut).abs() <= band).nonzero().flatten().tolist()))
    return out


def recording_scores(method, store: dict):
    """Make `method`'s eviction layers record their first cut's guarded scores `(1, H, T)` in
    `store[layer]` (the context's compression: slots are text positions then)."""
    make = type(method).make_layer

    def making(layer_idx, info):
        layer = make(method, layer_idx, info)
        guarded = getattr(layer, "guarded_scores", None)
        if guarded is not None:
            def recording(budget):
                scores = guarded(budget)
                store.setdefault(layer_idx, (scores.detach().clone(), budget))
                return scores
            layer.guarded_scores = recording
        return layer
    method.make_layer = making


def run_sample(engine, method, sample: dict, lift: bool) -> dict:
    """One sample through an engine request: context (compressed at its end), kept positions,
    then question + greedy answer (a per-step method's budget lifted: kvpress's protocol)."""
    from harness.core import batch as batching

    budget = getattr(method, "budget_tokens", None)
    scores: dict = {}
    recording_scores(method, scores)
    try:
        with engine.request() as req:
            req.prefill(sample["context_ids"])
            kept = [head_sets(kv.kept_positions(), engine.info.num_kv_heads)
                    for kv in req.cache.kv_layers]
            ties = [near_cut(*scores.pop(i), TIE_MARGIN_REL) if i in scores else []
                    for i in range(len(kept))]
            if lift:
                method.budget_tokens = LIFTED_BUDGET_TOKENS
            logits = req.prefill(sample["question_ids"], prompt_ends=False)
            stop_ids = engine.stop_token_ids()
            generated, steps = [], []
            while True:
                steps.append(top_logits(logits[0, -1], TOP_LOGITS))
                token = batching.greedy(logits[0, -1], ())
                generated.append(token)
                if token in stop_ids or len(generated) >= sample["max_new_tokens"]:
                    break
                logits = req.step(token)
            final = [kv.kept_tokens() for kv in req.cache.kv_layers]
    finally:
        if lift:
            method.budget_tokens = budget
        del method.make_layer
    return {"id": sample["id"], "kept": kept, "near_cut": ties, "generated": generated,
            "logits": steps,
            "final_kept_tokens": final}


def run_ours(folder: Path) -> None:
    import torch

    import transformers
    from harness.core import hf_adapter
    from harness.core import models
    from harness.core.engine import Engine, EngineSettings
    from methods import build_method

    torch.manual_seed(0)
    spec = models.resolve_model({"name": "smollm2_135m", "device": "cpu", "dtype": "float32"})
    model, tokenizer = models.load_model(spec, "sdpa")
    info = hf_adapter.model_info(model.config)
    samples = build_samples(tokenizer)
    chunk = max(len(s["context_ids"]) + len(s["question_ids"]) for s in samples)
    specs = case_specs(folder)
    save_qfilters(model, tokenizer, info, folder / QFILTERS_FILE)
    prompts = {"model_dir": spec.extra["converted_dir"], "model": spec.description,
               "top_logits": TOP_LOGITS, "samples": samples, "cases": specs,
               "ruler": SAMPLES, "kept_ratios": list(KEPT_RATIOS),
               "tie_margin_rel": TIE_MARGIN_REL}
    write_json(folder / "prompts.json", prompts)
    results, t0 = [], time.perf_counter()
    for c in specs:
        knobs = dict(c["ours"])
        if c["method"] != "full":
            knobs["budget_ratio"] = c["kept_ratio"]
        method = build_method(c["method"], **knobs)
        if method.needs_prepare():
            hf_adapter.prepare(method, model, tokenizer, info, data_dir=models.SHARED_DIR / "data")
        engine = Engine(model, tokenizer, method, info, EngineSettings(prefill_chunk_tokens=chunk))
        lift = c["method"] != "full" and method.capabilities.acts_during_decode
        rows = [run_sample(engine, method, s, lift) for s in samples]
        results.append({"case": c["name"], "samples": rows})
        print(f"ours: {c['name']} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    write_json(folder / "ours.json", {"ours": {"transformers": transformers.__version__,
                                               "torch": torch.__version__}, "results": results})


def save_qfilters(model, tokenizer, info, path: Path) -> None:
    """Q-Filters' filters from its own calibration (the method's defaults), for both sides."""
    from safetensors.torch import save_file

    from harness.core import hf_adapter
    from harness.core import models
    from methods import build_method

    method = build_method("qfilters")
    hf_adapter.prepare(method, model, tokenizer, info, data_dir=models.SHARED_DIR / "data")
    tmp = path.with_suffix(".tmp")
    save_file({"q_filters": method.filters().float().cpu().contiguous()}, str(tmp))
    os.replace(tmp, path)


def write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=["ours", "compare"])
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    if args.step == "ours":
        args.folder.mkdir(parents=True, exist_ok=True)
        run_ours(args.folder)
        return 0
    from parity_compare import compare_folder

    return compare_folder(args.folder, {c.name: c for c in CASES}, LOGIT_ABS)


if __name__ == "__main__":
    sys.exit(main())
