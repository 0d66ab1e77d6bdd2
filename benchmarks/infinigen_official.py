"""InfiniGen's official accuracy path (the mask simulation), re-implemented, beside ours.

    python benchmarks/infinigen_official.py --model smollm2_135m --text worked.txt --tokens 1024
    python benchmarks/infinigen_official.py --model tiny_gqa7 --text worked.txt --tokens 1024

The reference is a plain forward of the loaded Llama-style model (its own modules, no cache)
that applies the rule of snu-comparch/InfiniGen `accuracy/src/modeling_llama_ours.py` to the
whole sequence at once, as `accuracy/perplexity/llama.py` does: layers 0 and 1 dense; layer
i >= 2 speculates from layer i-1's normalised attention input times W_q[i] (RoPE, skewing A,
query columns outside the partial mask zeroed) against K A; row r scores its r + 1 tokens
(itself included), counts those >= head 0's row max - alpha, takes int(mean over heads)
capped at int(T * budget), its top-n per head (a count of 0 leaves the row unmasked, as the
official additive mask then shifts every logit alike); rows below the cap attend in full.
GQA is the official code's expansion (K/V repeated per query head; one A per query head).
A from the official formula (SVD of the calibration queries, PG-19's first 2048 tokens);
partial columns: the union of the top int(d * ratio) by sum |QA| and by sum |KA| over the
official six-sentence setup prompt (`accuracy/setup/gen_partial_weight.py`).

Each known difference can be switched alone on the reference side (`--reference-variants`,
`full` = no mask): `columns=calibration` (columns from the calibration text),
`threshold=per_head` (each head's own max), `current=added` (the current token attended on top
of the n' best earlier tokens, counted over those), `zero=one` (a count of 0 keeps one token
instead of leaving the row unmasked). Ours runs through the engine, one decode step per token
(benchmarks/infinigen_gap.py), with `--ours-variants` (method overrides).
`tiny_gqa7`: a 6-layer Llama built in code, 14 query heads over 2 KV heads (7:1), head_dim 32,
byte-level ids, q/k weights scaled so that its attention is peaked (random weights: the mask
path runs on any).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.infinigen_gap import parse_variant, run_one  # noqa: E402


def load(name: str):
    from harness.core import hf_adapter
    from harness.core import models
    if name == "tiny_gqa7":
        model = models.tiny_llama(num_layers=6, hidden=448, heads=14, kv_heads=2, vocab=256,
                                  seed=0, attn="eager")
        with torch.no_grad():
            for layer in hf_adapter.attention_modules(model):
                layer.q_proj.weight.mul_(6.0)
                layer.k_proj.weight.mul_(6.0)
        return model, None
    return models.load_model(models.resolve_model({"name": name, "device": "cpu"}))


def ours_engine(model, tok, info, name: str, kwargs: dict, data_dir: Path, extra: dict):
    """Our method on the model the authors' code reads (tiny_gqa7 is built in code, no model
    config names it), layers 0 and 1 dense as InfiniGen's."""
    from harness.core import hf_adapter
    from harness.core.engine import Engine, EngineSettings
    from methods import build_method
    from methods.protocol import Protocol

    method = build_method(name, **kwargs)
    hf_adapter.prepare(method, model, tok, info, data_dir=data_dir, **extra)
    return Engine(model, tok, method, info, EngineSettings(protocol=Protocol(dense_layers=(0, 1))))


def encode(tok, text: str) -> torch.Tensor:
    if tok is None:  # byte-level ids for the tiny model (vocab 256)
        return torch.tensor(list(text.encode("utf-8")))
    return torch.tensor(tok(text, verbose=False)["input_ids"])


class Reference:
    """The official mask simulation on a loaded Llama-style model (batch 1, fp32)."""

    def __init__(self, model, inv_freq: torch.Tensor):
        from harness.core import hf_adapter
        self.model = model
        self.attn = hf_adapter.attention_modules(model)
        self.inv_freq = inv_freq
        cfg = model.config
        self.h_q, self.h_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = self.attn[0].head_dim

    def qk(self, i: int, h: torch.Tensor, pos: torch.Tensor):
        from methods.rope import rotate
        a, t = self.attn[i], h.shape[1]
        q = a.q_proj(h).view(1, t, self.h_q, self.d).transpose(1, 2)
        k = a.k_proj(h).view(1, t, self.h_kv, self.d).transpose(1, 2)
        v = a.v_proj(h).view(1, t, self.h_kv, self.d).transpose(1, 2)
        g = self.h_q // self.h_kv
        q, k = rotate(q, pos, self.inv_freq), rotate(k, pos, self.inv_freq)
        return q[0], k[0].repeat_interleave(g, 0), v[0].repeat_interleave(g, 0)  # (H_q, T, d)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, rule=None):
        """ids (T,) -> (logits (T, V), per-layer post-RoPE (q, k) (H_q, T, d), attended share
        of the sparse layers (ratio of sums over rows), rows left unmasked by a zero count)."""
        m = self.model.model
        t = ids.numel()
        pos = torch.arange(t)
        x = m.embed_tokens(ids[None])
        causal = torch.full((t, t), float("-inf")).triu(1)
        captured, attended, rows, zero_rows = [], 0.0, 0.0, 0
        prev = None
        for i, layer in enumerate(m.layers):
            h = layer.input_layernorm(x)
            q, k, v = self.qk(i, h, pos)
            captured.append((q, k))
            logits = q @ k.transpose(1, 2) / math.sqrt(self.d)
            if rule is not None and prev is not None:
                spec = self.speculate(i, prev, pos, k, rule)
                add, n_att, zeros = rule.mask(spec)
                logits = logits + add
                attended, zero_rows = attended + n_att, zero_rows + zeros
                rows += t * (t + 1) / 2
            probs = torch.softmax(logits + causal, -1)
            out = (probs @ v).transpose(0, 1).reshape(1, t, -1)
            x = x + self.attn[i].o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            prev = h if i > 0 else None  # the official hand-off starts at layer 1 -> 2
        logits = self.model.lm_head(m.norm(x))[0]
        return logits, captured, attended / max(rows, 1), zero_rows

    def speculate(self, i, prev, pos, k, rule):
        from methods.rope import rotate
        t = prev.shape[1]
        q = self.attn[i].q_proj(prev).view(1, t, self.h_q, self.d).transpose(1, 2)
        q = rotate(q, pos, self.inv_freq)[0] @ rule.skew[i]  # (H_q, T, d)
        q = q * rule.columns[i][:, None, :]
        return q @ (k @ rule.skew[i]).transpose(1, 2) / math.sqrt(self.d)  # (H_q, T, T)


class Rule:
    def __init__(self, skew, columns, alpha, budget, threshold="head0", current="ranked",
                 zero="dense"):
        self.skew, self.columns, self.alpha, self.budget = skew, columns, alpha, budget
        self.threshold, self.current, self.zero = threshold, current, zero

    def mask(self, spec: torch.Tensor):
        """spec (H, T, T) -> additive mask (H, T, T), attended entries per head (all rows), rows
        left unmasked by a zero count."""
        h, t, _ = spec.shape
        cap = int(t * self.budget)
        ranked = self.current == "ranked"
        # row r's candidates: tokens 0..r (official: itself among them) or 0..r-1 (ours)
        allowed = torch.ones(t, t, dtype=torch.bool).tril(0 if ranked else -1)
        scored = spec.masked_fill(~allowed, float("-inf"))
        top = scored.amax(-1, keepdim=True)  # (H, T, 1)
        if self.threshold == "head0":  # the official torch.max(attn, -1)[0][0]
            top = top[:1]
        count = (scored >= top - self.alpha).sum(-1).float().mean(0).long().clamp(max=cap)
        if self.zero == "one":  # ours: at least one token
            count = count.clamp(min=1)
        ranks = scored.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)  # (H, T, T)
        keep = (ranks < count[None, :, None]) & allowed
        if not ranked:
            keep |= torch.eye(t, dtype=torch.bool)
        full = torch.ones(t, t, dtype=torch.bool).tril()
        dense = torch.arange(t) < cap  # the official first int(T * budget) rows attend in full
        zero = ~dense & (count == 0)  # topk(k=0): the row's logits all shifted alike
        keep[:, dense | zero] = full[dense | zero]
        add = torch.zeros(h, t, t).masked_fill(~keep, -10000.0)
        return add, float(keep.sum()) / h, int(zero.sum())


def skewing(captured):
    """A per layer and query head, the official formula: V of the SVD of Q, columns in the
    order of ascending sigma_q * sigma_k (the order does not change the chosen vectors)."""
    out = []
    for q, k in captured:
        per_head = []
        for j in range(q.shape[0]):
            _, s_q, vh = torch.linalg.svd(q[j].double(), full_matrices=False)
            s_k = torch.linalg.svdvals(k[j].double())
            per_head.append(vh.T[:, torch.argsort(s_q * s_k)].float())
        out.append(torch.stack(per_head))
    return out


def column_masks(captured, skew, ratio):
    """Official partial-weight masks (H, d): top int(d * ratio) by sum |QA| united with the top
    int(d * ratio) by sum |KA|, per query head."""
    masks = []
    for (q, k), a in zip(captured, skew):
        d = q.shape[-1]
        n = int(d * ratio)
        m = torch.zeros(q.shape[0], d)
        m.scatter_(-1, (q @ a).abs().sum(1).topk(n, -1).indices, 1.0)
        m.scatter_(-1, (k @ a).abs().sum(1).topk(n, -1).indices, 1.0)
        masks.append(m)
    return masks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--text", default="worked.txt", help="an essay file name, or a path")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--alpha", type=float, default=5.0)
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--partial", type=float, default=0.2)
    ap.add_argument("--reference-variants", nargs="*", default=["official"])
    ap.add_argument("--ours-variants", nargs="*", default=["infinigen:mode=simulate"])
    args = ap.parse_args()

    from harness.core import hf_adapter
    from harness.core import models
    from methods._infinigen_prep import SETUP_PROMPT
    from tasks.text_sources import essays_dir

    torch.manual_seed(0)
    model, tok = load(args.model)
    info = hf_adapter.model_info(model.config)
    data_dir = models.SHARED_DIR / "data"
    path = Path(args.text) if Path(args.text).is_file() else essays_dir(str(data_dir)) / args.text
    ids = encode(tok, path.read_text())[: args.tokens]
    calib = encode(tok, (data_dir / "pg19" / "pg19_firstbook.txt").read_text())[:2048]
    setup = encode(tok, SETUP_PROMPT)
    print(f"{args.model} {path.name} first {ids.numel()} tokens; alpha {args.alpha}, budget "
          f"{args.budget}, partial {args.partial}; threads {torch.get_num_threads()}", flush=True)
    ref = Reference(model, hf_adapter.rope_inv_freq(model))
    _, cal_qk, _, _ = ref.forward(calib)
    skew = skewing(cal_qk)
    _, setup_qk, _, _ = ref.forward(setup)
    cols = {"setup": column_masks(setup_qk, skew, args.partial),
            "calibration": column_masks(cal_qk, skew, args.partial)}
    print("| side | variant | ppl | attended (sparse layers) | rows unmasked (count 0) | s |\n"
          "|---|---|---|---|---|---|", flush=True)
    results = {}
    for spec in args.reference_variants:
        kw = dict(item.split("=") for item in spec.split(",") if "=" in item)
        t0 = time.time()
        rule = None if spec == "full" else Rule(
            skew, cols[kw.get("columns", "setup")], args.alpha, args.budget,
            kw.get("threshold", "head0"), kw.get("current", "ranked"), kw.get("zero", "dense"))
        logits, _, share, zeros = ref.forward(ids, rule)
        nll = torch.nn.functional.cross_entropy(logits[:-1], ids[1:])
        results[spec] = math.exp(float(nll))
        print(f"| official (re-implemented) | {spec} | {results[spec]:.3f} | {share:.4f} | "
              f"{zeros} | {time.time() - t0:.1f} |", flush=True)
    extra = {"calibration_ids": calib} if tok is None else {}
    for spec in args.ours_variants:
        name, kwargs = parse_variant(spec)
        r = run_one(ours_engine(model, tok, info, name, kwargs, data_dir, extra), ids, name,
                    kwargs)
        print(f"| ours | {r['variant']} | {r['ppl']:.3f} | {r['attended_sparse']:.4f} | – | "
              f"{r['wall_s']} |", flush=True)


if __name__ == "__main__":
    main()
