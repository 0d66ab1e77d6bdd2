"""InfiniGen's offline step: skewing matrices and partial columns, cached on disk.

One forward over the calibration tokens captures every layer's post-RoPE Q and K (through a
capturing cache bound to the model, like any request). Per layer and KV head (GQA, methods.md
§1.9): Q_j = the g query heads of the group stacked (g*n x d), K_j (n x d); A_j = V of the SVD of
Q_j, columns ordered by ascending sigma_q * sigma_k. Partial columns: top k of sum |Q_j A_j|.
Artefacts are saved atomically and validated (shapes + content hash) when loaded; a corrupt file
is rebuilt with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcore.errors import ConfigError
from methods.base import KVLayer, KVMethod, ModelInfo

log = logging.getLogger(__name__)
FORMAT_VERSION = 1


@dataclass
class SkewingArtefacts:
    skew: torch.Tensor  # (L, H_kv, d, d) fp32, orthogonal per head (identity without skewing)
    columns: torch.Tensor  # (L, H_kv, k) partial columns chosen on the calibration text
    project_query: object  # (layer, x (B, T, hidden)) -> (B, H_q, T, D): W_q[i] x (speculation)
    inv_freq: torch.Tensor  # (d/2,) RoPE frequencies
    k: int

    def columns_from(self, query: torch.Tensor, layer: int) -> torch.Tensor:
        """Partial columns from a prompt's own queries `(B, H_q, n, d)` (the official system)."""
        b, h_q, n, d = query.shape
        h_kv = self.skew.shape[1]
        q = query[0].float().reshape(h_kv, h_q // h_kv * n, d)  # group's heads stacked
        return column_choice(q, self.skew[layer].to(q.device), self.k)


def column_choice(q_group: torch.Tensor, skew: torch.Tensor, k: int) -> torch.Tensor:
    """(H_kv, g*n, d) queries, (H_kv, d, d) skew -> (H_kv, k) columns by sum |Q A|."""
    energy = torch.einsum("hnd,hde->hne", q_group, skew).abs().sum(1)
    return energy.topk(k, dim=-1).indices.sort(-1).values


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


def calibration_ids(method, ctx) -> torch.Tensor:
    if ctx.calibration_ids is not None:
        return torch.as_tensor(ctx.calibration_ids)[: method.calibration_tokens]
    info = ctx.info
    limit = min(method.calibration_tokens, info.max_positions or method.calibration_tokens)
    if ctx.tokenizer is None:  # a model built in code (tests) has no tokenizer: seeded random tokens
        log.warning("infinigen: no tokenizer, calibrating on %d seeded random token ids", limit)
        return torch.randint(3, ctx.vocab_size, (limit,), generator=torch.Generator().manual_seed(0))
    path = calibration_file(method, ctx.data_dir)
    ids = ctx.tokenizer(path.read_text(encoding="utf-8"), verbose=False)["input_ids"]
    return torch.tensor(ids[:limit])


def calibration_file(method, data_dir: Path | None) -> Path:
    default = None if data_dir is None else Path(data_dir) / "pg19" / "pg19_firstbook.txt"
    path = Path(method.calibration_path) if method.calibration_path else default
    if path is None or not path.is_file():
        raise ConfigError(f"method.calibration_path={path}: no such file (InfiniGen's skewing "
                          "calibration text; the default is PG-19's first book in ../shared/data)")
    return path


def _tensor_hash(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def compute(ctx, ids: torch.Tensor, skewing: bool, k: int):
    info = ctx.info
    layers = ctx.capture(_CaptureMethod(), ids)
    skews, cols = [], []
    g, d = info.group_size, info.head_dim
    for layer in layers:
        q = layer.query.reshape(info.num_kv_heads, g * ids.numel(), d)  # (H_kv, g*n, d)
        k_heads = layer.keys[0].float()  # (H_kv, n, d)
        if skewing:
            skew = torch.stack([skewing_from(q[j].cpu(), k_heads[j].cpu())
                                for j in range(info.num_kv_heads)])
        else:
            skew = torch.eye(d).expand(info.num_kv_heads, d, d).clone()
        skews.append(skew)
        cols.append(column_choice(q.cpu(), skew, k))
    return torch.stack(skews), torch.stack(cols)


def prepare_skewing(method, ctx) -> tuple[SkewingArtefacts, dict]:
    info = ctx.info
    if ctx.rope_inv_freq is None:
        raise ConfigError("method=infinigen speculates post-RoPE queries: this model has no plain "
                          "RoPE (none or a scaled variant)")
    k = max(1, int(info.head_dim * method.partial_ratio))
    ids = calibration_ids(method, ctx)
    key = hashlib.sha256(json.dumps({
        "v": FORMAT_VERSION, "model": ctx.fingerprint, "skewing": method.skewing,
        "k": k, "ids": hashlib.sha256(ids.numpy().tobytes()).hexdigest()}).encode()).hexdigest()[:24]
    root = Path(method.cache_dir or ctx.cache_dir or os.environ.get("KVH_CACHE_DIR") or
                Path.home() / ".cache" / "kv-harness") / "infinigen"
    path = root / f"{key}.pt"
    t0 = time.time()
    loaded = _load(path, info, k)
    if loaded is None:
        skew, cols = compute(ctx, ids, method.skewing, k)
        _save(path, skew, cols)
        status = "computed"
    else:
        skew, cols = loaded
        status = "loaded"
    device = ctx.device
    art = SkewingArtefacts(skew=skew.to(device), columns=cols.to(device),
                           project_query=ctx.project_query,
                           inv_freq=ctx.rope_inv_freq.to(device), k=k)
    facts = {"skewing_artefacts": status, "artefact_path": str(path), "partial_columns": k,
             "calibration_tokens": int(ids.numel()), "prepare_s": round(time.time() - t0, 3)}
    return art, facts


def _save(path: Path, skew: torch.Tensor, cols: torch.Tensor) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"version": FORMAT_VERSION, "skew": skew, "columns": cols,
               "sha256": _tensor_hash(skew, cols)}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _load(path: Path, info: ModelInfo, k: int):
    if not path.is_file():
        return None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        skew, cols = payload["skew"], payload["columns"]
        shape_ok = (tuple(skew.shape) == (info.num_layers, info.num_kv_heads, info.head_dim,
                                          info.head_dim)
                    and tuple(cols.shape) == (info.num_layers, info.num_kv_heads, k))
        if shape_ok and payload.get("sha256") == _tensor_hash(skew, cols):
            return skew, cols
    except Exception as exc:  # unreadable file: treated like a corrupt one
        log.warning("infinigen artefacts %s unreadable (%s): rebuilding", path, exc)
        return None
    log.warning("infinigen artefacts %s are corrupt (shape or hash mismatch): rebuilding", path)
    return None
