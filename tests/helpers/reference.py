"""The full cache's references: transformers' own forward over its DynamicCache, and the
engine's full cache, fed the same pieces."""

import torch
from transformers import DynamicCache

from methods import build_method
from tests.conftest import make_engine


def hf_incremental(model, ids, splits):
    """transformers' own forward over its DynamicCache, fed in the same pieces."""
    cache, outs, start = DynamicCache(config=model.config), [], 0
    with torch.no_grad():
        for end in splits + [ids.shape[1]]:
            pos = torch.arange(start, end)[None]
            outs.append(model(input_ids=ids[:, start:end], position_ids=pos, cache=cache,
                              use_cache=True).logits)
            start = end
    return torch.cat(outs, 1)


def engine_logits(model, ids, prefill_end, chunk):
    engine = make_engine(model, build_method("full"), chunk=chunk)
    with engine.request() as req:
        out = [req.prefill(ids[:, :prefill_end], all_logits=True)]
        out += [req.step(ids[:, i]) for i in range(prefill_end, ids.shape[1])]
    return torch.cat(out, 1)
