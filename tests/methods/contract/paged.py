"""Engines on the paged K/V layout, and the check that a request's layers really page."""

import dataclasses

import torch

from harness.core.engine import Engine
from kvcore.offload import PagedHostKVStore
from kvcore.paged import PagedRows
from tests.conftest import make_engine

BLOCK_TOKENS = 8


def paged_engine(model, method, kv_offload="none", layout="paged"):
    """An engine as make_engine builds it (prepare() included), storing K/V in `layout`."""
    engine = make_engine(model, method, chunk=16)
    settings = dataclasses.replace(engine.settings, kv_layout=layout, kv_offload=kv_offload,
                                   kv_block_tokens=BLOCK_TOKENS)
    return Engine(model, None, method, engine.info, settings)


def assert_paged(layers, name):
    """Every K/V storage of the request was paged (device rows and host stores)."""
    for kv in layers:
        assert all(isinstance(r, PagedRows) for r in kv._kv.values()), name
        assert kv.host is None or isinstance(kv.host, PagedHostKVStore), name


def decode(engine, prompt, steps):
    with engine.request() as req:
        logits = [req.prefill(prompt)[0, -1]]
        for _ in range(steps):
            logits.append(req.step(int(logits[-1].argmax()))[0, -1])
        layers = req.cache.kv_layers
    return torch.stack(logits), layers
