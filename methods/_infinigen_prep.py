"""InfiniGen's offline step: skewing matrices and column energies, cached on disk.

One forward over the calibration tokens captures every layer's post-RoPE Q and K (through a
capturing cache bound to the model, like any request). Per layer and KV head (the official code is
MHA only; with GQA one A must serve K and every query head of its group): Q_j = the g query heads
of the group stacked (g*n x d), K_j (n x d); A_j = V of the SVD of
Q_j, columns ordered by ascending sigma_q * sigma_k. Column energies sum |Q_j A_j| and sum |K_j A_j|
are stored; the partial columns are chosen from them at load time (`column_choice`): the top k by
|QA| (the official system) or the union of the top k by |QA| and by |KA| (the official Llama
accuracy setup, k to 2k columns). Artefacts are saved atomically and validated (shapes + content
hash) when loaded; a corrupt file is rebuilt with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from kvcore.errors import ConfigError
from methods import _artefacts as artefacts
from methods import _sidefiles as sidefiles
from methods.base import KVMethod
from methods.layer import KVLayer
from methods.model import ModelInfo

log = logging.getLogger(__name__)
FORMAT_VERSION = 2
ColumnScore = Literal["q", "qk_union", "qk_sum"]
PartialIndex = Literal["setup_prompt", "calibration", "prefill"]
# The official Llama setup's partial-column prompt (accuracy/setup/gen_partial_weight.py): six
# COPA-style sentences, about 100 tokens; the column energies of `partial_index=setup_prompt`.
SETUP_PROMPT = (
    "The bartender refused to serve the patron because the patron was drunk.\n\n"
    "The girl politely declined the hamburger because she was a vegetarian.\n\n"
    "The spy discovered the enemy's location because the spy bugged the enemy's phone.\n\n"
    "I tossed the ball upwards therefore the ball hit the ceiling.\n\n"
    "The rider fell to the ground because the bull bucked the rider.\n\n"
    "The pair of students came under scrutiny by the teacher because the students both "
    "received excellent grades.")


@dataclass
class SkewingArtefacts:
    skew: torch.Tensor  # (L, H_s, d, d) fp32, orthogonal per head (identity without skewing)
    q_energy: torch.Tensor  # (L, H_s, d) sum |Q A| over the calibration tokens (and group heads)
    k_energy: torch.Tensor  # (L, H_s, d) sum |K A|
    project_query: object  # (layer, x (B, T, hidden)) -> (B, H_q, T, D): W_q[i] x (speculation)
    inv_freq: torch.Tensor  # (d/2,) RoPE frequencies
    k: int  # columns per criterion: int(d * partial_ratio)
    column_score: str  # q | qk_union | qk_sum
    query_rows: int = 1  # g_s: query heads stacked per skewing head (their energies are summed)
    # H_s: skewing heads, H_kv (one A per KV head, shared by its group) or H_q (one per query head)

    def partial_map(self, layer: int, q_energy: torch.Tensor | None = None,
                    k_energy: torch.Tensor | None = None) -> torch.Tensor:
        """A restricted to the partial columns, `(H_s, d, k_u)`: q_rot @ it gives the skewed
        partial query directly (no d x d product per step). Padded columns (heads whose union
        is smaller than the widest head's) are zero, so they add nothing to a score."""
        q_e = self.q_energy[layer] if q_energy is None else q_energy
        k_e = self.k_energy[layer] if k_energy is None else k_energy
        cols, weight = column_choice(q_e, k_e, self.k, self.column_score, self.query_rows)
        skew = self.skew[layer].to(cols.device)
        picked = skew.gather(2, cols[:, None, :].expand(-1, skew.shape[1], -1))
        return picked * weight[:, None, :]

    def columns(self, layer: int) -> torch.Tensor:
        """The calibration's partial columns `(H_s, k_u)` (padding repeats a chosen column)."""
        q_e, k_e = self.q_energy[layer], self.k_energy[layer]
        return column_choice(q_e, k_e, self.k, self.column_score, self.query_rows)[0]

    def energies_from(self, query: torch.Tensor, keys: torch.Tensor, layer: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Column energies of a prompt's own queries `(B, H_q, n, d)` and keys `(B, H_kv, n, d)`
        (the official system chooses columns at prefill; batch element 0, as it does)."""
        heads, d = self.skew.shape[1], keys.shape[-1]
        q = query[0].float().reshape(heads, -1, d)  # (H_s, g_s * n, d): a group's heads stacked
        k = keys[0].float().repeat_interleave(heads // keys.shape[1], dim=0)  # (H_s, n, d)
        return energies(q, k, self.skew[layer].to(q.device))


def energies(q_group: torch.Tensor, k_heads: torch.Tensor, skew: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(H_kv, g*n, d) queries, (H_kv, n, d) keys, (H_kv, d, d) skew -> sum |QA|, sum |KA|,
    each (H_kv, d)."""
    q_e = torch.einsum("hnd,hde->hne", q_group, skew).abs().sum(1)
    k_e = torch.einsum("hnd,hde->hne", k_heads, skew).abs().sum(1)
    return q_e, k_e


def column_choice(q_energy: torch.Tensor, k_energy: torch.Tensor, k: int, score: str,
                  query_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial columns `(H, k_u)` and their 0/1 weights `(H, k_u)` from energies `(H, d)`.

    `q`: the top k by |QA| (k_u = k, all weights 1). `qk_sum`: the top k by |QA| + |KA| (the
    paper's §4.3 text: both magnitudes added, one top-k; the query energy is averaged over the
    `query_rows` heads of a GQA group so that g = 1 is the paper's MHA case). `qk_union`: top k
    by |QA| united with the top k by |KA|; k_u = the widest head's union, narrower heads padded
    with weight-0 entries.
    """
    if score in ("q", "qk_sum"):
        energy = q_energy if score == "q" else q_energy / query_rows + k_energy
        cols = energy.topk(k, dim=-1).indices.sort(-1).values
        return cols, torch.ones(cols.shape, device=cols.device)
    top_q = q_energy.topk(k, dim=-1).indices
    mask = torch.zeros(q_energy.shape, dtype=torch.bool, device=q_energy.device)
    mask.scatter_(-1, top_q, True).scatter_(-1, k_energy.topk(k, dim=-1).indices, True)
    width = int(mask.sum(-1).max())
    # chosen columns first (a stable sort keeps them in index order)
    order = torch.sort(mask.float(), dim=-1, descending=True, stable=True).indices[..., :width]
    weight = mask.gather(-1, order).float()
    cols = torch.where(weight.bool(), order, order[..., :1])  # padding repeats a chosen column
    return cols, weight


def skewing_from(q_group: torch.Tensor, k_head: torch.Tensor) -> torch.Tensor:
    """(g*n, d) queries, (n, d) keys of one KV head -> A (d, d)."""
    _, s_q, vh_q = torch.linalg.svd(q_group.double(), full_matrices=False)
    s_k = torch.linalg.svdvals(k_head.double())
    order = torch.argsort(s_q * s_k)
    return vh_q.T[:, order].float()


class _Capture(KVLayer):
    def __init__(self, layer_idx: int, info: ModelInfo):
        super().__init__(layer_idx, info)
        self.query = None

    def attend(self, module, query, keys, values, attention_mask, base, **kwargs):
        self.query = query[0].float()  # (H_q, n, d) post-RoPE
        return base(module, query, keys, values, attention_mask, **kwargs)


@dataclass(kw_only=True)
class _CaptureMethod(KVMethod):
    name = "infinigen_capture"

    def make_layer(self, layer_idx: int, info: ModelInfo) -> KVLayer:
        return _Capture(layer_idx, info)


def min_calibration_tokens(info: ModelInfo) -> int:
    """Fewer calibration tokens than head_dim leave the SVD of a KV head's keys (n x d) rank
    deficient, so part of the skewing basis would be arbitrary."""
    return max(16, info.head_dim)


def calibration_ids(method, ctx) -> torch.Tensor:
    """The calibration token ids: exactly `calibration_tokens` of them, or a ConfigError (never
    silently fewer)."""
    info = ctx.info
    want = calibration_budget(method, info)
    if ctx.calibration_ids is not None:
        ids, source = torch.as_tensor(ctx.calibration_ids), "the calibration ids given"
    elif ctx.tokenizer is None:  # a model built in code (tests) has no tokenizer: seeded random ids
        log.warning("infinigen: no tokenizer, calibrating on %d seeded random token ids", want)
        return torch.randint(3, ctx.vocab_size, (want,), generator=torch.Generator().manual_seed(0))
    else:
        path = calibration_file(method, ctx.data_dir)
        text = sidefiles.read_text("method.calibration_path", path)
        ids = torch.tensor(ctx.tokenizer(text, verbose=False)["input_ids"])
        source = f"method.calibration_path={path}"
    least = min_calibration_tokens(info)
    if ids.numel() < least:
        raise ConfigError(f"{source}: {ids.numel()} tokens; InfiniGen's skewing needs at least "
                          f"{least} (head_dim) calibration tokens")
    if ids.numel() < want:
        raise ConfigError(f"method.calibration_tokens={want} but {source} has only {ids.numel()} "
                          f"tokens: lower method.calibration_tokens or give a longer text")
    return ids[:want]


def calibration_file(method, data_dir: Path | None) -> Path:
    return sidefiles.calibration_path(method.calibration_path, data_dir,
                                      "InfiniGen's skewing calibration text")


def calibration_budget(method, info: ModelInfo) -> int:
    """Calibration tokens used: `calibration_tokens`, or the model's positions when it has fewer
    (one forward cannot be longer). The cut is logged and recorded in the prepare facts
    (`calibration_tokens_requested`); a text shorter than the count is refused instead."""
    want = method.calibration_tokens
    if info.max_positions and want > info.max_positions:
        log.warning("infinigen: method.calibration_tokens=%d exceeds the model's %d positions; "
                    "calibrating on %d tokens", want, info.max_positions, info.max_positions)
        return info.max_positions
    return want


def calibration_reasons(method, info: ModelInfo) -> list[str]:
    """Checks that need no tokenizer, before weights load: the file exists and is not too short
    (a text of b bytes has at most b + 1 tokens, the +1 for a BOS)."""
    reasons = []
    if method.calibration_path:  # the default text is located at prepare (runner's data dir)
        try:
            path = calibration_file(method, None)
            sidefiles.read_text("method.calibration_path", path)  # UTF-8 text, or one line
        except ConfigError as exc:
            return reasons + [str(exc)]
        size, least = path.stat().st_size, min_calibration_tokens(info)
        if size + 1 < least:
            what = "is empty" if size == 0 else f"has {size} bytes"
            reasons.append(f"method.calibration_path={path} {what}; InfiniGen's skewing needs at "
                           f"least {least} (head_dim) calibration tokens")
    return reasons


def artefact_root(method, cache_dir: Path | None = None) -> Path:
    return artefacts.cache_root("infinigen", method.cache_dir, cache_dir)


def cache_dir_reason(method) -> str | None:
    """Why the artefact cache cannot be written (checked before weights load), or None.

    Tries a real temporary file in the nearest existing folder (permission bits alone say
    nothing for root or on read-only mounts); creates nothing that stays."""
    root = artefact_root(method)
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    key = "method.cache_dir" if method.cache_dir else "the artefact cache (method.cache_dir)"
    if not probe.is_dir():
        return f"{key}: {root} is not a folder that can be created ({probe} is a file)"
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        return f"{key}: {root} is not writable ({exc.strerror or exc}); set method.cache_dir"
    return None


def skew_heads(method, info: ModelInfo) -> int:
    """H_s: one skewing matrix per KV head (shared by its g query heads) or per query head."""
    return info.num_heads if method.skew_per == "query_head" else info.num_kv_heads


def setup_prompt_ids(ctx) -> torch.Tensor:
    """The official setup prompt's token ids (a model without a tokenizer: its UTF-8 bytes,
    modulo the vocabulary)."""
    if ctx.tokenizer is None:
        return torch.tensor(list(SETUP_PROMPT.encode("utf-8"))) % ctx.vocab_size
    return torch.tensor(ctx.tokenizer(SETUP_PROMPT, verbose=False)["input_ids"])


def captured(ctx, ids: torch.Tensor, heads: int):
    """Per layer, post-RoPE queries `(H_s, g_s * n, d)` (a skewing head's query heads stacked)
    and keys `(H_s, n, d)` of one forward over `ids`."""
    info = ctx.info
    for layer in ctx.capture(_CaptureMethod(), ids):
        q = layer.query.reshape(heads, -1, info.head_dim).cpu()
        k_heads = layer.keys[0].float().cpu().repeat_interleave(heads // info.num_kv_heads, 0)
        yield q, k_heads


def compute(ctx, ids: torch.Tensor, skewing: bool, heads: int, partial_index: str):
    """Skewing matrices and column energies for every layer: (L, H_s, d, d), 2 x (L, H_s, d).
    The energies are the calibration text's, or (`setup_prompt`) the official setup prompt's
    under the calibration's skewing."""
    d = ctx.info.head_dim
    skews, q_energies, k_energies = [], [], []
    for q, k_heads in captured(ctx, ids, heads):
        if skewing:
            skew = torch.stack([skewing_from(q[j], k_heads[j]) for j in range(heads)])
        else:
            skew = torch.eye(d).expand(heads, d, d).clone()
        q_e, k_e = energies(q, k_heads, skew)
        skews.append(skew)
        q_energies.append(q_e)
        k_energies.append(k_e)
    if partial_index == "setup_prompt":
        setup = list(captured(ctx, setup_prompt_ids(ctx), heads))
        q_energies, k_energies = zip(*(energies(q, k, skew)
                                       for (q, k), skew in zip(setup, skews)))
    return torch.stack(skews), torch.stack(q_energies), torch.stack(k_energies)


def prepare_skewing(method, ctx) -> tuple[SkewingArtefacts, dict]:
    info = ctx.info
    if ctx.rope_inv_freq is None:
        raise ConfigError("method=infinigen speculates post-RoPE queries: this model has no plain "
                          "RoPE (none or a scaled variant)")
    k = max(1, int(info.head_dim * method.partial_ratio))
    ids = calibration_ids(method, ctx)
    key = hashlib.sha256(json.dumps({
        "v": FORMAT_VERSION, "model": ctx.fingerprint, "skewing": method.skewing,
        "skew_per": method.skew_per, "ids": hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
        "energies": (hashlib.sha256(setup_prompt_ids(ctx).numpy().tobytes()).hexdigest()
                     if method.partial_index == "setup_prompt" else "calibration"),
    }).encode()).hexdigest()[:24]
    path = artefact_root(method, ctx.cache_dir) / f"{key}.pt"
    t0 = time.time()
    heads = skew_heads(method, info)
    tensors = _load(path, info, heads)
    loaded = tensors is not None
    if not loaded:
        tensors = compute(ctx, ids, method.skewing, heads, method.partial_index)
        _save(path, *tensors)
    made = artefacts.provenance("infinigen skewing", key, path, tensors, loaded)
    device = ctx.device
    skew, q_e, k_e = (t.to(device) for t in tensors)
    art = SkewingArtefacts(skew=skew, q_energy=q_e, k_energy=k_e, project_query=ctx.project_query,
                           inv_freq=ctx.rope_inv_freq.to(device), k=k,
                           column_score=method.column_score,
                           query_rows=info.num_heads // heads)
    widths = [art.columns(i).shape[-1] for i in range(info.num_layers)]
    facts = {"skewing_artefacts": made, "partial_columns": k,
             "partial_columns_per_head_max": max(widths),
             "partial_columns_per_head_mean": round(sum(
                 float(column_choice(q_e[i], k_e[i], k, method.column_score)[1].sum(-1).mean())
                 for i in range(info.num_layers)) / info.num_layers, 3),
             "calibration_tokens": int(ids.numel()),
             "calibration_tokens_requested": method.calibration_tokens,
             "prepare_s": round(time.time() - t0, 3)}
    return art, facts


def _save(path: Path, skew: torch.Tensor, q_energy: torch.Tensor, k_energy: torch.Tensor) -> None:
    payload = {"version": FORMAT_VERSION, "skew": skew, "q_energy": q_energy, "k_energy": k_energy,
               "sha256": artefacts.tensors_sha256((skew, q_energy, k_energy))}
    artefacts.save(path, lambda tmp: torch.save(payload, tmp), "infinigen artefacts")


def _load(path: Path, info: ModelInfo, skew_heads: int):
    try:
        payload = artefacts.load(path)
        if payload is None:
            return None
        skew, q_e, k_e = payload["skew"], payload["q_energy"], payload["k_energy"]
        heads = (info.num_layers, skew_heads)
        shape_ok = (tuple(skew.shape) == (*heads, info.head_dim, info.head_dim)
                    and tuple(q_e.shape) == tuple(k_e.shape) == (*heads, info.head_dim))
        if shape_ok and payload.get("sha256") == artefacts.tensors_sha256((skew, q_e, k_e)):
            return skew, q_e, k_e
    except Exception as exc:  # unreadable file: treated like a corrupt one
        log.warning("infinigen artefacts %s unreadable (%s): rebuilding", path, exc)
        return None
    log.warning("infinigen artefacts %s are corrupt (shape or hash mismatch): rebuilding", path)
    return None
