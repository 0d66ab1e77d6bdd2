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

from harness.errors import ConfigError
from methods.base import KVLayer, KVMethod, ModelInfo

log = logging.getLogger(__name__)
FORMAT_VERSION = 1


@dataclass
class SkewingArtefacts:
    skew: torch.Tensor  # (L, H_kv, d, d) fp32, orthogonal per head (identity without skewing)
    columns: torch.Tensor  # (L, H_kv, k) partial columns chosen on the calibration text
    q_proj: list  # per layer: the model's query projection module (speculation uses W_q[i])
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


def calibration_ids(method, tokenizer, info: ModelInfo, context) -> torch.Tensor:
    if context.get("calibration_ids") is not None:
        return torch.as_tensor(context["calibration_ids"])[: method.calibration_tokens]
    limit = min(method.calibration_tokens, info.max_positions or method.calibration_tokens)
    if tokenizer is None:  # a model built in code (tests) has no tokenizer: seeded random tokens
        log.warning("infinigen: no tokenizer, calibrating on %d seeded random token ids", limit)
        vocab = getattr(context.get("model_config"), "vocab_size", None) or 256
        return torch.randint(3, vocab, (limit,), generator=torch.Generator().manual_seed(0))
    path = calibration_file(method)
    ids = tokenizer(path.read_text(encoding="utf-8"), verbose=False)["input_ids"]
    return torch.tensor(ids[:limit])


def calibration_file(method) -> Path:
    from harness.models import SHARED_DIR

    path = Path(method.calibration_path or SHARED_DIR / "data" / "pg19" / "pg19_firstbook.txt")
    if not path.is_file():
        raise ConfigError(f"method.calibration_path={path}: no such file (InfiniGen's skewing "
                          "calibration text; the default is PG-19's first book in ../shared/data)")
    return path


def _model_fingerprint(model) -> str:
    h = hashlib.sha256(model.config.to_json_string().encode())
    from harness.hf_adapter import attention_modules

    for module in attention_modules(model):
        w = module.q_proj.weight.detach().float().flatten()
        h.update(w[:: max(1, w.numel() // 4096)].cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _tensor_hash(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def compute(model, info: ModelInfo, ids: torch.Tensor, skewing: bool, k: int):
    from harness import hf_adapter

    cache = hf_adapter.MethodCache(_CaptureMethod(), info)
    with torch.inference_mode(), hf_adapter.bind(model, cache):
        device = next(model.parameters()).device
        hf_adapter.forward(model, ids[None].to(device), torch.arange(ids.numel(), device=device)[None],
                           cache, logits_to_keep=1)
    skews, cols = [], []
    g, d = info.group_size, info.head_dim
    for layer in cache.kv_layers:
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


def prepare_skewing(method, model, tokenizer, context) -> tuple[SkewingArtefacts, dict]:
    from harness import hf_adapter

    info = context.get("info") or hf_adapter.model_info(model.config)
    k = max(1, int(info.head_dim * method.partial_ratio))
    ids = calibration_ids(method, tokenizer, info, {**context, "model_config": model.config})
    key = hashlib.sha256(json.dumps({
        "v": FORMAT_VERSION, "model": _model_fingerprint(model), "skewing": method.skewing,
        "k": k, "ids": hashlib.sha256(ids.numpy().tobytes()).hexdigest()}).encode()).hexdigest()[:24]
    root = Path(method.cache_dir or os.environ.get("KVH_CACHE_DIR") or
                Path.home() / ".cache" / "kv-harness") / "infinigen"
    path = root / f"{key}.pt"
    t0 = time.time()
    loaded = _load(path, info, k)
    if loaded is None:
        skew, cols = compute(model, info, ids, method.skewing, k)
        _save(path, skew, cols)
        status = "computed"
    else:
        skew, cols = loaded
        status = "loaded"
    device = next(model.parameters()).device
    art = SkewingArtefacts(skew=skew.to(device), columns=cols.to(device),
                           q_proj=[m.q_proj for m in hf_adapter.attention_modules(model)],
                           inv_freq=hf_adapter.rope_inv_freq(model).to(device), k=k)
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
