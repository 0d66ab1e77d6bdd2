"""Decode speed and bytes moved with the KV on the host tier: full offload vs InfiniGen (+ H2O).

For each context length: prefill a prompt (essay text, or random ids for a random model), then
decode `--new-tokens` greedily; methods alternate A/B/A/B over `--rounds`. Prints decode tok/s
(median), host->device bytes per decode step, exposed transfer ms per step, and ratios to
full_offload measured in the same run. Writes a JSON summary with `--json`.

    python benchmarks/offload_speed.py --contexts 2048 4096 --new-tokens 16
    python benchmarks/offload_speed.py --model random_llama_1b --device cuda --contexts 8192 16384
    python benchmarks/offload_speed.py --methods full kivi_2bit --contexts 8192 32768 ...  # KIVI-2

Rows `full` and `kivi_2bit` keep the KV on the device; with `full` in the run every row also gets
`ms_per_token_vs_full` (KIVI-2's goal: <= 1.3).

`random_llama_1b` / `random_llama_8b`: randomly initialised Llama-3-shaped models built in code
(benchmarks/random_models.py), for speed only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.random_models import SHAPES, random_llama, random_prompt  # noqa: E402
from harness.core import hf_adapter
from harness.core import models  # noqa: E402
from harness.core.engine import Engine, EngineSettings  # noqa: E402
from harness.store.results import write_json_atomic  # noqa: E402
from harness.session import of_methods  # noqa: E402
from kvcore.errors import ConfigError  # noqa: E402
from methods import build_method  # noqa: E402

METHODS = {
    "full": ("full", {}, "none"),  # device-resident references (not in the default set)
    "kivi_2bit": ("kivi", {"k_bits": 2, "v_bits": 2}, "none"),
    "full_offload": ("full_offload", {}, "none"),
    "infinigen": ("infinigen", {}, "none"),
    "h2o_offload": ("h2o", {"budget_ratio": 0.2}, "cpu"),
}


def load(args):
    """(model, tokenizer, ModelInfo, engine_for(row, prompt ids): a fresh engine of the row)."""
    if args.model in SHAPES:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}[args.dtype]
        model, tok = random_llama(args.model, args.device, dtype,
                                  max(args.contexts) + args.new_tokens + 8)
        info = hf_adapter.model_info(model.config, next(model.parameters()).dtype)
        return model, tok, info, lambda name, ids: random_engine(model, info, name, ids)
    rows = {name: build_method(METHODS[name][0], **METHODS[name][1]) for name in args.methods}
    try:  # every row checked before the weights load
        session, settings = of_methods(
            {"name": args.model, "device": args.device, "dtype": args.dtype}, rows,
            row_knobs={name: {"kv_offload": METHODS[name][2]} for name in rows},
            prefill_chunk_tokens=2048)
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
    session.load("sdpa")
    return (session.model, session.tokenizer, session.info,
            lambda name, ids: session.engine(settings[name]))


def random_engine(model, info, name: str, ids: list[int]):
    """Row `name` over a random-weight model built in code, which no model config names (so no
    session): its method calibrates on the prompt's ids."""
    method_name, kw, offload = METHODS[name]
    method = build_method(method_name, **kw)
    hf_adapter.prepare(method, model, None, info, calibration_ids=torch.tensor(ids[:2048]),
                       data_dir=models.SHARED_DIR / "data")
    return Engine(model, None, method, info, EngineSettings(prefill_chunk_tokens=2048,
                                                            kv_offload=offload))


def prompt_ids(tokenizer, vocab: int, length: int) -> list[int]:
    if tokenizer is None:
        return random_prompt(vocab, length)
    from tasks.text_sources import load_essays

    return tokenizer(load_essays(), verbose=False)["input_ids"][:length]


def measure(engine, ids: list[int], new_tokens: int) -> dict:
    with engine.request() as req:
        req.generate(ids, max_new_tokens=new_tokens, stop_ids=set())
    decode = engine.timer.values("decode")
    t = engine.transfers.summary()
    steps = t["decode_steps"] or 1
    return {"decode_tok_s": len(decode) / (sum(decode) / 1e3),
            "bytes_per_step": t["bytes_per_decode_step"],
            "exposed_ms_per_step": engine.transfers.exposed_ms / steps,
            "density": engine.attended.summary().get("attended_fraction_sparse_layers")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--methods", nargs="+", default=["full_offload", "infinigen", "h2o_offload"],
                    choices=list(METHODS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"

    model, tok, info, engine_for = load(args)
    summary = {"model": args.model, "device": args.device, "dtype": args.dtype, "contexts": {}}
    t0 = time.time()
    for ctx in args.contexts:
        ids = prompt_ids(tok, model.config.vocab_size, ctx)
        runs: dict[str, list[dict]] = {m: [] for m in args.methods}
        for _ in range(args.rounds):
            for name in args.methods:  # alternate methods within each round
                runs[name].append(measure(engine_for(name, ids), ids, args.new_tokens))
        rows = {}
        for name, results in runs.items():
            rows[name] = {k: statistics.median(r[k] for r in results if r[k] is not None)
                          if any(r[k] is not None for r in results) else None for k in results[0]}
        base = rows.get("full_offload")
        full = rows.get("full")
        print(f"\ncontext {len(ids)} tokens, {args.new_tokens} new, {args.model} on {args.device}")
        print(f"{'method':14} {'tok/s':>8} {'MB/step':>9} {'exposed ms':>11} {'x tok/s':>8} {'x bytes':>8}")
        for name, r in rows.items():
            ratio_s = r["decode_tok_s"] / base["decode_tok_s"] if base else float("nan")
            ratio_b = ((r["bytes_per_step"] or 0) / base["bytes_per_step"]
                       if base and base["bytes_per_step"] else float("nan"))
            r.update(speedup_vs_full_offload=ratio_s, bytes_vs_full_offload=ratio_b)
            if full:  # decode ms/token relative to the device-resident full cache
                r["ms_per_token_vs_full"] = full["decode_tok_s"] / r["decode_tok_s"]
            mb = (r["bytes_per_step"] or 0) / 1e6
            print(f"{name:14} {r['decode_tok_s']:8.2f} {mb:9.3f} "
                  f"{r['exposed_ms_per_step']:11.3f} {ratio_s:8.3f} {ratio_b:8.3f}")
        summary["contexts"][str(len(ids))] = rows
    summary["wall_s"] = round(time.time() - t0, 1)
    if args.json:
        write_json_atomic(Path(args.json), summary)


if __name__ == "__main__":
    main()
