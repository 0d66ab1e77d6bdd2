"""Results trees for the report, check and plan tests: runs' metrics.json (and samples) written
by hand, so that every figure is known."""

import json
from pathlib import Path

import numpy as np


def fake_run(root: Path, method: str, ppl: float, tok_s: float, budget=None, started="2026-11-29T10:00:00",
             task="perplexity", extra_acc=None, density=None, dense_layers=(), batch=1) -> Path:
    folder = (root / task / "stories260k" / method
              / f"{method}-{budget}-{started[11:13]}-{len(dense_layers)}-{batch}")
    folder.mkdir(parents=True)
    hyper = {} if budget is None else {"budget_ratio": budget}
    metrics = {
        "schema_version": 1,
        "accuracy": {"ppl": ppl, "nll_per_block": [4.0, 3.9, 3.8], "block_tokens": 100,
                     **(extra_acc or {})},
        "speed": {"decode_tokens_per_s": tok_s, "decode_ms_per_token_median": 1000 / tok_s},
        "kv": {"compression_ratio": 1 / (budget or 1.0), "bytes_total": 1000.0 * (budget or 1.0),
               "bytes_device_total": 1000.0 * (budget or 1.0),
               "held_ratio": budget or 1.0, "seen_tokens_mean": 300.0,
               "attended_fraction_sparse_layers": density},
        "protocol": {"dense_layers": list(dense_layers), "prefill": "dense", "batch_size": batch},
        "transfer": {"bytes_per_decode_step": 500.0 * (budget or 1.0)},
        "memory": {}, "env": {},
        "model": {"name": "stories260k"}, "method": {"name": method, "hyperparameters": hyper,
                                                      "axis_keys": ["budget_ratio"], "variant_keys": []},
        "task": {"name": task, "options": {}},
        "run": {"started": started, "config_hash": f"{method}{budget}{started}{dense_layers}",
                "status": "ok"},
    }
    (folder / "metrics.json").write_text(json.dumps(metrics))
    return folder


def ruler_run(root, method, scores, budget=None, started="2026-11-29T10:00:00"):
    folder = fake_run(root, method, 0.0, 90.0, budget=budget, task="ruler", started=started,
                      extra_acc={"average": 100 * float(np.mean(scores))})
    rows = [{"sample_id": f"{i:016x}", "subtask": "niah_single", "length_tokens": 512,
             "score": float(s)} for i, s in enumerate(scores)]
    (folder / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return folder


def fidelity_run(root, method, budget, scores, kl=None, agree=None, gold=None):
    """A RULER run of `method` at `budget`: per-sample scores (0/1) and, when `kl` is given,
    per-sample fidelity records (KL mean, same-top ratio, gold log-prob vs the full cache's)."""
    folder = fake_run(root, method, 0.0, 90.0, budget=budget, task="ruler",
                      extra_acc={"average": 100 * float(np.mean(scores))})
    rows = []
    for i, s in enumerate(scores):
        row = {"sample_id": f"{i:016x}", "subtask": "niah_single", "length_tokens": 512,
               "score": float(s)}
        if kl is not None:
            row["fidelity"] = {"tokens": 4, "kl_mean": float(kl[i]), "kl_max": float(kl[i]),
                               "top_agree_ratio": float(agree[i]),
                               "gold_logprob": float(gold[i]), "gold_logprob_full": -1.0,
                               "kl": [float(kl[i])] * 4, "top_agree": [1, 1, 1, 1]}
        rows.append(row)
    (folder / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return folder
