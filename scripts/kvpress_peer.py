"""The peer side of `make parity`: the same prompts through kvpress (NVIDIA/kvpress, pinned in
scripts/kvpress-peer.lock), run by the peer venv's python. Standalone on purpose: it imports only
kvpress, transformers and torch (plus the standard library), never the harness, so the two sides of
the comparison share no code; the comparer (benchmarks/parity.py) reads both JSON files.

    .venv-peer/bin/python scripts/kvpress_peer.py --prompts DIR/prompts.json --out DIR/peer.json

prompts.json (written by the harness side) holds the model folder, the token ids of every sample
(context, then question) and, per case, the press class name and its keyword arguments. Each sample
goes through kvpress's own pipeline code (`KVPressTextGenerationPipeline._forward`: the context
prefilled under the press, which compresses it in the forward hooks, then the question and a greedy
answer on the compressed cache with the original positions). Recorded per sample: the positions
each layer and KV head kept (read off the press's `compress` call: every kept key is one of the
keys it was given, matched row by row), the positions near each cut (scores within
prompts.json's `tie_margin_rel` of the cut: a top-k there may flip with fp noise), the greedy ids,
and the top logits of each answer step.
A case with `"answers": false` runs the pipeline's prefill step alone (kept positions only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib.metadata import version

import torch
from transformers import DynamicCache


def kept_positions(keys_in: torch.Tensor, keys_out: torch.Tensor) -> list[list[int]]:
    """Positions (indices into `keys_in (1, H, T, D)`) of the rows of `keys_out (1, H, n, D)`,
    per head, sorted. The press gathers rows, so each kept row equals one input row exactly."""
    kept = []
    for h in range(keys_in.shape[1]):
        where = {row.numpy().tobytes(): j for j, row in enumerate(keys_in[0, h].float())}
        rows = [where.get(row.numpy().tobytes()) for row in keys_out[0, h].float()]
        if None in rows:
            raise RuntimeError("a kept key is none of the keys the press was given")
        kept.append(sorted(rows))
    return kept


def near_cut(scores: torch.Tensor, kept_count: int, margin_rel: float) -> list[list[int]]:
    """Positions whose score lies within `margin_rel` x the head's largest |score| of the score
    at the cut (the `kept_count`-th largest), per head of `scores (1, H, T)`: where fp noise may
    flip a top-k (the rule prompts.json's `tie_margin_rel` states; the comparer reads it)."""
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


def top_logits(logits: torch.Tensor, k: int) -> dict:
    values, ids = logits.float().topk(k)
    return {"ids": ids.tolist(), "values": [round(v, 6) for v in values.tolist()]}


def masked_kept(model, context_tokens: int) -> dict[int, list[list[int]]]:
    """Kept positions of a press that masks keys instead of gathering them (KVzipPress: the
    evicted keys' indices in each attention module's `masked_key_indices`)."""
    kept = {}
    for layer in model.model.layers:
        module = layer.self_attn
        heads = model.config.num_key_value_heads
        rows = [set(range(context_tokens)) for _ in range(heads)]
        masked = getattr(module, "masked_key_indices", None)
        if masked is not None:
            for h, t in zip(masked[1].tolist(), masked[2].tolist()):
                rows[h].discard(t)
        kept[module.layer_idx] = [sorted(r) for r in rows]
    return kept


def with_filters(press, path: str):
    """QFilterPress with filters read from a file (the harness side wrote them) instead of the
    hub."""
    from safetensors.torch import load_file

    press.q_filters = load_file(path)["q_filters"]
    press.post_init_from_model = lambda model: None  # the instance attribute: no hub lookup
    return press


def run_sample(pipe, model, press, sample: dict, top_k: int, answers: bool,
               margin_rel: float) -> dict:
    kept: dict[int, list[list[int]]] = {}
    ties: dict[int, list[list[int]]] = {}
    if press is not None:
        compress = type(press).compress

        def recording(module, hidden_states, keys, values, attentions, kwargs):
            k, v = compress(press, module, hidden_states, keys, values, attentions, kwargs)
            kept[module.layer_idx] = kept_positions(keys, k)
            if hasattr(press, "score"):  # a ScorerPress: its top-k cut
                scores = press.score(module, hidden_states, keys, values, attentions, kwargs)
                ties[module.layer_idx] = near_cut(scores, k.shape[2], margin_rel)
            return k, v

        press.compress = recording  # the instance attribute shadows the method for this sample
    steps: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda m, i, out: steps.append(out[0, -1].detach()))
    try:
        context = torch.tensor([sample["context_ids"]])
        question = torch.tensor([sample["question_ids"]])
        if answers:
            pipe._forward({"context_ids": context, "questions_ids": [question]},
                          max_new_tokens=sample["max_new_tokens"], press=press)
        else:  # the pipeline's prefill step alone: the context compressed under the press
            with press(model):
                model.model(input_ids=context, past_key_values=DynamicCache())
    finally:
        hook.remove()
        if press is not None:
            del press.compress
    if press is not None and not kept:  # no compress call: a masking press
        kept = masked_kept(model, len(sample["context_ids"]))
    return {"id": sample["id"], "kept": [kept[i] for i in sorted(kept)],
            "near_cut": [ties.get(i, []) for i in sorted(kept)],
            "generated": [int(s.argmax()) for s in steps],
            "logits": [top_logits(s, top_k) for s in steps]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    spec = json.load(open(args.prompts))

    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()  # weight-loading bars would flood CI's log
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    pipes = {}

    def pipeline_for(attn: str):
        if attn not in pipes:
            model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32,
                                                         attn_implementation=attn).eval()
            pipes[attn] = (kvpress.KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer,
                                                                 device="cpu"), model)
        return pipes[attn]

    results = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for case in spec["cases"]:
            peer = case["peer"]
            pipe, model = pipeline_for(peer.get("attn_implementation", "sdpa"))
            kwargs = dict(peer["kwargs"])
            filters = kwargs.pop("q_filters_file", None)
            press = None if peer["press"] is None else getattr(kvpress, peer["press"])(**kwargs)
            if filters is not None:
                press = with_filters(press, filters)
            answers = peer.get("answers", True)
            samples = [run_sample(pipe, model, press, s, spec["top_logits"], answers,
                                  spec.get("tie_margin_rel", 0.0)) for s in spec["samples"]]
            results.append({"case": case["name"], "samples": samples})
            print(f"peer: {case['name']} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    out = {"peer": {"kvpress": version("kvpress"), "transformers": transformers.__version__,
                    "torch": torch.__version__, "python": sys.version.split()[0]},
           "results": results}
    _write_json(args.out, out)
    return 0


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp"  # then renamed: never a half-written result
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
